"""A user's Grain datasets, read as training goes.

This module owns the data a dataset factory returns as Grain datasets:
:class:`StreamedDataset` holds the two splits. A ``grain.MapDataset`` is read
by index, step by step, through :class:`~qsync_jax.data.WorkerBatcher`'s
per-epoch permutations (the position in the data is the step, as for
arrays); a ``grain.IterDataset`` is iterated in its own order by
:class:`StreamBatcher`, whose position (the epoch and the Grain iterator's
state) a checkpoint holds. Neither is read whole: a training step reads its
examples, sizing the model reads the first ones (:meth:`StreamedDataset.head`)
and evaluation reads the test split batch by batch. Every example read is
checked against the first example's shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
import functools
import json
from typing import Any, NoReturn

import numpy as np

from qsync_jax.data.base import Dataset
from qsync_jax.data.batching import ArrayExamples
from qsync_jax.data.batching import check_batch_sizes
from qsync_jax.data.batching import check_finite
from qsync_jax.data.batching import WorkerBatcher

#: How a split is held: ``(inputs, labels)`` arrays, a ``grain.MapDataset``
#: or a ``grain.IterDataset``.
SPLIT_KINDS = ("arrays", "map", "iter")


class FactoryError(ValueError):
  """A user's dataset factory, its module, or its dataset as it is read,
  raised.

  The message names the factory and the exception in one line; the
  exception itself is the ``__cause__``, its traceback starting in the
  user's code. ``show_cause`` tells a binary to print that traceback above
  its ``error:`` line (:func:`qsync_jax.cli.bad_input_exits`).
  """

  show_cause = True


def one_line(err: BaseException) -> str:
  """An exception's message on one line."""
  return " ".join(str(err).split()) or "(no message)"


def user_code_failed(err: BaseException, what: str, doing: str) -> NoReturn:
  """Raises a :class:`FactoryError` naming ``what`` raised ``err`` while
  ``doing``; its cause is ``err`` without the caller's frame, so its
  traceback starts in the user's code."""
  tb = err.__traceback__
  cause = err.with_traceback(tb.tb_next if tb is not None else None)
  raise FactoryError(
    f"{what} raised {type(err).__name__} {doing}: {one_line(err)} (its "
    "traceback is above)"
  ) from cause


def _read(read: Callable[[], Any], what: str) -> Any:
  """``read()``: one example from a user's dataset, an exception it raises
  (other than the end of an iterator) a :class:`FactoryError`."""
  try:
    return read()
  except StopIteration:
    raise
  except Exception as err:  # the user's dataset failed
    user_code_failed(err, what, "as it was read")


def split_kind(split: Any) -> str | None:
  """Which of :data:`SPLIT_KINDS` ``split`` is, or None for none of them.

  Grain is imported only for a value that is not a tuple or list.
  """
  if isinstance(split, (tuple, list)):
    return "arrays"
  import grain  # local: only a Grain dataset needs it

  if isinstance(split, grain.MapDataset):
    return "map"
  if isinstance(split, grain.IterDataset):
    return "iter"
  return None


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
  """The shapes and dtypes of every example: the first example's.

  Attributes:
    x_shape: One example's inputs.
    y_shape: One example's labels.
    x_dtype: The inputs' dtype; batches are cast to it.
    y_dtype: The labels' dtype; batches are cast to it.
  """

  x_shape: tuple[int, ...]
  y_shape: tuple[int, ...]
  x_dtype: np.dtype
  y_dtype: np.dtype

  @classmethod
  def of(cls, x: np.ndarray, y: np.ndarray) -> ExampleSpec:
    """The spec of one example's ``(inputs, labels)``."""
    return cls(tuple(x.shape), tuple(y.shape), x.dtype, y.dtype)


