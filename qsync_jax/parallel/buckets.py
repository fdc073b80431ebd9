"""Buckets, their scales and the rounding noise the quantizing averagers share.

This module owns how a worker's array is cut into buckets (rows of
``bucket_size`` elements that share one scale), the bucket max that scales
them, and how a PRNG key becomes the uniform noise of stochastic rounding.
:mod:`qsync_jax.parallel.averagers` (QSGD) and
:mod:`qsync_jax.parallel.global_qsgd` (Global-QSGD) build on it.

Randomness. Stochastic rounding needs independent noise per worker (the
variance bounds assume it), and the exponential merges need noise shared by
the two workers of each pair. Pass ``key`` (the same key on every worker, a
fresh one per step) to control it; without it the key is derived from the
strategy's ``seed`` and the bits of the step's scales (for Global-QSGD the
global scales, which every worker shares and which change from step to
step). Worker noise is then keyed by ``fold_in(key, axis_index)``, a merge's
by the key folded with the stage and the pair's block.

Each quantizer's ``noise`` field picks how a key becomes one uniform per
element. ``"hash"`` (the default) draws one 32-bit salt from the key and
hashes each element's flat index, the bits of the value being rounded and
the salt with :func:`qsync_jax.numerics.quant.hash_uniform_at` (the counter
hash of the Pallas kernels; for Global-QSGD the codes equal those of
``pallas_kernels.gqsgd_encode`` with ``seed`` the salt). ``"threefry"``
draws ``jax.random.uniform(key, shape)``. Both give 24 (hash) or 23
(threefry) random bits per element, so rounding is unbiased to float32
resolution, and workers with distinct keys get unrelated noise. The hash
is a few integer operations per element, fused into the quantizer's pass;
XLA:CPU spends about 35 ns of CPU per element on threefry (jax 0.10, 2**24
elements), about ten times a float32 copy and several times the rest of
Global-QSGD, which made it slower than the float32 mean
(``experiments.benches.compression``). The hash is a statistical generator,
not a cryptographic one, which stochastic rounding does not need.
"""

from __future__ import annotations

from collections.abc import Callable
import math

import jax
from jax import lax
import jax.numpy as jnp

from qsync_jax.numerics import quant

# float32 holds every integer up to 2**24 exactly; more levels than that add
# no resolution to a float32 gradient and would make the float-to-int cast
# of the largest codes inexact.
MAX_LEVELS = 2**24
#: How a key becomes per-element uniform noise (module docstring).
NOISES = ("hash", "threefry")


def check_bucket_size(bucket_size: int | None) -> None:
  """Raises ValueError unless ``bucket_size`` is None or positive."""
  if bucket_size is not None and bucket_size < 1:
    raise ValueError(f"bucket_size must be positive, got {bucket_size}")


def check_noise(noise: str) -> None:
  """Raises ValueError unless ``noise`` is one of :data:`NOISES`."""
  if noise not in NOISES:
    raise ValueError(f"noise must be one of {list(NOISES)}, got {noise!r}")


def num_buckets(num_elements: int, bucket_size: int | None) -> int:
  """Buckets of at most ``bucket_size`` over ``num_elements`` (at least 1)."""
  if bucket_size is None or num_elements <= bucket_size:
    return 1
  return -(-num_elements // bucket_size)


def bucket_width(num_elements: int, bucket_size: int | None) -> int:
  """Elements per row of :func:`to_buckets`: ``bucket_size``, or all of them
  where they fit in one bucket."""
  if bucket_size is None or num_buckets(num_elements, bucket_size) == 1:
    return max(num_elements, 1)
  return bucket_size


def to_buckets(y: jax.Array, bucket_size: int | None) -> jax.Array:
  """Flattens ``y`` into ``(num_buckets, bucket_size)`` rows; the last row
  is zero padded.

  Every row but the last is ``bucket_size`` wide, so where that is a power
  of two (the averagers' default, 2**16) an element's row and column are a
  shift and a mask. Rows of equal width ``ceil(n / num_buckets)`` would
  make the padding and the slice back divide every index by an odd width,
  which costs XLA:CPU several times more.
  """
  flat = y.reshape(-1)
  nb = num_buckets(flat.size, bucket_size)
  width = bucket_width(flat.size, bucket_size)
  return jnp.pad(flat, (0, nb * width - flat.size)).reshape(nb, width)


def map_rows(
  fn: Callable[[jax.Array, int], jax.Array],
  y: jax.Array,
  bucket_size: int | None,
) -> jax.Array:
  """``fn`` over the rows of ``to_buckets(y, bucket_size)``, piecewise.

  ``fn(rows, start)`` takes a block of rows and the index of its first row
  and returns one row of results per row (an elementwise pass, such as an
  encode): it gets the full rows (a reshape of ``y``'s prefix), then the
  padded last row, and their results are concatenated, equal to
  ``fn(to_buckets(y, bucket_size), 0)``. XLA:CPU fuses a pad into the
  elementwise pass that reads it and then takes a slow path: Global-QSGD's
  encode of 10,617,226 floats (162 full buckets of 2**16 and a partial one)
  took 23 ms through the pad and 8 ms this way, one process on two cores.

  Args:
    fn: ``fn(rows, start) -> (len(rows), ...)``, row by row.
    y: the array to bucket.
    bucket_size: as for :func:`to_buckets`.

  Returns:
    ``fn``'s results for every row, in order.
  """
  flat = y.reshape(-1)
  nb = num_buckets(flat.size, bucket_size)
  width = bucket_width(flat.size, bucket_size)
  full = flat.size // width
  if full == nb:
    return fn(flat.reshape(nb, width), 0)
  tail = jnp.pad(flat[full * width :], (0, nb * width - flat.size))[None]
  if not full:
    return fn(tail, 0)
  head = flat[: full * width].reshape(full, width)
  return jnp.concatenate([fn(head, 0), fn(tail, full)])


def from_buckets(yb: jax.Array, like: jax.Array) -> jax.Array:
  """Undoes :func:`to_buckets`: drops the padding, takes ``like``'s shape."""
  return yb.reshape(-1)[: like.size].reshape(like.shape)


def bucket_absmax(yb: jax.Array, weight: jax.Array | float = 1.0) -> jax.Array:
  """Per-row max ``|weight * y|``, or inf where a row holds a non-finite
  value.

  ``inf`` survives ``pmax`` on every backend, whereas NaN ordering in a
  max-reduction is backend dependent.

  One pass over ``yb``: a two-output reduction (row max and row min) of
  ``yb`` itself, scaled by ``|weight|`` afterwards, which equals the max of
  the rounded products because rounding is monotonic. XLA:CPU runs it at
  memory speed, where a max of ``|y|`` or of any other elementwise
  expression goes through a slower reduction that, moreover, drops NaN
  (XLA:CPU's YNNPACK reductions, jax 0.10). The reducer is XLA's
  ``maximum``/``minimum``, which propagate NaN; a NaN row max or min maps to
  ``inf``.

  Args:
    yb: the bucketed rows (:func:`to_buckets`).
    weight: the worker's weight, applied to the max.

  Returns:
    One float per row.
  """
  neg_inf, pos_inf = jnp.array(-jnp.inf, yb.dtype), jnp.array(jnp.inf, yb.dtype)
  hi, lo = lax.reduce(
    (yb, yb),
    (neg_inf, pos_inf),
    lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])),
    (1,),
  )
  m = jnp.maximum(hi, -lo) * jnp.abs(weight)
  return jnp.where(jnp.isnan(m), jnp.inf, m)


