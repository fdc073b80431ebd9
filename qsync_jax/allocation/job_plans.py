"""A training job's precision plans, planned once for every process.

This module owns automatic planning as a training job runs it (QSync,
arXiv 2407.02327, section 5), from Python objects alone:

* :class:`AutoPlanSettings`: the allocator's settings, checked;
* :func:`plan_job`: the pipeline, down the layers once: the timing model's
  :class:`~qsync_jax.task.Probe` made once and its graph traced once; each
  kind's profile site chosen and its profile measured where it runs (or
  taken from the GPU catalog) and gathered on every process
  (:mod:`qsync_jax.allocation.sharing`); process 0 scores the model and runs
  the allocator (:func:`qsync_jax.allocation.pipeline.plan_cluster`), once;
  every process gets its plans (:class:`JobPlans`);
* :class:`PlanCache`: what planning again in the same run directory (a
  resume onto other workers) reuses: the indicator scores and each kind's
  measured profile, which do not depend on the workers;
* :func:`timing_batch`: a batch of the job's data that the timing model
  takes, to profile it.

The processes' check that they train with the same plans is
:func:`qsync_jax.allocation.sharing.check_plans`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import contextlib
import dataclasses
import functools
import json
import math
import numbers
import os
import time
from typing import Any, NamedTuple

from absl import logging
from flax import nnx
import jax
import jaxlib
import numpy as np
import optax

from qsync_jax import files
from qsync_jax import predictor
from qsync_jax import sensitivity
from qsync_jax.allocation import allocator as allocator_lib
from qsync_jax.allocation import pipeline
from qsync_jax.allocation import sharing
from qsync_jax.data.base import Dataset
from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import profiling
from qsync_jax.process import agreement
from qsync_jax.process import coordination
from qsync_jax.task import calling
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn
from qsync_jax.version import __version__

#: The run directory's measured profiles, ``<kind>.json`` each.
PROFILES_DIR = "profiles"
#: Beside ``allocation/scores.json``: the digest of what they depend on.
SCORES_KEY = "scores_key.json"


class SettingError(ValueError):
  """An :class:`AutoPlanSettings` field out of its range.

  Attributes:
    field: the field's name.
    rule: what it must be, in words (``"an integer >= 1"``).
    value: the value given.
  """

  def __init__(self, field: str, rule: str, value: Any):
    super().__init__(f"AutoPlanSettings.{field} must be {rule}, got {value!r}")
    self.field = field
    self.rule = rule
    self.value = value


def _is_int(value: Any, least: int) -> bool:
  return (
    isinstance(value, numbers.Integral)
    and not isinstance(value, bool)
    and int(value) >= least
  )


def _is_number(value: Any) -> bool:
  return (
    isinstance(value, numbers.Real)
    and not isinstance(value, bool)
    and math.isfinite(value)
  )


@dataclasses.dataclass(frozen=True)
class AutoPlanSettings:
  """How :func:`plan_job` plans: the allocator's settings.

  Every field is required; the main job's defaults are its config's
  (``experiments/configs/default.py``).

  Attributes:
    indicator: the indicator method
      (:data:`qsync_jax.sensitivity.METHODS`).
    method: the allocator's search
      (:data:`qsync_jax.allocation.allocator.METHODS`).
    num_batches: training batches the indicator scores on.
    compression: None, or instead of the catalog's device memory, give
      each weak kind the budget that saves this fraction of its FP32
      residual bytes (in [0, 1]).
    candidates: precisions the weak kinds may use (names, e.g. ``"int8"``).
    timing_model_kwargs: the arguments the timing model was built with
      (recorded in the profile cache's digest; the caller builds it).
    timing_batch_size: the per-worker batch the timing model is profiled
      and planned at; 0: the job's batch size.
    profiles: where each kind's profile comes from
      (:data:`qsync_jax.allocation.sharing.SOURCES`).
    profile_repeats: timed calls per measurement of a measured profile.
    profile_cache_dir: a directory measured profiles are cached in, or
      ``""``.
    planning_timeout_s: the longest wait for another process's profile or
      process 0's plans, in seconds.

  Raises:
    SettingError: a field out of its range (a ``ValueError`` naming it).
  """

  indicator: str
  method: str
  num_batches: int
  compression: float | None
  candidates: tuple[str, ...]
  timing_model_kwargs: Mapping[str, Any]
  timing_batch_size: int
  profiles: str
  profile_repeats: int
  profile_cache_dir: str
  planning_timeout_s: float

  def __post_init__(self):
    def one_of(field, valid):
      value = getattr(self, field)
      if value not in valid:
        raise SettingError(field, f"one of {', '.join(valid)}", value)

    one_of("indicator", sensitivity.METHODS)
    one_of("method", allocator_lib.METHODS)
    one_of("profiles", sharing.SOURCES)
    for field, least in (
      ("num_batches", 1),
      ("timing_batch_size", 0),
      ("profile_repeats", 1),
    ):
      if not _is_int(getattr(self, field), least):
        raise SettingError(
          field, f"an integer >= {least}", getattr(self, field)
        )
    c = self.compression
    if c is not None and not (_is_number(c) and 0 <= c <= 1):
      raise SettingError("compression", "None or a number in [0, 1]", c)
    t = self.planning_timeout_s
    if not (_is_number(t) and t > 0):
      raise SettingError("planning_timeout_s", "a finite number > 0", t)
    self._check_candidates()
    if not isinstance(self.timing_model_kwargs, Mapping):
      raise SettingError(
        "timing_model_kwargs", "a mapping", self.timing_model_kwargs
      )
    if not isinstance(self.profile_cache_dir, str):
      raise SettingError(
        "profile_cache_dir", "a path or ''", self.profile_cache_dir
      )

  def _check_candidates(self) -> None:
    names = self.candidates
    rule = "a non-empty list of precision names"
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
      raise SettingError("candidates", rule, names)
    try:
      parsed = tuple(Precision.parse(name).value for name in names)
    except ValueError:
      raise SettingError("candidates", rule, names) from None
    # Names as plans and profiles write them ("fp16"), whatever was given.
    object.__setattr__(self, "candidates", parsed)


class JobPlans(NamedTuple):
  """What :func:`plan_job` gives every process.

  Attributes:
    plans: ``{kind: PrecisionPlan}``, the same on every process (``{}``,
      FP32 everywhere, for a cluster of one kind).
    result: the :class:`~qsync_jax.allocation.pipeline.PlanningResult` on
      process 0 (the allocation, its graph, profiles and scores); None on
      the others, and where nothing was allocated.
    sources: ``{kind: where its profile came from}``
      (:func:`qsync_jax.allocation.sharing.describe_sites`).
  """

  plans: dict[str, PrecisionPlan]
  result: pipeline.PlanningResult | None
  sources: dict[str, str]


def timing_batch(
  model: Any, dataset: Dataset, batch_size: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """A training batch of ``batch_size`` the timing model takes, to profile.

  The dataset's examples (repeated to ``batch_size``) where the model takes
  the dataset's inputs; where the timing model's ``input_spec`` differs from
  them (the CNN as deployed, at 32 x 32 x 3 against digits' 8 x 8 x 1),
  random inputs of that spec: normal floats, or integers below the largest
  the dataset uses. Per-position labels (a language model's) follow the
  inputs' shape. Only shapes and dtypes set a profile's times.

  Args:
    model: the timing model.
    dataset: the job's dataset.
    batch_size: the per-worker batch to profile.
    seed: the random inputs' seed.

  Returns:
    ``(inputs, labels)``.
  """
  idx = np.arange(batch_size) % len(dataset.x_train)
  x, y = dataset.x_train[idx], dataset.y_train[idx]
  spec = getattr(model, "input_spec", None)
  if not callable(spec):
    return x, y
  want = spec(batch_size)
  if tuple(want.shape) == x.shape and np.dtype(want.dtype) == x.dtype:
    return x, y
  rng = np.random.default_rng(seed)
  per_position = y.shape[1:] == x.shape[1:] and y.ndim > 1
  if np.issubdtype(np.dtype(want.dtype), np.floating):
    new_x = rng.standard_normal(want.shape).astype(want.dtype)
  else:
    high = max(int(np.max(dataset.x_train)) + 1, 1)
    new_x = rng.integers(0, high, want.shape).astype(want.dtype)
  if per_position:
    y = rng.integers(
      0, max(int(np.max(dataset.y_train)) + 1, 1), want.shape
    ).astype(y.dtype)
  return new_x, y


def _versions() -> dict[str, str]:
  """What a cached score or profile was computed with, besides its inputs."""
  return {
    "qsync_jax": __version__,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "profile_format": str(profiling.PROFILE_FORMAT),
    "QSYNC_KERNELS": os.environ.get("QSYNC_KERNELS", ""),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
  }


def _read_json(path: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


class PlanCache:
  """What planning again in a run directory reuses.

  A run that plans again (automatic plans resumed onto other workers) needs
  the indicator scores and each kind's measured profile, neither of which
  depends on the workers. Each is reused where the digest of what it
  depends on, recorded beside it, is this run's: the scores from
  ``allocation/scores.json`` (the model's initial parameters, the
  indicator's batches and settings: ``allocation/scores_key.json``), a
  profile from ``profiles/<kind>.json`` (the timing model's graph and
  settings, the timing batch, the kind and the device measuring it, the
  library's versions). One that is stale (another digest) or unreadable is
  computed again, never reused; every outcome is logged. Analytic profiles
  cost next to nothing and are not kept.

  Reads happen while the run plans, on any process; :meth:`save` writes,
  on process 0 once the run is past its checks.

  Args:
    run_dir: the run directory.
    job: JSON facts of the job that the library does not see (the model's
      and dataset's names and arguments, the loss), part of every digest.
  """

  def __init__(self, run_dir: str, job: Mapping[str, Any] | None = None):
    self.run_dir = run_dir
    self.job = dict(job or {})
    self._scores_digest: str | None = None
    self._profile_digests: dict[str, str] = {}
    self._reused: set[str] = set()

  def _scores_path(self, name: str = "scores.json") -> str:
    return os.path.join(self.run_dir, "allocation", name)

  def profile_path(self, kind: str) -> str:
    """Where ``kind``'s measured profile is kept.

    Args:
      kind: the device kind.

    Returns:
      ``<run_dir>/profiles/<kind>.json``.
    """
    return os.path.join(self.run_dir, PROFILES_DIR, f"{kind}.json")

  def scores(
    self, inputs: Mapping[str, Any], compute: Callable[[], Any]
  ) -> Mapping[str, Mapping[str, float]]:
    """The indicator scores: the cached ones, or ``compute()``'s values.

    Args:
      inputs: what the scores depend on (JSON; ``indicator`` names the
        method).
      compute: computes them (a :class:`qsync_jax.sensitivity.Scores`).

    Returns:
      ``{layer: {precision: score}}``.
    """
    digest = agreement.json_digest({**self.job, **inputs, **_versions()})
    self._scores_digest = digest
    path = self._scores_path()
    key = _read_json(self._scores_path(SCORES_KEY))
    cached = _read_json(path)
    why = "none cached"
    if isinstance(key, dict):
      if key.get("digest") != digest:
        why = f"the ones in {path} are stale (computed from other inputs)"
      elif (
        isinstance(cached, dict)
        and cached.get("method") == inputs.get("indicator")
        and isinstance(cached.get("values"), dict)
      ):
        logging.info("indicator scores: reused from %s", path)
        return cached["values"]
      else:
        why = f"{path} is unreadable"
    start = time.perf_counter()
    values = compute().values
    logging.info(
      "indicator scores: computed in %.2f s (%s)",
      time.perf_counter() - start,
      why,
    )
    return values

  def expect_profile(self, kind: str, inputs: Mapping[str, Any]) -> None:
    """Records what ``kind``'s measured profile depends on.

    Args:
      kind: the device kind.
      inputs: what its profile depends on (JSON).

    Raises:
      ValueError: a file stands where the run keeps its profiles.
    """
    where = os.path.dirname(self.profile_path(kind))
    if os.path.lexists(where) and not os.path.isdir(where):
      raise ValueError(
        f"{where} is a file, where the run keeps its {PROFILES_DIR} "
        "directory; move it away or use a new --out_dir"
      )
    self._profile_digests[kind] = agreement.json_digest(
      {**self.job, **inputs, "kind": kind, **_versions()}
    )

  def profile(
    self, kind: str, measure: Callable[[], profiling.Profile]
  ) -> profiling.Profile:
    """``kind``'s profile: the cached one, or ``measure()``'s.

    Args:
      kind: the device kind (:meth:`expect_profile` recorded its inputs).
      measure: measures it.

    Returns:
      The profile.
    """
    digest = self._profile_digests[kind]
    path = self.profile_path(kind)
    cached = _read_json(path)
    why = "none cached"
    if isinstance(cached, dict):
      why = f"the one in {path} is stale (measured from other inputs)"
      if cached.get("digest") == digest:
        try:
          prof = profiling.Profile.from_dict(cached["profile"])
        except (KeyError, TypeError, ValueError, AttributeError):
          why = f"{path} is unreadable"
        else:
          logging.info("profile of %s: reused from %s", kind, path)
          self._reused.add(kind)
          return prof
    start = time.perf_counter()
    prof = measure()
    logging.info(
      "profile of %s: measured in %.2f s (%s)",
      kind,
      time.perf_counter() - start,
      why,
    )
    return prof

  def save(self, result: pipeline.PlanningResult) -> None:
    """Writes the allocation (``allocation/``) and what the cache keeps.

    Args:
      result: process 0's planning result.

    Raises:
      OSError: a file could not be written (naming it).
    """
    key = self._scores_path(SCORES_KEY)
    # The key goes first and comes back last: a run killed in between
    # leaves scores without a key, which are computed again.
    with contextlib.suppress(FileNotFoundError):
      os.remove(key)
    pipeline.write(result, os.path.dirname(key))
    if self._scores_digest is not None:
      files.write_json(
        key,
        {"digest": self._scores_digest, "method": result.indicator},
        indent=2,
      )
    self.save_profiles(result.profiles)

  def save_profiles(self, profiles: Mapping[str, profiling.Profile]) -> None:
    """Writes the measured ones of ``profiles`` not read from the cache.

    Args:
      profiles: ``{kind: Profile}``.

    Raises:
      OSError: a file could not be written (naming it).
    """
    for kind, digest in self._profile_digests.items():
      prof = profiles.get(kind)
      if kind in self._reused or prof is None or prof.source != "measured":
        continue
      os.makedirs(os.path.dirname(self.profile_path(kind)), exist_ok=True)
      files.write_json(
        self.profile_path(kind),
        {"digest": digest, "profile": prof.to_dict()},
        indent=2,
      )


@dataclasses.dataclass(frozen=True)
class _Job:
  """What :func:`plan_job` was given, for its steps."""

  model: nnx.Module
  timing_model: nnx.Module
  concrete_timing_model: Callable[[], nnx.Module]
  dataset: Dataset
  settings: AutoPlanSettings
  batch_size: int
  timing_batch_size: int
  loss_fn: LossFn
  tx: optax.GradientTransformation
  optimizer_name: str
  optimizer_state_copies: int
  seed: int
  model_name: str | None
  cache: PlanCache | None


def plan_job(
  model: nnx.Module,
  timing_model: nnx.Module,
  sample: Any,
  cluster: cluster_lib.ClusterSpec | str,
  settings: AutoPlanSettings,
  *,
  dataset: Dataset,
  batch_size: int,
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  optimizer_name: str,
  optimizer_state_copies: int,
  seed: int,
  build_timing_model: Callable[[], nnx.Module] | None = None,
  model_name: str | None = None,
  cache: PlanCache | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> JobPlans:
  """A training job's plans for ``cluster``, the same on every process.

  The timing model's :class:`~qsync_jax.task.Probe` is made once, at the
  timing batch, and its graph traced once; then each kind's profile is
  measured where its first worker runs (or taken from the GPU catalog, per
  ``settings.profiles``) and gathered on every process; process 0 scores
  ``model`` with ``settings.indicator`` on the first training batches and
  runs the allocator; every process gets its plans. With a ``cache``, the
  scores and measured profiles it holds for the same inputs are reused.

  Args:
    model: the model to train, as initialized (scored by the indicator).
    timing_model: the model whose step is predicted: ``model`` itself or a
      bigger one with the same layer paths (abstract weights will do:
      ``nnx.eval_shape``).
    sample: the timing model's sample, at any batch size: a
      :class:`~qsync_jax.task.Probe` or its inputs (one array, a tuple or a
      dict); None: its ``input_spec``, or else the dataset's first training
      example through ``loss_fn``'s objective.
    cluster: the workers' kinds, e.g. ``"v100:2,t4:2"``.
    settings: the allocator's settings.
    dataset: the job's data (the indicator's batches, the batch profiled).
    batch_size: the per-worker batch the indicator scores at (and the
      timing batch where ``settings.timing_batch_size`` is 0).
    loss_fn: the training loss, in any form
      :func:`qsync_jax.task.as_objective` takes (None: classification).
    tx: the optimizer a measured profile times.
    optimizer_name: its name, in the profile caches' keys.
    optimizer_state_copies: float32 copies of the parameters it keeps (2
      for Adam), which bound a measured profile's memory.
    seed: the indicator's seed and the random timing inputs'.
    build_timing_model: builds the timing model with real weights, called
      only where a kind is measured on this process (default:
      ``timing_model`` itself).
    model_name: the model's name in the profile cache's key.
    cache: the run directory's :class:`PlanCache`, or None.
    devices: the devices the workers map onto, in worker order (default
      ``jax.devices()``).

  Returns:
    The :class:`JobPlans`.

  Raises:
    ValueError: a kind left to the catalog that it lacks, a sample whose
      arrays have no batch axis, or a timing model whose layers differ from
      ``model``'s.
    qsync_jax.allocation.AllocationError: no plan fits (one process).
    qsync_jax.process.coordination.CoordinationError: another process
      failed to profile or to allocate (its error is the message), or did
      not share its part within ``settings.planning_timeout_s``.
  """
  spec = cluster_lib.parse_cluster(cluster)
  if len(spec.groups()) == 1:
    return JobPlans({}, None, {})
  assigned = cluster_lib.assign_devices(spec, devices)
  sites = sharing.profile_sites(spec, assigned, settings.profiles)
  job = _Job(
    model,
    timing_model,
    functools.cache(build_timing_model or (lambda: timing_model)),
    dataset,
    settings,
    batch_size,
    settings.timing_batch_size or batch_size,
    loss_fn,
    tx,
    optimizer_name,
    optimizer_state_copies,
    seed,
    model_name,
    cache,
  )
  probe = _timing_probe(job, sample)
  graph = predictor.trace_graph(timing_model, probe)
  if cache is not None:
    _expect_profiles(cache, job, graph, spec, assigned, sites)
  store = coordination.client() if jax.process_count() > 1 else None
  profiles = sharing.gather_profiles(
    graph,
    spec,
    assigned,
    sites,
    functools.partial(_measure, job, graph),
    store=store,
    process_index=jax.process_index(),
    timeout_s=settings.planning_timeout_s,
  )
  results = []

  def allocate() -> dict[str, PrecisionPlan]:
    results.append(_allocate(job, spec, probe, graph, profiles))
    return results[-1].allocation.plans

  plans = sharing.plan_once(
    allocate,
    store=store,
    process_index=jax.process_index(),
    timeout_s=settings.planning_timeout_s,
  )
  return JobPlans(
    plans, results[-1] if results else None, sharing.describe_sites(sites)
  )


def _timing_probe(job: _Job, sample: Any) -> calling.Probe:
  """The timing model's one Probe, at the timing batch."""
  timing_model = job.timing_model
  if sample is None and not callable(getattr(timing_model, "input_spec", None)):
    # Traced through the job's loss on a training example.
    x, y = job.dataset.x_train[:1], job.dataset.y_train[:1]
    sample = as_objective(job.loss_fn).probe(calling.abstract((x, y)))
  return calling.as_probe(
    timing_model,
    pipeline.sample_at(timing_model, sample, job.timing_batch_size),
  )


def _expect_profiles(
  cache: PlanCache,
  job: _Job,
  graph: graph_lib.ModelGraph,
  spec: cluster_lib.ClusterSpec,
  devices: Sequence[Any],
  sites: Mapping[str, Any],
) -> None:
  """Records in ``cache`` what each measured kind's profile depends on."""
  settings = job.settings
  for kind, device in sites.items():
    if device is None:
      continue  # analytic
    local = [
      d
      for k, d in zip(spec.kinds, devices)
      if k == kind and d.process_index == device.process_index
    ]
    cache.expect_profile(
      kind,
      {
        "timing_model_kwargs": dict(settings.timing_model_kwargs),
        "graph": graph.fingerprint(),
        "batch_shape": list(graph.input_shape),
        "timing_batch_size": job.timing_batch_size,
        "candidates": list(settings.candidates),
        "optimizer": job.optimizer_name,
        "optimizer_state_copies": job.optimizer_state_copies,
        "repeats": settings.profile_repeats,
        "device": [device.platform, device.device_kind],
        "host_devices": len(local) if len(local) > 1 else 0,
      },
    )


def _measure(
  job: _Job,
  graph: graph_lib.ModelGraph,
  kind: str,
  device: Any,
  local: Sequence[Any],
) -> profiling.Profile:
  """``kind``'s measured profile on ``device`` (from the cache if held)."""
  if job.cache is not None:
    return job.cache.profile(
      kind, lambda: _measure_here(job, graph, kind, device, local)
    )
  return _measure_here(job, graph, kind, device, local)


def _measure_here(
  job: _Job,
  graph: graph_lib.ModelGraph,
  kind: str,
  device: Any,
  local: Sequence[Any],
) -> profiling.Profile:
  """Measures ``kind``'s profile on ``device``."""
  logging.info("profiling %s on %s", kind, device)
  settings = job.settings
  supported = {q.value for q in supported_precisions(kind)}
  precisions = [p for p in settings.candidates if p in supported]
  host_devices = len(local) if len(local) > 1 else 0
  # Before the deployment-sized model and its batch are made.
  profiling.check_fits(
    graph,
    device,
    kind,
    precisions,
    host_devices,
    settings.profile_repeats,
    job.optimizer_state_copies,
  )
  return predictor.profile(
    job.concrete_timing_model(),
    timing_batch(
      job.timing_model, job.dataset, job.timing_batch_size, job.seed
    ),
    device=device,
    device_kind=kind,
    precisions=precisions,
    loss_fn=job.loss_fn,
    tx=job.tx,
    optimizer_name=job.optimizer_name,
    model_name=job.model_name,
    cache_dir=settings.profile_cache_dir or None,
    host_devices=list(local) if host_devices else None,
    repeats=settings.profile_repeats,
    graph=graph,
  )


def _allocate(
  job: _Job,
  spec: cluster_lib.ClusterSpec,
  probe: calling.Probe,
  graph: graph_lib.ModelGraph,
  profiles: Mapping[str, profiling.Profile],
) -> pipeline.PlanningResult:
  """Process 0's part: the indicator's scores, then the allocator."""
  settings = job.settings
  score = functools.partial(
    pipeline.compute_scores,
    job.model,
    job.dataset,
    settings.indicator,
    num_batches=settings.num_batches,
    batch_size=job.batch_size,
    seed=job.seed,
    loss_fn=job.loss_fn,
  )
  scores: Mapping[str, Mapping[str, float]]
  if job.cache is None:
    scores = score().values
  else:
    # The scores are of the model as initialized, on the first batches.
    batches = pipeline.indicator_batches(
      job.dataset, settings.num_batches, job.batch_size
    )
    scores = job.cache.scores(
      {
        "indicator": settings.indicator,
        "num_batches": settings.num_batches,
        "batch_size": job.batch_size,
        "seed": job.seed,
        "params": agreement.tree_digest(nnx.state(job.model, nnx.Param)),
        "batches": agreement.tree_digest(batches),
      },
      score,
    )
  return pipeline.plan_cluster(
    job.timing_model,
    spec,
    scores,
    job.timing_batch_size,
    indicator_name=settings.indicator,
    method=settings.method,
    compression=settings.compression,
    candidates=settings.candidates,
    baselines=False,
    sample_input=probe,
    profiles=profiles,
    graph=graph,
  )
