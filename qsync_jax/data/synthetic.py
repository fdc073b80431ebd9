"""Seeded synthetic classification and regression problems.

This module owns small, fully reproducible datasets that need no files: a
Gaussian-cluster classification task and a random-teacher regression task,
each shaped like vectors or images as requested.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qsync_jax.data.base import Dataset


def _check_sizes(num_train: int, num_test: int, input_shape: Sequence[int]):
  if num_train <= 0 or num_test <= 0:
    raise ValueError(
      f"num_train and num_test must be positive, got {num_train}, {num_test}"
    )
  if not input_shape or any(d <= 0 for d in input_shape):
    raise ValueError(
      f"input_shape must be non-empty and positive, got {tuple(input_shape)}"
    )


def load_synthetic(
  num_train: int = 2048,
  num_test: int = 512,
  input_shape: Sequence[int] = (8, 8, 1),
  num_classes: int = 10,
  class_sep: float = 3.0,
  seed: int = 0,
) -> Dataset:
  """Gaussian-cluster classification.

  Each class has a random mean in the flattened input space; an example is
  its class mean plus unit-variance isotropic noise. Means are scaled so the
  distance between two class means is about `class_sep * sqrt(2)` regardless
  of input size, keeping difficulty comparable across shapes.

  Args:
    num_train: Number of training examples.
    num_test: Number of test examples.
    input_shape: Shape of one example, e.g. (H, W, C) or (D,).
    num_classes: Number of classes (labels drawn uniformly).
    class_sep: Scale of the class means relative to the noise.
    seed: Seed for means, labels and noise.

  Returns:
    A classification `Dataset` with float32 inputs of shape
    ``(N, *input_shape)`` and int32 labels.

  Raises:
    ValueError: On non-positive sizes or fewer than 2 classes.
  """
  _check_sizes(num_train, num_test, input_shape)
  if num_classes < 2:
    raise ValueError(f"num_classes must be >= 2, got {num_classes}")
  rng = np.random.default_rng(seed)
  dim = int(np.prod(input_shape))
  n = num_train + num_test
  means = rng.normal(size=(num_classes, dim)) * (class_sep / np.sqrt(dim))
  y = rng.integers(0, num_classes, size=n).astype(np.int32)
  x = means[y] + rng.normal(size=(n, dim))
  x = x.astype(np.float32).reshape(n, *input_shape)
  return Dataset(
    x[:num_train],
    y[:num_train],
    x[num_train:],
    y[num_train:],
    num_classes=num_classes,
    task="classification",
    name="synthetic",
  )


def load_synthetic_regression(
  num_train: int = 2048,
  num_test: int = 512,
  input_shape: Sequence[int] = (16,),
  output_dim: int = 1,
  hidden: int = 32,
  noise: float = 0.1,
  seed: int = 0,
) -> Dataset:
  """Regression onto a random one-hidden-layer tanh teacher.

  Targets are `tanh(x @ W1 / sqrt(D)) @ W2 / sqrt(hidden) + noise * eps`
  with standard-normal `x`, `W1`, `W2` and `eps`, so they are nonlinear in
  the input yet O(1) in scale.

  Args:
    num_train: Number of training examples.
    num_test: Number of test examples.
    input_shape: Shape of one example, e.g. (D,) or (H, W, C).
    output_dim: Number of regression targets per example.
    hidden: Width of the teacher's hidden layer.
    noise: Standard deviation of the additive label noise.
    seed: Seed for inputs, teacher weights and noise.

  Returns:
    A regression `Dataset` with float32 inputs of shape ``(N, *input_shape)``,
    float32 targets of shape (N, output_dim) and `num_classes == output_dim`.

  Raises:
    ValueError: On non-positive sizes or negative noise.
  """
  _check_sizes(num_train, num_test, input_shape)
  if output_dim <= 0 or hidden <= 0 or noise < 0:
    raise ValueError(
      f"need output_dim > 0, hidden > 0, noise >= 0; got "
      f"{output_dim}, {hidden}, {noise}"
    )
  rng = np.random.default_rng(seed)
  dim = int(np.prod(input_shape))
  n = num_train + num_test
  w1 = rng.normal(size=(dim, hidden))
  w2 = rng.normal(size=(hidden, output_dim))
  x: np.ndarray = rng.normal(size=(n, dim))
  y = np.tanh(x @ w1 / np.sqrt(dim)) @ w2 / np.sqrt(hidden)
  y = y + noise * rng.normal(size=y.shape)
  x = x.astype(np.float32).reshape(n, *input_shape)
  y = y.astype(np.float32)
  return Dataset(
    x[:num_train],
    y[:num_train],
    x[num_train:],
    y[num_train:],
    num_classes=output_dim,
    task="regression",
    name="synthetic_regression",
  )
