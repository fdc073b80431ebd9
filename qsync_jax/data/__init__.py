"""Datasets and per-worker batching for qsync_jax.

This package owns every data source used by the experiments (all offline),
the name-based registry `load_dataset`, and a user's own data through
`open_dataset` (a `package.module:factory` returning arrays or a Grain
dataset). Loaders return a `Dataset` of numpy arrays, a user's Grain dataset
is a `StreamedDataset` read as training goes; `WorkerBatcher` (by index:
arrays, a Grain `MapDataset`) and `StreamBatcher` (a Grain `IterDataset`)
deal them to data-parallel workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import inspect
from typing import Any

from qsync_jax.data.base import Dataset
from qsync_jax.data.base import TASKS
from qsync_jax.data.batching import ArrayExamples
from qsync_jax.data.batching import BatchStream
from qsync_jax.data.batching import eval_batches
from qsync_jax.data.batching import IndexedExamples
from qsync_jax.data.batching import WorkerBatcher
from qsync_jax.data.cifar10 import load_cifar10
from qsync_jax.data.digits import load_digits
from qsync_jax.data.mnist1d import load_mnist1d
from qsync_jax.data.streams import FactoryError
from qsync_jax.data.streams import StreamBatcher
from qsync_jax.data.streams import StreamedDataset
from qsync_jax.data.synthetic import load_synthetic
from qsync_jax.data.synthetic import load_synthetic_regression
from qsync_jax.data.text import byte_category
from qsync_jax.data.text import load_text
from qsync_jax.data.text import load_text_classes
from qsync_jax.data.text import make_lm_windows
from qsync_jax.data.user import is_factory_spec
from qsync_jax.data.user import load_user_dataset

_LOADERS: dict[str, Callable[..., Dataset]] = {
  "digits": load_digits,
  "mnist1d": load_mnist1d,
  "text": load_text,
  "text_classes": load_text_classes,
  "synthetic": load_synthetic,
  "synthetic_regression": load_synthetic_regression,
  "cifar10": load_cifar10,
}
#: The names :func:`load_dataset` takes.
DATASET_NAMES = tuple(_LOADERS)


def load_dataset(name: str, **kwargs: Any) -> Dataset:
  """Loads a dataset by name.

  Args:
    name: One of `DATASET_NAMES`.
    **kwargs: Passed to the named loader (e.g. `data_dir=` for "cifar10",
      `num_samples=` for "mnist1d").

  Returns:
    The loaded `Dataset`.

  Raises:
    ValueError: If `name` is unknown, a keyword is not one the loader
      takes, or "cifar10" is requested without `data_dir`.
  """
  if name not in _LOADERS:
    raise ValueError(
      f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}"
    )
  accepted = list(inspect.signature(_LOADERS[name]).parameters)
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    raise ValueError(
      f"dataset {name!r} takes no argument {', '.join(unknown)}; it "
      f"accepts: {', '.join(accepted) or 'none'}"
    )
  if name == "cifar10" and kwargs.get("data_dir") is None:
    raise ValueError(
      "dataset 'cifar10' needs data_dir= pointing at a local "
      "copy of cifar-10-batches-py"
    )
  return _LOADERS[name](**kwargs)


def open_dataset(
  spec: str | Callable[..., Any],
  *,
  integer_labels: bool = False,
  **kwargs: Any,
) -> Dataset | StreamedDataset:
  """Opens a built-in dataset by name or a user's by its factory.

  Args:
    spec: One of `DATASET_NAMES`, or ``"package.module:factory"`` (or the
      factory itself), called as ``factory(split="train"|"test", **kwargs)`` and returning
      ``(inputs, labels)`` arrays or a Grain ``MapDataset`` /
      ``IterDataset`` of ``(inputs, labels)`` examples
      (:func:`load_user_dataset`).
    integer_labels: A factory's labels must be integer class ids (the
      default classification objective); built-in datasets are not
      checked.
    **kwargs: The loader's or the factory's keyword arguments.

  Returns:
    A `Dataset` (in memory), or a `StreamedDataset` for a factory that
    returns a Grain dataset.

  Raises:
    ValueError: An unknown name, a bad factory spec or keyword, or an
      unusable split (see :func:`load_user_dataset`).
    FactoryError: The factory or its module raised.
  """
  if callable(spec) or is_factory_spec(spec):
    return load_user_dataset(spec, integer_labels=integer_labels, **kwargs)
  if spec not in _LOADERS:
    raise ValueError(
      f"unknown dataset {spec!r}; valid names: {', '.join(DATASET_NAMES)}, "
      "or a factory 'package.module:factory'"
    )
  return load_dataset(spec, **kwargs)


def examples_in_memory(dataset: Dataset | StreamedDataset, n: int) -> Dataset:
  """The examples a model is sized, traced and planned on.

  Args:
    dataset: What :func:`open_dataset` returned.
    n: How many a streamed dataset reads of each split (a global batch, or
      the indicator's batches, whichever is more).

  Returns:
    ``dataset`` itself when it is in memory; a streamed dataset's first
    ``n`` examples (:meth:`StreamedDataset.head`).
  """
  if isinstance(dataset, StreamedDataset):
    return dataset.head(n)
  return dataset


def training_batcher(
  dataset: Dataset | StreamedDataset,
  batch_sizes: Sequence[int],
  seed: int = 0,
) -> WorkerBatcher | StreamBatcher:
  """The batcher that deals ``dataset``'s training split to workers.

  Args:
    dataset: What :func:`open_dataset` returned.
    batch_sizes: Examples per worker per step (may differ).
    seed: Seed of the per-epoch permutations (not used by an
      ``IterDataset``, read in its own order).

  Returns:
    A `WorkerBatcher` for arrays and a ``MapDataset``, a `StreamBatcher`
    for an ``IterDataset``.

  Raises:
    ValueError: Bad batch sizes or a global batch larger than the data.
  """
  if isinstance(dataset, StreamedDataset):
    return dataset.batcher(batch_sizes, seed)
  return WorkerBatcher(dataset.x_train, dataset.y_train, batch_sizes, seed)


def eval_set(dataset: Dataset | StreamedDataset) -> Any:
  """``dataset``'s test split as :func:`eval_batches` takes it.

  Returns:
    ``(x_test, y_test)`` for a `Dataset`; a :class:`BatchStream` that reads
    a streamed dataset's test split in order at each evaluation.
  """
  if isinstance(dataset, StreamedDataset):
    return dataset.eval_set()
  return dataset.x_test, dataset.y_test


__all__ = [
  "DATASET_NAMES",
  "TASKS",
  "ArrayExamples",
  "BatchStream",
  "Dataset",
  "FactoryError",
  "IndexedExamples",
  "StreamBatcher",
  "StreamedDataset",
  "WorkerBatcher",
  "byte_category",
  "eval_batches",
  "eval_set",
  "examples_in_memory",
  "is_factory_spec",
  "load_cifar10",
  "load_dataset",
  "load_digits",
  "load_mnist1d",
  "load_synthetic",
  "load_synthetic_regression",
  "load_text",
  "load_text_classes",
  "load_user_dataset",
  "make_lm_windows",
  "open_dataset",
  "training_batcher",
]
