"""qsync_jax: synchronous data-parallel training across hybrid devices.

The public API, flat, in the order of the data flow (docs/ARCHITECTURE.md):
plans and what they compute, sensitivity scores, the predictor, the
allocator, and the training that runs the plans and synchronizes workers.
The subpackages (``qs.numerics``, ``qs.plan``, ``qs.sensitivity``,
``qs.predictor``, ``qs.allocation``, ``qs.parallel``, ``qs.train``,
``qs.task``, ``qs.models``, ``qs.data``, a run's directory ``qs.rundir``,
and for multi-process runs ``qs.process`` and ``qs.launch``) hold the rest.

Typical use::

  import qsync_jax as qs
  plan = qs.PrecisionPlan([(r"conv\\d", "int8")], default="fp32")
  qs.apply_plan(model, plan, device_kind="t4")
  graph = qs.trace_graph(model, model.input_spec(32))
  profiles = {k: qs.analytic_profile(graph, k) for k in ("v100", "t4")}
  allocation = qs.allocate(graph, "v100:8,t4:8", scores, profiles)
"""

# The imports are grouped by topic, in the order of the data flow.

# Subpackages, for the names not exported flat below.
from qsync_jax import allocation
from qsync_jax import data
from qsync_jax import launch
from qsync_jax import models
from qsync_jax import numerics
from qsync_jax import parallel
from qsync_jax import plan
from qsync_jax import predictor
from qsync_jax import process
from qsync_jax import rundir
from qsync_jax import sensitivity
from qsync_jax import task
from qsync_jax import train
from qsync_jax.plan import linen

# What a plan computes: precisions and quantization.
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import Granularity
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.numerics.quant import Rounding

# The model-call contract: how a user's model is called and scored.
from qsync_jax.task.calling import call_model
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import Objective

# Plans, the device table, and applying a plan to a model.
from qsync_jax.plan.devices import device_kinds
from qsync_jax.plan.devices import DEVICE_PRECISIONS
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.plan.layers import MatMul
from qsync_jax.plan.bridge import from_linen
from qsync_jax.plan.bridge import LinenModel
from qsync_jax.plan.policy import apply_plan
from qsync_jax.plan.policy import describe
from qsync_jax.plan.policy import effective_precisions
from qsync_jax.plan.policy import Layer
from qsync_jax.plan.policy import layer_paths
from qsync_jax.plan.policy import model_layers
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan

# Sensitivity: how much each layer suffers at each precision.
from qsync_jax.sensitivity.scores import Scores

# The predictor: graph, profiles, one simulated step.
from qsync_jax.predictor.analytic import analytic_profile
from qsync_jax.predictor.graph import ModelGraph
from qsync_jax.predictor.graph import trace_graph
from qsync_jax.predictor.profiling import Profile
from qsync_jax.predictor.profiling import profile
from qsync_jax.predictor.simulation import predict
from qsync_jax.predictor.simulation import Prediction

# The allocator and the pipeline the main job runs.
from qsync_jax.allocation.allocator import allocate
from qsync_jax.allocation.allocator import Allocation
from qsync_jax.allocation.pipeline import plan_cluster
from qsync_jax.allocation.search import AllocationError

# Clusters, synchronization and the wire.
from qsync_jax.parallel.averagers import make_averager
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.parallel.schedules import make_schedule

# Training.
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.state import TrainState
from qsync_jax.train.step import elementwise
from qsync_jax.train.sync import SyncSettings
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

from qsync_jax.version import __version__ as __version__

__all__ = [
  # subpackages
  "allocation",
  "data",
  "launch",
  "linen",
  "models",
  "numerics",
  "parallel",
  "plan",
  "predictor",
  "process",
  "rundir",
  "sensitivity",
  "task",
  "train",
  # task
  "Objective",
  "as_objective",
  "call_model",
  # numerics
  "Granularity",
  "Precision",
  "QuantConfig",
  "Rounding",
  # plan
  "DEVICE_PRECISIONS",
  "Layer",
  "LinenModel",
  "MatMul",
  "PlanError",
  "PrecisionPlan",
  "apply_plan",
  "describe",
  "device_kinds",
  "effective_precisions",
  "from_linen",
  "layer_paths",
  "model_layers",
  "supported_precisions",
  # sensitivity
  "Scores",
  # predictor
  "ModelGraph",
  "Prediction",
  "Profile",
  "analytic_profile",
  "predict",
  "profile",
  "trace_graph",
  # allocation
  "Allocation",
  "AllocationError",
  "allocate",
  "plan_cluster",
  # parallel
  "ClusterSpec",
  "make_averager",
  "make_schedule",
  "parse_cluster",
  # train
  "Checkpointer",
  "HybridTrainer",
  "SyncSettings",
  "TrainState",
  "Worker",
  "elementwise",
]
