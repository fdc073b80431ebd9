"""What loading a built-in dataset makes, from its loader's arguments alone.

This module owns :func:`dataset_size`: a built-in dataset's training
examples and the most host memory its loader holds at once, known before
the loader runs, so that a size no host holds is refused (with
:func:`qsync_jax.host_memory.check`) before it is allocated. The arguments
that size the data must be positive integers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import math
import numbers
from typing import Any

from qsync_jax.data import text as text_lib


@dataclasses.dataclass(frozen=True)
class DatasetSize:
  """What loading a built-in dataset makes.

  Attributes:
    train: training examples (at most; a text corpus may hold fewer).
    bytes: the most host memory its loader holds at once.
  """

  train: int
  bytes: float


def _count(
  kwargs: Mapping[str, Any], name: str, default: Any, least: int, what: str
) -> Any:
  """``kwargs[name]`` (or ``default``), an integer ``>= least``, or None."""
  value = kwargs.get(name, default)
  if value is None and default is None:
    return None
  if not (
    isinstance(value, numbers.Integral)
    and not isinstance(value, bool)
    and int(value) >= least
  ):
    raise ValueError(
      f"{what}.{name} must be an integer >= {least}, got {value!r}"
    )
  return int(value)


def _shape(
  kwargs: Mapping[str, Any], default: Sequence[int], what: str
) -> list[int]:
  """``kwargs["input_shape"]`` (or ``default``): integers >= 1."""
  value = kwargs.get("input_shape", default)
  if not isinstance(value, (list, tuple)) or not value:
    raise ValueError(
      f"{what}.input_shape must be a list of integers >= 1, got {value!r}"
    )
  for d in value:
    _count({"input_shape": d}, "input_shape", None, 1, what)
  return [int(d) for d in value]


def _stdlib_bytes(stdlib_dir: Any) -> int | None:
  """The bytes of the text corpus, or None if it cannot be listed (the
  loader then says why)."""
  try:
    return sum(p.stat().st_size for p in text_lib.stdlib_files(stdlib_dir))
  except (OSError, ValueError):
    return None


def _synthetic_size(
  name: str, kwargs: Mapping[str, Any], what: str
) -> DatasetSize:
  regression = name == "synthetic_regression"
  n = _count(kwargs, "num_train", 2048, 1, what)
  n_all = n + _count(kwargs, "num_test", 512, 1, what)
  dim = math.prod(_shape(kwargs, (16,) if regression else (8, 8, 1), what))
  if not regression:
    # The means of the labels, the noise and their sum in float64, then
    # the float32 inputs.
    return DatasetSize(n, n_all * dim * (3 * 8 + 4))
  hidden = _count(kwargs, "hidden", 32, 1, what)
  out = _count(kwargs, "output_dim", 1, 1, what)
  return DatasetSize(n, n_all * (dim * (8 + 4) + hidden * 16 + out * 12))


def _text_size(name: str, kwargs: Mapping[str, Any], what: str) -> DatasetSize:
  seq_len = _count(kwargs, "seq_len", 128 if name == "text" else 64, 1, what)
  max_bytes = _count(
    kwargs, "max_bytes", 2_000_000 if name == "text" else 400_000, 1, what
  )
  stride = _count(kwargs, "stride", None, 1, what) or seq_len
  corpus = _stdlib_bytes(kwargs.get("stdlib_dir"))
  read = max_bytes if corpus is None else min(max_bytes, corpus)
  windows = read // stride + 1
  # The int32 windows (seq_len + 1 each), then inputs and labels apart;
  # the classes' reversed copies on top.
  copies = 3 if name == "text" else 5
  return DatasetSize(windows, read + windows * (seq_len + 1) * 4 * copies)


def dataset_size(
  name: str, kwargs: Mapping[str, Any], what: str
) -> DatasetSize | None:
  """The training examples and peak bytes of a built-in dataset's loader.

  From the loader's arguments alone, before it runs; the arguments that
  size the data must be positive integers.

  Args:
    name: the dataset (:data:`qsync_jax.data.DATASET_NAMES`).
    kwargs: its loader's arguments.
    what: how the arguments are named in messages
      (``"config.dataset_kwargs"``).

  Returns:
    The size, or None for a dataset that is not built in (a user's factory)
    or an unknown name (the loader reports it).

  Raises:
    ValueError: a size argument that is not a positive integer.
  """
  if name == "digits":
    fraction = kwargs.get("test_fraction", 0.2)
    test = math.ceil(1797 * fraction) if isinstance(fraction, float) else 0
    return DatasetSize(1797 - test, 1797 * 64 * 4 * 8)
  if name in ("synthetic", "synthetic_regression"):
    return _synthetic_size(name, kwargs, what)
  if name == "mnist1d":
    n = _count(kwargs, "num_samples", 5000, 10, what)
    length = _count(kwargs, "final_seq_length", 40, 1, what)
    split = kwargs.get("train_split", 0.8)
    train = int(n * split) if isinstance(split, float) else n
    # Each example made in float64 (padded, transformed), then float32.
    return DatasetSize(train, n * length * 8 * 4)
  if name in ("text", "text_classes"):
    return _text_size(name, kwargs, what)
  if name == "cifar10":
    # uint8 files, float32 images, and a normalized copy.
    return DatasetSize(50_000, 60_000 * 3072 * (1 + 4 + 4))
  return None
