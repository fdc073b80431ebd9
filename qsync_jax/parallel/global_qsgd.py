"""Global-QSGD: one global scale per bucket, so codes can be summed.

This module owns the two Global-QSGD averagers. Both take each bucket's
scale from the ``pmax`` over workers of its max ``|w_i x_i|`` (the same
scale on every worker), then differ in how the codes travel:
:class:`GlobalQSGD` (standard dithering) rounds to an integer grid and sums
the codes in one integer ``psum``; :class:`GlobalQSGDExp` (exponential
dithering) rounds to signed powers of two and merges them pairwise over
``ppermute``, as XLA collectives take no custom reduction.

Buckets, scales and noise come from :mod:`qsync_jax.parallel.buckets`; the
weights, unbiasedness and non-finite handling follow
:mod:`qsync_jax.parallel.averagers`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

from qsync_jax.numerics import gqsgd_encode as encode_lib
from qsync_jax.parallel import buckets
from qsync_jax.parallel.wire import Reducing
from qsync_jax.parallel.wire import ring_allreduce_bytes

# Integer wire formats of the standard-dithering all-reduce: the largest code
# magnitude the summed type holds.
_WIRE_MAX = {"int8": 127, "int16": 32767, "int32": 2**31 - 1}
# Exponential dithering codes a magnitude 2**-k in 7 bits; k <= 126 keeps
# every decoded power of two a normal float32.
_EXP_MAX_K = 126


def _global_max(
  x: jax.Array, weight: jax.Array, bucket_size: int | None, axis_name: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Buckets ``w_i x_i`` and finds every bucket's max over all workers.

  Returns:
    ``(yb, m, bad)``: this worker's bucketed ``w_i x_i``; the ``pmax`` over
    workers of each bucket's max ``|w_i x_i|`` (inf where any worker's
    bucket holds a non-finite value); and the buckets where ``m`` is not
    finite.
  """
  x = x.astype(jnp.float32)
  xb = buckets.to_buckets(x, bucket_size)
  m = lax.pmax(buckets.absmax(x, bucket_size, weight), axis_name)
  return xb * weight, m, ~jnp.isfinite(m)


