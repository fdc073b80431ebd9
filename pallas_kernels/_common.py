"""Shared pieces of the Pallas kernels: backend choice, padding, the GEMM.

Every kernel here is written once and runs two ways:

* ``interpret=True``: Pallas's interpreter (a jitted scan over the grid), the
  only way to run a Pallas kernel on CPU. Numerically it executes the same
  jnp operations as the kernel body, so tests on CPU check the kernel's
  arithmetic exactly.
* ``interpret=False``: the Triton backend, forced with
  ``compiler_params=pltriton.CompilerParams(...)``. On jax 0.10 the default GPU
  lowering is Mosaic GPU, which cannot lower ``dot_general`` inside a kernel, so
  every GPU call passes Triton parameters. Triton needs sm_80+ and power-of-two
  block shapes.

``interpret=None`` (the default of every public wrapper) means "interpret
unless the default backend is a GPU".
"""

from __future__ import annotations

import functools
import warnings

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp


def on_gpu() -> bool:
  """Whether the default backend is a GPU (CUDA or ROCm)."""
  return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
  """``None`` -> interpret unless running on a GPU; otherwise as given."""
  return (not on_gpu()) if interpret is None else bool(interpret)


def triton_params(num_warps: int = 4, num_stages: int = 2):
  """Triton compiler parameters (selects the Triton backend on GPU).

  jax 0.11 deprecates the Triton backend and may warn; the warning is not
  actionable for callers, so it is silenced here.
  """
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(
  kernel, *, interpret: bool, num_warps: int, num_stages: int, **kwargs
):
  """``pl.pallas_call`` in interpret mode, or with Triton parameters."""
  if interpret:
    return pl.pallas_call(kernel, interpret=True, **kwargs)
  return pl.pallas_call(
    kernel, compiler_params=triton_params(num_warps, num_stages), **kwargs
  )


def check_block(name: str, value: int, minimum: int = 1) -> int:
  """Validates a block size: a power of two, at least ``minimum``.

  Raises:
    ValueError: ``value`` is not an int power of two ``>= minimum``.
  """
  if not isinstance(value, int) or value < minimum or value & (value - 1):
    raise ValueError(
      f"{name} must be a power of two >= {minimum} (Triton "
      f"tiles are powers of two), got {value!r}"
    )
  return value


def round_up(n: int, m: int) -> int:
  """The smallest multiple of ``m`` that is ``>= n`` (at least ``m``)."""
  return max(-(-n // m), 1) * m


def pad2(x: jax.Array, rows: int, cols: int, value=0) -> jax.Array:
  """Pads a 2-D array at the end to ``(rows, cols)`` with ``value``."""
  pr, pc = rows - x.shape[0], cols - x.shape[1]
  if pr == 0 and pc == 0:
    return x
  return jnp.pad(x, ((0, pr), (0, pc)), constant_values=value)


def pick_block(n: int, lo: int = 16, hi: int = 128) -> int:
  """A power-of-two block for a dimension of size ``n``, in [lo, hi]."""
  return min(max(lo, 1 << max(n - 1, 0).bit_length()), hi)


# --------------------------------------------------------------------------
# Element-wise helpers usable both inside kernels (Triton lowers every op
# used: uint32 mul / xor / logical shift, bitcast, floor) and in references.
# --------------------------------------------------------------------------


def round_half_even(v: jax.Array) -> jax.Array:
  """``jnp.round`` (ties to even) from floor only; Triton has no round op.

  ``f = v - floor(v)`` is exact, so unlike ``floor(v + 0.5)`` this never
  double-rounds (e.g. at ``0.5 - 2**-25``).
  """
  r = jnp.floor(v)
  f = v - r
  odd = (r - 2.0 * jnp.floor(0.5 * r)) == 1.0
  up = (f > 0.5) | ((f == 0.5) & odd)
  return jnp.where(up, r + 1.0, r)


def flat_index(row0, col0, shape: tuple[int, int], ncols) -> jax.Array:
  """uint32 row-major indices ``(row0 + i) * ncols + col0 + j`` of a block."""
  rows = lax.broadcasted_iota(jnp.int32, shape, 0) + row0
  cols = lax.broadcasted_iota(jnp.int32, shape, 1) + col0
  return rows.astype(jnp.uint32) * jnp.uint32(ncols) + cols.astype(jnp.uint32)


def as_salt(salt) -> jax.Array:
  """A (1, 1) uint32 array from an int or a traced integer scalar."""
  if isinstance(salt, int):
    salt = salt & 0xFFFFFFFF
    return jnp.full((1, 1), salt, jnp.uint32)
  salt = jnp.asarray(salt)
  if salt.size != 1 or not jnp.issubdtype(salt.dtype, jnp.integer):
    raise ValueError(
      f"salt/seed must be an integer scalar, got {salt.dtype}{list(salt.shape)}"
    )
  return salt.reshape(1, 1).astype(jnp.uint32)


# --------------------------------------------------------------------------
# The scaled GEMM shared by int8_matmul and fp8_matmul.
# --------------------------------------------------------------------------


def _gemm_kernel(
  x_ref,
  w_ref,
  sx_ref,
  sw_ref,
  *rest,
  block_k: int,
  num_k: int,
  acc_dtype,
  tile_dtype,
  has_bias: bool,
):
  b_ref, o_ref = rest if has_bias else (None, rest[0])
  bm, bn = x_ref.shape[0], w_ref.shape[1]

  def body(k, acc):
    start = pl.multiple_of(k * block_k, block_k)
    xs = x_ref[:, pl.ds(start, block_k)]
    ws = w_ref[pl.ds(start, block_k), :]
    if tile_dtype is not None:
      xs, ws = xs.astype(tile_dtype), ws.astype(tile_dtype)
    return acc + jnp.dot(xs, ws, preferred_element_type=acc_dtype)

  acc = lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), acc_dtype))
  # Same association as qsync_jax.numerics.ops: acc * (s_row * s_col).
  y = acc.astype(jnp.float32) * (sx_ref[...] * sw_ref[...])
  if has_bias:
    y = y + b_ref[...]
  o_ref[...] = y.astype(o_ref.dtype)


