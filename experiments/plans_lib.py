"""The main job's precision plans, the same on every process.

This module owns how ``experiments.train`` gets one plan per device kind:

* ``plan_mode="manual"``: ``config.plans`` (read by
  :func:`experiments.train_lib.make_workers`);
* ``plan_mode="auto"`` (:func:`auto_plans`): each kind's profile of the
  timing model is measured on the first device of that kind in the run, by
  the process that holds it, and shared with every process (kinds no device
  is use the GPU catalog; :mod:`qsync_jax.allocation.sharing`); process 0
  alone scores the layers and runs the allocator, and shares the plans;
* either way, :func:`check_plans`: before the first collective every
  process compares the digest of the plans it will train with, so a process
  that read another plan (a plan file that differs per node) stops the run
  with one line;
* :class:`PlanCache`: what planning again in the same run directory (a
  resume onto other workers) reuses: the indicator scores and each kind's
  measured profile, which do not depend on the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import contextlib
import functools
import json
import os
import time
from typing import Any

from absl import logging
from flax import nnx
import jax
import jaxlib
import ml_collections
import numpy as np

from experiments import config_lib
from experiments import limits_lib
from experiments import run_files
import qsync_jax
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import predictor
from qsync_jax import task
from qsync_jax.allocation import pipeline
from qsync_jax.allocation import sharing
from qsync_jax.parallel import agreement
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel import coordination
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import profiling


def timing_batch(
  model: Any, dataset: data_lib.Dataset, batch_size: int, seed: int = 0
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


def _store() -> Any:
  return coordination.client() if jax.process_count() > 1 else None


#: The run directory's measured profiles, ``<kind>.json`` each.
PROFILES_DIR = "profiles"
#: Beside ``allocation/scores.json``: the digest of what they depend on.
SCORES_KEY = "scores_key.json"


def _versions() -> dict[str, str]:
  """What a cached score or profile was computed with, besides its inputs."""
  return {
    "qsync_jax": qsync_jax.__version__,
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

  A run that plans again (``--plan=auto`` resumed onto other workers) needs
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
  """

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self._scores_digest: str | None = None
    self._profile_digests: dict[str, str] = {}
    self._reused: set[str] = set()

  def _scores_path(self, name: str = "scores.json") -> str:
    return os.path.join(self.run_dir, "allocation", name)

  def profile_path(self, kind: str) -> str:
    """Where ``kind``'s measured profile is kept."""
    return os.path.join(self.run_dir, PROFILES_DIR, f"{kind}.json")

  def scores(
    self, inputs: Mapping[str, Any], compute: Callable[[], Any]
  ) -> Mapping[str, Mapping[str, float]]:
    """The indicator scores: the cached ones, or ``compute()``'s values.

    Args:
      inputs: what the scores depend on (JSON).
      compute: computes them (a :class:`qsync_jax.sensitivity.Scores`).

    Returns:
      ``{layer: {precision: score}}``.
    """
    digest = agreement.json_digest({**inputs, **_versions()})
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
      {**inputs, "kind": kind, **_versions()}
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
      run_files.write_json(
        key, {"digest": self._scores_digest, "method": result.indicator}
      )
    self.save_profiles(result.profiles)

  def save_profiles(self, profiles: Mapping[str, profiling.Profile]) -> None:
    """Writes the measured ones of ``profiles`` not read from the cache.

    Raises:
      OSError: a file could not be written (naming it).
    """
    for kind, digest in self._profile_digests.items():
      prof = profiles.get(kind)
      if kind in self._reused or prof is None or prof.source != "measured":
        continue
      os.makedirs(os.path.dirname(self.profile_path(kind)), exist_ok=True)
      run_files.write_json(
        self.profile_path(kind), {"digest": digest, "profile": prof.to_dict()}
      )


