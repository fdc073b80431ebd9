"""Datasets and per-worker batching for qsync_jax.

This package owns every data source used by the experiments (all offline) and
the name-based registry `load_dataset`. Loaders return a `Dataset` of numpy
arrays; `WorkerBatcher` deals them to data-parallel workers.
"""

from __future__ import annotations

from collections.abc import Callable
import inspect
from typing import Any

from qsync_jax.data.base import Dataset
from qsync_jax.data.base import TASKS
from qsync_jax.data.batching import eval_batches
from qsync_jax.data.batching import WorkerBatcher
from qsync_jax.data.cifar10 import load_cifar10
from qsync_jax.data.digits import load_digits
from qsync_jax.data.mnist1d import load_mnist1d
from qsync_jax.data.synthetic import load_synthetic
from qsync_jax.data.synthetic import load_synthetic_regression
from qsync_jax.data.text import byte_category
from qsync_jax.data.text import load_text
from qsync_jax.data.text import load_text_classes
from qsync_jax.data.text import make_lm_windows

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


__all__ = [
  "DATASET_NAMES",
  "TASKS",
  "Dataset",
  "WorkerBatcher",
  "byte_category",
  "eval_batches",
  "load_cifar10",
  "load_dataset",
  "load_digits",
  "load_mnist1d",
  "load_synthetic",
  "load_synthetic_regression",
  "load_text",
  "load_text_classes",
  "make_lm_windows",
]
