"""The on-disk cache of the datasets ``qsync_jax.data`` makes.

This module owns the cache directory convention of ``qsync_jax.data`` (an
argument, then the ``QSYNC_JAX_CACHE`` environment variable, then
``~/.cache/qsync_jax``) and the arrays cached in it: one ``.npz`` per name
and key, written whole, so that a concurrent reader never sees part of one.
A dataset that is slow to make (MNIST-1D's generator) or to load (the
digits' split, behind scikit-learn's import of a second or two) is made once
per machine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import hashlib
import io
import json
import logging
import os
import pathlib
from typing import Any
import zipfile

import numpy as np

from qsync_jax import files

CACHE_ENV_VAR = "QSYNC_JAX_CACHE"


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


def cached_arrays(
  name: str,
  key: Mapping[str, Any],
  make: Callable[[], Mapping[str, np.ndarray]],
  *,
  cache_dir: str | os.PathLike | None = None,
  use_cache: bool = True,
) -> dict[str, np.ndarray]:
  """The arrays ``make`` returns, read from the cache where it has them.

  Args:
    name: the dataset's name, the start of the file's name.
    key: everything the arrays depend on (JSON-serializable): the loader's
      arguments and the versions of the packages that make them.
    make: makes the arrays (called on a miss).
    cache_dir: the cache directory; see :func:`default_cache_dir`.
    use_cache: if False, ``make`` is called and nothing is written.

  Returns:
    ``{name: array}``. A cached file that cannot be read (cut short,
    damaged) is made again and replaced, with a warning.

  Raises:
    ValueError: the cache directory is a file (see
      :func:`default_cache_dir`).
    OSError: the cache could not be written, naming the file.
  """
  if not use_cache:
    return dict(make())
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
  path = default_cache_dir(cache_dir) / f"{name}_{digest.hexdigest()[:16]}.npz"
  if path.exists():
    try:
      with np.load(path) as f:
        return {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
      logging.warning(
        "the cached %s (%s) is unreadable (%s): made again", name, path, e
      )
  arrays = dict(make())
  path.parent.mkdir(parents=True, exist_ok=True)
  npz = io.BytesIO()
  np.savez(npz, **arrays)  # type: ignore[arg-type]
  files.write_bytes(str(path), npz.getvalue())
  return arrays