def as_row_scale(s, m: int, name: str) -> jax.Array:
  """A per-tensor (scalar) or per-row ``(m,)`` / ``(m, 1)`` scale as (m, 1)."""
  s = jnp.asarray(s, jnp.float32)
  if s.size == 1:
    return jnp.broadcast_to(s.reshape(1, 1), (m, 1))
  if s.shape in ((m,), (m, 1)):
    return s.reshape(m, 1)
  raise ValueError(
    f"{name} must be a scalar (per tensor) or have shape "
    f"({m},) or ({m}, 1), got {s.shape}"
  )


def as_col_scale(s, n: int, name: str) -> jax.Array:
  """A per-tensor (scalar) or per-column ``(n,)`` / ``(1, n)`` scale as (1, n)."""
  s = jnp.asarray(s, jnp.float32)
  if s.size == 1:
    return jnp.broadcast_to(s.reshape(1, 1), (1, n))
  if s.shape in ((n,), (1, n)):
    return s.reshape(1, n)
  raise ValueError(
    f"{name} must be a scalar (per tensor) or have shape "
    f"({n},) or (1, {n}), got {s.shape}"
  )


def check_matmul_operands(x, w, x_dtypes, w_dtypes, op: str):
  """Validates 2-D operands of a GEMM and returns ``(M, K, N)``."""
  if x.ndim != 2 or w.ndim != 2:
    raise ValueError(
      f"{op} takes 2-D operands x (M, K) and w (K, N), got "
      f"shapes {x.shape} and {w.shape}"
    )
  if x.shape[1] != w.shape[0]:
    raise ValueError(
      f"{op}: contracting sizes differ: x {x.shape} and w {w.shape}"
    )
  for name, a, ok in (("x", x, x_dtypes), ("w", w, w_dtypes)):
    if a.dtype not in [jnp.dtype(d) for d in ok]:
      raise ValueError(
        f"{op}: {name} must have dtype in "
        f"{[jnp.dtype(d).name for d in ok]}, got {a.dtype}"
      )
  return x.shape[0], x.shape[1], w.shape[1]


OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_out_dtype(out_dtype, op: str):
  dt = jnp.dtype(out_dtype)
  if dt not in [jnp.dtype(d) for d in OUT_DTYPES]:
    raise ValueError(
      f"{op}: out_dtype must be float32, bfloat16 or float16, got {dt}"
    )
  return dt


