"""Byte-level language-modelling data built from Python's own stdlib sources.

This module owns the offline text corpus: the top-level *.py files of the
running interpreter's standard library, read in sorted order, split into
train/test by file, and cut into next-byte prediction windows (vocab 256).
"""

from __future__ import annotations

import os
import pathlib
import sysconfig

import numpy as np

from qsync_jax.data.base import Dataset

VOCAB_SIZE = 256


def stdlib_files(
  stdlib_dir: str | os.PathLike | None = None,
) -> list[pathlib.Path]:
  """Lists the corpus files in deterministic (sorted) order.

  Only the top level of the stdlib directory is used: recursing would pick up
  site-packages, whose contents depend on what happens to be installed.

  Args:
    stdlib_dir: Directory to read; defaults to
      `sysconfig.get_paths()["stdlib"]`.

  Returns:
    The sorted list of *.py files directly inside the directory.

  Raises:
    FileNotFoundError: If the directory holds no ``*.py`` files.
  """
  root = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.glob("*.py") if p.is_file())
  if not files:
    raise FileNotFoundError(
      f"no *.py files found in stdlib directory {root}; pass stdlib_dir= "
      "pointing at a directory of Python sources"
    )
  return files


def load_stdlib_bytes(
  max_bytes: int = 2_000_000,
  test_fraction: float = 0.1,
  stdlib_dir: str | os.PathLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Reads up to `max_bytes` of stdlib source and splits it by file.

  Files are taken in sorted order until the byte budget is spent (the last
  one is truncated). Each file goes wholly to test if the test share so far
  is below `test_fraction`, else to train. The decision for a file depends
  only on earlier files, so raising `max_bytes` never moves a file between
  splits.

  Args:
    max_bytes: Total bytes read across both splits.
    test_fraction: Target fraction of bytes in the test split.
    stdlib_dir: Directory to read; see `stdlib_files`.

  Returns:
    `(train_bytes, test_bytes)`, two 1-D uint8 arrays.

  Raises:
    ValueError: If `max_bytes` is not positive or `test_fraction` is not in
      (0, 1).
    FileNotFoundError: If the directory holds no ``*.py`` files.
  """
  if max_bytes <= 0:
    raise ValueError(f"max_bytes must be positive, got {max_bytes}")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  train, test = [], []
  n_train = n_test = 0
  for path in stdlib_files(stdlib_dir):
    remaining = max_bytes - n_train - n_test
    if remaining <= 0:
      break
    data = path.read_bytes()[:remaining]
    if n_test < test_fraction * (n_train + n_test + len(data)):
      test.append(data)
      n_test += len(data)
    else:
      train.append(data)
      n_train += len(data)
  return (
    np.frombuffer(b"".join(train), dtype=np.uint8),
    np.frombuffer(b"".join(test), dtype=np.uint8),
  )


def make_lm_windows(
  tokens: np.ndarray, seq_len: int, stride: int | None = None
) -> np.ndarray:
  """Cuts a token stream into windows for next-token prediction.

  Args:
    tokens: 1-D integer array.
    seq_len: Model context length; each window holds `seq_len + 1` tokens so
      that inputs are `w[:, :-1]` and targets `w[:, 1:]`.
    stride: Offset between window starts; defaults to `seq_len`, so every
      token is a target exactly once.

  Returns:
    An int32 array of shape (N, seq_len + 1).

  Raises:
    ValueError: If `seq_len`/`stride` is not positive or `tokens` is shorter
      than one window.
  """
  stride = seq_len if stride is None else stride
  if seq_len <= 0 or stride <= 0:
    raise ValueError(
      f"seq_len and stride must be positive, got {seq_len}, {stride}"
    )
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or len(tokens) < seq_len + 1:
    raise ValueError(
      f"need a 1-D stream of at least {seq_len + 1} tokens, "
      f"got shape {tokens.shape}"
    )
  windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)
  return windows[::stride].astype(np.int32)


def load_text(
  seq_len: int = 128,
  max_bytes: int = 2_000_000,
  test_fraction: float = 0.1,
  stride: int | None = None,
  stdlib_dir: str | os.PathLike | None = None,
) -> Dataset:
  """Byte-level next-token dataset from the Python stdlib sources.

  Args:
    seq_len: Context length of each example.
    max_bytes: Total bytes read; see `load_stdlib_bytes`.
    test_fraction: Target fraction of bytes in the test split.
    stride: Offset between windows; see `make_lm_windows`.
    stdlib_dir: Directory to read; see `stdlib_files`.

  Returns:
    An "lm" `Dataset` with int32 `x` and `y` of shape (N, seq_len), where
    `y` is `x` shifted left by one byte, and `num_classes == 256`.

  Raises:
    ValueError: If either split is shorter than one window (raise
      `max_bytes`), or on invalid arguments.
    FileNotFoundError: If the directory holds no ``*.py`` files.
  """
  train_bytes, test_bytes = load_stdlib_bytes(
    max_bytes, test_fraction, stdlib_dir
  )
  splits = []
  for split, stream in (("train", train_bytes), ("test", test_bytes)):
    if len(stream) < seq_len + 1:
      raise ValueError(
        f"{split} split has {len(stream)} bytes, fewer than one window of "
        f"{seq_len + 1}; increase max_bytes (now {max_bytes})"
      )
    w = make_lm_windows(stream, seq_len, stride)
    splits += [np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])]
  x_train, y_train, x_test, y_test = splits
  return Dataset(
    x_train,
    y_train,
    x_test,
    y_test,
    num_classes=VOCAB_SIZE,
    task="lm",
    name="text",
  )


#: Classes of :func:`byte_category`.
BYTE_CATEGORIES = ("letter", "digit", "whitespace", "punctuation", "other")


def byte_category(b: np.ndarray) -> np.ndarray:
  """The class of each byte: 0 letter, 1 digit, 2 whitespace, 3 punctuation,
  4 other (int32, same shape)."""
  ch = np.asarray(b).astype(np.uint8)
  letter = ((ch >= 65) & (ch <= 90)) | ((ch >= 97) & (ch <= 122))
  digit = (ch >= 48) & (ch <= 57)
  space = np.isin(ch, [9, 10, 13, 32])
  punct = (ch >= 33) & (ch <= 126) & ~letter & ~digit
  return np.select([letter, digit, space, punct], [0, 1, 2, 3], 4).astype(
    np.int32
  )


def load_text_classes(
  seq_len: int = 64,
  max_bytes: int = 400_000,
  test_fraction: float = 0.1,
  stride: int | None = None,
  stdlib_dir: str | os.PathLike | None = None,
) -> Dataset:
  """Classify the byte that follows a window of stdlib source.

  The windows of :func:`load_text`, most recent byte first (reversed), so
  an encoder that classifies from its first token (as BERT does) finds the
  byte just before the target there; the label is the
  :func:`byte_category` of the next byte (5 classes). A task for an encoder
  classifier that trains on a CPU in minutes.

  Returns:
    A "classification" `Dataset`: int32 `x` of shape (N, seq_len), int32 `y`
    of shape (N,).
  """
  text = load_text(seq_len, max_bytes, test_fraction, stride, stdlib_dir)
  return Dataset(
    np.ascontiguousarray(text.x_train[:, ::-1]),
    byte_category(text.y_train[:, -1]),
    np.ascontiguousarray(text.x_test[:, ::-1]),
    byte_category(text.y_test[:, -1]),
    num_classes=len(BYTE_CATEGORIES),
    task="classification",
    name="text_classes",
  )
