"""The main job's config: its checks, and the objects it names.

This module owns ``validate_config`` (every numeric field of a train config,
checked before anything runs, each plan's device kind against the
cluster, the BatchNorm choice of evaluation and the optimizer-state fields
to average), reading plans and JSON given on the command line (``load_plan``,
``read_json``: depth-bounded by Python's recursion limit), and turning the
config into the training objects: the model (``build_model``, sized for the
dataset), the learning rate (optax for training, a float64 twin for QSR),
the optimizer, the sync schedule and the averager.
:mod:`experiments.train_lib` runs the job with them; the binary's shortcut
flags are in :mod:`experiments.flag_aliases`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import json
import math
import numbers
import os
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import task
from qsync_jax.allocation import sharing
from qsync_jax.parallel import averagers
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel import schedules
from qsync_jax.plan import devices as devices_lib
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import detection
from qsync_jax.train import evaluation
from qsync_jax.train import programs
from qsync_jax.train import step as step_lib


def load_plan(spec: Any) -> PrecisionPlan:
  """Builds a plan from a JSON file path, JSON text, or a config mapping.

  Raises:
    FileNotFoundError: a path that does not exist.
    qsync_jax.PlanError: a malformed plan.
  """
  if isinstance(spec, PrecisionPlan):
    return spec
  spec = to_plain(spec)
  if isinstance(spec, Mapping):
    return PrecisionPlan.from_dict(spec)
  text, what = spec, "plan JSON"
  if isinstance(spec, str) and not spec.lstrip().startswith("{"):
    text, what = read_file(spec, "plan file"), f"plan file {spec!r}"
  try:
    return PrecisionPlan.from_json(text)
  except RecursionError:
    raise ValueError(f"{what} is nested too deeply") from None
  except ValueError as e:  # PlanError, or not JSON: say which plan
    if what == "plan JSON":
      raise
    raise (PlanError if isinstance(e, PlanError) else ValueError)(
      f"{what}: {e}"
    ) from None


def read_file(path: str, what: str) -> str:
  """The UTF-8 text of the file ``path`` a user named.

  Raises:
    FileNotFoundError: no such file.
    ValueError: ``path`` is a directory, unreadable, or not UTF-8 text
      (the message names ``what`` and ``path``).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"{what} {path!r} does not exist")
  if os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is a directory, not a JSON file")
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise ValueError(
      f"{what} {path!r} is not UTF-8 text (byte {e.start} is "
      f"{e.object[e.start : e.start + 1]!r}); expected a JSON file"
    ) from None
  except OSError as e:
    raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from None


def read_json(text: str, what: str) -> Any:
  """Parses JSON text given by the user.

  Args:
    text: the JSON.
    what: what it is, for the message (e.g. ``"--model_kwargs"``).

  Returns:
    The parsed value.

  Raises:
    ValueError: malformed JSON, or JSON nested deeper than Python's recursion
      limit (the decoder recurses per level).
  """
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{what} is not JSON: {e}") from None
  except RecursionError:
    raise ValueError(f"{what} is nested too deeply") from None


# Integer fields and their least value.
_INT_FIELDS: dict[str, int] = {
  "batch_size": 1,
  "steps": 1,
  "warmup_steps": 0,
  "h_base": 1,
  "switch_step": 0,
  "seed": 0,
  "log_every": 1,
  "eval_every": 0,
  "checkpoint_every": 0,
  "allocator.num_batches": 1,
  "allocator.timing_batch_size": 0,
  "compress_kwargs.bucket_size": 1,
  "compress_kwargs.levels": 1,
  "bn_batches": 1,
  "distributed.initialization_timeout_s": 1,
  "distributed.heartbeat_timeout_s": 1,
  "distributed.shutdown_timeout_s": 1,
  "compress_kwargs.rank": 1,
  "compress_kwargs.cols": 1,
  "allocator.profile_repeats": 1,
  "distributed.planning_timeout_s": 1,
}


