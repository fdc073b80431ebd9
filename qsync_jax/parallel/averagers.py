"""Averaging strategies run inside ``shard_map`` over the workers' axis.

This module owns how worker arrays are combined on the wire: the weighted
mean ``sum_i w_i x_i`` (``sum_i w_i = 1``: equal weights for plain data
parallelism, ``b_i / sum(b)`` for dynamic batch sizing), the number formats
and collectives used for it, and the byte count each worker sends.

Every strategy is a frozen dataclass with

* ``__call__(x, weight, axis_name, key=None) -> mean``: run inside
  ``jax.shard_map`` (or ``jax.vmap(..., axis_name=...)``) with this worker's
  array ``x`` and scalar ``weight``; every worker gets the same ``mean``;
* ``reduce(x, weight, axis_name, key=None) -> (mean, sent)``: also returns
  ``sent``, the decoded value of what this worker put on the wire (its
  compressed ``w_i x_i``), which error feedback needs;
* ``wire_bytes(num_elements, num_workers) -> float``: bytes each worker
  sends per call;
* ``name``.

Strategies: :class:`MeanAverager` (float32 ``psum``), :class:`CastAverager`
(fp16 / bf16 ``psum``), :class:`GlobalQSGD` (standard dithering with a global
scale and an integer ``psum``), :class:`GlobalQSGDExp` (exponential dithering
merged pairwise over ``ppermute``), :class:`QSGD` (per-worker scale and
``all_gather``), plus :func:`compress_with_feedback` (error feedback) and
:func:`make_averager`.

Weights and unbiasedness. Every quantizer compresses the weighted
contribution ``y_i = w_i x_i``, never ``x_i`` with the weight applied later:
an integer ``psum`` mixes the codes of all workers, so a per-worker weight
cannot be applied after it, and a scale taken from ``max |x|`` with codes
``n w_i x_i / scale`` would overflow for any ``w_i > 1/n``. With the scale
taken from ``max_i max |y_i|`` the codes stay unbiased
(``E[q_i] scale = w_i x_i``) and bounded (``|q_i| <= s``) for any weights.

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
the salt with :func:`qsync_jax.numerics.quant.hash_uniform_at` (the counter hash of
the Pallas kernels; for Global-QSGD the codes equal those of
``pallas_kernels.gqsgd_encode`` with ``seed`` the salt). ``"threefry"``
draws ``jax.random.uniform(key, shape)``. Both give 24 (hash) or 23
(threefry) random bits per element, so rounding is unbiased to float32
resolution, and workers with distinct keys get unrelated noise. The hash
is a few integer operations per element, fused into the quantizer's pass;
XLA:CPU spends about 35 ns of CPU per element on threefry (jax 0.10, 2**24
elements), about ten times a float32 copy and several times the rest of
Global-QSGD, which made it slower than the float32 mean
(``experiments.benches.compression``). The hash is a statistical generator, not
a cryptographic one, which stochastic rounding does not need.

Non-finite inputs (an overflowing loss-scaled FP16 gradient) stay non-finite
in the mean, so the trainer's finiteness check still skips the step: the
quantizers, which would otherwise turn ``inf`` into finite codes, set every
affected bucket to NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol

import jax
from jax import lax
import jax.numpy as jnp

from qsync_jax.numerics import quant

# Integer wire formats of the standard-dithering all-reduce: the largest code
# magnitude the summed type holds.
_WIRE_MAX = {"int8": 127, "int16": 32767, "int32": 2**31 - 1}
# float32 holds every integer up to 2**24 exactly; more levels than that add
# no resolution to a float32 gradient and would make the float-to-int cast
# of the largest codes inexact.
_MAX_LEVELS = 2**24
# Exponential dithering codes a magnitude 2**-k in 7 bits; k <= 126 keeps
# every decoded power of two a normal float32.
_EXP_MAX_K = 126
# How a key becomes per-element uniform noise (module docstring).
_NOISES = ("hash", "threefry")


class Averager(Protocol):
  """What the trainer needs from an averaging strategy."""

  name: str

  def __call__(self, x: jax.Array, weight: jax.Array, axis_name: str,
               key: jax.Array | None = None) -> jax.Array:
    ...

  def reduce(self, x: jax.Array, weight: jax.Array, axis_name: str,
             key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    ...

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    ...


class _Reducing:
  """Gives a strategy ``__call__`` from its ``reduce``."""

  def __call__(self, x: jax.Array, weight: jax.Array, axis_name: str,
               key: jax.Array | None = None) -> jax.Array:
    """Returns ``sum_i weight_i * x_i`` over ``axis_name`` (float32)."""
    return self.reduce(x, weight, axis_name, key)[0]


def ring_allreduce_bytes(payload_bytes: float, num_workers: int) -> float:
  """Bytes each worker sends in a ring all-reduce of ``payload_bytes``.

  A ring all-reduce is a reduce-scatter then an all-gather, each sending
  ``(n - 1) / n`` of the payload per worker.
  """
  if num_workers <= 1:
    return 0.0
  return 2.0 * (num_workers - 1) / num_workers * payload_bytes


def ring_allgather_bytes(payload_bytes: float, num_workers: int) -> float:
  """Bytes each worker sends in a ring all-gather of ``payload_bytes`` each.

  Every worker forwards ``n - 1`` payloads around the ring.
  """
  return max(num_workers - 1, 0) * payload_bytes


def _num_buckets(num_elements: int, bucket_size: int | None) -> int:
  if bucket_size is None or num_elements <= bucket_size:
    return 1
  return -(-num_elements // bucket_size)


def _to_buckets(y: jax.Array, bucket_size: int | None) -> jax.Array:
  """Flattens ``y`` into ``(num_buckets, bucket)`` rows, zero padded."""
  flat = y.reshape(-1)
  nb = _num_buckets(flat.size, bucket_size)
  width = max(-(-flat.size // nb), 1)
  return jnp.pad(flat, (0, nb * width - flat.size)).reshape(nb, width)


def _from_buckets(yb: jax.Array, like: jax.Array) -> jax.Array:
  return yb.reshape(-1)[:like.size].reshape(like.shape)


def _bucket_absmax(yb: jax.Array, weight: jax.Array | float = 1.0
                   ) -> jax.Array:
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
  """
  neg_inf, pos_inf = jnp.array(-jnp.inf, yb.dtype), jnp.array(jnp.inf,
                                                              yb.dtype)
  hi, lo = lax.reduce(
      (yb, yb), (neg_inf, pos_inf),
      lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])), (1,))
  m = jnp.maximum(hi, -lo) * jnp.abs(weight)
  return jnp.where(jnp.isnan(m), jnp.inf, m)


