"""Plans: which precision each layer computes at, on which device kind.

In the data flow a plan is what the allocator produces per device kind and
what training applies to each worker's model. The subpackage owns

* :class:`PrecisionPlan` and :class:`PlanError` (:mod:`.precision`): ordered
  regex rules over layer paths, JSON round trip, validation;
* the one device table (:mod:`.devices`): each kind's native precisions
  (:func:`supported_precisions`) and, for GPUs, its catalog figures
  (:class:`DeviceSpec`, :data:`DEVICES`);
* the rules shared by every model API (:mod:`.rules`): the op that replaces
  each layer's contraction and the forced precisions (FP32 head, 16-bit
  floor for embeddings and attention matmuls);
* applying a plan to an NNX model (:mod:`.policy`: :func:`apply_plan`,
  :func:`layer_paths`, ...) with :class:`MatMul` for the attention matmuls
  (:mod:`.layers`), the contractions modules compute with jax ops found by
  interception and planned through their sites (:mod:`.intercept`:
  :class:`DotSite`, :class:`ConvSite`), and to a Linen model (:mod:`.linen`:
  ``linen.apply_plan`` returns a :class:`PlannedModule`);
* a Linen model as an NNX module the whole library works on
  (:mod:`.bridge`: :func:`from_linen` returns a :class:`LinenModel` whose
  Linen layers are addressable by their Linen paths).
"""

from qsync_jax.plan.bridge import from_linen
from qsync_jax.plan.bridge import LinenModel
from qsync_jax.plan.devices import device_kinds
from qsync_jax.plan.devices import DEVICE_PRECISIONS
from qsync_jax.plan.devices import device_spec
from qsync_jax.plan.devices import DEVICES
from qsync_jax.plan.devices import DeviceSpec
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.plan.intercept import ConvSite
from qsync_jax.plan.intercept import DotSite
from qsync_jax.plan.intercept import StackedLayerError
from qsync_jax.plan.layers import MatMul
from qsync_jax.plan.linen import PlannedModule
from qsync_jax.plan.policy import apply_plan
from qsync_jax.plan.policy import describe
from qsync_jax.plan.policy import effective_precisions
from qsync_jax.plan.policy import Layer
from qsync_jax.plan.policy import layer_paths
from qsync_jax.plan.policy import model_layers
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.plan.rules import resolve_with_forced

__all__ = [
  "ConvSite",
  "DEVICES",
  "DEVICE_PRECISIONS",
  "DeviceSpec",
  "DotSite",
  "Layer",
  "LinenModel",
  "MatMul",
  "PlanError",
  "PlannedModule",
  "PrecisionPlan",
  "StackedLayerError",
  "apply_plan",
  "describe",
  "device_kinds",
  "device_spec",
  "effective_precisions",
  "from_linen",
  "layer_paths",
  "model_layers",
  "resolve_with_forced",
  "supported_precisions",
]