# Float fields: the condition their (finite) value must meet, in words.
_FLOAT_FIELDS: dict[str, tuple[Callable[[float], bool], str]] = {
  "learning_rate": (lambda v: v > 0, "> 0"),
  "final_learning_rate": (lambda v: v >= 0, ">= 0"),
  "lr_decay_factor": (lambda v: v > 0, "> 0"),
  "lr_round_base": (lambda v: v > 0 and v != 1, "> 0 and != 1"),
  "momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
  "alpha": (lambda v: v >= 0, ">= 0"),
  "gamma": (lambda v: v > 0, "> 0"),
  "allocator.compression": (lambda v: 0 <= v <= 1, "in [0, 1]"),
  "outer_lr": (lambda v: v > 0, "> 0"),
  "outer_momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


# Fields that may be None: unset, the library's default applies.
_OPTIONAL = (
  "allocator.compression",
  "compress_kwargs.bucket_size",
  "compress_kwargs.levels",
  "compress_kwargs.rank",
  "compress_kwargs.cols",
  "compress_kwargs.warm_start",
)


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
  """``{dotted.path: value}`` of every non-container entry of a config."""
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      out.update(_leaves(v, f"{prefix}{k}."))
    return out
  if isinstance(value, (list, tuple)):
    out = {}
    for i, v in enumerate(value):
      out.update(_leaves(v, f"{prefix[:-1]}[{i}]."))
    return out
  return {prefix[:-1]: value}


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Checks the main job's config before anything runs.

  Every integer field has its least value (steps, batch sizes and the log
  interval at least 1; offsets, seeds and the intervals where 0 turns
  something off at least 0), every float field its range (a learning rate
  > 0, momentum in [0, 1), ...), every other number anywhere in the config
  (model and dataset arguments included) is finite, in manual plan mode
  every entry of ``config.plans`` names a device kind of ``config.cluster``,
  ``config.compress`` with ``config.compress_kwargs`` builds an averager,
  and the learning-rate and sync schedules build. Fields the config does
  not have are not checked.

  Args:
    config: the job's config.

  Raises:
    ValueError: naming the first bad field and its value.
  """
  for name, value in _leaves(to_plain(config)).items():
    if value is None and name in _OPTIONAL:
      continue
    if name in _INT_FIELDS:
      least = _INT_FIELDS[name]
      if not (
        _is_number(value)
        and isinstance(value, numbers.Integral)
        and value >= least
      ):
        raise ValueError(
          f"config.{name} must be an integer >= {least}, got {value!r}"
        )
    elif name in _FLOAT_FIELDS:
      ok, words = _FLOAT_FIELDS[name]
      if not (_is_number(value) and math.isfinite(value) and ok(value)):
        raise ValueError(
          f"config.{name} must be a finite number {words}, got {value!r}"
        )
    elif _is_number(value) and not math.isfinite(value):
      raise ValueError(f"config.{name} must be a finite number, got {value!r}")
  # "auto" is resolved from the devices once JAX starts (experiments.train).
  if (
    config.get("plan_mode", "manual") == "manual"
    and "cluster" in config
    and config.cluster.strip().lower() != cluster_lib.AUTO
  ):
    check_plan_kinds(
      to_plain(config.get("plans", {})) or {},
      cluster_lib.parse_cluster(config.cluster),
    )
  if config.get("plan_mode", "manual") == "manual":
    # Read now, so that an unreadable plan file stops the run before it
    # writes anything.
    for plan in (to_plain(config.get("plans", {})) or {}).values():
      load_plan(plan)
  bn_stats = config.get("bn_stats", "reestimate")
  if bn_stats not in evaluation.BN_STATS:
    raise ValueError(
      f"config.bn_stats must be one of "
      f"{', '.join(evaluation.BN_STATS)}, got {bn_stats!r}"
    )
  local_devices = config.get("distributed", {}).get("local_devices", "auto")
  if local_devices not in detection.LOCAL_DEVICES:
    raise ValueError(
      f"config.distributed.local_devices must be one of "
      f"{', '.join(detection.LOCAL_DEVICES)}, got "
      f"{local_devices!r}"
    )
  source = config.get("allocator", {}).get("profiles", "auto")
  if source not in sharing.SOURCES:
    raise ValueError(
      f"config.allocator.profiles must be one of "
      f"{', '.join(sharing.SOURCES)}, got {source!r}"
    )
  check_auto_plan_kinds(config)
  opt_fields(config)  # a field the optimizer's state does not have
  make_averager(config)  # an unknown strategy or field; building is cheap
  make_outer_optimizer(config)  # an unknown one, or one dp would not use
  if all(k in config for k in ("lr_schedule", "learning_rate", "steps")) and (
    "warmup_steps" in config
  ):
    # The learning-rate schedule's fields (lr_decay_steps, ...) and the
    # sync schedule that reads it.
    make_schedule(config)


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


def check_auto_plan_kinds(config: ml_collections.ConfigDict) -> None:
  """Raises ``ValueError`` if ``--plan=auto`` would profile a kind no GPU is.

  With ``config.allocator.profiles="auto"`` a kind gets the GPU catalog's
  analytic profile or, where a device of that kind runs, a measured one. A
  kind outside the catalog (``cpu``) would be measured on this host's CPU
  at the timing model's deployment size, which takes many times the host
  memory the run itself needs; such a kind needs a plan of its own (or
  ``profiles="measured"``, which bounds what it measures). A cluster of one
  kind allocates nothing and is left alone.
  """
  if config.get("plan_mode", "manual") != "auto" or "cluster" not in config:
    return
  if config.cluster.strip().lower() == cluster_lib.AUTO:
    return
  if config.get("allocator", {}).get("profiles", "auto") != "auto":
    return
  kinds = cluster_lib.parse_cluster(config.cluster).groups()
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


def to_plain(value: Any) -> Any:
  """Converts ConfigDicts (recursively) to plain dicts and lists."""
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: to_plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_plain(v) for v in value]
  return value


LR_SCHEDULES = ("constant", "cosine", "linear", "step", "cosine_step")


def _lr_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The learning-rate fields of ``config``, checked.

  Raises:
    ValueError: an unknown ``lr_schedule``, or fields it cannot use.
  """
  name = config.lr_schedule
  if name not in LR_SCHEDULES:
    raise ValueError(
      f"unknown lr_schedule {name!r}; valid: {', '.join(LR_SCHEDULES)}"
    )
  s = dict(
    name=name,
    peak=float(config.learning_rate),
    final=float(config.get("final_learning_rate", 0.0)),
    warmup=int(config.warmup_steps),
    total=int(config.steps),
    decay_steps=tuple(config.get("lr_decay_steps") or ()),
    factor=float(config.get("lr_decay_factor", 0.1)),
    base=float(config.get("lr_round_base", 2.0)),
  )
  if name == "constant":
    return s
  if not 0 <= s["warmup"] < s["total"]:
    raise ValueError(
      f"lr_schedule={name} needs 0 <= warmup_steps < steps, "
      f"got warmup_steps={s['warmup']}, steps={s['total']}"
    )
  if name == "step":
    d = s["decay_steps"]
    if (
      not d
      or any(not isinstance(x, int) or x < 1 for x in d)
      or list(d) != sorted(set(d))
    ):
      raise ValueError(
        "lr_schedule=step needs lr_decay_steps, increasing "
        f"positive step counts, got {d!r}"
      )
    if not s["factor"] > 0:
      raise ValueError(f"lr_decay_factor must be > 0, got {s['factor']}")
  if name == "cosine_step":
    if not (s["base"] > 0 and s["base"] != 1):
      raise ValueError(f"lr_round_base must be > 0 and != 1, got {s['base']}")
    if not (s["final"] > 0 and s["peak"] > 0):  # it rounds log(lr)
      raise ValueError(
        "lr_schedule=cosine_step needs learning_rate and "
        "final_learning_rate > 0, got "
        f"{s['peak']} and {s['final']}"
      )
  return s


def _rounded_to_powers(schedule: optax.Schedule, base: float) -> optax.Schedule:
  """``schedule`` rounded to the nearest power of ``base`` in log space."""
  log_base = float(np.log(base))

  def rounded(count):
    return base ** jnp.round(jnp.log(schedule(count)) / log_base)

  return rounded


def make_learning_rate(
  config: ml_collections.ConfigDict,
) -> optax.ScalarOrSchedule:
  """The learning rate of ``config.lr_schedule``, for training.

  The official QSR code's schedules (``xscheduler.py``) as optax schedules:
  ``constant``; after a linear warmup from ``config.final_learning_rate``
  to ``config.learning_rate`` over ``config.warmup_steps``, ``cosine``
  (decay to ``final_learning_rate`` at ``config.steps``), ``linear`` (the
  same, linearly), ``step`` (``learning_rate * lr_decay_factor ** i`` from
  the ``i``-th of ``lr_decay_steps``) or ``cosine_step`` (the cosine rounded
  to a power of ``lr_round_base``). :func:`make_learning_rate_f64` is the
  same schedule in float64, for QSR.

  Args:
    config: the main job's config.

  Returns:
    A constant or an optax schedule (optax count -> LR).

  Raises:
    ValueError: an unknown schedule or bad fields (see ``_lr_settings``).
  """
  s = _lr_settings(config)
  peak, final, warmup = s["peak"], s["final"], s["warmup"]
  span = s["total"] - warmup
  if s["name"] == "constant":
    return peak
  if s["name"] == "linear":
    after = optax.linear_schedule(peak, final, span)
  elif s["name"] == "step":
    after = optax.piecewise_constant_schedule(
      peak, {d - warmup: s["factor"] for d in s["decay_steps"]}
    )
  else:
    after = optax.cosine_decay_schedule(
      peak, span, alpha=final / peak if peak else 0.0
    )
    if s["name"] == "cosine_step":
      after = _rounded_to_powers(after, s["base"])
  if not warmup:
    return after
  return optax.join_schedules(
    [optax.linear_schedule(final, peak, warmup), after], [warmup]
  )


def make_learning_rate_f64(
  config: ml_collections.ConfigDict,
) -> Callable[[int], float]:
  """The schedule of :func:`make_learning_rate` in float64, for QSR.

  Each formula is the official ``xscheduler.py``'s, operation for operation,
  so QSR's ``int((alpha / lr) ** power)`` lands on the same integers as the
  official code (optax's float32, or its float64 formulas, can round the
  other way at an exact integer).

  Args:
    config: the main job's config.

  Returns:
    ``lr(step) -> float``, the LR of optax count ``step``.

  Raises:
    ValueError: an unknown schedule or bad fields (see ``_lr_settings``).
  """
  s = _lr_settings(config)
  peak, final, warmup, total = s["peak"], s["final"], s["warmup"], s["total"]
  span = total - warmup

  def after(step: int) -> float:
    delta = min(step - warmup, span)
    if s["name"] == "constant":
      return peak
    if s["name"] == "linear":
      return final + (span - delta) * (peak - final) / span
    if s["name"] == "step":
      i = sum(step >= d for d in s["decay_steps"])
      return peak * s["factor"] ** i
    lr = final + 0.5 * (peak - final) * (1 + np.cos(delta / span * np.pi))
    if s["name"] == "cosine_step":
      lr = s["base"] ** np.round(np.log(lr) / np.log(s["base"]))
    return float(lr)

  def lr(step: int) -> float:
    if s["name"] != "constant" and step < warmup:
      return final + step * (peak - final) / warmup
    return after(int(step))

  return lr


def make_optimizer(
  config: ml_collections.ConfigDict,
) -> optax.GradientTransformation:
  """``config.optimizer``: Adam, or SGD with ``config.momentum`` (0: none).

  Both treat every parameter alike, so they are declared
  :func:`qsync_jax.train.step.elementwise` and run on the flat parameters.
  """
  lr = make_learning_rate(config)
  name = config.get("optimizer", "adam")
  if name == "adam":
    return step_lib.elementwise(optax.adam(lr))
  if name == "sgd":
    return step_lib.elementwise(
      optax.sgd(lr, momentum=config.get("momentum", 0.0) or None)
    )
  raise ValueError(f"unknown optimizer {name!r}; valid: adam, sgd")


def opt_fields(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """``config.opt_fields_to_average``, checked against the optimizer.

  The command line gives ``--config.opt_fields_to_average=mu,nu`` as one
  string, so every entry is split at commas.

  Returns:
    The field names (empty: none).

  Raises:
    ValueError: a field the optimizer's state does not have.
  """
  fields = tuple(
    f.strip()
    for entry in config.get("opt_fields_to_average", ()) or ()
    for f in str(entry).split(",")
    if f.strip()
  )
  if fields:  # the state's fields do not depend on the parameters' shapes
    state = jax.eval_shape(make_optimizer(config).init, jnp.zeros(1))
    programs.opt_field_mask(state, fields)
  return fields


def make_loss_fn(config: ml_collections.ConfigDict) -> Any:
  """The objective ``config.loss_fn`` names (None: classification).

  Raises:
    ValueError: a spec that does not name a callable, or a callable of
      neither loss form.
  """
  spec = str(config.get("loss_fn", "") or "").strip()
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
  config: ml_collections.ConfigDict,
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
  name = config.get("outer_optimizer", "none")
  if name not in OUTER_OPTIMIZERS:
    raise ValueError(
      f"config.outer_optimizer must be one of "
      f"{', '.join(OUTER_OPTIMIZERS)}, got {name!r}"
    )
  if name == "none":
    return None
  if config.get("sync", "dp") == "dp":
    raise ValueError(
      f"config.outer_optimizer={name} needs a local sync "
      "(local, postlocal, qsr), got sync='dp'"
    )
  return optax.sgd(
    config.get("outer_lr", 0.7),
    momentum=config.get("outer_momentum", 0.9) or None,
    nesterov=True,
  )


def make_schedule(config: ml_collections.ConfigDict) -> schedules.Schedule:
  """The synchronization schedule of ``config.sync``.

  See schedules.make_schedule. QSR reads the learning-rate schedule and keeps
  ``h_base`` during warmup.
  """
  return schedules.make_schedule(
    config.get("sync", "dp"),
    total_steps=config.steps,
    lr_schedule=make_learning_rate_f64(config),
    h_base=config.get("h_base", 1),
    alpha=config.get("alpha", 0.0),
    gamma=config.get("gamma", 2.0),
    warmup_steps=config.warmup_steps,
    switch_step=config.get("switch_step", 0),
  )


def make_averager(config: ml_collections.ConfigDict) -> averagers.Averager:
  """The averaging strategy of ``config.compress``.

  See averagers.make_averager; built with the fields of
  ``config.compress_kwargs`` that are set (the default config declares the
  known ones unset, so that the command line can set them) and the run's
  seed for its noise.

  Raises:
    ValueError: an unknown strategy, or a field it does not have.
  """
  kwargs = {
    k: v
    for k, v in (to_plain(config.get("compress_kwargs", {})) or {}).items()
    if v is not None
  }
  name = config.get("compress", "none")
  if name in ("gqsgd", "gqsgd_exp", "qsgd", "powersgd"):
    kwargs.setdefault("seed", config.seed)
  try:
    return averagers.make_averager(name, **kwargs)
  except TypeError as e:  # a field the strategy's dataclass does not have
    raise ValueError(
      f"config.compress_kwargs {sorted(kwargs)} do not fit "
      f"compress={name!r}: {e}"
    ) from None


def build_model(
  config: ml_collections.ConfigDict,
  dataset: data_lib.Dataset,
  timing: bool = False,
) -> nnx.Module:
  """``config.model`` sized for ``dataset`` (the dataset's facts go where
  the model takes them), with ``config.model_kwargs``.

  Args:
    config: the job's config.
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
  kwargs = to_plain(config.get("model_kwargs", {})) or {}
  data_kwargs = dataset.model_kwargs()
  if timing:
    wanted = to_plain(config.allocator.get("timing_model_kwargs", {})) or {}
    usable = models_lib.model_arguments(config.model, wanted, {})
    if config.model not in models_lib.MODELS:
      # A user's model is traced on the dataset's inputs: it keeps the
      # dataset's input facts.
      usable = {k: v for k, v in usable.items() if k not in data_kwargs}
    left_out = sorted(set(wanted) - set(usable))
    if left_out:
      logging.info(
        "timing model %s: not taking allocator.timing_model_kwargs %s",
        config.model,
        ", ".join(left_out),
      )
    data_kwargs = {**data_kwargs, **usable}
    kwargs = {k: v for k, v in kwargs.items() if k not in usable}
  return models_lib.build_model(
    config.model,
    rngs=nnx.Rngs(config.seed),
    data_kwargs=data_kwargs,
    sample_input=dataset.x_train[:2],
    **kwargs,
  )


def check_model_fits(
  config: ml_collections.ConfigDict,
  model: nnx.Module,
  dataset: data_lib.Dataset,
) -> None:
  """Checks, abstractly, that ``model`` and the loss fit ``dataset``.

  Before training: with the built-in objective on class labels, the model's
  output has a logit for every class the labels use (fewer makes the loss
  NaN, which would pass for a learning rate too high); and the objective's
  loss is a scalar (a user's loss_fn that returns one loss per example is
  named with its shape).

  Raises:
    ValueError: naming the model's number of outputs and the dataset's
      number of classes, or the loss and its shape.
  """
  loss_fn = make_loss_fn(config)
  objective = task.as_objective(loss_fn)
  n = max(1, min(int(config.get("batch_size", 2)), len(dataset.x_train)))
  batch = task.abstract((dataset.x_train[:n], dataset.y_train[:n]))
  graphdef, state = nnx.split(model)

  def run(state, batch):
    model = nnx.merge(graphdef, state)
    if loss_fn is None and dataset.task != "regression":
      _check_logits(config, objective.forward(model, batch), dataset, n)
    objective(model, batch)

  jax.eval_shape(run, state, batch)


def _check_logits(
  config: ml_collections.ConfigDict,
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
      f"model {config.model!r} outputs {got} for labels of shape {labels}; "
      f"the built-in loss needs logits of shape "
      f"{(*labels, classes)} (or set config.loss_fn)"
    )
  if shape[-1] < classes:
    raise ValueError(
      f"model {config.model!r} outputs {shape[-1]} classes but dataset "
      f"{dataset.name!r} has {classes} (labels 0..{top}): give the model a "
      f"head of {classes} (num_classes)"
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


def unused_settings(config: ml_collections.ConfigDict) -> list[str]:
  """The settings of ``config`` the run will not read, each in one line.

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
  from experiments.configs import default  # local: the defaults' values

  plain = to_plain(config)
  defaults = to_plain(default.get_config())
  out = []
  for field, choice, readers in _READ_ONLY_BY:
    if field not in plain or choice not in plain:
      continue
    value = plain[field]
    if value == defaults.get(field) or value in ((), [], None, {}):
      continue
    if plain[choice] in readers or (
      # final_learning_rate starts the warmup of every schedule but constant.
      field == "final_learning_rate"
      and plain[choice] == "step"
      and plain.get("warmup_steps")
    ):
      continue
    given = {field: value}
    if isinstance(value, Mapping):  # each setting of a section its own line
      known = defaults.get(field) or {}
      given = {f"{field}.{k}": v for k, v in value.items() if v != known.get(k)}
    out.extend(
      f"config.{name}={_shown(v)} is not used with "
      f"{choice}={plain[choice]!r} (only with "
      f"{' or '.join(map(repr, readers))})"
      for name, v in given.items()
    )
  name, steps = plain.get("lr_schedule"), plain.get("steps")
  late = [
    d
    for d in plain.get("lr_decay_steps") or ()
    if isinstance(d, int) and isinstance(steps, int) and d >= steps
  ]
  if name == "step" and late:
    out.append(
      f"config.lr_decay_steps {', '.join(map(str, late))} "
      f"{'is' if len(late) == 1 else 'are'} at or past the last step "
      f"(config.steps={steps}): the learning rate never decays there"
    )
  if (
    name == "constant"
    and plain.get("warmup_steps")
    and plain.get("sync") != "qsr"
  ):
    out.append(
      f"config.warmup_steps={plain['warmup_steps']} is not used with "
      "lr_schedule='constant' (no warmup; only sync='qsr' reads it, for "
      "its period)"
    )
  return out


def _shown(value: Any) -> str:
  text = (
    ",".join(map(str, value))
    if isinstance(value, (list, tuple))
    else str(value)
  )
  return text if len(text) <= 48 else text[:45] + "..."
