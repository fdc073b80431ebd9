"""Allocation: per-device-kind precision plans for a hybrid cluster.

The last planning stage of the data flow: from the indicator's
``scores[layer][precision]`` (:mod:`qsync_jax.sensitivity`) and the
predictor's graph and profiles (:mod:`qsync_jax.predictor`) to one
:class:`~qsync_jax.plan.precision.PrecisionPlan` per device kind.

* :func:`allocate` and its result :class:`Allocation` (:mod:`.allocator`);
* the per-kind searches and what they trade: ladders, memory, the fastest
  plan under memory, the least-indicator plan (:mod:`.search`);
* the baselines the allocation is compared with (:mod:`.baselines`);
* :func:`plan_cluster`: scores, graph, profiles, allocation and baselines
  in one call (:mod:`.pipeline`);
* :func:`plan_job`: a training job's plans, planned once for every process
  of a run, with :class:`AutoPlanSettings` and the run directory's
  :class:`PlanCache` (:mod:`.job_plans`); :func:`check_plans`, every
  process's check that the others train with the same plans
  (:mod:`.sharing`).
"""

from qsync_jax.allocation.allocator import allocate
from qsync_jax.allocation.allocator import Allocation
from qsync_jax.allocation.allocator import METHODS
from qsync_jax.allocation.allocator import training_kinds_of
from qsync_jax.allocation.baselines import dynamic_batch_split
from qsync_jax.allocation.baselines import predict_dynamic_batch
from qsync_jax.allocation.baselines import shuffled_scores
from qsync_jax.allocation.baselines import uniform_low_plans
from qsync_jax.allocation.job_plans import AutoPlanSettings
from qsync_jax.allocation.job_plans import JobPlans
from qsync_jax.allocation.job_plans import plan_job
from qsync_jax.allocation.job_plans import PlanCache
from qsync_jax.allocation.pipeline import compute_scores
from qsync_jax.allocation.pipeline import plan_cluster
from qsync_jax.allocation.pipeline import PlanningResult
from qsync_jax.allocation.search import AllocationError
from qsync_jax.allocation.search import compression_budget
from qsync_jax.allocation.search import DEFAULT_CANDIDATES
from qsync_jax.allocation.search import indicator_of
from qsync_jax.allocation.search import plan_memory
from qsync_jax.allocation.sharing import check_plans

__all__ = [
  "DEFAULT_CANDIDATES",
  "METHODS",
  "Allocation",
  "AllocationError",
  "AutoPlanSettings",
  "JobPlans",
  "PlanCache",
  "PlanningResult",
  "allocate",
  "check_plans",
  "compression_budget",
  "compute_scores",
  "dynamic_batch_split",
  "indicator_of",
  "plan_cluster",
  "plan_job",
  "plan_memory",
  "predict_dynamic_batch",
  "shuffled_scores",
  "training_kinds_of",
  "uniform_low_plans",
]
