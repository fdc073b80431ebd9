"""Pallas low-precision kernels for qsync_jax.

This package owns the hand-written kernels behind the low-precision paths:

* :func:`int8_matmul`: int8 x int8 -> int32 tiled GEMM with a fused
  epilogue (per-row / per-column or per-tensor dequantize scales, optional
  bias, float32 / bfloat16 / float16 output);
* :func:`fp8_matmul`: e4m3 / e5m2 GEMM with float32 accumulation and scales;
* :func:`quantize`: fused scale-and-round to int8, per tensor or per row,
  nearest / stochastic (counter hash inside the kernel) / truncate;
* :func:`gqsgd_encode`: Global-QSGD standard-dithering encode of gradient
  buckets given the global max (arXiv 2305.18627).

Each kernel has a pure-jnp ``*_reference``. Kernels run through Triton on a
GPU (sm_80+) and in Pallas interpret mode elsewhere (``interpret=None``);
:mod:`qsync_jax.numerics.ops` dispatches INT8 / FP8 ``dot_general`` to the GEMMs
(``QSYNC_KERNELS=auto|pallas|xla``). :mod:`experiments.benches.kernels` measures
them against XLA's dots (``experiments/kernels_bench.py``).
"""

from pallas_kernels.fp8_matmul import fp8_error_bound
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.fp8_matmul import fp8_matmul_reference
from pallas_kernels.gqsgd_encode import gqsgd_decode
from pallas_kernels.gqsgd_encode import gqsgd_encode
from pallas_kernels.gqsgd_encode import gqsgd_encode_reference
from pallas_kernels.int8_matmul import int8_matmul
from pallas_kernels.int8_matmul import int8_matmul_reference
from pallas_kernels.quantize import quantize
from pallas_kernels.quantize import quantize_reference

__all__ = [
  "fp8_error_bound",
  "fp8_matmul",
  "fp8_matmul_reference",
  "gqsgd_decode",
  "gqsgd_encode",
  "gqsgd_encode_reference",
  "int8_matmul",
  "int8_matmul_reference",
  "quantize",
  "quantize_reference",
]
