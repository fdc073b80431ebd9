"""Numerics: what a layer computes at the precision its plan gives it.

In the data flow this is the bottom: a plan (:mod:`qsync_jax.plan`) picks a
:class:`Precision` per layer and swaps the layer's contraction for one of the
ops here, and training, the indicator and the predictor all run those ops.
The subpackage owns

* :class:`Precision` (:mod:`.precision`), the names of the number formats;
* quantization (:mod:`.quant`): absmax scales, rounding (nearest, stochastic
  with the counter hash of :mod:`pallas_kernels.hashing`, truncate), int8
  and fp8 casts, :class:`QuantConfig`;
* the precision-aware ``dot_general``, ``conv_general_dilated`` and
  ``einsum`` with QSync's backward pass (:mod:`.ops`), and the choice of
  backend for their forward contraction (Pallas kernels or XLA);
* the weight gradient of a plain FP32 / TF32 matmul as a library GEMM on
  XLA:CPU (:mod:`.cpu_gemm`, a switch the trainer's gradient function
  traces under);
* the numerics self-check (:mod:`.selfcheck`): each low-precision
  contraction compiled on its device against a float reference within its
  error bound, and the safe paths a wrong one is switched to
  (:mod:`.safe_paths`).
"""

from qsync_jax.numerics.ops import conv_general_dilated
from qsync_jax.numerics.ops import ConvGeneralDilated
from qsync_jax.numerics.ops import dot_general
from qsync_jax.numerics.ops import DotGeneral
from qsync_jax.numerics.ops import Einsum
from qsync_jax.numerics.ops import einsum
from qsync_jax.numerics.ops import get_kernel_backend
from qsync_jax.numerics.ops import kernel_backend
from qsync_jax.numerics.ops import KERNEL_BACKENDS
from qsync_jax.numerics.ops import set_kernel_backend
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import absmax_scale
from qsync_jax.numerics.quant import dequantize
from qsync_jax.numerics.quant import FP8_FORWARD
from qsync_jax.numerics.quant import FP8_GRADIENT
from qsync_jax.numerics.quant import Granularity
from qsync_jax.numerics.quant import hash_uniform
from qsync_jax.numerics.quant import INT8_MAX
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.numerics.quant import quantize
from qsync_jax.numerics.quant import quantize_fp8
from qsync_jax.numerics.quant import quantize_int8
from qsync_jax.numerics.quant import round_values
from qsync_jax.numerics.quant import Rounding

__all__ = [
  "ConvGeneralDilated",
  "DotGeneral",
  "Einsum",
  "FP8_FORWARD",
  "FP8_GRADIENT",
  "Granularity",
  "INT8_MAX",
  "KERNEL_BACKENDS",
  "Precision",
  "QuantConfig",
  "Rounding",
  "absmax_scale",
  "conv_general_dilated",
  "dequantize",
  "dot_general",
  "einsum",
  "get_kernel_backend",
  "hash_uniform",
  "kernel_backend",
  "quantize",
  "quantize_fp8",
  "quantize_int8",
  "round_values",
  "set_kernel_backend",
]