def as_example(
  example: Any, what: str, integer_labels: bool
) -> tuple[np.ndarray, np.ndarray]:
  """One example as ``(inputs, labels)`` numpy arrays, checked.

  Args:
    example: what the dataset gave.
    what: the example, for messages (``"dataset 'm:f', split 'train',
      example 3"``).
    integer_labels: the labels must be non-negative integers (the default
      classification objective's class ids).

  Returns:
    ``(inputs, labels)``.

  Raises:
    ValueError: a hole (None), not an ``(inputs, labels)`` pair, arrays
      that are not numbers, or labels that are not class ids.
  """
  if example is None:
    raise ValueError(
      f"{what} is None (a MapDataset's filter() leaves holes; call "
      ".to_iter_dataset() on it to skip them)"
    )
  if not isinstance(example, (tuple, list)) or len(example) != 2:
    raise ValueError(
      f"{what} is a {type(example).__name__}; examples must be "
      "(inputs, labels) pairs"
    )
  try:
    x, y = np.asarray(example[0]), np.asarray(example[1])
  except ValueError as err:  # ragged nested lists
    raise ValueError(
      f"{what} holds arrays of inconsistent shapes ({err})"
    ) from None
  for name, a in (("inputs", x), ("labels", y)):
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
      raise ValueError(f"{what}: its {name} are not numbers (dtype {a.dtype})")
  check_finite(x, what, examples=False)
  check_labels(y, what, integer_labels)
  return x, y


def check_labels(y: np.ndarray, what: str, integer_labels: bool) -> None:
  """Raises ``ValueError`` where ``integer_labels`` and ``y`` are not
  non-negative integers (class ids)."""
  if not integer_labels:
    return
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(
      f"{what}: its labels are {y.dtype}, not integers; the default "
      "classification loss needs integer class ids (a loss_fn takes other "
      "labels)"
    )
  if y.size and int(y.min()) < 0:
    raise ValueError(f"{what}: a label is negative ({int(y.min())})")


def stack_examples(
  pairs: Sequence[tuple[np.ndarray, np.ndarray]],
  spec: ExampleSpec,
  what: Callable[[int], str],
) -> tuple[np.ndarray, np.ndarray]:
  """Stacks examples into one batch in ``spec``'s dtypes.

  Args:
    pairs: ``(inputs, labels)`` of each example.
    spec: the shapes every example must have.
    what: the ``k``-th example, for messages.

  Returns:
    ``(inputs, labels)`` with a leading example axis.

  Raises:
    ValueError: an example whose shapes differ from ``spec``'s.
  """
  for k, (x, y) in enumerate(pairs):
    if x.shape != spec.x_shape or y.shape != spec.y_shape:
      raise ValueError(
        f"{what(k)} has inputs of shape {x.shape} and labels of shape "
        f"{y.shape}; the first example's are {spec.x_shape} and "
        f"{spec.y_shape}"
      )
  xs = np.stack([x for x, _ in pairs]).astype(spec.x_dtype, copy=False)
  ys = np.stack([y for _, y in pairs]).astype(spec.y_dtype, copy=False)
  return xs, ys