@functools.partial(
  jax.jit,
  static_argnames=(
    "acc_dtype",
    "out_dtype",
    "block_m",
    "block_n",
    "block_k",
    "interpret",
    "num_warps",
    "num_stages",
    "tile_dtype",
  ),
)
def scaled_matmul(
  x,
  w,
  sx,
  sw,
  bias,
  *,
  acc_dtype,
  out_dtype,
  block_m: int,
  block_n: int,
  block_k: int,
  interpret: bool,
  num_warps: int,
  num_stages: int,
  tile_dtype=None,
) -> jax.Array:
  """``(x @ w in acc_dtype) * (sx * sw) [+ bias]`` as one tiled kernel.

  Operands are zero padded to block multiples (exact: zero rows and columns
  add nothing to the accumulator) and the output is sliced back, so any
  shape works on both backends (interpret mode would otherwise read NaN past
  the edges, Triton would need masks).

  Args:
    x: (M, K) low-precision operand.
    w: (K, N) low-precision operand.
    sx: (M, 1) float32 row scales.
    sw: (1, N) float32 column scales.
    bias: (1, N) float32 or None.
    acc_dtype: int32 or float32.
    out_dtype: float32, bfloat16 or float16.
    block_m, block_n, block_k: tile sizes (powers of two).
    interpret: run in the Pallas interpreter.
    num_warps, num_stages: Triton parameters (ignored when interpreting).
    tile_dtype: if set, loaded tiles are cast to it before the dot (used for
      mixed fp8 operand types, which Triton's dot cannot take directly).
  """
  m, k = x.shape
  n = w.shape[1]
  mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
  args = [
    pad2(x, mp, kp),
    pad2(w, kp, np_),
    pad2(sx, mp, 1, 1.0),
    pad2(sw, 1, np_, 1.0),
  ]
  in_specs = [
    pl.BlockSpec((block_m, kp), lambda i, j: (i, 0)),
    pl.BlockSpec((kp, block_n), lambda i, j: (0, j)),
    pl.BlockSpec((block_m, 1), lambda i, j: (i, 0)),
    pl.BlockSpec((1, block_n), lambda i, j: (0, j)),
  ]
  if bias is not None:
    args.append(pad2(bias, 1, np_))
    in_specs.append(pl.BlockSpec((1, block_n), lambda i, j: (0, j)))
  kernel = functools.partial(
    _gemm_kernel,
    block_k=block_k,
    num_k=kp // block_k,
    acc_dtype=acc_dtype,
    tile_dtype=tile_dtype,
    has_bias=bias is not None,
  )
  out = pallas_call(
    kernel,
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
    grid=(mp // block_m, np_ // block_n),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
    out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
  )(*args)
  return out[:m, :n]


def is_triton_lowered(text: str) -> bool:
  """Whether lowered StableHLO text holds a Triton kernel custom call."""
  return "__gpu$xla.gpu.triton" in text


def lower_for_cuda(fn, *args) -> str:
  """Lowers ``jax.jit(fn)(*args)`` for CUDA (no GPU needed); returns text."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def checked_scaled_matmul(
  name: str,
  x,
  w,
  x_scale,
  w_scale,
  bias,
  *,
  operand_dtypes,
  acc_dtype,
  out_dtype,
  block_m: int,
  block_n: int,
  block_k: int,
  interpret: bool | None,
  num_warps: int,
  num_stages: int,
  tile_dtype=None,
) -> jax.Array:
  """Checks a public GEMM's arguments, then runs :func:`scaled_matmul`.

  Raises:
    ValueError: wrong ranks, dtypes, scale or bias shapes, or block sizes.
  """
  m, _, n = check_matmul_operands(x, w, operand_dtypes, operand_dtypes, name)
  out_dtype = check_out_dtype(out_dtype, name)
  for arg, b in (
    ("block_m", block_m),
    ("block_n", block_n),
    ("block_k", block_k),
  ):
    check_block(arg, b, 16)
  if bias is not None and jnp.size(bias) != n:
    raise ValueError(f"bias must have shape ({n},), got {jnp.shape(bias)}")
  sx = as_row_scale(x_scale, m, "x_scale")
  sw = as_col_scale(w_scale, n, "w_scale")
  bias_col = None if bias is None else as_col_scale(bias, n, "bias")
  return scaled_matmul(
    x,
    w,
    sx,
    sw,
    bias_col,
    acc_dtype=acc_dtype,
    out_dtype=out_dtype,
    block_m=block_m,
    block_n=block_n,
    block_k=block_k,
    interpret=resolve_interpret(interpret),
    num_warps=num_warps,
    num_stages=num_stages,
    tile_dtype=tile_dtype,
  )


def reference_epilogue(
  acc: jax.Array, x_scale, w_scale, bias, out_dtype
) -> jax.Array:
  """The GEMM epilogue in jnp: ``acc * (s_row * s_col) [+ bias]``."""
  m, n = acc.shape
  y = acc.astype(jnp.float32) * (
    as_row_scale(x_scale, m, "x_scale") * as_col_scale(w_scale, n, "w_scale")
  )
  if bias is not None:
    y = y + as_col_scale(bias, n, "bias")
  return y.astype(out_dtype)


def rowwise_call(
  kernel,
  x2: jax.Array,
  per_row: jax.Array,
  scalar: jax.Array,
  *,
  out_dtype,
  block_rows: int,
  block_cols: int,
  interpret: bool,
  num_warps: int,
  num_stages: int,
  row_pad=0,
) -> jax.Array:
  """Runs an element-wise ``kernel(x_ref, row_ref, scalar_ref, o_ref)``
  over a 2-D array in (block_rows, block_cols) tiles.

  ``per_row`` is (rows, 1) (padded with ``row_pad``), ``scalar`` is (1, 1);
  ``x2`` is zero padded to block multiples and the output sliced back.
  """
  rows, cols = x2.shape
  rp, cp = round_up(rows, block_rows), round_up(cols, block_cols)
  out = pallas_call(
    kernel,
    interpret=interpret,
    num_warps=num_warps,
    num_stages=num_stages,
    grid=(rp // block_rows, cp // block_cols),
    in_specs=[
      pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j)),
      pl.BlockSpec((block_rows, 1), lambda i, j: (i, 0)),
      pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
    ],
    out_specs=pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j)),
    out_shape=jax.ShapeDtypeStruct((rp, cp), out_dtype),
  )(pad2(x2, rp, cp), pad2(per_row, rp, 1, row_pad), scalar)
  return out[:rows, :cols]
