"""The main job's config, parsed once into typed, frozen structures.

This module owns :class:`JobConfig` (every field of the main job's config,
typed, with the range its values must be in; the sections
:class:`AllocatorConfig`, :class:`CompressConfig` and
:class:`DistributedConfig`) and :func:`parse`, which turns a config file's
``ml_collections.ConfigDict`` into one: the fields a config gives replace
the defaults of ``experiments/configs/default.py`` (the only place defaults
live), a field the default config does not have is an error naming it,
every value is converted and checked once, the settings that depend on each
other are checked together (:func:`check_together`), and each plan file is
read once. Everything after :func:`parse` reads attributes of the result.

It also owns the training objects a parsed config names: the model
(:func:`build_model`, sized for the dataset), the learning rate (optax for
training, a float64 twin for QSR), the optimizer, the sync schedule, the
averager, the outer optimizer and the synchronization settings
(:func:`sync_settings`); and :func:`unused_settings`, the settings the run
will not read. :mod:`experiments.train_lib` runs the job with them; the
binary's shortcut flags are in :mod:`experiments.flag_aliases`.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import functools
import types
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments.config_fields import choice
from experiments.config_fields import flag
from experiments.config_fields import integer
from experiments.config_fields import integers
from experiments.config_fields import load_plan
from experiments.config_fields import mapping
from experiments.config_fields import names
from experiments.config_fields import parse_section
from experiments.config_fields import real
from experiments.config_fields import section
from experiments.config_fields import text
from experiments.config_fields import to_plain
from experiments.configs import default as default_config
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import task
from qsync_jax.allocation import job_plans
from qsync_jax.numerics import selfcheck
from qsync_jax.parallel import averagers
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel import schedules
from qsync_jax.parallel.lr_schedules import LearningRateSchedule
from qsync_jax.plan import devices as devices_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import detection
from qsync_jax.train import evaluation
from qsync_jax.train import programs
from qsync_jax.train import step as step_lib
from qsync_jax.train.sync import SyncSettings

_POSITIVE = (lambda v: v > 0, "> 0")
_NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
  """``config.allocator``: how ``--plan=auto`` plans (the default config
  says what each field does)."""

  indicator: str = text()
  method: str = text()
  num_batches: int = integer(1)
  compression: float | None = real(
    lambda v: 0 <= v <= 1, "in [0, 1]", optional=True
  )
  candidates: tuple[str, ...] = names()
  timing_model_kwargs: Mapping[str, Any] = mapping()
  timing_batch_size: int = integer(0)
  profiles: str = text()
  profile_repeats: int = integer(1)
  profile_cache_dir: str = text()


@dataclasses.dataclass(frozen=True)
class CompressConfig:
  """``config.compress_kwargs``: the averager's fields; None leaves the
  averager's own default."""

  wire: str | None = text(optional=True)
  bucket_size: int | None = integer(1, optional=True)
  levels: int | None = integer(1, optional=True)
  norm: str | None = text(optional=True)
  noise: str | None = text(optional=True)
  rank: int | None = integer(1, optional=True)
  cols: int | None = integer(1, optional=True)
  warm_start: bool | None = flag(optional=True)

  def given(self) -> dict[str, Any]:
    """The fields that are set."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """``config.distributed``: joining a multi-process run (not part of the
  processes' agreement check: it may differ per process)."""

  initialization_timeout_s: int = integer(1)
  heartbeat_timeout_s: int = integer(1)
  shutdown_timeout_s: int = integer(1)
  local_devices: str = choice(*detection.LOCAL_DEVICES)
  planning_timeout_s: int = integer(1)
  coordinator_address: str | None = text(optional=True)
  num_processes: int | None = integer(1, optional=True)
  process_id: int | None = integer(0, optional=True)


def _plans(value: Any, name: str) -> Mapping[str, PrecisionPlan]:
  """``config.plans``: each kind's plan read once (a mapping, JSON text or
  a JSON file), as a read-only mapping."""
  value = to_plain(value) or {}
  if not isinstance(value, Mapping):
    raise ValueError(f"{name} must be a mapping of device kinds to plans")
  return types.MappingProxyType(
    {str(kind).lower(): load_plan(spec) for kind, spec in value.items()}
  )


@dataclasses.dataclass(frozen=True)
class JobConfig:
  """The main job's config, every field typed and checked
  (``experiments/configs/default.py`` has the defaults and says what each
  field does)."""

  model: str = text()
  model_kwargs: Mapping[str, Any] = mapping()
  loss_fn: str = text()
  dataset: str = text()
  dataset_kwargs: Mapping[str, Any] = mapping()
  cluster: str = text()
  plan_mode: str = choice("auto", "manual")
  plans: Mapping[str, PrecisionPlan] = dataclasses.field(
    metadata={"check": _plans}
  )
  allocator: AllocatorConfig = section(AllocatorConfig)
  batch_size: int = integer(1)
  batch_mode: str = choice("equal", "dynamic")
  speeds: str = text()
  steps: int = integer(1)
  optimizer: str = text()
  momentum: float = real(*_FRACTION)
  learning_rate: float = real(*_POSITIVE)
  lr_schedule: str = text()
  warmup_steps: int = integer(0)
  final_learning_rate: float = real(*_NON_NEGATIVE)
  lr_decay_steps: tuple[int, ...] = integers()
  lr_decay_factor: float = real(*_POSITIVE)
  lr_round_base: float = real(lambda v: v > 0 and v != 1, "> 0 and != 1")
  sync: str = text()
  h_base: int = integer(1)
  alpha: float | None = real(*_NON_NEGATIVE, optional=True)
  gamma: float = real(*_POSITIVE)
  switch_step: int = integer(0)
  compress: str = text()
  compress_kwargs: CompressConfig = section(CompressConfig)
  error_feedback: bool = flag()
  seed: int = integer(0)
  log_every: int = integer(1)
  eval_every: int = integer(0)
  bn_stats: str = choice(*evaluation.BN_STATS)
  bn_batches: int = integer(1)
  opt_fields_to_average: tuple[str, ...] = names()
  outer_optimizer: str = text()
  outer_lr: float = real(*_POSITIVE)
  outer_momentum: float = real(*_FRACTION)
  checkpoint_every: int = integer(0)
  resume: bool = flag()
  numerics_check: str = choice(*selfcheck.MODES)
  distributed: DistributedConfig = section(DistributedConfig)

  def replace(self, **changes: Any) -> JobConfig:
    """A copy with ``changes`` (e.g. the cluster an elastic world runs)."""
    return dataclasses.replace(self, **changes)

  def to_plain(self) -> dict[str, Any]:
    """The config as plain JSON values (plans as their dicts)."""
    return _plain(self)


def _plain(value: Any) -> Any:
  if isinstance(value, PrecisionPlan):  # a dataclass too: its JSON form
    return value.to_dict()
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {
      f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
    }
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
  return to_plain(default_config.get_config())


def parse(config: ml_collections.ConfigDict | Mapping[str, Any]) -> JobConfig:
  """The main job's config, parsed and checked once.

  The fields ``config`` gives replace the defaults
  (``experiments/configs/default.py``); a section it gives in part keeps
  the defaults of the rest.

  Args:
    config: a config file's ``ConfigDict`` (or a plain mapping), with its
      command-line overrides applied.

  Returns:
    The :class:`JobConfig`.

  Raises:
    ValueError: naming the first bad field and its value (a field the main
      job's config does not have, a value out of its range, a plan that
      cannot be read, settings that do not fit together:
      :func:`check_together`).
    FileNotFoundError: a plan file that does not exist.
  """
  job = parse_section(JobConfig, to_plain(config) or {}, _defaults(), "config")
  check_together(job)
  return job


def check_together(job: JobConfig) -> None:
  """Checks the settings that depend on each other.

  In manual plan mode every plan names a device kind of the cluster; with
  ``--plan=auto`` every kind can be profiled; the allocator's settings,
  the optimizer and its averaged fields, the averager, the outer
  optimizer and the learning-rate and sync schedules all build.

  Raises:
    ValueError: naming the settings that do not fit.
  """
  # "auto" is resolved from the devices once JAX starts (experiments.train).
  if (
    job.plan_mode == "manual"
    and job.cluster.strip().lower() != cluster_lib.AUTO
  ):
    check_plan_kinds(job.plans, cluster_lib.parse_cluster(job.cluster))
  check_auto_plan_kinds(job)
  auto_settings(job)  # the allocator's choices
  sync_settings(job)  # optimizer fields, averager, outer optimizer, schedule


def check_plan_kinds(
  plans: Mapping[str, Any], spec: cluster_lib.ClusterSpec
) -> None:
  """Raises ``ValueError`` if ``plans`` names a kind ``spec`` lacks.

  A plan for a kind the cluster does not have is a typo or the wrong
  cluster; dropping it would silently train that kind in FP32.
  """
  kinds = spec.groups()
  outside = sorted(k for k in plans if k not in kinds)
  if outside:
    raise ValueError(
      f"plan(s) given for device kind(s) {', '.join(outside)}, which the "
      f"cluster {spec} does not have (its kinds: {', '.join(kinds)})"
    )


def check_auto_plan_kinds(job: JobConfig) -> None:
  """Raises ``ValueError`` if ``--plan=auto`` would profile a kind no GPU is.

  With ``config.allocator.profiles="auto"`` a kind gets the GPU catalog's
  analytic profile or, where a device of that kind runs, a measured one. A
  kind outside the catalog (``cpu``) would be measured on this host's CPU
  at the timing model's deployment size, which takes many times the host
  memory the run itself needs; such a kind needs a plan of its own (or
  ``profiles="measured"``, which bounds what it measures). A cluster of one
  kind allocates nothing and is left alone.
  """
  if job.plan_mode != "auto":
    return
  if job.cluster.strip().lower() == cluster_lib.AUTO:
    return
  if job.allocator.profiles != "auto":
    return
  kinds = cluster_lib.parse_cluster(job.cluster).groups()
  outside = [k for k in kinds if k not in devices_lib.DEVICES]
  if len(kinds) > 1 and outside:
    kind = outside[0]
    raise ValueError(
      f"--plan=auto cannot plan device kind {kind}: it is not a GPU, so "
      "the GPU catalog has no figures for it, and "
      "config.allocator.profiles=auto measures none but GPUs; give it a "
      f"plan: --plan={kind}=FILE.json, or a uniform one such as "
      f'--plan={kind}=\'{{"default": "fp32"}}\''
    )


def auto_settings(job: JobConfig) -> job_plans.AutoPlanSettings:
  """The config's allocator settings (``config.allocator``) as the
  library's :class:`~qsync_jax.allocation.job_plans.AutoPlanSettings`.

  Raises:
    ValueError: a field out of its range, named as the config names it
      (``config.allocator.method must be one of ...``).
  """
  a = job.allocator
  try:
    return job_plans.AutoPlanSettings(
      indicator=a.indicator,
      method=a.method,
      num_batches=a.num_batches,
      compression=a.compression,
      candidates=a.candidates,
      timing_model_kwargs=dict(a.timing_model_kwargs),
      timing_batch_size=a.timing_batch_size,
      profiles=a.profiles,
      profile_repeats=a.profile_repeats,
      profile_cache_dir=a.profile_cache_dir,
      planning_timeout_s=job.distributed.planning_timeout_s,
    )
  except job_plans.SettingError as e:
    field = (
      "distributed.planning_timeout_s"
      if e.field == "planning_timeout_s"
      else f"allocator.{e.field}"
    )
    raise ValueError(
      f"config.{field} must be {e.rule}, got {e.value!r}"
    ) from None


def learning_rate(job: JobConfig) -> LearningRateSchedule:
  """The learning-rate schedule of ``config.lr_schedule`` and its fields
  (:class:`~qsync_jax.parallel.lr_schedules.LearningRateSchedule`: optax
  for training, float64 for QSR's period).

  Raises:
    ValueError: an unknown schedule, or fields it cannot use.
  """
  return LearningRateSchedule(
    job.lr_schedule,
    peak=job.learning_rate,
    final=job.final_learning_rate,
    warmup=job.warmup_steps,
    total=job.steps,
    decay_steps=job.lr_decay_steps,
    factor=job.lr_decay_factor,
    base=job.lr_round_base,
  )


def make_optimizer(
  job: JobConfig,
) -> optax.GradientTransformation:
  """``job.optimizer``: Adam, or SGD with ``job.momentum`` (0: none).

  Both treat every parameter alike, so they are declared
  :func:`qsync_jax.train.step.elementwise` and run on the flat parameters.
  """
  lr = learning_rate(job).optax()
  name = job.optimizer
  if name == "adam":
    return step_lib.elementwise(optax.adam(lr))
  if name == "sgd":
    return step_lib.elementwise(optax.sgd(lr, momentum=job.momentum or None))
  raise ValueError(f"unknown optimizer {name!r}; valid: adam, sgd")


def opt_fields(job: JobConfig) -> tuple[str, ...]:
  """``config.opt_fields_to_average``, checked against the optimizer.

  Returns:
    The field names (empty: none).

  Raises:
    ValueError: a field the optimizer's state does not have.
  """
  fields = job.opt_fields_to_average
  if fields:  # the state's fields do not depend on the parameters' shapes
    state = jax.eval_shape(make_optimizer(job).init, jnp.zeros(1))
    programs.opt_field_mask(state, fields)
  return fields


def make_loss_fn(job: JobConfig) -> Any:
  """The objective ``config.loss_fn`` names (None: classification).

  Raises:
    ValueError: a spec that does not name a callable, or a callable of
      neither loss form.
  """
  spec = job.loss_fn.strip()
  if not spec:
    return None
  fn = task.load_callable(spec, "loss_fn", "expected 'package.module:loss_fn'")
  try:
    return task.as_objective(fn)
  except TypeError as err:
    raise ValueError(f"loss_fn {spec!r}: {err}") from None


#: The outer optimizers of ``config.outer_optimizer``.
OUTER_OPTIMIZERS = ("none", "diloco")


def make_outer_optimizer(
  job: JobConfig,
) -> optax.GradientTransformation | None:
  """The outer optimizer of ``config.outer_optimizer`` (None for "none").

  "diloco" is DiLoCo's (Douillard et al., arXiv 2311.08105, as MaxText and
  torchft run it): SGD with Nesterov momentum, ``optax.sgd(outer_lr,
  momentum=outer_momentum, nesterov=True)``, stepping the anchor by
  ``anchor - mean`` at each parameter average.

  Raises:
    ValueError: an unknown name, or "diloco" with ``sync=dp`` (which never
      averages parameters).
  """
  name = job.outer_optimizer
  if name not in OUTER_OPTIMIZERS:
    raise ValueError(
      f"config.outer_optimizer must be one of "
      f"{', '.join(OUTER_OPTIMIZERS)}, got {name!r}"
    )
  if name == "none":
    return None
  if job.sync == "dp":
    raise ValueError(
      f"config.outer_optimizer={name} needs a local sync "
      "(local, postlocal, qsr), got sync='dp'"
    )
  return optax.sgd(
    job.outer_lr, momentum=job.outer_momentum or None, nesterov=True
  )


def make_schedule(job: JobConfig) -> schedules.Schedule:
  """The synchronization schedule of ``config.sync``.

  See schedules.make_schedule. QSR reads the learning-rate schedule and keeps
  ``h_base`` during warmup; without ``alpha`` it takes
  :func:`~qsync_jax.parallel.schedules.default_alpha` of
  ``learning_rate``, which needs a decaying ``lr_schedule``.

  Raises:
    ValueError: the schedule's fields do not fit (QSR with neither alpha
      nor a decaying learning rate names the flag to pass).
  """
  if job.sync == "qsr" and job.alpha is None and job.lr_schedule == "constant":
    # QSR's period grows only as the learning rate decays: on a constant one
    # it would stay at h_base, which is sync=local under another name.
    raise ValueError(
      "config.sync='qsr' needs a decaying learning rate, but "
      "config.lr_schedule='constant' keeps QSR's period at "
      f"h_base={job.h_base} (that is --sync=local); pass "
      "--config.lr_schedule=cosine (QSR's schedule; or linear, step, "
      "cosine_step), or --alpha for a fixed longer period"
    )
  return schedules.make_schedule(
    job.sync,
    total_steps=job.steps,
    lr_schedule=learning_rate(job).float64(),
    h_base=job.h_base,
    alpha=job.alpha,
    gamma=job.gamma,
    warmup_steps=job.warmup_steps,
    switch_step=job.switch_step,
  )


def make_averager(job: JobConfig) -> averagers.Averager:
  """The averaging strategy of ``config.compress``.

  See averagers.make_averager; built with the fields of
  ``config.compress_kwargs`` that are set (the default config declares the
  known ones unset, so that the command line can set them) and the run's
  seed for its noise.

  Raises:
    ValueError: an unknown strategy, or a field it does not have.
  """
  kwargs = job.compress_kwargs.given()
  name = job.compress
  if name in ("gqsgd", "gqsgd_exp", "qsgd", "powersgd"):
    kwargs.setdefault("seed", job.seed)
  try:
    return averagers.make_averager(name, **kwargs)
  except TypeError as e:  # a field the strategy's dataclass does not have
    raise ValueError(
      f"config.compress_kwargs {sorted(kwargs)} do not fit "
      f"compress={name!r}: {e}"
    ) from None


def build_model(
  job: JobConfig,
  dataset: data_lib.Dataset,
  timing: bool = False,
) -> nnx.Module:
  """``config.model`` sized for ``dataset`` (the dataset's facts go where
  the model takes them), with ``config.model_kwargs``.

  Args:
    job: the job's config.
    dataset: the data the model fits.
    timing: build the allocator's timing model instead:
      ``config.allocator.timing_model_kwargs`` on top of the model kwargs,
      where the model takes them (the defaults describe the built-in CNN as
      deployed). A user's model keeps the dataset's input facts, since it
      is traced on the dataset's inputs; the log says what was left out.

  Raises:
    ValueError: a model kwarg the model does not take (naming those it
      does), or a bad model spec.
  """
  kwargs = dict(job.model_kwargs)
  data_kwargs = dataset.model_kwargs()
  if timing:
    wanted = dict(job.allocator.timing_model_kwargs)
    usable = models_lib.model_arguments(job.model, wanted, {})
    if job.model not in models_lib.MODELS:
      # A user's model is traced on the dataset's inputs: it keeps the
      # dataset's input facts.
      usable = {k: v for k, v in usable.items() if k not in data_kwargs}
    left_out = sorted(set(wanted) - set(usable))
    if left_out:
      logging.info(
        "timing model %s: not taking allocator.timing_model_kwargs %s",
        job.model,
        ", ".join(left_out),
      )
    data_kwargs = {**data_kwargs, **usable}
    kwargs = {k: v for k, v in kwargs.items() if k not in usable}
  return models_lib.build_model(
    job.model,
    rngs=nnx.Rngs(job.seed),
    data_kwargs=data_kwargs,
    sample_input=dataset.x_train[:2],
    **kwargs,
  )


def check_model_fits(
  job: JobConfig,
  model: nnx.Module,
  dataset: data_lib.Dataset,
) -> int | None:
  """Checks, abstractly, that ``model`` and the loss fit ``dataset``.

  Before training: with the built-in objective on class labels, the model's
  output has a logit for every class the labels use (fewer makes the loss
  NaN, which would pass for a learning rate too high); and the objective's
  loss is a scalar (a user's loss_fn that returns one loss per example is
  named with its shape).

  Returns:
    The model's number of classes (its logits' last size) with the
    built-in objective on class labels, which the labels must index; None
    otherwise.

  Raises:
    ValueError: naming the model's number of outputs and the dataset's
      number of classes, or the loss and its shape.
  """
  loss_fn = make_loss_fn(job)
  objective = task.as_objective(loss_fn)
  n = max(1, min(job.batch_size, len(dataset.x_train)))
  batch = task.abstract((dataset.x_train[:n], dataset.y_train[:n]))
  graphdef, state = nnx.split(model)

  classify = loss_fn is None and dataset.task != "regression"

  def run(state, batch):
    model = nnx.merge(graphdef, state)
    logits = None
    if classify:
      logits = objective.forward(model, batch)
      _check_logits(job, logits, dataset, n)
    objective(model, batch)
    return logits

  logits = jax.eval_shape(run, state, batch)
  return int(logits.shape[-1]) if classify else None


def _check_logits(
  job: JobConfig,
  logits: Any,
  dataset: data_lib.Dataset,
  n: int,
) -> None:
  """Raises ``ValueError`` unless ``logits`` has a logit per class.

  A streamed dataset's classes are not known without a full pass: its first
  examples' labels stand for them.
  """
  labels = (n, *dataset.y_train.shape[1:])
  top = int(
    max(np.max(dataset.y_train, initial=0), np.max(dataset.y_test, initial=0))
  )
  classes = max(top + 1, int(dataset.num_classes or 0))
  shape = getattr(logits, "shape", None)
  if shape is None or tuple(shape[:-1]) != labels:
    got = f"shape {tuple(shape)}" if shape is not None else "no array"
    raise ValueError(
      f"model {job.model!r} outputs {got} for labels of shape {labels}; "
      f"the built-in loss needs logits of shape "
      f"{(*labels, classes)} (or set config.loss_fn)"
    )
  if shape[-1] < classes:
    raise ValueError(
      f"model {job.model!r} outputs {shape[-1]} classes but dataset "
      f"{dataset.name!r} has {classes} (labels 0..{top}): give the model a "
      f"head of {classes} (num_classes)"
    )


def sync_settings(job: JobConfig) -> SyncSettings:
  """The trainer's synchronization settings the config names.

  Error feedback with the exact float32 mean (``compress="none"``) has
  nothing to feed back; :func:`unused_settings` says so at start, and the
  settings leave it off.

  Raises:
    ValueError: an unknown schedule, averager or outer optimizer, fields
      they cannot use, or an optimizer-state field the optimizer lacks.
  """
  averager = make_averager(job)
  return SyncSettings(
    schedule=make_schedule(job),
    averager=averager,
    error_feedback=job.error_feedback
    and not isinstance(averager, averagers.MeanAverager),
    outer_tx=make_outer_optimizer(job),
    opt_fields_to_average=opt_fields(job),
  )


# Settings only some choices read: (field, the choice's field, the values of
# it that read the setting). A setting away from the default config's value
# that the chosen value would not read is said at start.
_READ_ONLY_BY: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
  ("momentum", "optimizer", ("sgd",)),
  ("lr_decay_steps", "lr_schedule", ("step",)),
  ("lr_decay_factor", "lr_schedule", ("step",)),
  ("lr_round_base", "lr_schedule", ("cosine_step",)),
  ("final_learning_rate", "lr_schedule", ("cosine", "linear", "cosine_step")),
  ("h_base", "sync", ("local", "postlocal", "qsr")),
  ("alpha", "sync", ("qsr",)),
  ("gamma", "sync", ("qsr",)),
  ("switch_step", "sync", ("postlocal",)),
  ("opt_fields_to_average", "sync", ("local", "postlocal", "qsr")),
  ("outer_lr", "outer_optimizer", ("diloco",)),
  ("outer_momentum", "outer_optimizer", ("diloco",)),
  ("speeds", "batch_mode", ("dynamic",)),
  ("bn_batches", "bn_stats", ("reestimate",)),
  (
    "error_feedback",
    "compress",
    ("fp16", "bf16", "gqsgd", "gqsgd_exp", "qsgd", "powersgd"),
  ),
  ("allocator", "plan_mode", ("auto",)),
  ("plans", "plan_mode", ("manual",)),
)