class MapExamples:
  """:class:`~qsync_jax.data.IndexedExamples` over a ``grain.MapDataset``.

  Args:
    dataset: the ``MapDataset``.
    spec: the shapes every example must have.
    what: the split, for messages.
    integer_labels: see :func:`as_example`.
  """

  def __init__(
    self, dataset: Any, spec: ExampleSpec, what: str, integer_labels: bool
  ):
    self.dataset = dataset
    self.spec = spec
    self.what = what
    self.integer_labels = integer_labels

  def __len__(self) -> int:
    return len(self.dataset)

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The examples at ``indices``, read one by one and stacked.

    Raises:
      ValueError: an example that is not an ``(inputs, labels)`` pair of
        the first example's shapes.
    """
    idx = [int(i) for i in indices]
    pairs = [
      as_example(
        _read(
          functools.partial(self.dataset.__getitem__, i),
          f"{self.what}, example {i}",
        ),
        f"{self.what}, example {i}",
        self.integer_labels,
      )
      for i in idx
    ]
    return stack_examples(
      pairs, self.spec, lambda k: f"{self.what}, example {idx[k]}"
    )


class _Cursor:
  """A position in a ``grain.IterDataset``: its iterator, the epoch and the
  full global batches read in that epoch."""

  def __init__(
    self,
    dataset: Any,
    what: str,
    epoch: int = 0,
    batches: int = 0,
    iterator_state: Any = None,
  ):
    self.dataset = dataset
    self.what = what
    self.epoch = epoch
    self.batches = batches
    self.iterator = iter(dataset)
    if iterator_state is not None:
      self.iterator.set_state(iterator_state)

  def state(self) -> dict[str, Any]:
    return {
      "epoch": self.epoch,
      "batches_in_epoch": self.batches,
      "iterator": self.iterator.get_state(),
    }

  def copy(self) -> _Cursor:
    return _Cursor(
      self.dataset,
      self.what,
      self.epoch,
      self.batches,
      self.iterator.get_state(),
    )

  def take(self, count: int) -> list[Any]:
    """The next ``count`` examples; an epoch's last partial batch is
    dropped and the dataset iterated again from its start."""
    out: list[Any] = []
    while len(out) < count:
      try:
        out.append(_read(lambda: next(self.iterator), self.what))
      except StopIteration:
        if self.batches == 0:
          raise ValueError(
            f"{self.what}: one pass yields {len(out)} examples, fewer than "
            f"a global batch of {count}"
          ) from None
        self.epoch, self.batches, out = self.epoch + 1, 0, []
        self.iterator = iter(self.dataset)
    self.batches += 1
    return out


class StreamBatcher:
  """Deals a ``grain.IterDataset``'s examples to workers, in its order.

  Each step takes the next ``sum(batch_sizes)`` examples and splits them
  into consecutive per-worker slices, as :class:`~qsync_jax.data.WorkerBatcher`
  splits a permuted global batch. When the dataset ends, the examples short
  of a global batch are dropped and it is iterated again from its start (an
  epoch; shuffle across epochs inside the dataset, e.g. with
  ``repeat()``). Steps are read in order; :meth:`state_dict` is the
  position a checkpoint holds, so a resumed run reads on from the same
  example.

  Attributes:
    batch_sizes: Per-worker batch sizes.
    global_batch_size: `sum(batch_sizes)`.
    step: The next step to read.
  """

  def __init__(
    self,
    dataset: Any,
    batch_sizes: Sequence[int],
    spec: ExampleSpec,
    what: str,
    integer_labels: bool = False,
  ):
    """Initializes the batcher at step 0.

    Args:
      dataset: the ``grain.IterDataset``.
      batch_sizes: Number of examples per worker per step.
      spec: the shapes every example must have.
      what: the split, for messages.
      integer_labels: see :func:`as_example`.

    Raises:
      ValueError: bad batch sizes, a dataset shorter than one global batch
        (its first global batch is read from a copy, to tell before
        training), or an iterator whose state is not JSON (a checkpoint
        holds it as JSON).
    """
    self.batch_sizes = check_batch_sizes(batch_sizes)
    self.global_batch_size = sum(self.batch_sizes)
    self.spec = spec
    self.what = what
    self.integer_labels = integer_labels
    self._dataset = dataset
    self._offsets = np.cumsum((0, *self.batch_sizes))
    self._cursor = _Cursor(dataset, what)
    self.step = 0
    try:
      json.dumps(self._cursor.state())
    except TypeError as err:
      raise ValueError(
        f"{what}: its iterator's state cannot be checkpointed ({err})"
      ) from None
    self._cursor.copy().take(self.global_batch_size)

  @property
  def num_workers(self) -> int:
    """Number of workers."""
    return len(self.batch_sizes)

  def _check_step(self, step: int) -> None:
    if step != self.step:
      raise ValueError(
        f"{self.what} is read in order: step {step} was asked where the "
        f"stream is at step {self.step}"
      )

  def _split(
    self, examples: list[Any], workers: Sequence[int], epoch: int
  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for i in workers:
      lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])

      def what(k: int, lo: int = lo) -> str:
        return f"{self.what}, epoch {epoch}, example {lo + k} of its step"

      pairs = [
        as_example(e, what(k), self.integer_labels)
        for k, e in enumerate(examples[lo:hi])
      ]
      out[i] = stack_examples(pairs, self.spec, what)
    return out

  def worker_batches(
    self, step: int, workers: Sequence[int]
  ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Reads step ``step``'s global batch; returns ``workers``' slices.

    Args:
      step: must be :attr:`step`, the next one.
      workers: Worker indices (a process's local workers).

    Returns:
      ``{worker: (x, y)}``.

    Raises:
      ValueError: another step than the next, a dataset shorter than one
        global batch, or a bad example.
    """
    self._check_step(step)
    examples = self._cursor.take(self.global_batch_size)
    self.step += 1
    return self._split(examples, workers, self._cursor.epoch)

  def step_batches(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every worker's ``(x, y)`` at ``step`` (the next step), in order."""
    return list(self.worker_batches(step, range(self.num_workers)).values())

  def upcoming(
    self, step: int, count: int, workers: Sequence[int]
  ) -> Iterator[dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The batches of the ``count`` steps from ``step`` (the next step),
    read from a copy of the iterator: training still gets them.

    Raises:
      ValueError: another step than the next (when iterated).
    """
    self._check_step(step)
    cursor = self._cursor.copy()
    for _ in range(count):
      examples = cursor.take(self.global_batch_size)
      yield self._split(examples, workers, cursor.epoch)

  def state_dict(self) -> dict[str, Any]:
    """The position a checkpoint holds (JSON): the next step, the epoch,
    the full batches read in it and the Grain iterator's state."""
    return {"stream": {"step": self.step, **self._cursor.state()}}

  def load_state_dict(self, state: Mapping[str, Any] | None, step: int) -> None:
    """Moves to the position :meth:`state_dict` returned.

    Args:
      state: the checkpoint's data position.
      step: the checkpoint's step.

    Raises:
      ValueError: a checkpoint without a position in this stream, or one at
        another step, or an iterator state the dataset refuses.
    """
    stream = (state or {}).get("stream")
    if not isinstance(stream, Mapping) or stream.get("step") != step:
      raise ValueError(
        f"the checkpoint of step {step} holds no position in {self.what} "
        "(it was written by a run over other data); resume with the data "
        "it was written with, or start a new run directory"
      )
    try:
      cursor = _Cursor(
        self._dataset,
        self.what,
        int(stream["epoch"]),
        int(stream["batches_in_epoch"]),
        stream["iterator"],
      )
    except Exception as err:  # the dataset's own set_state refused it
      raise ValueError(
        f"{self.what} cannot be moved to the checkpoint's position at step "
        f"{step}: {type(err).__name__}: {err}"
      ) from err
    self._cursor, self.step = cursor, step


def first_examples(
  split: Any, kind: str, n: int, what: str
) -> Iterator[tuple[int, Any]]:
  """``(index, example)`` of the first ``n`` examples of a Grain split
  (``what``, for messages: an exception the split raises as it is read is
  a :class:`FactoryError` naming it)."""
  if kind == "map":
    for i in range(min(n, len(split))):
      yield i, _read(functools.partial(split.__getitem__, i), what)
    return
  iterator = _read(lambda: iter(split), what)
  for i in range(n):
    try:
      example = _read(lambda: next(iterator), what)
    except StopIteration:
      return
    yield i, example


class TestSplit:
  """A streamed dataset's test split, read batch by batch in order
  (a :class:`~qsync_jax.data.BatchStream`).

  Args:
    split: ``(inputs, labels)`` arrays, a ``grain.MapDataset`` or a
      ``grain.IterDataset``.
    kind: which of :data:`SPLIT_KINDS`.
    spec: the shapes every example must have.
    what: the split, for messages.
    integer_labels: see :func:`as_example`.
  """

  def __init__(
    self,
    split: Any,
    kind: str,
    spec: ExampleSpec,
    what: str,
    integer_labels: bool,
  ):
    self.split, self.kind, self.spec = split, kind, spec
    self.what, self.integer_labels = what, integer_labels

  def batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, ...]]:
    """One pass over the split in batches of ``batch_size`` (the last
    smaller)."""
    if self.kind == "arrays":
      x, y = self.split
      for i in range(0, len(x), batch_size):
        yield x[i : i + batch_size], y[i : i + batch_size]
      return
    chunk: list[tuple[int, Any]] = []
    for item in first_examples(
      self.split, self.kind, np.iinfo(np.int64).max, self.what
    ):
      chunk.append(item)
      if len(chunk) == batch_size:
        yield self._stack(chunk)
        chunk = []
    if chunk:
      yield self._stack(chunk)

  def _stack(self, chunk: list[tuple[int, Any]]) -> tuple[np.ndarray, ...]:
    names = [f"{self.what}, example {i}" for i, _ in chunk]
    pairs = [
      as_example(e, name, self.integer_labels)
      for (_, e), name in zip(chunk, names)
    ]
    return stack_examples(pairs, self.spec, names.__getitem__)


