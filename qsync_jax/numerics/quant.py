"""Quantization primitives: scales, rounding, int8 and fp8 casts.

Numerics follow QSync's LP-PyTorch backend (arXiv 2407.02327; QSync's
official code, bytedance/QSync, ``qsync/LpTorch/quant.py``):
symmetric quantization with zero point 0, ``scale = amax / 127`` for INT8,
per tensor by default and per channel as an option. Rounding is
round-to-nearest by default; ``truncate`` reproduces QSync's CUDA kernel
(``pytorch/quantization/minimax_cuda_kernel.cu``:
``static_cast<int8_t>(x / scale)``) and ``stochastic`` rounds up with
probability equal to the fractional part, which is unbiased.

Stochastic rounding draws its noise from a counter-based hash of each element's
index and bit pattern (``lowbias32``), not from ``jax.random``: it needs no key
threaded through Flax layers, costs a few integer ops per element (far fewer
than Threefry's rounds), and is the same function the Pallas quantize kernel
computes (it lives in :mod:`pallas_kernels.hashing`). Pass ``key`` to use
``jax.random`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import enum

import jax
from jax import lax
import jax.numpy as jnp

# The hash lives with the kernels, which may import nothing from qsync_jax;
# rounding here and in the kernels then draws the same noise bit for bit.
from pallas_kernels.hashing import hash_uniform_at

#: The largest int8 code of symmetric quantization.
INT8_MAX = 127


class Rounding(enum.Enum):
  """How a scaled value is rounded to an integer."""

  NEAREST = "nearest"
  STOCHASTIC = "stochastic"
  TRUNCATE = "truncate"


class Granularity(enum.Enum):
  """Which elements share one scale.

  ``TENSOR``: one scale per tensor. ``CHANNEL``: one scale per slice along the
  non-contracting axes of each operand, i.e. per output channel of a weight
  and per row (per example for a conv input) of an activation, as AQT's
  ``CalibrationMode.CONTRACTING_AXIS``. Scales then factor out of the
  contraction, so the int32 accumulator is dequantized by an outer product.
  """

  TENSOR = "tensor"
  CHANNEL = "channel"


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """How INT8 and FP8 layers quantize their operands.

  Attributes:
    granularity: per-tensor or per-channel scales.
    rounding: rounding of the forward operands (INT8 only; FP8 casts round to
      nearest).
  """

  granularity: Granularity = Granularity.TENSOR
  rounding: Rounding = Rounding.NEAREST

  def __post_init__(self):
    object.__setattr__(
      self, "granularity", _parse(Granularity, self.granularity)
    )
    object.__setattr__(self, "rounding", _parse(Rounding, self.rounding))

  def to_dict(self) -> dict:
    return {
      "granularity": self.granularity.value,
      "rounding": self.rounding.value,
    }

  @classmethod
  def from_dict(cls, data: Mapping) -> QuantConfig:
    if not isinstance(data, Mapping):
      raise ValueError(f"'quant' must be an object, got {data!r}")
    unknown = set(data) - {"granularity", "rounding"}
    if unknown:
      raise ValueError(
        f"unknown quant keys {sorted(unknown)}; valid keys: "
        "granularity, rounding"
      )
    return cls(**data)


def _parse(enum_cls, value):
  if isinstance(value, enum_cls):
    return value
  try:
    return enum_cls(value)
  except ValueError:
    raise ValueError(
      f"unknown {enum_cls.__name__.lower()} {value!r}; valid: "
      f"{', '.join(m.value for m in enum_cls)}"
    ) from None


def absmax_scale(
  x: jax.Array, qmax: float, reduce_axes: Sequence[int] | None = None
) -> jax.Array:
  """Returns the symmetric scale ``amax(|x|) / qmax`` in float32.

  Args:
    x: the tensor to quantize.
    qmax: the largest representable magnitude (127 for INT8, 448 for e4m3).
    reduce_axes: axes sharing one scale; ``None`` for one scale per tensor.
      The result keeps reduced axes as size 1 so it broadcasts against ``x``.

  Returns:
    A float32 scale; all-zero slices get scale 1 so they quantize to 0, and
    slices holding a NaN or an infinity get a NaN or infinite scale, so the
    quantized layer's output is not finite either (loss scaling then skips
    the step) instead of the bad value being rounded into a valid code.
  """
  axes = tuple(range(x.ndim)) if reduce_axes is None else tuple(reduce_axes)
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
  # XLA:CPU's max-reduction can drop NaN (jax 0.10, large rows): test for it.
  amax = jnp.where(
    jnp.any(jnp.isnan(x), axis=axes, keepdims=True), jnp.nan, amax
  )
  if reduce_axes is None:
    amax = amax.reshape(())
  return jnp.where(amax == 0, 1.0, amax / qmax).astype(jnp.float32)


def hash_uniform(x: jax.Array, salt: int = 0) -> jax.Array:
  """Returns pseudo-random floats in [0, 1), one per element of ``x``.

  Each value is a ``lowbias32`` hash of the element's flat index, its float32
  bit pattern and ``salt`` (:func:`pallas_kernels.hashing.hash_uniform_at`),
  so equal values at different positions get independent noise and no PRNG
  key is needed.
  """
  idx = lax.iota(jnp.uint32, x.size).reshape(x.shape)
  return hash_uniform_at(idx, x, jnp.uint32(salt & 0xFFFFFFFF))


def round_values(
  v: jax.Array,
  rounding: Rounding | str,
  *,
  salt: int = 0,
  key: jax.Array | None = None,
) -> jax.Array:
  """Rounds float32 values to integers (still float32) by ``rounding``.

  Args:
    v: scaled values.
    rounding: nearest (half to even), stochastic, or truncate (toward zero).
    salt: mixed into the stochastic-rounding hash (use distinct salts for
      tensors that should get independent noise).
    key: if given, stochastic noise comes from ``jax.random.uniform(key)``.
  """
  rounding = _parse(Rounding, rounding)
  if rounding is Rounding.NEAREST:
    return jnp.round(v)
  if rounding is Rounding.TRUNCATE:
    return jnp.trunc(v)
  noise = (
    jax.random.uniform(key, v.shape, jnp.float32)
    if key is not None
    else hash_uniform(v, salt)
  )
  return jnp.floor(v + noise)


def quantize_int8(
  x: jax.Array,
  scale: jax.Array,
  rounding: Rounding | str = Rounding.NEAREST,
  *,
  salt: int = 0,
  key: jax.Array | None = None,
) -> jax.Array:
  """Quantizes ``x`` to int8 with a given scale: ``clip(round(x / scale))``.

  Returns:
    An int8 array of ``x``'s shape, values in [-127, 127].
  """
  v = x.astype(jnp.float32) / scale
  q = round_values(v, rounding, salt=salt, key=key)
  return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8)


def quantize(
  x: jax.Array,
  reduce_axes: Sequence[int] | None = None,
  rounding: Rounding | str = Rounding.NEAREST,
  *,
  salt: int = 0,
  key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Quantizes ``x`` to int8 with an absmax scale.

  Args:
    x: the tensor.
    reduce_axes: axes sharing a scale (``None``: per tensor).
    rounding: see :func:`round_values`.
    salt: stochastic-rounding hash salt.
    key: optional PRNG key for stochastic rounding.

  Returns:
    ``(q, scale)`` with ``x ~= q * scale``.
  """
  scale = absmax_scale(x, INT8_MAX, reduce_axes)
  return quantize_int8(x, scale, rounding, salt=salt, key=key), scale


def dequantize(
  q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32
) -> jax.Array:
  """Returns ``q * scale`` in ``dtype``."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


FP8_FORWARD = jnp.float8_e4m3fn
FP8_GRADIENT = jnp.float8_e5m2


def quantize_fp8(
  x: jax.Array,
  dtype: jnp.dtype = FP8_FORWARD,
  reduce_axes: Sequence[int] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Casts ``x`` to an fp8 type after scaling its amax to the type's maximum.

  As in ``flax.linen.fp8_ops`` (current scaling, no amax history): e4m3 for
  forward operands, e5m2 for gradients.

  Returns:
    ``(q, scale)`` with ``x ~= q.astype(f32) * scale``.
  """
  fmax = float(jnp.finfo(dtype).max)
  scale = absmax_scale(x, fmax, reduce_axes)
  q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)
  return q, scale