def auto_plans(
  config: ml_collections.ConfigDict,
  model: Any,
  dataset: data_lib.Dataset,
  cache: PlanCache | None = None,
) -> tuple[
  dict[str, PrecisionPlan], pipeline.PlanningResult | None, dict[str, str]
]:
  """The allocator's plans for ``config.cluster`` (``plan_mode="auto"``).

  The timing model (``model``'s config rebuilt with
  ``config.allocator.timing_model_kwargs``, at ``timing_batch_size`` per
  worker) is profiled where each kind runs (``config.allocator.profiles``,
  :data:`qsync_jax.allocation.sharing.SOURCES`); process 0 scores
  ``model`` with ``config.allocator.indicator`` on the first training
  batches and runs the allocator; every process gets its plans. With a
  ``cache``, the scores and measured profiles it holds for the same inputs
  are reused.

  Args:
    config: the job's config.
    model: the model to train (scored by the indicator), as initialized.
    dataset: the job's dataset.
    cache: the run directory's :class:`PlanCache`, or None.

  Returns:
    ``(plans, result, sources)``: ``{kind: PrecisionPlan}`` on every
    process; the :class:`~qsync_jax.allocation.pipeline.PlanningResult` on
    process 0 (None elsewhere); ``{kind: where its profile came from}``.

  Raises:
    ValueError: a bad allocator setting, a kind left to the catalog that it
      lacks, or a timing model whose layers differ from ``model``'s.
    qsync_jax.allocation.AllocationError: no plan fits (one process).
    qsync_jax.parallel.coordination.CoordinationError: another process
      failed to profile or to allocate (its error is the message), or did
      not share its part within ``config.distributed.planning_timeout_s``.
  """
  a = config.allocator
  spec = cluster_lib.parse_cluster(config.cluster)
  devices = cluster_lib.assign_devices(spec)
  sites = sharing.profile_sites(spec, devices, a.get("profiles", "auto"))
  loss_fn = config_lib.make_loss_fn(config)
  # The timing model is deployment-sized (the default job's has a 67M-weight
  # layer): only its shapes are needed to trace the graph and allocate, so
  # it is built abstractly, and for real only where a kind is measured here.
  timing_model = models_lib.without_weights(
    lambda: config_lib.build_model(config, dataset, timing=True)
  )

  @functools.cache
  def concrete_timing_model():
    return config_lib.build_model(config, dataset, timing=True)

  batch_size = a.get("timing_batch_size", 0) or config.batch_size
  # A model without input_spec is traced through the job's loss on a
  # training batch (resized to the timing batch).
  sample = (
    None
    if callable(getattr(timing_model, "input_spec", None))
    else (
      task.as_objective(loss_fn).probe(
        task.abstract((dataset.x_train[:1], dataset.y_train[:1]))
      )
    )
  )
  graph = predictor.trace_graph(
    timing_model, pipeline.sample_at(timing_model, sample, batch_size)
  )
  candidates = tuple(a.get("candidates", ("int8", "fp16", "fp32")))
  common = {
    "model": config.model,
    "model_kwargs": config_lib.to_plain(config.get("model_kwargs", {})),
    "dataset": config.dataset,
    "dataset_kwargs": config_lib.to_plain(config.get("dataset_kwargs", {})),
    "loss_fn": config.get("loss_fn", ""),
  }
  if cache is not None:
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
          **common,
          "timing_model_kwargs": config_lib.to_plain(
            a.get("timing_model_kwargs", {})
          ),
          "graph": graph.fingerprint(),
          "batch_shape": list(graph.input_shape),
          "timing_batch_size": batch_size,
          "candidates": list(candidates),
          "optimizer": config.optimizer,
          "momentum": config.get("momentum", 0.0),
          "repeats": a.get("profile_repeats", 5),
          "device": [device.platform, device.device_kind],
          "host_devices": len(local) if len(local) > 1 else 0,
        },
      )

  def measure(kind: str, device: Any, local: Sequence[Any]):
    if cache is not None:
      return cache.profile(kind, lambda: measure_here(kind, device, local))
    return measure_here(kind, device, local)

  def measure_here(kind: str, device: Any, local: Sequence[Any]):
    logging.info("profiling %s on %s", kind, device)
    supported = supported_precisions(kind)
    precisions = [p for p in candidates if p in {q.value for q in supported}]
    # Before the deployment-sized model and its batch are made.
    profiling.check_fits(
      graph,
      device,
      kind,
      precisions,
      len(local) if len(local) > 1 else 0,
      a.get("profile_repeats", 5),
      limits_lib.optimizer_state_copies(config),
    )
    return predictor.profile(
      concrete_timing_model(),
      timing_batch(timing_model, dataset, batch_size, config.seed),
      device=device,
      device_kind=kind,
      precisions=precisions,
      loss_fn=loss_fn,
      tx=config_lib.make_optimizer(config),
      optimizer_name=config.optimizer,
      model_name=config.model,
      cache_dir=a.get("profile_cache_dir") or None,
      host_devices=list(local) if len(local) > 1 else None,
      repeats=a.get("profile_repeats", 5),
      graph=graph,
    )

  store = _store()
  timeout = config.get("distributed", {}).get("planning_timeout_s", 900)
  profiles = sharing.gather_profiles(
    graph,
    spec,
    devices,
    sites,
    measure,
    store=store,
    process_index=jax.process_index(),
    timeout_s=timeout,
  )
  result = None

  def allocate():
    nonlocal result
    score = functools.partial(
      pipeline.compute_scores,
      model,
      dataset,
      a.indicator,
      num_batches=a.num_batches,
      batch_size=config.batch_size,
      seed=config.seed,
      loss_fn=loss_fn,
    )
    if cache is None:
      scores = score().values
    else:
      # The scores are of the model as initialized, on the first batches.
      batches = pipeline.indicator_batches(
        dataset, a.num_batches, config.batch_size
      )
      scores = cache.scores(
        {
          **common,
          "indicator": a.indicator,
          "num_batches": a.num_batches,
          "batch_size": config.batch_size,
          "seed": config.seed,
          "params": agreement.tree_digest(nnx.state(model, nnx.Param)),
          "batches": agreement.tree_digest(batches),
        },
        score,
      )
    result = pipeline.plan_cluster(
      timing_model,
      spec,
      scores,
      batch_size,
      indicator_name=a.indicator,
      method=a.method,
      compression=a.get("compression"),
      candidates=candidates,
      baselines=False,
      sample_input=sample,
      profiles=profiles,
      graph=graph,
    )
    return result.allocation.plans

  plans = sharing.plan_once(
    allocate, store=store, process_index=jax.process_index(), timeout_s=timeout
  )
  return plans, result, sharing.describe_sites(sites)


