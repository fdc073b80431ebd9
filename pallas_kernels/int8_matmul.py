"""Tiled int8 x int8 -> int32 GEMM with a fused dequantize epilogue.

The forward contraction of an INT8 layer (QSync, arXiv 2407.02327; as
:mod:`qsync_jax.numerics.ops` computes it, after QSync's official code,
bytedance/QSync, ``qsync/LpTorch/ops.py``): symmetric int8 operands
``x ~= x_q * s_x`` and ``w ~= w_q * s_w``, products accumulated exactly in
int32, then one float32 epilogue

    y = float32(x_q @ w_q) * (s_row * s_col) [+ bias]

cast to float32, bfloat16 or float16. ``s_row`` is one scale per row of ``x``
(per token / example) or one per tensor, ``s_col`` one per output column (per
channel) or one per tensor. The association ``acc * (s_row * s_col)`` is the one
:mod:`qsync_jax.numerics.ops` uses, so the float32 output is bit-identical to
the XLA path, not merely close.

Kernel: a 2-D grid over ``(M / block_m, N / block_n)`` output tiles; each
program loops over K in ``block_k`` slices (``lax.fori_loop``) with an int32
register accumulator, the form that both lowers through Triton and runs in
interpret mode. Inputs are zero padded to block multiples (exact for
integers) and the output sliced back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common


def int8_matmul(
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
  """Returns ``dequantize(x @ w) [+ bias]`` from int8 operands.

  Args:
    x: (M, K) int8.
    w: (K, N) int8.
    x_scale: scalar (per tensor) or (M,) / (M, 1) per-row float scales.
    w_scale: scalar (per tensor) or (N,) / (1, N) per-column float scales.
    bias: optional (N,) bias added after dequantization (in float32).
    out_dtype: float32, bfloat16 or float16.
    block_m, block_n: output tile (powers of two, >= 16).
    block_k: K slice per inner step (power of two, >= 16).
    interpret: ``None``: interpret mode unless on a GPU.
    num_warps, num_stages: Triton launch parameters.

  Returns:
    (M, N) array of ``out_dtype``.

  Raises:
    ValueError: wrong ranks, dtypes, scale or bias shapes, or block sizes.
  """
  return _common.checked_scaled_matmul(
    "int8_matmul",
    x,
    w,
    x_scale,
    w_scale,
    bias,
    operand_dtypes=[jnp.int8],
    acc_dtype=jnp.int32,
    out_dtype=out_dtype,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
  )


def int8_matmul_reference(
  x: jax.Array,
  w: jax.Array,
  x_scale,
  w_scale,
  bias: jax.Array | None = None,
  *,
  out_dtype=jnp.float32,
) -> jax.Array:
  """Pure-jnp :func:`int8_matmul`: XLA's int8 dot, the same epilogue."""
  _common.check_matmul_operands(
    x, w, [jnp.int8], [jnp.int8], "int8_matmul_reference"
  )
  acc = jnp.dot(x, w, preferred_element_type=jnp.int32)
  return _common.reference_epilogue(acc, x_scale, w_scale, bias, out_dtype)
