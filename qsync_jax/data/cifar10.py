"""CIFAR-10 read from a local copy in its standard python-pickle format.

This module owns locating and decoding the `cifar-10-batches-py` files
(`data_batch_1`..`data_batch_5`, `test_batch`). It never downloads: the data
must already be on disk. The files are pickles, and a pickle can run code when
it is loaded, so they are decoded by an unpickler that builds only the objects
the official files hold (dicts, lists, bytes, numbers and numpy arrays) and
refuses every other global.
"""

from __future__ import annotations

import codecs
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


# numpy's array pickle constructors, taken from numpy itself: their module is
# numpy.core in numpy 1 and numpy._core in numpy 2, and files name either.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_FROMBUFFER = np.zeros(0).__reduce_ex__(5)[0]


def _latin1_bytes(text: str, encoding: str) -> bytes:
  """``_codecs.encode`` restricted to what pickle writes for bytes.

  Python 3 pickles ``bytes`` at protocols below 3 as
  ``_codecs.encode(text, "latin1")``; any other codec is refused.
  """
  if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
    raise pickle.UnpicklingError(
      f"refused _codecs.encode({type(text).__name__}, {encoding!r})"
    )
  return codecs.encode(text, encoding)


def _empty_bytes() -> bytes:
  """``bytes()`` with no argument: how pickle protocols < 3 write ``b''``."""
  return b""


# Every global a CIFAR-10 batch pickle may name, mapped to what it builds.
# The official files (Python 2 cPickle) name the numpy 1 array constructors;
# the others are what Python 3 and numpy 2 write for the same dict.
_ALLOWED_GLOBALS = {
  ("numpy", "ndarray"): np.ndarray,
  ("numpy", "dtype"): np.dtype,
  ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
  ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
  ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
  ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
  ("_codecs", "encode"): _latin1_bytes,
  ("__builtin__", "bytes"): _empty_bytes,
  ("builtins", "bytes"): _empty_bytes,
}


class _RefusedGlobal(ValueError):
  """A batch pickle names a global that no CIFAR-10 batch holds."""


class _BatchUnpickler(pickle.Unpickler):
  """An unpickler that builds only the globals of ``_ALLOWED_GLOBALS``."""

  def __init__(self, file, path: pathlib.Path):
    super().__init__(file, encoding="bytes")
    self._path = path

  def find_class(self, module: str, name: str):
    """Returns an allowed global; raises ``_RefusedGlobal`` for any other."""
    try:
      return _ALLOWED_GLOBALS[(module, name)]
    except KeyError:
      raise _RefusedGlobal(
        f"{self._path}: refused to load global {module}.{name}: a CIFAR-10 "
        "batch holds only a dict of bytes, lists and numpy arrays"
      ) from None


def _unpickle(path: pathlib.Path) -> dict:
  """Loads one batch file without running any code it names.

  Args:
    path: The batch file.

  Returns:
    The batch dict, with bytes keys (b"data", b"labels", ...).

  Raises:
    ValueError: The file names a global a CIFAR-10 batch does not hold, is
      not a pickle, or holds something other than a dict.
  """
  with open(path, "rb") as f:
    try:
      batch = _BatchUnpickler(f, path).load()
    except _RefusedGlobal:
      raise
    except Exception as e:  # The pickle module raises many kinds.
      raise ValueError(
        f"{path}: not a CIFAR-10 batch pickle: {type(e).__name__}: {e}"
      ) from None
  if not isinstance(batch, dict) or not {b"data", b"labels"} <= set(batch):
    got = (
      f"keys {sorted(map(repr, batch))}"
      if isinstance(batch, dict)
      else type(batch).__name__
    )
    raise ValueError(
      f"{path}: expected a dict with keys b'data' and b'labels', got {got}"
    )
  return batch


def _resolve_dir(data_dir: pathlib.Path) -> pathlib.Path:
  """Returns the directory holding the batches, or raises naming the path."""
  # Accept both the batches directory itself and its parent (the layout
  # left by extracting cifar-10-python.tar.gz).
  for cand in (data_dir, data_dir / SUBDIR):
    if all((cand / f).is_file() for f in EXPECTED_FILES):
      return cand
  tried = data_dir if not (data_dir / SUBDIR).is_dir() else (data_dir / SUBDIR)
  missing = [f for f in EXPECTED_FILES if not (tried / f).is_file()]
  raise FileNotFoundError(
    f"CIFAR-10 not found at {tried}: expected files "
    f"{', '.join(EXPECTED_FILES)} (python-pickle format) in {data_dir} or "
    f"{data_dir / SUBDIR}; missing {', '.join(missing)}"
  )


def _read_batch(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
  """Decodes one pickle batch into uint8 NHWC images and int32 labels."""
  batch = _unpickle(path)
  data = np.asarray(batch[b"data"], dtype=np.uint8)
  labels = np.asarray(batch[b"labels"], dtype=np.int32)
  if (
    data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or (len(data) != len(labels))
  ):
    raise ValueError(
      f"{path}: expected data of shape (N, 3072) and N labels, got "
      f"{data.shape} and {labels.shape}"
    )
  # Rows are channel-major (1024 R, then G, then B), each plane row-major.
  return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def load_cifar10(
  data_dir: str | os.PathLike, normalize: bool = False
) -> Dataset:
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
  return Dataset(
    x_train,
    y_train,
    x_test,
    y_test,
    num_classes=10,
    task="classification",
    name="cifar10",
  )
