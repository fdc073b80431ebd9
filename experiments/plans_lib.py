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
  with one line.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np

from experiments import config_lib
from experiments import limits_lib
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


def auto_plans(
  config: ml_collections.ConfigDict, model: Any, dataset: data_lib.Dataset
) -> tuple[
  dict[str, PrecisionPlan], pipeline.PlanningResult | None, dict[str, str]
]:
  """The allocator's plans for ``config.cluster`` (``plan_mode="auto"``).

  The timing model (``model``'s config rebuilt with
  ``config.allocator.timing_model_kwargs``, at ``timing_batch_size`` per
  worker) is profiled where each kind runs (``config.allocator.profiles``,
  :data:`qsync_jax.allocation.sharing.SOURCES`); process 0 scores
  ``model`` with ``config.allocator.indicator`` on the first training
  batches and runs the allocator; every process gets its plans.

  Args:
    config: the job's config.
    model: the model to train (scored by the indicator).
    dataset: the job's dataset.

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

  def measure(kind: str, device: Any, local: Sequence[Any]):
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
    scores = pipeline.compute_scores(
      model,
      dataset,
      a.indicator,
      num_batches=a.num_batches,
      batch_size=config.batch_size,
      seed=config.seed,
      loss_fn=loss_fn,
    )
    result = pipeline.plan_cluster(
      timing_model,
      spec,
      scores.values,
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
