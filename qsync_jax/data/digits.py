"""scikit-learn's bundled 8x8 handwritten digits as a `Dataset`.

This module owns loading and splitting `sklearn.datasets.load_digits()`, the
small real-image dataset that ships with scikit-learn (no download needed).
"""

from __future__ import annotations

import numpy as np

from qsync_jax.data.base import Dataset


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """Loads the 1,797 8x8 grey-scale digit images.

  Args:
    test_fraction: Fraction of examples held out for the test split.
    seed: Seed of the stratified train/test split.

  Returns:
    A classification `Dataset` with float32 NHWC images of shape (N, 8, 8, 1)
    in [0, 1] and int32 labels in [0, 10).

  Raises:
    ValueError: If `test_fraction` is not in (0, 1).
  """
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  # Imported lazily: scikit-learn is slow to import and only this loader
  # needs it.
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
  return Dataset(
    x_tr, y_tr, x_te, y_te, num_classes=10, task="classification", name="digits"
  )
