"""The main job's precision plans, from its config.

This module owns what is the main job's own about its plans; the planning
itself is the library's (:mod:`qsync_jax.allocation.job_plans`):

* ``plan_mode="manual"``: ``config.plans`` (read once by
  :func:`experiments.config_lib.parse`);
* ``plan_mode="auto"`` (:func:`job_plans`): the config's allocator section
  as :class:`~qsync_jax.allocation.job_plans.AutoPlanSettings`
  (:func:`experiments.config_lib.auto_settings`), the timing model built from
  ``config.allocator.timing_model_kwargs``, and
  :func:`~qsync_jax.allocation.job_plans.plan_job` called and logged;
* :func:`plan_cache`: the run directory's
  :class:`~qsync_jax.allocation.job_plans.PlanCache`, keyed by the config's
  model, dataset and loss;
* :func:`reads_weights`: whether the planning reads the model's weights.

Every process checks that the others train with the same plans with
:func:`qsync_jax.allocation.sharing.check_plans`.
"""

from __future__ import annotations

from typing import Any

from absl import logging

from experiments import config_lib
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax.allocation import job_plans as job_plans_lib
from qsync_jax.allocation import pipeline
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import host_limits


def plan_cache(
  job: config_lib.JobConfig, run_dir: str
) -> job_plans_lib.PlanCache:
  """The run directory's plan cache, keyed by the config's model, dataset
  and loss (what the library does not see of them).

  Args:
    job: the job's config.
    run_dir: the run directory.

  Returns:
    The :class:`~qsync_jax.allocation.job_plans.PlanCache`.
  """
  return job_plans_lib.PlanCache(
    run_dir,
    {
      "model": job.model,
      "model_kwargs": dict(job.model_kwargs),
      "dataset": job.dataset,
      "dataset_kwargs": dict(job.dataset_kwargs),
      "loss_fn": job.loss_fn,
    },
  )


def reads_weights(job: config_lib.JobConfig) -> bool:
  """Whether :func:`job_plans` reads the model's weights.

  The allocator scores them with the sensitivity indicator, so ``"auto"``
  on a cluster of several device kinds reads them. Manual plans, and
  ``"auto"`` on one kind (FP32, nothing to allocate), use only the model's
  shapes. A run that resumes from a checkpoint builds the model with
  placeholder weights where nothing reads them
  (:func:`qsync_jax.models.placeholder_weights`).
  """
  return (
    job.plan_mode != "manual"
    and len(cluster_lib.parse_cluster(job.cluster).groups()) > 1
  )


def job_plans(
  job: config_lib.JobConfig,
  model: Any,
  dataset: data_lib.Dataset,
  cache: job_plans_lib.PlanCache | None = None,
) -> tuple[
  dict[str, PrecisionPlan] | None,
  pipeline.PlanningResult | None,
  dict[str, str] | None,
]:
  """The plans the main job trains with, per ``config.plan_mode``.

  ``"manual"``: None (``job.plans`` holds them); ``"auto"``: FP32 for a cluster of one kind (nothing
  to allocate), else :func:`qsync_jax.allocation.job_plans.plan_job` for
  ``config.cluster`` with the timing model (``model``'s config rebuilt
  with ``config.allocator.timing_model_kwargs``), logged.

  Args:
    job: the job's config.
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
  if job.plan_mode == "manual":
    return None, None, None
  if not reads_weights(job):
    logging.info(
      "one device kind in %s: nothing to allocate, FP32", job.cluster
    )
    return {}, None, None
  settings = config_lib.auto_settings(job)
  # The timing model is deployment-sized (the default job's has a 67M-weight
  # layer): only its shapes are needed to trace the graph and allocate, so
  # it is built abstractly, and for real only where a kind is measured here.
  timing_model = models_lib.without_weights(
    lambda: config_lib.build_model(job, dataset, timing=True)
  )
  planned = job_plans_lib.plan_job(
    model,
    timing_model,
    None,
    job.cluster,
    settings,
    dataset=dataset,
    batch_size=job.batch_size,
    loss_fn=config_lib.make_loss_fn(job),
    tx=config_lib.make_optimizer(job),
    optimizer_name=job.optimizer,
    optimizer_state_copies=host_limits.optimizer_state_copies(
      job.optimizer, job.momentum
    ),
    seed=job.seed,
    build_timing_model=lambda: config_lib.build_model(
      job, dataset, timing=True
    ),
    model_name=job.model,
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
      job.cluster,
      result.allocation.search_time_s,
      result.table(),
    )
  return plans, result, sources
