"""qsync_jax: synchronous data-parallel training across hybrid devices.

Per-layer precision plans (QSync, arXiv 2407.02327) applied to Flax models,
with real low-precision arithmetic (int8 x int8 -> int32, fp16, bf16, fp8).

Typical use::

  import qsync_jax as qs
  plan = qs.PrecisionPlan([(r"conv\\d", "int8")], default="fp32")
  qs.apply_plan(model, plan, device_kind="t4")
"""

from qsync_jax.allocation import allocator
from qsync_jax.parallel import averagers
from qsync_jax.sensitivity import indicator
from qsync_jax.plan import linen
from qsync_jax.numerics import ops
from qsync_jax import predictor
from qsync_jax.numerics import quant
from qsync_jax.parallel import schedules
from qsync_jax.allocation.allocator import allocate
from qsync_jax.plan.layers import MatMul
from qsync_jax.plan.policy import apply_plan
from qsync_jax.plan.policy import describe
from qsync_jax.plan.policy import effective_precisions
from qsync_jax.plan.policy import Layer
from qsync_jax.plan.policy import layer_paths
from qsync_jax.plan.policy import model_layers
from qsync_jax.plan.precision import DEVICE_PRECISIONS
from qsync_jax.plan.precision import device_kinds
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import Precision
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.plan.precision import supported_precisions
from qsync_jax.numerics.quant import Granularity
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.numerics.quant import Rounding

__version__ = "0.1.0"

__all__ = [
    "DEVICE_PRECISIONS", "Granularity", "Layer", "MatMul", "PlanError",
    "Precision", "PrecisionPlan", "QuantConfig", "Rounding", "allocate",
    "allocator", "apply_plan", "comm",
    "describe", "device_kinds", "effective_precisions", "indicator",
    "layer_paths",
    "linen", "model_layers", "ops", "predictor", "quant",
    "supported_precisions", "sync",
]
