"""Fused scale-and-round to int8, per tensor or per row.

One pass over the input: ``q = clip(round(x / scale), -127, 127)`` as int8, with
the rounding of :mod:`qsync_jax.numerics.quant` (QSync's LP-PyTorch numerics,
arXiv 2407.02327; QSync's official code, bytedance/QSync,
``qsync/LpTorch/quant.py``):

* ``nearest``: ties to even, as ``jnp.round`` (built from ``floor``, since
  Triton has no round op);
* ``truncate``: toward zero, as QSync's CUDA kernel's ``static_cast``;
* ``stochastic``: ``floor(v + u)`` with ``u`` in [0, 1) from a counter-based
  hash (``lowbias32``) of the element's flat index, the bit pattern of
  ``v = x / scale`` and a salt. ``P(round up) = frac(v)`` up to the 2**-24
  grid of ``u``, so the rounding is unbiased; no ``jax.random`` key or state
  is needed inside the kernel.

The noise is :func:`pallas_kernels.hashing.hash_uniform_at`, the same function
``qsync_jax.numerics.quant`` rounds with, so the kernel equals
``qsync_jax.numerics.quant.quantize_int8`` element for element.

On a GPU, Triton lowers float32 division to the approximate ``div.full.f32``
(at most 2 ulp), not XLA's correctly rounded division, so a code can differ
by one step from XLA's where ``x / scale`` lies within 2 ulp of a rounding
boundary; interpret mode (CPU) is bit-exact.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.hashing import hash_uniform_at

INT8_MAX = 127
ROUNDINGS = ("nearest", "stochastic", "truncate")
_FLOAT_INPUTS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _rounding_name(rounding) -> str:
  # qsync_jax.numerics.quant.Rounding
  name = getattr(rounding, "value", rounding)
  if name not in ROUNDINGS:
    raise ValueError(
      f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}"
    )
  return name


def round_scaled(
  v: jax.Array,
  rounding: str,
  idx: jax.Array | None = None,
  salt: jax.Array | None = None,
) -> jax.Array:
  """Rounds float32 ``v`` to integers (as float32); kernel and reference.

  Args:
    v: scaled values.
    rounding: ``nearest``, ``stochastic`` or ``truncate``.
    idx: uint32 flat indices of ``v`` (stochastic only).
    salt: uint32 salt (stochastic only).
  """
  if rounding == "nearest":
    return _common.round_half_even(v)
  if rounding == "truncate":
    return jnp.where(v < 0, jnp.ceil(v), jnp.floor(v))
  assert idx is not None and salt is not None, "stochastic: idx and salt"
  return jnp.floor(v + hash_uniform_at(idx, v, salt))


def _quantize_kernel(
  x_ref, s_ref, salt_ref, o_ref, *, rounding: str, ncols: int
):
  br, bc = o_ref.shape
  v = x_ref[...].astype(jnp.float32) / s_ref[...]
  idx = None
  if rounding == "stochastic":
    idx = _common.flat_index(
      pl.program_id(0) * br, pl.program_id(1) * bc, (br, bc), ncols
    )
  r = round_scaled(v, rounding, idx, salt_ref[...])
  o_ref[...] = jnp.clip(r, -INT8_MAX, INT8_MAX).astype(jnp.int8)


def _as_2d(x: jax.Array, scale) -> tuple[jax.Array, jax.Array]:
  """Views ``x`` as (rows, cols) and the scale as (rows, 1)."""
  if x.dtype not in [jnp.dtype(d) for d in _FLOAT_INPUTS]:
    raise ValueError(
      f"quantize: x must be float32, bfloat16 or float16, got {x.dtype}"
    )
  s = jnp.asarray(scale, jnp.float32)
  cols = x.shape[-1] if x.ndim else 1
  x2 = x.reshape(-1, cols) if x.size else x.reshape(0, cols)
  if s.size == 1:
    return x2, jnp.broadcast_to(s.reshape(1, 1), (x2.shape[0], 1))
  if x.ndim == 2 and s.shape in ((x.shape[0],), (x.shape[0], 1)):
    return x2, s.reshape(-1, 1)
  raise ValueError(
    f"quantize: scale must be a scalar (per tensor) or one per "
    f"row of a 2-D x, shape ({x.shape[0] if x.ndim else 1},) "
    f"or (rows, 1); got scale {s.shape} for x {x.shape}"
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "rounding",
    "block_rows",
    "block_cols",
    "interpret",
    "num_warps",
    "num_stages",
  ),
)
def _quantize(
  x2,
  s2,
  salt,
  *,
  rounding,
  block_rows,
  block_cols,
  interpret,
  num_warps,
  num_stages,
):
  kernel = functools.partial(
    _quantize_kernel, rounding=rounding, ncols=x2.shape[1]
  )
  return _common.rowwise_call(
    kernel,
    x2,
    s2,
    salt,
    out_dtype=jnp.int8,
    block_rows=block_rows,
    block_cols=block_cols,
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
    row_pad=1.0,
  )


def quantize(
  x: jax.Array,
  scale,
  *,
  rounding="nearest",
  salt=0,
  block_rows: int = 32,
  block_cols: int = 256,
  interpret: bool | None = None,
  num_warps: int = 4,
  num_stages: int = 2,
) -> jax.Array:
  """Returns ``clip(round(x / scale), -127, 127)`` as int8, in one kernel.

  Args:
    x: float32 / bfloat16 / float16 array of any shape (per tensor), or 2-D
      (per row).
    scale: a scalar (per tensor), or (rows,) / (rows, 1) for a 2-D ``x``.
    rounding: ``nearest`` (ties to even), ``stochastic`` or ``truncate``
      (strings or :class:`qsync_jax.numerics.quant.Rounding`).
    salt: int or traced integer scalar mixed into the stochastic hash; use
      distinct salts for tensors (or steps) that need independent noise.
    block_rows, block_cols: tile (powers of two).
    interpret: ``None``: interpret mode unless on a GPU.
    num_warps, num_stages: Triton launch parameters.

  Returns:
    int8 array of ``x``'s shape.

  Raises:
    ValueError: unknown rounding, wrong dtype, scale shape or block size.
  """
  rounding = _rounding_name(rounding)
  _common.check_block("block_rows", block_rows)
  _common.check_block("block_cols", block_cols)
  x2, s2 = _as_2d(x, scale)
  if x.size == 0:
    return jnp.zeros(x.shape, jnp.int8)
  out = _quantize(
    x2,
    s2,
    _common.as_salt(salt),
    rounding=rounding,
    block_rows=block_rows,
    block_cols=block_cols,
    interpret=_common.resolve_interpret(interpret),
    num_warps=num_warps,
    num_stages=num_stages,
  )
  return out.reshape(x.shape)


def quantize_reference(
  x: jax.Array, scale, *, rounding="nearest", salt=0
) -> jax.Array:
  """Pure-jnp :func:`quantize`.

  Equal to ``qsync_jax.numerics.quant.quantize_int8``.
  """
  rounding = _rounding_name(rounding)
  x2, s2 = _as_2d(x, scale)
  v = x2.astype(jnp.float32) / s2
  idx = jax.lax.iota(jnp.uint32, v.size).reshape(v.shape)
  r = round_scaled(v, rounding, idx, _common.as_salt(salt))
  return jnp.clip(r, -INT8_MAX, INT8_MAX).astype(jnp.int8).reshape(x.shape)