def _base_key(key: jax.Array | None, seed: int,
              data: jax.Array) -> jax.Array:
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


def _check_noise(noise: str) -> None:
  if noise not in _NOISES:
    raise ValueError(f"noise must be one of {list(_NOISES)}, got {noise!r}")


def _uniform(key: jax.Array, shape: tuple[int, ...], noise: str,
             values: jax.Array | None = None) -> jax.Array:
  """Uniform [0, 1) noise of ``shape`` from ``key``.

  Args:
    key: the PRNG key; equal keys give equal noise.
    shape: the noise's shape.
    noise: ``"hash"`` or ``"threefry"`` (module docstring).
    values: for ``"hash"``, float32 values of ``shape`` whose bits are mixed
      into the hash (the values being rounded); None mixes in zeros.
  """
  if noise == "threefry":
    return jax.random.uniform(key, shape, jnp.float32)
  salt = jax.random.bits(key, (), jnp.uint32)
  idx = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
  return quant.hash_uniform_at(
      idx, jnp.float32(0) if values is None else values, salt)


def _worker_uniform(key: jax.Array, axis_name: str, shape: tuple[int, ...],
                    noise: str, values: jax.Array | None = None
                    ) -> jax.Array:
  """Uniform [0, 1) noise, independent per worker (see :func:`_uniform`)."""
  worker_key = jax.random.fold_in(key, lax.axis_index(axis_name))
  return _uniform(worker_key, shape, noise, values)