@dataclasses.dataclass(frozen=True)
class GlobalQSGD(Reducing):
  """Global-QSGD with standard dithering: one integer ``psum`` of codes.

  Per bucket of ``bucket_size`` elements every worker uses the same scale
  ``M / s``, with ``M`` the ``pmax`` over workers of the bucket's
  ``max |w_i x_i|``, and rounds ``w_i x_i`` stochastically to the integer
  grid (unbiased). ``s = floor(qmax / n)`` levels per worker, so the sum of
  ``n`` codes, each ``|q_i| <= s``, never exceeds ``n s <= qmax`` and the
  integer all-reduce cannot wrap. The official code (sands-lab/global-qsgd,
  ``standard_dithering_hook``) uses ``127 / n`` levels, which rounds up to
  ``ceil(127 / n)`` and wraps (e.g. 4 workers at the maximum sum to 128 with
  probability 0.75**4); a wrapped int8 ``psum`` is silent in XLA as in NCCL.

  Variance: with independent rounding the mean's per-element variance is at
  most ``n (M / s)**2 / 4``; the per-worker resolution coarsens as ``n``
  grows, which the int16 and int32 wires offset.

  References:
    Xin, Canini, Richtarik, Horvath, "Quantize Once, Train Fast:
    Allreduce-Compatible Compression with Provable Guarantees",
    arXiv 2305.18627 (Algorithm 1, standard dithering Global-L_s with the
    l_inf norm).

  Attributes:
    wire: ``"int8"``, ``"int16"`` or ``"int32"``: the summed integer type.
    bucket_size: elements sharing one scale (``None``: one per call). Finer
      buckets are more accurate and cost one float32 per bucket in the
      scale ``pmax``.
    seed: seeds the rounding noise when no ``key`` is passed.
    noise: ``"hash"`` or ``"threefry"``: how the rounding noise is drawn
      (:mod:`qsync_jax.parallel.buckets`). With ``"hash"`` a worker's codes
      are ``pallas_kernels.gqsgd_encode`` of its bucketed ``w_i x_i``, with
      the worker's salt as ``seed``, and the kernel itself encodes them
      where the kernel backend says so: on a CUDA GPU (sm_80+) under
      ``QSYNC_KERNELS=auto``, everywhere under ``pallas``, never under
      ``xla`` (:mod:`qsync_jax.numerics.gqsgd_encode`, which also lists
      what makes ``auto`` keep jnp and ``pallas`` raise).
    name: the strategy's name.
  """

  wire: str = "int8"
  bucket_size: int | None = 1 << 16
  seed: int = 0
  noise: str = "hash"
  name: str = "gqsgd"

  def __post_init__(self):
    if self.wire not in _WIRE_MAX:
      raise ValueError(
        f"GlobalQSGD wire must be one of {sorted(_WIRE_MAX)}, got {self.wire!r}"
      )
    buckets.check_bucket_size(self.bucket_size)
    buckets.check_noise(self.noise)

  def levels(self, num_workers: int) -> int:
    """Levels per worker, ``floor(qmax / n)`` (capped at 2**24).

    Raises:
      ValueError: the wire cannot hold one level for each of ``n`` workers.
    """
    s = min(_WIRE_MAX[self.wire] // num_workers, buckets.MAX_LEVELS)
    if s < 1:
      raise ValueError(
        f"a {self.wire} wire sums at most {_WIRE_MAX[self.wire]} workers' "
        f"codes without overflow, got {num_workers} workers; use a wider "
        "wire"
      )
    return s

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``, ``sent`` this worker's decoded codes.

    Arguments as for :meth:`qsync_jax.parallel.wire.Averager.reduce`.

    Raises:
      ValueError: more workers than the wire has levels for, or
        ``QSYNC_KERNELS=pallas`` where the encode kernel cannot run
        (``noise="threefry"``, a GPU below sm_80).
    """
    s = self.levels(lax.axis_size(axis_name))
    yb, m, bad = _global_max(x, weight, self.bucket_size, axis_name)
    scale = jnp.where((m > 0) & ~bad, m / s, 1.0)[:, None]
    wkey = buckets.worker_key(buckets.base_key(key, self.seed, m), axis_name)
    if encode_lib.use_kernel(self.noise, yb.shape):
      q = encode_lib.encode(yb, m, s, buckets.hash_salt(wkey), self.wire)
    else:

      def encode(xb: jax.Array, start: int) -> jax.Array:
        rows = slice(start, start + xb.shape[0])
        v = xb * weight / scale[rows]
        u = buckets.uniform(
          wkey, v.shape, self.noise, v, start=start, num_rows=len(m)
        )
        # |y| / scale <= s up to the rounding of m / s; the clip keeps that
        # last ulp from ever producing the code s + 1. A non-finite bucket
        # sends codes 0, as the kernel does (its mean is NaN either way).
        q = jnp.clip(jnp.floor(v + u), -s, s)
        return jnp.where(bad[rows, None], 0.0, q).astype(self.wire)

      # Row blocks, not the padded rows: XLA:CPU encodes through a pad
      # several times slower.
      q = buckets.map_rows(encode, x.astype(jnp.float32), self.bucket_size)
    total = lax.psum(q, axis_name)
    # NaN in the decode scale marks the non-finite buckets in the same pass.
    mean = total.astype(jnp.float32) * buckets.nan_where(bad, scale)
    sent = q.astype(jnp.float32) * scale
    return buckets.from_buckets(mean, x), buckets.from_buckets(sent, x)

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Ring all-reduce of the codes plus the float32 scale ``pmax``."""
    code_bytes = jnp.dtype(self.wire).itemsize
    scales = buckets.num_buckets(num_elements, self.bucket_size)
    return ring_allreduce_bytes(
      code_bytes * num_elements, num_workers
    ) + ring_allreduce_bytes(4.0 * scales, num_workers)


def _exp_compress(a: jax.Array, u: jax.Array) -> jax.Array:
  """Rounds ``a`` (``|a| <= 1/2``) to a signed power of two, unbiasedly.

  ``|a| = m 2**e`` with ``m`` in [1/2, 1) lies between ``2**(e-1)`` and
  ``2**e``; rounding up with probability ``2m - 1`` keeps the mean.

  Returns:
    uint8 codes: ``k`` in bits 0-6 for magnitude ``2**-k`` (0: zero), the
    sign in bit 7. Magnitudes below ``2**-126`` flush to zero, a bias far
    below float32 resolution of the bucket's scale.
  """
  mant, e = jnp.frexp(jnp.abs(a))
  k = jnp.where(u < 2 * mant - 1, -e, 1 - e)
  k = jnp.where((a == 0) | (k > _EXP_MAX_K), 0, k)
  return _exp_pack(k, (a < 0) & (k > 0))


def _exp_pack(k: jax.Array, negative: jax.Array) -> jax.Array:
  """uint8 codes of magnitudes ``2**-k`` (bits 0-6) and signs (bit 7)."""
  return k.astype(jnp.uint8) | (negative.astype(jnp.uint8) << 7)


def _exp_decode(code: jax.Array) -> jax.Array:
  """float32 values of :func:`_exp_compress` codes."""
  k = (code & 127).astype(jnp.int32)
  mag = jnp.where(k == 0, 0.0, jnp.ldexp(jnp.float32(1), -k))
  return jnp.where(code >> 7 == 1, -mag, mag)


def _exp_merge(a: jax.Array, b: jax.Array, u: jax.Array) -> jax.Array:
  """Unbiased power-of-two rounding of the sum of two codes.

  With ``2**-k`` the larger magnitude and ``d`` the exponent gap: equal signs
  give ``2**-(k-1)`` with probability ``2**-d``, else ``2**-k``; opposite
  signs give 0 when ``d == 0``, else ``2**-(k+1)`` with probability
  ``2**-(d-1)``, else ``2**-k``, with the larger operand's sign. The rule is
  symmetric in ``a`` and ``b``, so both workers of a pair compute the same
  code from the same ``u``.
  """
  ka, kb = (a & 127).astype(jnp.int32), (b & 127).astype(jnp.int32)
  sa, sb = a >> 7, b >> 7
  k_big, d = jnp.minimum(ka, kb), jnp.abs(ka - kb)
  s_big = jnp.where(ka <= kb, sa, sb)
  same = sa == sb
  p = jnp.ldexp(jnp.float32(1), jnp.where(same, -d, 1 - d))
  bump = (u < p).astype(jnp.int32)
  merged = _exp_pack(jnp.where(same, k_big - bump, k_big + bump), s_big == 1)
  merged = jnp.where(~same & (d == 0), jnp.uint8(0), merged)
  return jnp.where(ka == 0, b, jnp.where(kb == 0, a, merged))


@dataclasses.dataclass(frozen=True)
class GlobalQSGDExp(Reducing):
  """Global-QSGD with exponential dithering, merged by recursive doubling.

  Every worker normalizes ``w_i x_i`` by ``N = 2 n M`` (``M`` the global
  bucket max, so ``|a_i| <= 1/(2n)``), rounds it to a signed power of two
  (uint8 code) and the codes are summed over ``log2 n`` butterfly stages of
  ``lax.ppermute``: at stage ``t`` worker ``i`` swaps codes with
  ``i ^ 2**t`` and both replace them with the unbiased power-of-two rounding
  of their sum. A power-of-two sum of two values at most doubles the larger
  one, so after all stages ``|sum| <= 1/2`` and the 7-bit exponent never
  reaches 0. The merge noise of stage ``t`` is keyed by ``(t, i >> (t+1))``,
  the block of ``2**(t+1)`` workers that now share one value, and zero has a
  single code, so every replica ends bit-identical. XLA collectives take no
  custom reduction, hence the butterfly rather than a ``psum``; it sends
  ``log2 n`` full vectors per worker, against about two for a ring.

  Variance: each merge multiplies the second moment by at most 9/8,
  compounding over ``log2 n`` stages (about ``n**0.17``), but the
  resolution does not coarsen with ``n`` as standard dithering's does.

  References:
    Xin, Canini, Richtarik, Horvath, arXiv 2305.18627 (exponential
    dithering Global-E_s and its pairwise reduction, after natural
    compression, Horvath et al., arXiv 1905.10988).

  Attributes:
    bucket_size: elements sharing one scale (``None``: one per call).
    seed: seeds the rounding noise when no ``key`` is passed.
    noise: ``"hash"`` or ``"threefry"`` (:mod:`qsync_jax.parallel.buckets`).
      A merge's noise comes from the pair's shared key alone (with
      ``"hash"``: zeros mixed in), so both workers of a pair draw the same
      values.
    name: the strategy's name.
  """

  bucket_size: int | None = 1 << 16
  seed: int = 0
  noise: str = "hash"
  name: str = "gqsgd_exp"

  def __post_init__(self):
    buckets.check_bucket_size(self.bucket_size)
    buckets.check_noise(self.noise)

  @staticmethod
  def _stages(num_workers: int) -> int:
    if num_workers < 1 or num_workers & (num_workers - 1):
      raise ValueError(
        "exponential dithering merges pairwise and needs a "
        f"power-of-two number of workers, got {num_workers}"
      )
    return num_workers.bit_length() - 1

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``, ``sent`` this worker's decoded codes.

    Arguments as for :meth:`qsync_jax.parallel.wire.Averager.reduce`.

    Raises:
      ValueError: the number of workers is not a power of two.
    """
    n = lax.axis_size(axis_name)
    stages = self._stages(n)
    yb, m, bad = _global_max(x, weight, self.bucket_size, axis_name)
    norm = jnp.where((m > 0) & ~bad, 2.0 * n * m, 1.0)[:, None]
    compress_key, merge_key = jax.random.split(
      buckets.base_key(key, self.seed, m)
    )
    a = yb / norm
    sent = _exp_compress(
      a,
      buckets.worker_uniform(compress_key, axis_name, yb.shape, self.noise, a),
    )
    code, worker = sent, lax.axis_index(axis_name)
    for t in range(stages):
      partner = lax.ppermute(
        code, axis_name, [(i, i ^ (1 << t)) for i in range(n)]
      )
      block_key = jax.random.fold_in(
        jax.random.fold_in(merge_key, t), worker >> (t + 1)
      )
      code = _exp_merge(
        code, partner, buckets.uniform(block_key, yb.shape, self.noise)
      )
    mean = buckets.nan_where(bad, _exp_decode(code) * norm)
    return (
      buckets.from_buckets(mean, x),
      buckets.from_buckets(_exp_decode(sent) * norm, x),
    )

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """``log2 n`` uint8 vectors plus the float32 scale ``pmax``."""
    scales = buckets.num_buckets(num_elements, self.bucket_size)
    return self._stages(num_workers) * float(
      num_elements
    ) + ring_allreduce_bytes(4.0 * scales, num_workers)
