"""MNIST-1D generated locally with the `mnist1d` package, cached as .npz.

This module owns generating MNIST-1D from its procedural templates (never the
package's download path), cached by `qsync_jax.data.cache`.
"""

from __future__ import annotations

import importlib.metadata
import os
import random
from typing import Any

import numpy as np

from qsync_jax.data import cache
from qsync_jax.data.base import Dataset

# Keys of the mnist1d args object that do not affect the generated arrays.
_NON_GENERATIVE_KEYS = ("url",)


def _generate(args: Any) -> dict[str, np.ndarray]:
  """Runs mnist1d's generator without leaking its global-RNG seeding."""
  from mnist1d.data import make_dataset  # Lazy: pulls in matplotlib/scipy.

  # make_dataset seeds the global `random` and `np.random` states; restore
  # them so loading data never changes the caller's random streams.
  np_state, py_state = np.random.get_state(), random.getstate()
  try:
    raw = make_dataset(args)
  finally:
    np.random.set_state(np_state)
    random.setstate(py_state)
  return {
    "x_train": raw["x"].astype(np.float32),
    "y_train": raw["y"].astype(np.int32),
    "x_test": raw["x_test"].astype(np.float32),
    "y_test": raw["y_test"].astype(np.int32),
  }


def load_mnist1d(
  num_samples: int | None = None,
  seed: int | None = None,
  cache_dir: str | os.PathLike | None = None,
  use_cache: bool = True,
  **overrides: Any,
) -> Dataset:
  """Generates (or reads from cache) the MNIST-1D dataset.

  Inputs are returned as float32 arrays of shape (N, 40): one channel-less
  1-D signal per example. Add a trailing axis (`x[..., None]`) for Conv1D
  models that expect (N, L, C).

  Args:
    num_samples: Total examples before the train/test split (mnist1d default
      5000). mnist1d generates `num_samples // 10` per class, so the total is
      rounded down to a multiple of 10.
    seed: Generation seed (mnist1d default 42).
    cache_dir: Directory of the .npz cache; see
      `qsync_jax.data.cache.default_cache_dir`.
    use_cache: If False, always regenerate and do not write the cache.
    **overrides: Any other field of `mnist1d.data.get_dataset_args()`, e.g.
      `train_split=0.9` or `shuffle_seq=True`.

  Returns:
    A classification `Dataset` with 10 classes and int32 labels.

  Raises:
    ValueError: If an override names an unknown mnist1d argument, or
      `num_samples` is smaller than 10.
  """
  from mnist1d.data import get_dataset_args

  arg_dict = get_dataset_args(as_dict=True)
  if num_samples is not None:
    overrides["num_samples"] = num_samples
  if seed is not None:
    overrides["seed"] = seed
  unknown = sorted(set(overrides) - set(arg_dict))
  if unknown:
    raise ValueError(
      f"unknown mnist1d arguments {unknown}; valid: "
      f"{sorted(set(arg_dict) - set(_NON_GENERATIVE_KEYS))}"
    )
  arg_dict.update(overrides)
  if arg_dict["num_samples"] < 10:
    raise ValueError(
      f"num_samples must be >= 10 (one per class), got "
      f"{arg_dict['num_samples']}"
    )

  # The key covers every generative argument and the package version, since
  # a different mnist1d release may generate different arrays.
  key = {k: v for k, v in arg_dict.items() if k not in _NON_GENERATIVE_KEYS}
  key["mnist1d_version"] = importlib.metadata.version("mnist1d")

  def generate() -> dict[str, np.ndarray]:
    from mnist1d.utils import ObjectView

    return _generate(ObjectView(dict(arg_dict)))

  arrays = cache.cached_arrays(
    "mnist1d", key, generate, cache_dir=cache_dir, use_cache=use_cache
  )
  return Dataset(
    arrays["x_train"],
    arrays["y_train"],
    arrays["x_test"],
    arrays["y_test"],
    num_classes=10,
    task="classification",
    name="mnist1d",
  )