def _nan_where(bad: jax.Array, values: jax.Array) -> jax.Array:
  """Sets the rows of ``values`` flagged in ``bad`` (one per row) to NaN."""
  return jnp.where(bad[:, None], jnp.nan, values)


@dataclasses.dataclass(frozen=True)
class MeanAverager(_Reducing):
  """Weighted mean in float32: one ``psum`` of ``w_i * x_i``."""

  name: str = "mean"

  def reduce(self, x: jax.Array, weight: jax.Array, axis_name: str,
             key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, w_i x_i)``; ``key`` is unused (exact arithmetic)."""
    del key
    y = x.astype(jnp.float32) * weight
    return lax.psum(y, axis_name), y

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Bytes per worker for one average of ``num_elements`` floats."""
    return ring_allreduce_bytes(4.0 * num_elements, num_workers)


@dataclasses.dataclass(frozen=True)
class CastAverager(_Reducing):
  """Weighted mean with a float16 or bfloat16 wire format.

  Each worker casts ``w_i x_i`` to ``dtype`` and the ``psum`` runs in that
  dtype, as PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook`` do
  (weighting before the cast plays the role of their pre-division by the
  world size, keeping the sum in range). The all-reduce must really run in
  the low dtype to model the wire (jax#27496: where the cast sits decides
  the reduction's precision), so the cast comes before the ``psum`` and the
  result is cast back afterwards. JAX emits the all-reduce in ``dtype``;
  XLA:CPU keeps float16 but promotes a bfloat16 all-reduce to float32 (one
  rounding of the exact sum), while NCCL on GPU sums bfloat16 natively.

  Precision: each contribution is rounded once (relative error <= 2**-11 for
  float16, 2**-8 for bfloat16) and every partial sum of the all-reduce is
  rounded again, so the error grows with the number of workers. float16
  overflows beyond 65504: with dynamic loss scaling an overflow shows up as
  ``inf`` and the step is skipped, as for an FP16 gradient.

  Attributes:
    dtype: ``"float16"`` or ``"bfloat16"``.
    name: defaults to ``"fp16"`` / ``"bf16"``.
  """

  dtype: str = "float16"
  name: str = ""

  def __post_init__(self):
    names = {"float16": "fp16", "bfloat16": "bf16"}
    if self.dtype not in names:
      raise ValueError(f"CastAverager dtype must be one of {sorted(names)}, "
                       f"got {self.dtype!r}")
    if not self.name:
      object.__setattr__(self, "name", names[self.dtype])

  def reduce(self, x: jax.Array, weight: jax.Array, axis_name: str,
             key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``; ``key`` is unused (rounding to nearest)."""
    del key
    low = (x.astype(jnp.float32) * weight).astype(self.dtype)
    return (lax.psum(low, axis_name).astype(jnp.float32),
            low.astype(jnp.float32))

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Ring all-reduce bytes at 2 bytes per element."""
    return ring_allreduce_bytes(2.0 * num_elements, num_workers)


@dataclasses.dataclass(frozen=True)
class GlobalQSGD(_Reducing):
  """Global-QSGD with standard dithering: one integer ``psum`` of codes.

  Per bucket of ``bucket_size`` elements every worker uses the same scale
  ``M / s``, with ``M`` the ``pmax`` over workers of the bucket's
  ``max |w_i x_i|``, and rounds ``w_i x_i`` stochastically to the integer
  grid (unbiased). ``s = floor(qmax / n)`` levels per worker, so the sum of
  ``n`` codes, each ``|q_i| <= s``, never exceeds ``n s <= qmax`` and the
  integer all-reduce cannot wrap. The reference code uses ``127 / n`` levels,
  which rounds up to ``ceil(127 / n)`` and wraps (e.g. 4 workers at the
  maximum sum to 128 with probability 0.75**4); a wrapped int8 ``psum`` is
  silent in XLA as in NCCL.

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
      (module docstring). With ``"hash"`` a worker's codes are
      ``pallas_kernels.gqsgd_encode`` of its bucketed ``w_i x_i``, with the
      worker's salt as ``seed``.
    name: the strategy's name.
  """

  wire: str = "int8"
  bucket_size: int | None = 1 << 16
  seed: int = 0
  noise: str = "hash"
  name: str = "gqsgd"

  def __post_init__(self):
    if self.wire not in _WIRE_MAX:
      raise ValueError(f"GlobalQSGD wire must be one of {sorted(_WIRE_MAX)}, "
                       f"got {self.wire!r}")
    if self.bucket_size is not None and self.bucket_size < 1:
      raise ValueError(f"bucket_size must be positive, got {self.bucket_size}")
    _check_noise(self.noise)

  def levels(self, num_workers: int) -> int:
    """Levels per worker, ``floor(qmax / n)`` (capped at 2**24).

    Raises:
      ValueError: the wire cannot hold one level for each of ``n`` workers.
    """
    s = min(_WIRE_MAX[self.wire] // num_workers, _MAX_LEVELS)
    if s < 1:
      raise ValueError(
          f"a {self.wire} wire sums at most {_WIRE_MAX[self.wire]} workers' "
          f"codes without overflow, got {num_workers} workers; use a wider "
          "wire")
    return s

  def reduce(self, x: jax.Array, weight: jax.Array, axis_name: str,
             key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``, ``sent`` this worker's decoded codes.

    Args:
      x: this worker's array.
      weight: this worker's weight.
      axis_name: the workers' axis.
      key: PRNG key, the same on every worker; fresh per call.

    Raises:
      ValueError: more workers than the wire has levels for.
    """
    s = self.levels(lax.axis_size(axis_name))
    xb = _to_buckets(x.astype(jnp.float32), self.bucket_size)
    m = lax.pmax(_bucket_absmax(xb, weight), axis_name)
    yb = xb * weight
    bad = ~jnp.isfinite(m)
    scale = jnp.where((m > 0) & ~bad, m / s, 1.0)[:, None]
    v = yb / scale
    u = _worker_uniform(_base_key(key, self.seed, m), axis_name, yb.shape,
                        self.noise, v)
    # |y| / scale <= s up to the rounding of m / s; the clip keeps that
    # last ulp from ever producing the code s + 1.
    q = jnp.clip(jnp.floor(v + u), -s, s)
    total = lax.psum(q.astype(self.wire), axis_name)
    # NaN in the decode scale marks the non-finite buckets in the same pass.
    mean = total.astype(jnp.float32) * jnp.where(bad[:, None], jnp.nan, scale)
    return _from_buckets(mean, x), _from_buckets(q * scale, x)

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Ring all-reduce of the codes plus the float32 scale ``pmax``."""
    code_bytes = jnp.dtype(self.wire).itemsize
    scales = _num_buckets(num_elements, self.bucket_size)
    return (ring_allreduce_bytes(code_bytes * num_elements, num_workers)
            + ring_allreduce_bytes(4.0 * scales, num_workers))


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
  return (k.astype(jnp.uint8) | (negative.astype(jnp.uint8) << 7))


def _exp_decode(code: jax.Array) -> jax.Array:
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
class GlobalQSGDExp(_Reducing):
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
    noise: ``"hash"`` or ``"threefry"`` (module docstring). A merge's noise
      comes from the pair's shared key alone (with ``"hash"``: zeros mixed
      in), so both workers of a pair draw the same values.
    name: the strategy's name.
  """

  bucket_size: int | None = 1 << 16
  seed: int = 0
  noise: str = "hash"
  name: str = "gqsgd_exp"

  def __post_init__(self):
    if self.bucket_size is not None and self.bucket_size < 1:
      raise ValueError(f"bucket_size must be positive, got {self.bucket_size}")
    _check_noise(self.noise)

  @staticmethod
  def _stages(num_workers: int) -> int:
    if num_workers < 1 or num_workers & (num_workers - 1):
      raise ValueError("exponential dithering merges pairwise and needs a "
                       f"power-of-two number of workers, got {num_workers}")
    return num_workers.bit_length() - 1

  def reduce(self, x: jax.Array, weight: jax.Array, axis_name: str,
             key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``, ``sent`` this worker's decoded codes.

    Args:
      x: this worker's array.
      weight: this worker's weight.
      axis_name: the workers' axis.
      key: PRNG key, the same on every worker; fresh per call.

    Raises:
      ValueError: the number of workers is not a power of two.
    """
    n = lax.axis_size(axis_name)
    stages = self._stages(n)
    xb = _to_buckets(x.astype(jnp.float32), self.bucket_size)
    m = lax.pmax(_bucket_absmax(xb, weight), axis_name)
    yb = xb * weight
    bad = ~jnp.isfinite(m)
    norm = jnp.where((m > 0) & ~bad, 2.0 * n * m, 1.0)[:, None]
    compress_key, merge_key = jax.random.split(_base_key(key, self.seed, m))
    a = yb / norm
    sent = _exp_compress(
        a, _worker_uniform(compress_key, axis_name, yb.shape, self.noise, a))
    code, worker = sent, lax.axis_index(axis_name)
    for t in range(stages):
      partner = lax.ppermute(code, axis_name,
                             [(i, i ^ (1 << t)) for i in range(n)])
      block_key = jax.random.fold_in(jax.random.fold_in(merge_key, t),
                                     worker >> (t + 1))
      code = _exp_merge(code, partner,
                        _uniform(block_key, yb.shape, self.noise))
    mean = _nan_where(bad, _exp_decode(code) * norm)
    return _from_buckets(mean, x), _from_buckets(_exp_decode(sent) * norm, x)

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """``log2 n`` uint8 vectors plus the float32 scale ``pmax``."""
    scales = _num_buckets(num_elements, self.bucket_size)
    return (self._stages(num_workers) * float(num_elements)
            + ring_allreduce_bytes(4.0 * scales, num_workers))


def _code_dtype(levels: int) -> str:
  return "int8" if levels <= 127 else "int16" if levels <= 32767 else "int32"


@dataclasses.dataclass(frozen=True)
class QSGD(_Reducing):
  """QSGD baseline: per-worker scales, so codes are gathered, not summed.

  Each worker scales each bucket of ``w_i x_i`` by its own norm, rounds
  ``s |y| / norm`` stochastically to an integer (unbiased, ``|q| <= s``),
  and ``all_gather`` sends the codes (int8 for ``s <= 127``) and the float32
  norms to every worker, which dequantizes and sums them in worker order
  (so the replicas agree bit for bit). Without Elias coding, as in the
  Global-QSGD authors' ``qsgd_hook``.

  References:
    Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient
    SGD via Gradient Quantization and Encoding", arXiv 1610.02132.

  Attributes:
    levels: ``s``, the number of positive levels (1 to 2**24).
    norm: ``"l2"`` (the paper's) or ``"linf"`` (the Global-QSGD baseline's).
    bucket_size: elements sharing one norm (``None``: one per call).
    seed: seeds the rounding noise when no ``key`` is passed.
    noise: ``"hash"`` or ``"threefry"`` (module docstring).
    name: the strategy's name.
  """

  levels: int = 127
  norm: str = "l2"
  bucket_size: int | None = 512
  seed: int = 0
  noise: str = "hash"
  name: str = "qsgd"

  def __post_init__(self):
    if not 1 <= self.levels <= _MAX_LEVELS:
      raise ValueError(f"QSGD levels must be in [1, {_MAX_LEVELS}], got "
                       f"{self.levels}")
    if self.norm not in ("l2", "linf"):
      raise ValueError(f"QSGD norm must be 'l2' or 'linf', got {self.norm!r}")
    if self.bucket_size is not None and self.bucket_size < 1:
      raise ValueError(f"bucket_size must be positive, got {self.bucket_size}")
    _check_noise(self.noise)

  def reduce(self, x: jax.Array, weight: jax.Array, axis_name: str,
             key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``, ``sent`` this worker's decoded codes.

    Args:
      x: this worker's array.
      weight: this worker's weight.
      axis_name: the workers' axis.
      key: PRNG key, the same on every worker; fresh per call.
    """
    xb = _to_buckets(x.astype(jnp.float32), self.bucket_size)
    yb = xb * weight
    if self.norm == "l2":
      norm = jnp.sqrt(jnp.sum(yb * yb, axis=1))
    else:
      norm = _bucket_absmax(xb, weight)
    # A non-finite bucket has a non-finite norm (a NaN or inf element makes
    # the sum of squares or the max non-finite); a NaN norm makes every
    # decoded value of that bucket NaN on all workers.
    norm = jnp.where(jnp.isfinite(norm), norm, jnp.nan)
    scale = (jnp.where(norm == 0, 1.0, norm) / self.levels)[:, None]
    # No shared value exists before the gather: the local norms vary the
    # default key per step and fold_in(axis_index) separates the workers.
    v = yb / scale
    u = _worker_uniform(_base_key(key, self.seed, norm), axis_name, yb.shape,
                        self.noise, v)
    q = jnp.clip(jnp.floor(v + u), -self.levels, self.levels)
    codes = lax.all_gather(q.astype(_code_dtype(self.levels)), axis_name)
    scales = lax.all_gather(scale, axis_name)
    mean = jnp.sum(codes.astype(jnp.float32) * scales, axis=0)
    return _from_buckets(mean, x), _from_buckets(q * scale, x)

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """All-gather of the codes and one float32 norm per bucket."""
    code_bytes = jnp.dtype(_code_dtype(self.levels)).itemsize
    payload = (code_bytes * num_elements
               + 4.0 * _num_buckets(num_elements, self.bucket_size))
    return ring_allgather_bytes(payload, num_workers)


def compress_with_feedback(averager: Averager, x: jax.Array,
                           residual: jax.Array, weight: jax.Array,
                           axis_name: str, key: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """Averages with error feedback: re-sends what compression dropped.

  The worker sends ``p = w_i x_i + residual`` (through ``averager`` with
  weight 1) and keeps ``p - sent`` for the next call, so the compression
  error telescopes instead of accumulating: over ``T`` calls the sum of the
  means differs from the sum of the exact means by the final residuals only.
  Only the local compression error is fed back (the exponential merges' and
  the low-precision partial sums' errors are shared and not attributable).
  The residual is per-worker state in units of ``w_i x_i``; the caller (the
  trainer) carries it between steps, starting from zeros.

  References:
    Seide et al., "1-Bit Stochastic Gradient Descent ..." (Interspeech
    2014); Karimireddy et al., "Error Feedback Fixes SignSGD ...",
    arXiv 1901.09847.

  Args:
    averager: any strategy of this module.
    x: this worker's array.
    residual: this worker's residual from the previous call.
    weight: this worker's weight.
    axis_name: the workers' axis.
    key: optional PRNG key, as for the averager.

  Returns:
    ``(mean, new_residual)``.
  """
  p = x.astype(jnp.float32) * weight + residual
  mean, sent = averager.reduce(p, jnp.float32(1), axis_name, key)
  return mean, p - sent


_FACTORIES: dict[str, Callable[..., Any]] = {
    "none": MeanAverager,
    "fp32": MeanAverager,
    "mean": MeanAverager,
    "fp16": functools.partial(CastAverager, "float16"),
    "bf16": functools.partial(CastAverager, "bfloat16"),
    "gqsgd": GlobalQSGD,
    "gqsgd_exp": GlobalQSGDExp,
    "qsgd": QSGD,
}


def make_averager(name: str, **kwargs: Any) -> Averager:
  """Builds an averaging strategy by name.

  Args:
    name: one of none, fp32, mean (float32 mean), fp16, bf16, gqsgd,
      gqsgd_exp, qsgd.
    **kwargs: the strategy's dataclass fields (e.g. ``wire="int16"``).

  Returns:
    The strategy.

  Raises:
    ValueError: an unknown name.
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown averager {name!r}; valid: "
                     f"{', '.join(_FACTORIES)}")
  return _FACTORIES[name](**kwargs)
