"""Global-QSGD standard-dithering encode of gradient buckets, fused.

Global-QSGD (Xin, Canini, Richtarik, Horvath, arXiv 2305.18627, Algorithm 1,
standard dithering with the l_inf norm) quantizes every worker's bucket on a
grid shared by all workers: with ``M`` the global (``pmax`` over workers)
max-abs of the bucket and ``s`` levels per worker,

    scale = M / s,    q = clip(floor(y / scale + u), -s, s),   u ~ U[0, 1)

so ``E[q * scale] = y`` and the integer codes of ``n`` workers can be summed
directly by the all-reduce. With ``s = floor(127 / n)``
(:meth:`qsync_jax.parallel.averagers.GlobalQSGD.levels`) every ``|q| <= s`` and
the sum of ``n`` codes stays within ``n * s <= 127``: the int8 wire never wraps
(the official code's ``127 / n`` levels do: sands-lab/global-qsgd,
``standard_dithering_hook``).

This kernel is that encode for a ``(num_buckets, bucket_size)`` block of
buckets, given ``M`` per bucket: one read of ``y``, one write of codes.
Buckets whose ``M`` is 0 use scale 1 (all codes 0); buckets whose ``M`` is
not finite get codes 0 (the caller marks them NaN after the sum, as
``GlobalQSGD.reduce`` does). The dither ``u`` is the counter hash of
:mod:`pallas_kernels.hashing` (flat index within the bucket block, bits of
``y / scale``, ``seed``) instead of ``jax.random``: give each worker and each
step a distinct ``seed`` for independent rounding.

The same GPU caveat as :mod:`pallas_kernels.quantize` applies: Triton's
float32 division is ``div.full.f32`` (2 ulp), so on a GPU a code can differ by
one step from the reference where ``y / scale`` is that close to a grid point.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.hashing import hash_uniform_at

_CODE_DTYPES = (jnp.int8, jnp.int16, jnp.int32)


def _encode(y, m, idx, seed, levels: int):
  """The encode of float32 ``y`` rows with maxima ``m`` (rows, 1)."""
  finite = jnp.isfinite(m)
  scale = jnp.where((m > 0) & finite, m / float(levels), 1.0)
  v = y / scale
  q = jnp.floor(v + hash_uniform_at(idx, v, seed))
  q = jnp.clip(q, -float(levels), float(levels))
  return jnp.where(finite, q, 0.0)


def _encode_kernel(y_ref, m_ref, seed_ref, o_ref, *, levels: int, ncols: int):
  br, bc = o_ref.shape
  idx = _common.flat_index(
    pl.program_id(0) * br, pl.program_id(1) * bc, (br, bc), ncols
  )
  q = _encode(
    y_ref[...].astype(jnp.float32), m_ref[...], idx, seed_ref[...], levels
  )
  o_ref[...] = q.astype(o_ref.dtype)


def _check(y, global_max, levels, out_dtype):
  if y.ndim not in (1, 2) or not jnp.issubdtype(y.dtype, jnp.floating):
    raise ValueError(
      f"gqsgd_encode: y must be a float (num_buckets, "
      f"bucket_size) array or one 1-D bucket, got "
      f"{y.dtype}{list(y.shape)}"
    )
  y2 = y.reshape(1, -1) if y.ndim == 1 else y
  m = jnp.asarray(global_max, jnp.float32)
  if m.size != y2.shape[0]:
    raise ValueError(
      f"gqsgd_encode: global_max needs one value per bucket "
      f"({y2.shape[0]}), got shape {m.shape}"
    )
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in [jnp.dtype(d) for d in _CODE_DTYPES]:
    raise ValueError(
      f"gqsgd_encode: out_dtype must be int8, int16 or int32, got {out_dtype}"
    )
  if (
    not isinstance(levels, int)
    or levels < 1
    or levels > jnp.iinfo(out_dtype).max
  ):
    raise ValueError(
      f"gqsgd_encode: levels must be an int in [1, "
      f"{jnp.iinfo(out_dtype).max}] for {out_dtype} codes, got "
      f"{levels!r}"
    )
  return y2, m.reshape(-1, 1), out_dtype


@functools.partial(
  jax.jit,
  static_argnames=(
    "levels",
    "out_dtype",
    "block_rows",
    "block_cols",
    "interpret",
    "num_warps",
    "num_stages",
  ),
)
def _gqsgd_encode(
  y2,
  m2,
  seed,
  *,
  levels,
  out_dtype,
  block_rows,
  block_cols,
  interpret,
  num_warps,
  num_stages,
):
  kernel = functools.partial(_encode_kernel, levels=levels, ncols=y2.shape[1])
  return _common.rowwise_call(
    kernel,
    y2,
    m2,
    seed,
    out_dtype=out_dtype,
    block_rows=block_rows,
    block_cols=block_cols,
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
  )


def gqsgd_encode(
  y: jax.Array,
  global_max,
  levels: int,
  *,
  seed=0,
  out_dtype=jnp.int8,
  block_rows: int = 8,
  block_cols: int = 512,
  interpret: bool | None = None,
  num_warps: int = 4,
  num_stages: int = 2,
) -> jax.Array:
  """Returns this worker's Global-QSGD codes of ``y``.

  Args:
    y: (num_buckets, bucket_size) float values (the weighted gradient,
      bucketed and zero padded as ``qsync_jax.parallel.averagers`` does), or
      one 1-D bucket.
    global_max: (num_buckets,) float32 ``pmax`` over workers of each
      bucket's ``max |y|``.
    levels: ``s``, levels per worker (``floor(127 / n)`` for an int8 wire).
    seed: int or traced integer scalar; distinct per worker and per step.
    out_dtype: int8, int16 or int32 codes (the wire type).
    block_rows, block_cols: tile (powers of two).
    interpret: ``None``: interpret mode unless on a GPU.
    num_warps, num_stages: Triton launch parameters.

  Returns:
    Codes of ``y``'s shape and ``out_dtype``, ``|q| <= levels``; decode with
    ``q * global_max / levels``.

  Raises:
    ValueError: wrong shapes or dtypes, or ``levels`` out of range.
  """
  _common.check_block("block_rows", block_rows)
  _common.check_block("block_cols", block_cols)
  y2, m2, out_dtype = _check(y, global_max, levels, out_dtype)
  out = _gqsgd_encode(
    y2,
    m2,
    _common.as_salt(seed),
    levels=levels,
    out_dtype=out_dtype,
    block_rows=block_rows,
    block_cols=block_cols,
    interpret=_common.resolve_interpret(interpret),
    num_warps=num_warps,
    num_stages=num_stages,
  )
  return out.reshape(y.shape)


def gqsgd_encode_reference(
  y: jax.Array, global_max, levels: int, *, seed=0, out_dtype=jnp.int8
) -> jax.Array:
  """Pure-jnp :func:`gqsgd_encode`."""
  y2, m2, out_dtype = _check(y, global_max, levels, out_dtype)
  idx = jax.lax.iota(jnp.uint32, y2.size).reshape(y2.shape)
  q = _encode(y2.astype(jnp.float32), m2, idx, _common.as_salt(seed), levels)
  return q.astype(out_dtype).reshape(y.shape)


def gqsgd_decode(codes: jax.Array, global_max, levels: int) -> jax.Array:
  """``codes * M / s`` per bucket (a sum of ``n`` workers' codes decodes to
  the sum of their values; divide by nothing more: weights are inside y)."""
  m = jnp.asarray(global_max, jnp.float32)
  codes2 = codes.reshape(m.size, -1)
  scale = jnp.where((m > 0) & jnp.isfinite(m), m / float(levels), 1.0)
  return (codes2.astype(jnp.float32) * scale[:, None]).reshape(codes.shape)