def absmax(
  y: jax.Array, bucket_size: int | None, weight: jax.Array | float = 1.0
) -> jax.Array:
  """:func:`bucket_absmax` of ``to_buckets(y, bucket_size)``, read from
  ``y`` by :func:`map_rows`: XLA:CPU fuses a pad into the reduction that
  reads it and then takes a slow path."""
  return map_rows(lambda rows, _: bucket_absmax(rows, weight), y, bucket_size)


def nan_where(bad: jax.Array, values: jax.Array) -> jax.Array:
  """Sets the rows of ``values`` flagged in ``bad`` (one per row) to NaN."""
  return jnp.where(bad[:, None], jnp.nan, values)


def base_key(key: jax.Array | None, seed: int, data: jax.Array) -> jax.Array:
  """The call's key: ``key``, or ``seed`` folded with a checksum of ``data``.

  ``data`` changes from step to step (a scale vector); where the key must be
  shared (exponential merges) it must also be identical on every worker, as
  a ``pmax`` result is.
  """
  if key is not None:
    return key
  bits = lax.bitcast_convert_type(data.astype(jnp.float32), jnp.uint32)
  checksum = jnp.sum(bits, dtype=jnp.uint32)  # wraps mod 2**32
  return jax.random.fold_in(jax.random.key(seed), checksum)


def uniform(
  key: jax.Array,
  shape: tuple[int, ...],
  noise: str,
  values: jax.Array | None = None,
  *,
  start: int = 0,
  num_rows: int | None = None,
) -> jax.Array:
  """Uniform [0, 1) noise of ``shape`` from ``key``.

  Args:
    key: the PRNG key; equal keys give equal noise.
    shape: the noise's shape.
    noise: ``"hash"`` or ``"threefry"`` (module docstring).
    values: for ``"hash"``, float32 values of ``shape`` whose bits are mixed
      into the hash (the values being rounded); None mixes in zeros.
    start: the rows from ``start`` on of the noise of a larger array of
      ``num_rows`` rows (a block of :func:`map_rows`), equal to that
      noise's rows for equal ``values``.
    num_rows: the larger array's rows (default: ``shape[0]``).

  Returns:
    float32 noise of ``shape``.
  """
  if noise == "threefry":
    rows = shape[0] if num_rows is None else num_rows
    whole = jax.random.uniform(key, (rows, *shape[1:]), jnp.float32)
    return whole[start : start + shape[0]]
  offset = start * math.prod(shape[1:])
  idx = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) + jnp.uint32(
    offset
  )
  return quant.hash_uniform_at(
    idx, jnp.float32(0) if values is None else values, hash_salt(key)
  )


def hash_salt(key: jax.Array) -> jax.Array:
  """The uint32 salt of ``"hash"`` noise drawn from ``key``."""
  return jax.random.bits(key, (), jnp.uint32)


def worker_key(key: jax.Array, axis_name: str) -> jax.Array:
  """``key`` folded with this worker's index: its noise is its own."""
  return jax.random.fold_in(key, lax.axis_index(axis_name))


def worker_uniform(
  key: jax.Array,
  axis_name: str,
  shape: tuple[int, ...],
  noise: str,
  values: jax.Array | None = None,
) -> jax.Array:
  """Uniform [0, 1) noise, independent per worker (see :func:`uniform`)."""
  return uniform(worker_key(key, axis_name), shape, noise, values)