@dataclasses.dataclass(frozen=True)
class StreamedDataset:
  """A dataset whose splits are read as training goes (a user's factory
  returned a Grain dataset for at least one of them).

  Attributes:
    train: The training split: ``(inputs, labels)`` arrays, a
      ``grain.MapDataset`` (read by index per step) or a
      ``grain.IterDataset`` (iterated, its position checkpointed).
    test: The test split, held the same ways (read in order, batch by
      batch, at each evaluation).
    train_kind: Which of :data:`SPLIT_KINDS` ``train`` is.
    test_kind: Which of :data:`SPLIT_KINDS` ``test`` is.
    spec: Every example's shapes and dtypes (the first training example's).
    task: One of :data:`~qsync_jax.data.TASKS`, from the first example.
    num_classes: The target dimension for "regression"; None otherwise
      (counting classes would read every label: the model takes them from
      its own arguments).
    name: The factory spec.
    integer_labels: Every example's labels must be class ids.
  """

  train: Any
  test: Any
  train_kind: str
  test_kind: str
  spec: ExampleSpec
  task: str
  num_classes: int | None
  name: str
  integer_labels: bool = False

  def _what(self, split: str) -> str:
    return f"dataset {self.name!r}, split {split!r}"

  def _head_arrays(self, split: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    data, kind = (
      (self.train, self.train_kind)
      if split == "train"
      else (self.test, self.test_kind)
    )
    if kind == "arrays":
      return data[0][:n], data[1][:n]
    what = self._what(split)
    chunk = list(first_examples(data, kind, n, what))
    pairs = [
      as_example(e, f"{what}, example {i}", self.integer_labels)
      for i, e in chunk
    ]
    return stack_examples(
      pairs, self.spec, lambda k: f"{what}, example {chunk[k][0]}"
    )

  def head(self, n: int) -> Dataset:
    """The first ``n`` examples of each split, in memory.

    What sizes, traces and plans the model; its facts
    (:meth:`~qsync_jax.data.Dataset.model_kwargs`) are only those one
    example shows.

    Args:
      n: examples per split (fewer where a split has fewer).

    Returns:
      A :class:`~qsync_jax.data.Dataset` with ``streamed=True``.

    Raises:
      ValueError: a bad example among them.
    """
    x_train, y_train = self._head_arrays("train", n)
    x_test, y_test = self._head_arrays("test", n)
    return Dataset(
      x_train,
      y_train,
      x_test,
      y_test,
      num_classes=self.num_classes,
      task=self.task,
      name=self.name,
      streamed=True,
    )

  def batcher(
    self, batch_sizes: Sequence[int], seed: int = 0
  ) -> WorkerBatcher | StreamBatcher:
    """The training batcher of ``batch_sizes`` per worker.

    Arrays and a ``MapDataset`` are dealt by :class:`WorkerBatcher` (the
    per-epoch permutations of ``seed``), an ``IterDataset`` by
    :class:`StreamBatcher` (its own order).

    Raises:
      ValueError: bad batch sizes, or a global batch larger than the
        training split (where its length is known).
    """
    what = self._what("train")
    if self.train_kind == "arrays":
      return WorkerBatcher.over(ArrayExamples(*self.train), batch_sizes, seed)
    if self.train_kind == "map":
      examples = MapExamples(self.train, self.spec, what, self.integer_labels)
      return WorkerBatcher.over(examples, batch_sizes, seed)
    return StreamBatcher(
      self.train, batch_sizes, self.spec, what, self.integer_labels
    )

  def eval_set(self) -> TestSplit:
    """The test split, read batch by batch (what ``evaluate`` takes)."""
    return TestSplit(
      self.test,
      self.test_kind,
      self.spec,
      self._what("test"),
      self.integer_labels,
    )
