"""scikit-learn's bundled 8x8 handwritten digits as a `Dataset`.

This module owns loading and splitting `sklearn.datasets.load_digits()`, the
small real-image dataset that ships with scikit-learn (no download needed).
The split is cached (`qsync_jax.data.cache`): importing scikit-learn costs a
process a second or two, more than everything else the data needs.
"""

from __future__ import annotations

import importlib.metadata
import os

import numpy as np

from qsync_jax.data import cache
from qsync_jax.data.base import Dataset


def load_digits(
  test_fraction: float = 0.2,
  seed: int = 0,
  cache_dir: str | os.PathLike | None = None,
  use_cache: bool = True,
) -> Dataset:
  """Loads the 1,797 8x8 grey-scale digit images.

  Args:
    test_fraction: Fraction of examples held out for the test split.
    seed: Seed of the stratified train/test split.
    cache_dir: Directory of the .npz cache of the split; see
      `qsync_jax.data.cache.default_cache_dir`.
    use_cache: If False, always load and split with scikit-learn and write
      no cache.

  Returns:
    A classification `Dataset` with float32 NHWC images of shape (N, 8, 8, 1)
    in [0, 1] and int32 labels in [0, 10).

  Raises:
    ValueError: If `test_fraction` is not in (0, 1).
  """
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  key = {
    "test_fraction": float(test_fraction),
    "seed": seed,
    "scikit_learn_version": importlib.metadata.version("scikit-learn"),
  }
  arrays = cache.cached_arrays(
    "digits",
    key,
    lambda: _split(test_fraction, seed),
    cache_dir=cache_dir,
    use_cache=use_cache,
  )
  return Dataset(
    arrays["x_train"],
    arrays["y_train"],
    arrays["x_test"],
    arrays["y_test"],
    num_classes=10,
    task="classification",
    name="digits",
  )


def _split(test_fraction: float, seed: int) -> dict[str, np.ndarray]:
  """scikit-learn's digits, split as :func:`load_digits` returns them."""
  # Imported here: only a cache miss needs scikit-learn.
  from sklearn import datasets
  from sklearn import model_selection

  raw = datasets.load_digits()
  # Pixel values are integers in [0, 16].
  x = (raw.images.astype(np.float32) / 16.0)[..., None]
  y = raw.target.astype(np.int32)
  # Stratified so every class keeps its share in both splits.
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
    x, y, test_size=test_fraction, random_state=seed, stratify=y
  )
  return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}
