"""MNIST-1D generated locally with the `mnist1d` package, cached as .npz.

This module owns generating MNIST-1D from its procedural templates (never the
package's download path), the on-disk cache of generated arrays, and the
cache-directory convention shared by `qsync_jax.data` (argument, then the
QSYNC_JAX_CACHE environment variable, then ~/.cache/qsync_jax).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import pathlib
import random
from typing import Any

import numpy as np

from qsync_jax import files
from qsync_jax.data.base import Dataset

CACHE_ENV_VAR = "QSYNC_JAX_CACHE"
# Keys of the mnist1d args object that do not affect the generated arrays.
_NON_GENERATIVE_KEYS = ("url",)


def default_cache_dir(
  cache_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
  """Resolves the cache directory.

  Args:
    cache_dir: Explicit directory; wins over everything else when given.

  Returns:
    `cache_dir` if given, else $QSYNC_JAX_CACHE if set and non-empty, else
    ~/.cache/qsync_jax.

  Raises:
    ValueError: the directory, or one of its parents, is an existing file
      (naming $QSYNC_JAX_CACHE where it came from there).
  """
  if cache_dir is not None:
    path, what = pathlib.Path(cache_dir).expanduser(), "cache_dir"
  elif os.environ.get(CACHE_ENV_VAR):
    path = pathlib.Path(os.environ[CACHE_ENV_VAR]).expanduser()
    what = CACHE_ENV_VAR
  else:
    return pathlib.Path.home() / ".cache" / "qsync_jax"
  for part in (path, *path.parents):
    if part.exists():
      if not part.is_dir():
        raise ValueError(
          f"{what}={str(path)!r} cannot be the dataset cache directory: "
          f"{str(part)!r} is a file"
        )
      break
  return path


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
    cache_dir: Directory of the .npz cache; see `default_cache_dir`.
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
  key_src = {k: v for k, v in arg_dict.items() if k not in _NON_GENERATIVE_KEYS}
  key_src["mnist1d_version"] = importlib.metadata.version("mnist1d")
  key = hashlib.sha256(
    json.dumps(key_src, sort_keys=True).encode()
  ).hexdigest()[:16]
  path = default_cache_dir(cache_dir) / f"mnist1d_{key}.npz"

  if use_cache and path.exists():
    with np.load(path) as f:
      arrays = {k: f[k] for k in f.files}
  else:
    from mnist1d.utils import ObjectView

    arrays = _generate(ObjectView(dict(arg_dict)))
    if use_cache:
      path.parent.mkdir(parents=True, exist_ok=True)
      # Written whole, so a concurrent reader never sees a partial file.
      npz = io.BytesIO()
      # mypy matches **arrays against savez's allow_pickle too.
      np.savez(npz, **arrays)  # type: ignore[arg-type]
      files.write_bytes(path, npz.getvalue())
  return Dataset(
    arrays["x_train"],
    arrays["y_train"],
    arrays["x_test"],
    arrays["y_test"],
    num_classes=10,
    task="classification",
    name="mnist1d",
  )
