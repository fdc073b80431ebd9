"""Averaging strategies run inside ``shard_map`` over the workers' axis.

An averager turns each worker's local array into the weighted mean over all
workers, ``sum_i w_i x_i`` with ``sum_i w_i = 1`` (equal weights for plain
data parallelism, ``b_i / sum(b)`` for dynamic batch sizing), and reports the
bytes each worker puts on the wire for it. Compressed strategies (FP16/BF16
wire formats, Global-QSGD) implement the same two methods.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax


def ring_allreduce_bytes(payload_bytes: float, num_workers: int) -> float:
  """Bytes each worker sends in a ring all-reduce of ``payload_bytes``.

  A ring all-reduce is a reduce-scatter then an all-gather, each sending
  ``(n - 1) / n`` of the payload per worker.
  """
  if num_workers <= 1:
    return 0.0
  return 2.0 * (num_workers - 1) / num_workers * payload_bytes


@dataclasses.dataclass(frozen=True)
class MeanAverager:
  """Weighted mean in float32: one ``psum`` of ``w_i * x_i``."""

  name: str = "mean"

  def __call__(self, x: jax.Array, weight: jax.Array,
               axis_name: str) -> jax.Array:
    """Returns ``sum_i weight_i * x_i`` over ``axis_name`` (float32)."""
    return lax.psum(x.astype("float32") * weight, axis_name)

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Bytes per worker for one average of ``num_elements`` floats."""
    return ring_allreduce_bytes(4.0 * num_elements, num_workers)