def unused_settings(job: JobConfig) -> list[str]:
  """The settings of ``job`` the run will not read, each in one line.

  A setting counts as given where it differs from the default config's
  (``experiments/configs/default.py``); it is unused where the choice that
  reads it chose otherwise (``momentum`` with ``optimizer=adam``, ``alpha``
  with ``sync=dp``, ...). Also: ``lr_decay_steps`` at or past the last
  step (they never decay), ``warmup_steps`` with the constant learning rate
  (only QSR's period reads it then) and ``final_learning_rate`` with the
  step schedule and no warmup.

  Returns:
    One sentence per unused setting, for a ``warning:`` line at start.
  """
  plain = job.to_plain()
  defaults = _default_job().to_plain()
  out = []
  for field, chooser, readers in _READ_ONLY_BY:
    value = plain[field]
    if value == defaults[field] or value in ((), [], None, {}):
      continue
    if plain[chooser] in readers or (
      # final_learning_rate starts the warmup of every schedule but constant.
      field == "final_learning_rate"
      and plain[chooser] == "step"
      and job.warmup_steps
    ):
      continue
    given = {field: value}
    if isinstance(value, Mapping):  # each setting of a section its own line
      known = defaults[field] or {}
      given = {f"{field}.{k}": v for k, v in value.items() if v != known.get(k)}
    out.extend(
      f"config.{name}={_shown(v)} is not used with "
      f"{chooser}={plain[chooser]!r} (only with "
      f"{' or '.join(map(repr, readers))})"
      for name, v in given.items()
    )
  name, steps = job.lr_schedule, job.steps
  late = [d for d in job.lr_decay_steps if d >= steps]
  if name == "step" and late:
    out.append(
      f"config.lr_decay_steps {', '.join(map(str, late))} "
      f"{'is' if len(late) == 1 else 'are'} at or past the last step "
      f"(config.steps={steps}): the learning rate never decays there"
    )
  if name == "constant" and job.warmup_steps and job.sync != "qsr":
    out.append(
      f"config.warmup_steps={job.warmup_steps} is not used with "
      "lr_schedule='constant' (no warmup; only sync='qsr' reads it, for "
      "its period)"
    )
  return out


@functools.lru_cache(maxsize=1)
def _default_job() -> JobConfig:
  """The default config, parsed (what a setting is compared with)."""
  return parse_section(JobConfig, _defaults(), _defaults(), "config")


def _shown(value: Any) -> str:
  text = (
    ",".join(map(str, value))
    if isinstance(value, (list, tuple))
    else str(value)
  )
  return text if len(text) <= 48 else text[:45] + "..."
