"""CIFAR-10 read from a local copy in its standard python-pickle format.

This module owns locating and decoding the `cifar-10-batches-py` files
(`data_batch_1`..`data_batch_5`, `test_batch`). It never downloads: the data
must already be on disk.
"""

from __future__ import annotations

import os
import pathlib
import pickle

import numpy as np

from qsync_jax.data.base import Dataset

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
EXPECTED_FILES = TRAIN_FILES + (TEST_FILE,)
SUBDIR = "cifar-10-batches-py"
# Per-channel statistics of the CIFAR-10 training set, in [0, 1] units.
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)


def _resolve_dir(data_dir: pathlib.Path) -> pathlib.Path:
  """Returns the directory holding the batches, or raises naming the path."""
  # Accept both the batches directory itself and its parent (the layout
  # left by extracting cifar-10-python.tar.gz).
  for cand in (data_dir, data_dir / SUBDIR):
    if all((cand / f).is_file() for f in EXPECTED_FILES):
      return cand
  tried = data_dir if not (data_dir / SUBDIR).is_dir() else (
      data_dir / SUBDIR)
  missing = [f for f in EXPECTED_FILES if not (tried / f).is_file()]
  raise FileNotFoundError(
      f"CIFAR-10 not found at {tried}: expected files "
      f"{', '.join(EXPECTED_FILES)} (python-pickle format) in {data_dir} or "
      f"{data_dir / SUBDIR}; missing {', '.join(missing)}")


def _read_batch(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  """Decodes one pickle batch into uint8 NHWC images and int32 labels."""
  # The official files are pickles; only point data_dir at trusted copies.
  with open(path, "rb") as f:
    batch = pickle.load(f, encoding="bytes")
  data = np.asarray(batch[b"data"], dtype=np.uint8)
  labels = np.asarray(batch[b"labels"], dtype=np.int32)
  if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or (
      len(data) != len(labels)):
    raise ValueError(
        f"{path}: expected data of shape (N, 3072) and N labels, got "
        f"{data.shape} and {labels.shape}")
  # Rows are channel-major (1024 R, then G, then B), each plane row-major.
  return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def load_cifar10(data_dir: str | os.PathLike,
                 normalize: bool = False) -> Dataset:
  """Loads CIFAR-10 from `data_dir`.

  Args:
    data_dir: Directory containing the batch files, or containing a
      `cifar-10-batches-py` directory with them.
    normalize: If True, subtract the per-channel training mean and divide by
      the per-channel std; otherwise pixels are in [0, 1].

  Returns:
    A classification `Dataset` with float32 NHWC images of shape
    (N, 32, 32, 3), int32 labels and 10 classes.

  Raises:
    FileNotFoundError: If any expected batch file is missing; the message
      names the path and lists the expected files.
    ValueError: If a batch file has the wrong layout.
  """
  root = _resolve_dir(pathlib.Path(data_dir).expanduser())

  def read(names):
    parts = [_read_batch(root / n) for n in names]
    x = np.concatenate([p[0] for p in parts]).astype(np.float32) / 255.0
    if normalize:
      x = (x - MEAN) / STD
    return x, np.concatenate([p[1] for p in parts])

  x_train, y_train = read(TRAIN_FILES)
  x_test, y_test = read((TEST_FILE,))
  return Dataset(x_train, y_train, x_test, y_test, num_classes=10,
                 task="classification", name="cifar10")
