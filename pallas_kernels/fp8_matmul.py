"""Tiled fp8 GEMM (e4m3 / e5m2) with float32 accumulation and scales.

The FP8 layer's contraction (as :mod:`qsync_jax.numerics.ops` computes it;
``flax.linen.fp8_ops`` style current scaling): e4m3 forward operands, e5m2 for
gradients, each with a float32 absmax scale, products accumulated in float32:

    y = (x_q @ w_q in float32) * (s_row * s_col) [+ bias]

Kernel layout as :mod:`pallas_kernels.int8_matmul` (2-D grid of output
tiles, ``fori_loop`` over K, zero padding; zero is exact in fp8).

Mixed operand types (e5m2 x e4m3, the input-gradient GEMM) do not lower
natively: jax's Triton ``dot_general`` lowering requires both operands of
``tt.dot`` to have the same element type ("a and b must have the same element
type, but got: f8E5M2 and f8E4M3FN" on jax 0.10.2). For a mixed pair the
kernel widens both tiles to float16 in registers before the dot. That is
exact (every e4m3 and e5m2 value, subnormals included, is a float16 value)
but runs at the float16 tensor-core rate. Equal types (e4m3 x e4m3, e5m2 x
e5m2) use the native fp8 dot (sm_89+ / Hopper).

Tolerance: products of two fp8 values are exact in float32; only the order
of the float32 sums differs from XLA's, so ``|y - ref| <= K * 2**-24 *
(|x_q| @ |w_q|) * s_row * s_col`` (the standard bound for recursive
summation, plus the final rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def fp8_matmul(
  x: jax.Array,
  w: jax.Array,
  x_scale,
  w_scale,
  bias: jax.Array | None = None,
  *,
  out_dtype=jnp.float32,
  block_m: int = 64,
  block_n: int = 64,
  block_k: int = 64,
  interpret: bool | None = None,
  num_warps: int = 4,
  num_stages: int = 2,
) -> jax.Array:
  """Returns ``(x @ w) * scales [+ bias]`` from fp8 operands.

  Args:
    x: (M, K) float8_e4m3fn or float8_e5m2.
    w: (K, N) float8_e4m3fn or float8_e5m2.
    x_scale: scalar or (M,) / (M, 1) float scales.
    w_scale: scalar or (N,) / (1, N) float scales.
    bias: optional (N,) bias (added in float32).
    out_dtype: float32, bfloat16 or float16.
    block_m, block_n, block_k: tile sizes (powers of two, >= 16).
    interpret: ``None``: interpret mode unless on a GPU.
    num_warps, num_stages: Triton launch parameters.

  Returns:
    (M, N) array of ``out_dtype``.

  Raises:
    ValueError: wrong ranks, dtypes, scale or bias shapes, or block sizes.
  """
  return _common.checked_scaled_matmul(
    "fp8_matmul",
    x,
    w,
    x_scale,
    w_scale,
    bias,
    operand_dtypes=FP8_DTYPES,
    acc_dtype=jnp.float32,
    out_dtype=out_dtype,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
    # Mixed e5m2 x e4m3: widen the tiles (module docstring).
    tile_dtype=jnp.float16 if x.dtype != w.dtype else None,
  )


def fp8_matmul_reference(
  x: jax.Array,
  w: jax.Array,
  x_scale,
  w_scale,
  bias: jax.Array | None = None,
  *,
  out_dtype=jnp.float32,
) -> jax.Array:
  """Pure-jnp :func:`fp8_matmul`: XLA's fp8 dot with float32 accumulation."""
  _common.check_matmul_operands(
    x, w, FP8_DTYPES, FP8_DTYPES, "fp8_matmul_reference"
  )
  acc = jnp.dot(
    x.astype(jnp.float32),
    w.astype(jnp.float32),
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
  )
  return _common.reference_epilogue(acc, x_scale, w_scale, bias, out_dtype)


def fp8_error_bound(x: jax.Array, w: jax.Array, x_scale, w_scale) -> jax.Array:
  """Bound on ``|fp8_matmul - fp8_matmul_reference|`` (float32 outputs).

  ``K * 2**-24 * (|x| @ |w|) * |s_row * s_col|`` bounds the difference of
  two float32 summation orders of exact products, plus one ulp-sized term
  per output for the epilogue's rounding.
  """
  m, k, n = _common.check_matmul_operands(
    x, w, FP8_DTYPES, FP8_DTYPES, "fp8_error_bound"
  )
  mag = jnp.dot(
    jnp.abs(x.astype(jnp.float32)),
    jnp.abs(w.astype(jnp.float32)),
    precision=jax.lax.Precision.HIGHEST,
  )
  s = jnp.abs(
    _common.as_row_scale(x_scale, m, "x_scale")
    * _common.as_col_scale(w_scale, n, "w_scale")
  )
  return (2 * k + 2) * 2.0**-24 * mag * s
