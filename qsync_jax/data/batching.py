"""Per-worker batching with unequal batch sizes and stateless step lookup.

This module owns how training examples are dealt to data-parallel workers:
each step's global batch is `sum(batch_sizes)` distinct examples taken from a
per-epoch permutation and split into consecutive per-worker slices. A step's
batches are a pure function of `(seed, step)`, so a resumed run sees exactly
the batches the original run would have, without replaying earlier steps.
The examples are read by index: from arrays, or from any
:class:`IndexedExamples` (a Grain ``MapDataset``, read per step). It also
owns the evaluation batches (:func:`eval_batches`: arrays sliced in order, or
a :class:`BatchStream` read once).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np


class IndexedExamples(Protocol):
  """Examples read by index: what :meth:`WorkerBatcher.over` deals.

  ``len()`` is the number of examples; ``read(indices)`` returns the
  ``(inputs, labels)`` arrays of those examples, in that order.
  """

  def __len__(self) -> int: ...

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class ArrayExamples:
  """:class:`IndexedExamples` over in-memory arrays.

  Args:
    x: Inputs, leading axis is the example axis.
    y: Targets with the same leading length as `x`.

  Raises:
    TypeError: If `x` or `y` is an array of objects.
    ValueError: If `x` and `y` differ in length, or `x` holds NaN or
      infinity.
  """

  def __init__(self, x: np.ndarray, y: np.ndarray):
    for name, a in (("x", x), ("y", y)):
      if getattr(getattr(a, "dtype", None), "kind", "") == "O":
        raise TypeError(
          f"{name} is an array of objects; convert it to numbers first "
          "(np.asarray(..., np.float32), or np.int32 for class ids)"
        )
    if len(x) != len(y):
      raise ValueError(f"x has {len(x)} examples but y has {len(y)}")
    check_finite(np.asarray(x), "x")
    self.x, self.y = x, y

  def __len__(self) -> int:
    return len(self.x)

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The examples at ``indices``, by numpy indexing."""
    return self.x[indices], self.y[indices]


def check_finite(x: np.ndarray, what: str, examples: bool = True) -> None:
  """Raises ``ValueError`` where floating-point inputs ``x`` hold NaN or
  infinity (they would make every loss and gradient NaN), naming the
  first example that does where ``x`` holds ``examples`` (one per entry of
  its leading axis) rather than one."""
  if not np.issubdtype(x.dtype, np.inexact) or np.isfinite(x).all():
    return
  where = ""
  if examples and x.ndim:
    bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    count = int(bad.sum())
    where = (
      f" at example {int(np.argmax(bad))} ({count} example"
      f"{'s' if count > 1 else ''})"
    )
  raise ValueError(
    f"{what}: its inputs are not finite (NaN or infinity){where}; clean or "
    "drop those examples"
  )


def check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
  """``batch_sizes`` as ints, checked.

  Raises:
    ValueError: If `batch_sizes` is empty or has a non-positive entry.
  """
  sizes = tuple(int(b) for b in batch_sizes)
  if not sizes:
    raise ValueError("batch_sizes must name at least one worker")
  if any(b <= 0 for b in sizes):
    raise ValueError(f"every batch size must be positive, got {sizes}")
  return sizes


class WorkerBatcher:
  """Deals training batches of (possibly unequal) sizes to workers.

  Examples left over after `steps_per_epoch` full global batches are skipped
  for that epoch; since each epoch uses a fresh permutation, different
  examples are skipped in different epochs. The position in the data is the
  step itself, so a checkpoint needs none (:meth:`state_dict` is empty).

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
    self._setup(ArrayExamples(x, y), batch_sizes, seed)

  @classmethod
  def over(
    cls,
    examples: IndexedExamples,
    batch_sizes: Sequence[int],
    seed: int = 0,
  ) -> WorkerBatcher:
    """A batcher that reads ``examples`` by index, step by step.

    The same permutations and slices as over arrays: examples that hold the
    same data as arrays give the same batches.

    Args:
      examples: the training examples (e.g. a Grain ``MapDataset`` wrapped
        by :class:`qsync_jax.data.StreamedDataset`).
      batch_sizes: Number of examples per worker per step.
      seed: Seed of the per-epoch permutations.

    Returns:
      The batcher.

    Raises:
      ValueError: If `batch_sizes` is empty or has a non-positive entry, or
        the global batch exceeds the examples.
    """
    batcher = cls.__new__(cls)
    batcher._setup(examples, batch_sizes, seed)
    return batcher

  def _setup(
    self, examples: IndexedExamples, batch_sizes: Sequence[int], seed: int
  ) -> None:
    sizes = check_batch_sizes(batch_sizes)
    n = len(examples)
    if sum(sizes) > n:
      raise ValueError(
        f"global batch size {sum(sizes)} (sum of {sizes}) exceeds the "
        f"{n} available examples"
      )
    self.examples = examples
    self.seed = seed
    self.batch_sizes = sizes
    self.global_batch_size = sum(sizes)
    self.steps_per_epoch = n // self.global_batch_size
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
      self._perm = rng.permutation(len(self.examples))
      self._perm_epoch = epoch
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
    return [self.examples.read(i) for i in self.step_indices(step)]

  def worker_batches(
    self, step: int, workers: Sequence[int]
  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The batches of ``workers`` at ``step``, reading only theirs.

    Args:
      step: Global step, counted from 0 across epochs.
      workers: Worker indices (a process's local workers).

    Returns:
      ``{worker: (x, y)}``.

    Raises:
      ValueError: If `step` is negative.
    """
    indices = self.step_indices(step)
    return {i: self.examples.read(indices[i]) for i in workers}

  def upcoming(
    self, step: int, count: int, workers: Sequence[int]
  ) -> Iterator[dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The batches of steps ``step`` to ``step + count - 1``, lazily.

    Reading them changes nothing: training still gets them at their steps.

    Args:
      step: The first step.
      count: How many steps.
      workers: Worker indices.

    Returns:
      A generator of :meth:`worker_batches` results.
    """
    for s in range(step, step + count):
      yield self.worker_batches(s, workers)

  def state_dict(self) -> dict[str, Any]:
    """The data position a checkpoint holds: none, the step is it."""
    return {}

  def load_state_dict(self, state: Mapping[str, Any] | None, step: int) -> None:
    """Restores :meth:`state_dict` output: nothing to restore.

    Args:
      state: what :meth:`state_dict` returned (or None: a checkpoint from
        before data positions were saved).
      step: the restored step.
    """
    del state, step


@runtime_checkable
class BatchStream(Protocol):
  """An evaluation set read batch by batch in order, once per pass (a
  streamed dataset's test split): what :func:`eval_batches` takes besides
  arrays."""

  def batches(self, batch_size: int) -> Iterator[Any]: ...


def eval_batches(data: Any, batch_size: int) -> Iterator[Any]:
  """Iterates over all examples exactly once, in order.

  Args:
    data: a pytree of arrays (``(x, y)`` for classification) whose leading
      axis is the example axis, or a :class:`BatchStream`.
    batch_size: Examples per batch; the last batch may be smaller.

  Returns:
    An iterator of pytrees like ``data``, sliced along the example axis.

  Raises:
    ValueError: If `batch_size` is not positive or the arrays differ in
      length (raised at call time, not on first iteration).
  """
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}")
  if isinstance(data, BatchStream):
    return data.batches(batch_size)
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
