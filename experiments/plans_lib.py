"""The main job's precision plans, from its config.

This module owns what is the main job's own about its plans; the planning
itself is the library's (:mod:`qsync_jax.allocation.job_plans`):

* ``plan_mode="manual"``: ``config.plans`` (read by
  :func:`experiments.train_lib.make_workers`);
* ``plan_mode="auto"`` (:func:`job_plans`): the config's allocator section
  as :class:`~qsync_jax.allocation.job_plans.AutoPlanSettings`
  (:func:`auto_settings`), the timing model built from
  ``config.allocator.timing_model_kwargs``, and
  :func:`~qsync_jax.allocation.job_plans.plan_job` called and logged;
* :func:`plan_cache`: the run directory's
  :class:`~qsync_jax.allocation.job_plans.PlanCache`, keyed by the config's
  model, dataset and loss.

Every process checks that the others train with the same plans with
:func:`qsync_jax.allocation.sharing.check_plans`.
"""

from __future__ import annotations

from typing import Any

from absl import logging
import ml_collections

from experiments import config_lib
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax.allocation import job_plans as job_plans_lib
from qsync_jax.allocation import pipeline
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import host_limits

#: The config field each :class:`AutoPlanSettings` field is read from, where
#: it is not ``allocator.<field>``.
_CONFIG_FIELDS = {"planning_timeout_s": "distributed.planning_timeout_s"}


def auto_settings(
  config: ml_collections.ConfigDict,
) -> job_plans_lib.AutoPlanSettings:
  """The config's allocator settings (``config.allocator``), typed.

  Args:
    config: the job's config.

  Returns:
    The :class:`~qsync_jax.allocation.job_plans.AutoPlanSettings`.

  Raises:
    ValueError: a field out of its range, named as the config names it
      (``config.allocator.method must be one of ...``).
  """
  a = config.allocator
  try:
    return job_plans_lib.AutoPlanSettings(
      indicator=a.indicator,
      method=a.method,
      num_batches=a.num_batches,
      compression=a.compression,
      candidates=tuple(a.candidates),
      timing_model_kwargs=config_lib.to_plain(a.timing_model_kwargs) or {},
      timing_batch_size=a.timing_batch_size,
      profiles=a.profiles,
      profile_repeats=a.profile_repeats,
      profile_cache_dir=a.profile_cache_dir,
      planning_timeout_s=config.distributed.planning_timeout_s,
    )
  except job_plans_lib.SettingError as e:
    field = _CONFIG_FIELDS.get(e.field, f"allocator.{e.field}")
    raise ValueError(
      f"config.{field} must be {e.rule}, got {e.value!r}"
    ) from None


def plan_cache(
  config: ml_collections.ConfigDict, run_dir: str
) -> job_plans_lib.PlanCache:
  """The run directory's plan cache, keyed by the config's model, dataset
  and loss (what the library does not see of them).

  Args:
    config: the job's config.
    run_dir: the run directory.

  Returns:
    The :class:`~qsync_jax.allocation.job_plans.PlanCache`.
  """
  return job_plans_lib.PlanCache(
    run_dir,
    {
      "model": config.model,
      "model_kwargs": config_lib.to_plain(config.model_kwargs),
      "dataset": config.dataset,
      "dataset_kwargs": config_lib.to_plain(config.dataset_kwargs),
      "loss_fn": config.loss_fn,
    },
  )


def job_plans(
  config: ml_collections.ConfigDict,
  model: Any,
  dataset: data_lib.Dataset,
  cache: job_plans_lib.PlanCache | None = None,
) -> tuple[
  dict[str, PrecisionPlan] | None,
  pipeline.PlanningResult | None,
  dict[str, str] | None,
]:
  """The plans the main job trains with, per ``config.plan_mode``.

  ``"manual"``: None (:func:`experiments.train_lib.make_workers` reads
  ``config.plans``); ``"auto"``: FP32 for a cluster of one kind (nothing
  to allocate), else :func:`qsync_jax.allocation.job_plans.plan_job` for
  ``config.cluster`` with the timing model (``model``'s config rebuilt
  with ``config.allocator.timing_model_kwargs``), logged.

  Args:
    config: the job's config.
    model: the model to train (scored by the indicator), as initialized.
    dataset: the job's dataset.
    cache: the run directory's plan cache (:func:`plan_cache`), or None.

  Returns:
    ``(plans, result, sources)``: ``{kind: PrecisionPlan}`` on every
    process; the :class:`~qsync_jax.allocation.pipeline.PlanningResult` on
    process 0 (None elsewhere); ``{kind: where its profile came from}``
    (``result`` and ``sources`` None where nothing was allocated; all three
    None in manual mode).

  Raises:
    ValueError: an unknown plan mode or a bad allocator setting; what
      :func:`~qsync_jax.allocation.job_plans.plan_job` raises.
  """
  if config.plan_mode == "manual":
    return None, None, None
  if config.plan_mode != "auto":
    raise ValueError(
      f"unknown plan_mode {config.plan_mode!r}; valid: auto, manual"
    )
  if len(cluster_lib.parse_cluster(config.cluster).groups()) == 1:
    logging.info(
      "one device kind in %s: nothing to allocate, FP32", config.cluster
    )
    return {}, None, None
  settings = auto_settings(config)
  # The timing model is deployment-sized (the default job's has a 67M-weight
  # layer): only its shapes are needed to trace the graph and allocate, so
  # it is built abstractly, and for real only where a kind is measured here.
  timing_model = models_lib.without_weights(
    lambda: config_lib.build_model(config, dataset, timing=True)
  )
  planned = job_plans_lib.plan_job(
    model,
    timing_model,
    None,
    config.cluster,
    settings,
    dataset=dataset,
    batch_size=config.batch_size,
    loss_fn=config_lib.make_loss_fn(config),
    tx=config_lib.make_optimizer(config),
    optimizer_name=config.optimizer,
    optimizer_state_copies=host_limits.optimizer_state_copies(
      config.optimizer, config.momentum
    ),
    seed=config.seed,
    build_timing_model=lambda: config_lib.build_model(
      config, dataset, timing=True
    ),
    model_name=config.model,
    cache=cache,
  )
  plans, result, sources = planned
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