def job_plans(
  config: ml_collections.ConfigDict,
  model: Any,
  dataset: data_lib.Dataset,
  cache: PlanCache | None = None,
) -> tuple[
  dict[str, Any] | None, pipeline.PlanningResult | None, dict[str, str] | None
]:
  """The plans the main job trains with, per ``config.plan_mode``.

  ``"manual"``: None (:func:`experiments.train_lib.make_workers` reads
  ``config.plans``); ``"auto"``: FP32 for a cluster of one kind (nothing
  to allocate), else :func:`auto_plans`, logged.

  Returns:
    ``(plans, result, sources)`` as :func:`auto_plans` returns them
    (``result`` and ``sources`` None where nothing was allocated).

  Raises:
    ValueError: an unknown plan mode; what :func:`auto_plans` raises.
  """
  plan_mode = config.get("plan_mode", "manual")
  if plan_mode == "manual":
    return None, None, None
  if plan_mode != "auto":
    raise ValueError(f"unknown plan_mode {plan_mode!r}; valid: auto, manual")
  if len(cluster_lib.parse_cluster(config.cluster).groups()) == 1:
    logging.info(
      "one device kind in %s: nothing to allocate, FP32", config.cluster
    )
    return {}, None, None
  plans, result, sources = auto_plans(config, model, dataset, cache)
  logging.info(
    "profiles: %s", ", ".join(f"{k} {v}" for k, v in sources.items())
  )
  if result is None:
    logging.info("plans from process 0's allocator")
  else:
    logging.info(
      "allocator (%s, %s indicator) on %s in %.2f s:\n%s",
      result.allocation.method,
      result.indicator,
      config.cluster,
      result.allocation.search_time_s,
      result.table(),
    )
  return plans, result, sources


def check_plans(plans: dict[str, PrecisionPlan]) -> str:
  """Checks that every process trains with ``plans``; returns their digest.

  A no-op but for the digest in a single-process run.

  Raises:
    qsync_jax.parallel.agreement.AgreementError: a process has other plans
      (the message names it), or did not report in time.
  """
  facts = plan_facts(plans)
  agreement.check(facts)
  return facts["plans"]


def plan_facts(plans: dict[str, PrecisionPlan]) -> dict[str, str]:
  """What processes compare of their plans: the digest, and the plans'
  settings as :func:`qsync_jax.parallel.agreement.details`, so that a
  mismatch names the kind and the rule or default that differ."""
  return {
    "plans": sharing.plans_digest(plans),
    **agreement.details(
      "plans", {kind: plan.to_dict() for kind, plan in plans.items()}
    ),
  }
