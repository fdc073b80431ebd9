"""The `Dataset` container shared by every loader in `qsync_jax.data`.

This module owns the one in-memory representation of a dataset: plain numpy
arrays plus the metadata a trainer needs to build a model head and pick a loss.
Loaders never return JAX arrays; device placement belongs to the training loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: The tasks a :class:`Dataset` can be for.
TASKS = ("classification", "regression", "lm")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A train/test split held as numpy arrays.

  Attributes:
    x_train: Training inputs, leading axis is the example axis.
    y_train: Training targets, same leading length as `x_train`.
    x_test: Test inputs.
    y_test: Test targets.
    num_classes: Width of the model's output head: the number of classes for
      "classification", the vocabulary size for "lm", and the target
      dimension for "regression"; None where the data does not tell it
      without a full pass (a streamed dataset's classes).
    task: One of "classification", "regression" or "lm".
    name: Short identifier of the source, e.g. "digits".
    streamed: The arrays are the first examples of a streamed dataset
      (:meth:`qsync_jax.data.StreamedDataset.head`), not all of them:
      :meth:`model_kwargs` gives only the facts one example shows.
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int | None
  task: str
  name: str
  streamed: bool = False

  def __post_init__(self):
    # Catch loader bugs at construction instead of deep inside a train step.
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
    if len(self.x_train) != len(self.y_train):
      raise ValueError(
        f"{self.name}: x_train has {len(self.x_train)} examples but "
        f"y_train has {len(self.y_train)}"
      )
    if len(self.x_test) != len(self.y_test):
      raise ValueError(
        f"{self.name}: x_test has {len(self.x_test)} examples but "
        f"y_test has {len(self.y_test)}"
      )

  @property
  def input_shape(self) -> tuple[int, ...]:
    """Shape of one input example (without the batch axis)."""
    return tuple(self.x_train.shape[1:])

  @property
  def num_train(self) -> int:
    """Number of training examples."""
    return len(self.x_train)

  @property
  def num_test(self) -> int:
    """Number of test examples."""
    return len(self.x_test)

  def model_kwargs(self) -> dict[str, object]:
    """What a model needs to know to fit this dataset.

    Returns:
      ``input_shape`` (one example) always and ``num_classes`` (the head's
      width) where it is known; for images (``(H, W, C)`` float inputs)
      ``image_size`` (when square) and ``in_channels``; for integer token
      inputs ``max_len`` and, unless the dataset is streamed,
      ``vocab_size`` (the largest token id plus one, train and test, and at
      least ``num_classes`` for language modelling).
    """
    out: dict[str, object] = {"input_shape": self.input_shape}
    if self.num_classes is not None:
      out["num_classes"] = int(self.num_classes)
    shape = self.input_shape
    if np.issubdtype(self.x_train.dtype, np.integer) and len(shape) == 1:
      out["max_len"] = shape[0]
      # The largest token id needs every example: a streamed dataset's
      # model takes vocab_size from its kwargs.
      if not self.streamed:
        vocab = (
          int(max(self.x_train.max(initial=0), self.x_test.max(initial=0))) + 1
        )
        if self.task == "lm" and self.num_classes is not None:
          vocab = max(vocab, int(self.num_classes))
        out["vocab_size"] = vocab
    elif len(shape) == 3:
      if shape[0] == shape[1]:
        out["image_size"] = shape[0]
      out["in_channels"] = shape[2]
    return out
