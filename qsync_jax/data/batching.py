"""Per-worker batching with unequal batch sizes and stateless step lookup.

This module owns how training examples are dealt to data-parallel workers:
each step's global batch is `sum(batch_sizes)` distinct examples taken from a
per-epoch permutation and split into consecutive per-worker slices. A step's
batches are a pure function of `(seed, step)`, so a resumed run sees exactly
the batches the original run would have, without replaying earlier steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np


class WorkerBatcher:
  """Deals training batches of (possibly unequal) sizes to workers.

  Examples left over after `steps_per_epoch` full global batches are skipped
  for that epoch; since each epoch uses a fresh permutation, different
  examples are skipped in different epochs.

  Attributes:
    batch_sizes: Per-worker batch sizes.
    global_batch_size: `sum(batch_sizes)`.
    steps_per_epoch: Full global batches per pass over the data.
    seed: Seed of the per-epoch permutations.
  """

  def __init__(
    self,
    x: np.ndarray,
    y: np.ndarray,
    batch_sizes: Sequence[int],
    seed: int = 0,
  ):
    """Initializes the batcher.

    Args:
      x: Inputs, leading axis is the example axis.
      y: Targets with the same leading length as `x`.
      batch_sizes: Number of examples per worker per step, one entry per
        worker; entries may differ.
      seed: Seed of the per-epoch permutations.

    Raises:
      ValueError: If `x` and `y` differ in length, `batch_sizes` is empty or
        has a non-positive entry, or the global batch exceeds the dataset.
    """
    if len(x) != len(y):
      raise ValueError(f"x has {len(x)} examples but y has {len(y)}")
    sizes = tuple(int(b) for b in batch_sizes)
    if not sizes:
      raise ValueError("batch_sizes must name at least one worker")
    if any(b <= 0 for b in sizes):
      raise ValueError(f"every batch size must be positive, got {sizes}")
    if sum(sizes) > len(x):
      raise ValueError(
        f"global batch size {sum(sizes)} (sum of {sizes}) exceeds the "
        f"{len(x)} available examples"
      )
    self.x, self.y = x, y
    self.seed = seed
    self.batch_sizes = sizes
    self.global_batch_size = sum(sizes)
    self.steps_per_epoch = len(x) // self.global_batch_size
    self._offsets = np.cumsum(sizes)[:-1]
    # One-entry cache: consecutive steps share an epoch's permutation.
    self._perm: np.ndarray | None
    self._perm_epoch, self._perm = -1, None

  @property
  def num_workers(self) -> int:
    """Number of workers."""
    return len(self.batch_sizes)

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      # Seeding with (seed, epoch) makes each epoch's order independent of
      # every other epoch, hence computable directly.
      rng = np.random.default_rng([self.seed, epoch])
      self._perm, self._perm_epoch = rng.permutation(len(self.x)), epoch
    assert self._perm is not None
    return self._perm

  def step_indices(self, step: int) -> list[np.ndarray]:
    """Returns the example indices of every worker at `step`.

    Args:
      step: Global step, counted from 0 across epochs.

    Returns:
      One int array per worker, worker i's of length `batch_sizes[i]`.

    Raises:
      ValueError: If `step` is negative.
    """
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    epoch, within = divmod(int(step), self.steps_per_epoch)
    start = within * self.global_batch_size
    idx = self._permutation(epoch)[start : start + self.global_batch_size]
    return np.split(idx, self._offsets)

  def step_batches(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Returns `(x_i, y_i)` for every worker i at `step`.

    Args:
      step: Global step, counted from 0 across epochs.

    Returns:
      One `(x_i, y_i)` pair per worker, with `batch_sizes[i]` examples.

    Raises:
      ValueError: If `step` is negative.
    """
    return [(self.x[i], self.y[i]) for i in self.step_indices(step)]


def eval_batches(data: Any, batch_size: int) -> Iterator[Any]:
  """Iterates over all examples exactly once, in order.

  Args:
    data: a pytree of arrays (``(x, y)`` for classification) whose leading
      axis is the example axis.
    batch_size: Examples per batch; the last batch may be smaller.

  Returns:
    An iterator of pytrees like ``data``, sliced along the example axis.

  Raises:
    ValueError: If `batch_size` is not positive or the arrays differ in
      length (raised at call time, not on first iteration).
  """
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  lengths = {len(a) for a in jax.tree.leaves(data)}
  if len(lengths) != 1:
    raise ValueError(
      f"the arrays of an eval set differ in length: {sorted(lengths)}"
    )
  n = lengths.pop()

  def gen():
    for i in range(0, n, batch_size):
      yield jax.tree.map(lambda a, i=i: a[i : i + batch_size], data)

  return gen()
