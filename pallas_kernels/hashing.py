"""The counter-based hash that stands in for a PRNG inside the kernels.

Stochastic rounding (:mod:`pallas_kernels.quantize`) and the Global-QSGD
dither (:mod:`pallas_kernels.gqsgd_encode`) need one uniform number per
element. A Pallas kernel cannot thread a ``jax.random`` key through its grid
cheaply, so the noise is a pure function of the element's flat index, its
value's bit pattern and a salt. This module owns that function; the jnp
numerics (:mod:`qsync_jax.numerics.quant`) import it from here, so the
kernels and the reference rounding draw bit-identical noise.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def hash_uniform_at(idx: jax.Array, x: jax.Array, salt: jax.Array) -> jax.Array:
  """Returns pseudo-random floats in [0, 1) for elements at indices ``idx``.

  ``h = idx * 0x9E3779B9 ^ bits(x) ^ salt`` followed by the ``lowbias32``
  finalizer (C. Wellons, "Prospecting for hash functions", 2018); only
  uint32 multiply, xor and logical shifts, so it runs inside Pallas kernels
  (Triton and interpret mode) as well as in plain jnp.

  Args:
    idx: uint32 flat element indices (wrap mod 2**32).
    x: the values; their float32 bit patterns are mixed in.
    salt: a uint32 scalar (or broadcastable array).

  Returns:
    float32 values of ``x``'s broadcast shape on the 2**-24 grid of [0, 1).
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  h = idx * jnp.uint32(0x9E3779B9) ^ bits ^ salt
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  h = h ^ (h >> 16)
  # The top 24 bits give an exactly representable float32 in [0, 1).
  return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
