"""Parameter-free layers that a precision plan can address.

Flax ships layers for every contraction that owns a weight (``nnx.Linear``,
``nnx.Conv``, ``nnx.Einsum``...). The two matmuls inside attention
(``q @ k^T`` and ``p @ v``) contract two activations and have no Flax layer, so
models wrap them in :class:`MatMul`. That gives each one a stable path in the
module tree and an ``einsum_op`` attribute that :func:`qsync_jax.apply_plan`
replaces, exactly as it does for ``nnx.Einsum``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp


class MatMul(nnx.Module):
  """An einsum of two activations whose precision a plan can set.

  Attributes:
    einsum_op: the einsum implementation; ``jnp.einsum`` until a plan replaces
      it with a precision-aware op from :mod:`qsync_jax.numerics.ops`.
  """

  def __init__(self, einsum_op: Callable[..., jax.Array] = jnp.einsum):
    self.einsum_op = einsum_op

  def __call__(
    self, subscripts: str, a: jax.Array, b: jax.Array, **kwargs: Any
  ) -> jax.Array:
    """Returns ``einsum(subscripts, a, b)`` computed by ``self.einsum_op``."""
    return self.einsum_op(subscripts, a, b, **kwargs)
