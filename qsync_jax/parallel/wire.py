"""The contract every averager meets, and what its collectives send.

This module owns the :class:`Averager` protocol the trainer programs against,
the optional :class:`Stateful` protocol of an averager that carries state from
one call to the next, the :class:`Reducing` mixin that derives an averager's
``__call__`` from its ``reduce``, and the byte counts of the two collectives
the averagers send over (ring all-reduce, ring all-gather), from which each
averager's ``wire_bytes`` is built.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax


class Averager(Protocol):
  """What the trainer needs from an averaging strategy.

  ``__call__`` and ``reduce`` run inside ``jax.shard_map`` (or
  ``jax.vmap(..., axis_name=...)``) with this worker's array ``x`` and scalar
  ``weight``; every worker gets the same mean. ``reduce`` also returns
  ``sent``, the decoded value of what this worker put on the wire (its
  compressed ``w_i x_i``), which error feedback needs. ``wire_bytes`` is the
  bytes each worker sends per call.
  """

  @property
  def name(self) -> str:
    """The strategy's name."""
    ...

  def __call__(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> jax.Array: ...

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Averages over ``axis_name``, keeping what this worker sent.

    Args:
      x: this worker's array.
      weight: this worker's weight.
      axis_name: the workers' axis.
      key: PRNG key, the same on every worker; fresh per call. None
        derives it from the strategy's ``seed`` and the step's scales
        (:mod:`qsync_jax.parallel.buckets`).

    Returns:
      ``(mean, sent)``: the float32 mean, the same on every worker, and the
      decoded value of what this worker put on the wire.
    """
    ...

  def wire_bytes(self, num_elements: int, num_workers: int) -> float: ...

  def __hash__(self) -> int:
    """Averagers are hashable (frozen dataclasses): compiled programs and
    measurements are cached by them."""
    ...


class Stateful(Protocol):
  """What an averager that carries state between calls adds to
  :class:`Averager`.

  Only stateful averagers implement it (PowerSGD's warm start); the callers
  that thread the state (:func:`~qsync_jax.parallel.averagers.average`, the
  trainer's programs, :func:`~qsync_jax.parallel.transform.averaged`) get it
  from :func:`~qsync_jax.parallel.averagers.init_state`, which gives None for
  every other averager, and a None state is never passed here. The state is
  a pytree of arrays the same on every worker; the trainer stacks it per
  worker and checkpoints it.
  """

  def init_state(self, num_elements: int) -> Any:
    """The state before the first call on ``num_elements`` elements.

    Returns:
      A pytree of arrays, or None where this instance carries no state (then
      the callers use ``reduce``).
    """
    ...

  def reduce_with_state(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None,
    state: Any,
  ) -> tuple[jax.Array, jax.Array, Any]:
    """:meth:`Averager.reduce` that also reads and returns the state.

    Args:
      x, weight, axis_name, key: as for :meth:`Averager.reduce`.
      state: what the previous call returned (first: ``init_state``).

    Returns:
      ``(mean, sent, new_state)``.
    """
    ...


class Reducing:
  """Gives a strategy ``__call__`` from its ``reduce``."""

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """:meth:`Averager.reduce`, which every strategy defines."""
    raise NotImplementedError

  def __call__(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> jax.Array:
    """Returns ``sum_i weight_i * x_i`` over ``axis_name`` (float32)."""
    return self.reduce(x, weight, axis_name, key)[0]


def ring_allreduce_bytes(payload_bytes: float, num_workers: int) -> float:
  """Bytes each worker sends in a ring all-reduce of ``payload_bytes``.

  A ring all-reduce is a reduce-scatter then an all-gather, each sending
  ``(n - 1) / n`` of the payload per worker.

  Args:
    payload_bytes: the bytes of the array being all-reduced.
    num_workers: the workers in the ring.

  Returns:
    Bytes per worker (0 for a single worker).
  """
  if num_workers <= 1:
    return 0.0
  return 2.0 * (num_workers - 1) / num_workers * payload_bytes


def ring_allgather_bytes(payload_bytes: float, num_workers: int) -> float:
  """Bytes each worker sends in a ring all-gather of ``payload_bytes`` each.

  Every worker forwards ``n - 1`` payloads around the ring.

  Args:
    payload_bytes: the bytes each worker contributes.
    num_workers: the workers in the ring.

  Returns:
    Bytes per worker.
  """
  return max(num_workers - 1, 0) * payload_bytes
