"""One flat vector from a pytree of computed arrays, without a slow fusion.

This module owns :func:`ravel`, the flat vector of a gradient (or any pytree
computed in the same program) that the trainer averages and the indicator
measures. It gives what ``jax.flatten_util.ravel_pytree(tree)[0]`` gives,
element for element.

Why not ``ravel_pytree``: it builds the vector with one ``concatenate``, and
XLA:CPU fuses the leaves' producers into that concatenate's loop. For a
gradient, a producer is a layer's weight gradient, a ``dot`` whose
contraction is the batch: fused, it runs as a naive loop instead of a GEMM
(also behind ``lax.optimization_barrier``). :func:`ravel` writes each leaf
into its slice of a zero vector with ``lax.dynamic_update_slice``; XLA
updates that buffer in place and keeps the dots as GEMMs.
(``python -m experiments.trainer_bench``'s wide CNN case measures the
trainer's step with it.)
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp


def ravel(tree: Any) -> jax.Array:
  """The pytree's leaves raveled and joined in ``jax.tree.leaves`` order.

  Args:
    tree: a pytree of arrays (a gradient, an update).

  Returns:
    A 1-D array of every leaf's elements in their common dtype (as
    ``jax.flatten_util.ravel_pytree(tree)[0]``; empty for a tree without
    leaves).
  """
  leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  dtype = jnp.result_type(*leaves)
  out = jnp.zeros((sum(leaf.size for leaf in leaves),), dtype)
  offset = 0
  for leaf in leaves:
    out = lax.dynamic_update_slice(out, leaf.astype(dtype).ravel(), (offset,))
    offset += leaf.size
  return out
