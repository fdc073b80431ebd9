"""Compiled per-device programs kept for every process of a run.

This module owns a persistent cache of the programs one process compiles
for its own devices (a worker's gradient, evaluation), for the processes
jax's persistent compilation cache leaves out. That cache writes entries
from process 0 only, and on CPU its keys name the program's devices, so
every other process compiles its per-device programs again in each run:
after an elastic launcher's restart, three of four processes compiled a
worker's gradient for seconds while process 0 loaded its own.

:func:`cached` wraps a jitted function. In a process other than 0 of a
multi-process run with jax's persistent cache on, its first call for a
given signature lowers the function and looks the lowered program up under
``<jax's cache directory>/qsync_executables``, keyed by the program's text,
its devices, the jax and jaxlib versions, the backend, jax's configuration
(``jax_disable_most_optimizations`` and the like) and ``XLA_FLAGS``; a
hit is loaded (``jax.experimental.serialize_executable``) and logged
(``compiled program loaded``), a miss is compiled and written there
(``compiled program kept``).
Later calls run the compiled program. Anywhere else the function is
returned as it is.

Entries are pickles, as jax's own cache entries are executables: keep the
cache directory as private as the code it runs. Entries are never evicted
(``jax_compilation_cache_max_size`` bounds jax's entries only); the
elastic launcher's cache directory is removed with its job.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
import hashlib
import os
import time
from typing import Any

from absl import logging
import jax
from jax.experimental import serialize_executable
import jaxlib

from qsync_jax import files

#: The subdirectory of jax's cache directory holding this cache's entries.
SUBDIRECTORY = "qsync_executables"


def directory() -> str | None:
  """Where :func:`cached` keeps entries in this process; None where it keeps
  none (a single process, process 0, jax's cache off or not on a local
  path)."""
  if jax.process_count() == 1 or jax.process_index() == 0:
    return None
  root = jax.config.values["jax_compilation_cache_dir"]
  if not (jax.config.values["jax_enable_compilation_cache"] and root):
    return None
  if "://" in root:  # A remote store (gs://...): jax's alone.
    return None
  return os.path.join(root, SUBDIRECTORY)


def _signature(args: tuple[Any, ...]) -> Hashable:
  """What selects one compiled program: the arguments' tree, and each leaf's
  shape, dtype, weak type and (for jax arrays) sharding."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple(
    (
      type(x),
      getattr(x, "shape", None),
      str(getattr(x, "dtype", "")),
      getattr(x, "weak_type", None),
      x.sharding if isinstance(x, jax.Array) else None,
    )
    for x in leaves
  )


def _devices(args: tuple[Any, ...]) -> list[jax.Device]:
  """The devices the program runs on: those of its committed array
  arguments, else this process's first device."""
  devices = {
    d
    for x in jax.tree.leaves(args)
    if isinstance(x, jax.Array) and x.committed
    for d in x.sharding.device_set
  }
  return sorted(devices, key=lambda d: d.id) or [jax.local_devices()[0]]


def entry_key(lowered: jax.stages.Lowered, devices: list[jax.Device]) -> str:
  """The entry's name: a digest of everything that makes the executable.

  jax's configuration is taken whole (what compile options derive from it
  is jax's own business): a value that differs only costs a compile.
  """
  client = devices[0].client
  parts = [
    lowered.as_text(),
    repr([(d.id, d.platform, d.device_kind) for d in devices]),
    jax.__version__,
    jaxlib.__version__,
    client.platform,
    client.platform_version,
    os.environ.get("XLA_FLAGS", ""),
    repr(sorted(jax.config.values.items())),
  ]
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _load(
  path: str, lowered: jax.stages.Lowered, devices: list[jax.Device]
) -> jax.stages.Compiled | None:
  """The entry at ``path``, loaded; None where there is none. An entry that
  does not load is reported and ignored (it is written again)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None
  try:
    return serialize_executable.deserialize_and_load(
      data,
      lowered.in_tree,
      lowered.out_tree,
      backend=devices[0].client,
      execution_devices=devices,
    )
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("compiled program %s did not load (%s); compiling", path, e)
    return None


def _write(path: str, compiled: jax.stages.Compiled) -> bool:
  """Writes ``compiled`` to ``path`` whole
  (:func:`qsync_jax.files.write_bytes`); returns whether it was written
  (an executable the backend cannot serialize is not)."""
  try:
    data, _, _ = serialize_executable.serialize(compiled)
  except (ValueError, NotImplementedError) as e:
    logging.info("compiled program not kept: %s", e)
    return False
  os.makedirs(os.path.dirname(path), exist_ok=True)
  files.write_bytes(path, data)
  return True


def load_or_compile(
  fn: Any, args: tuple[Any, ...], cache_dir: str
) -> jax.stages.Compiled:
  """``fn`` (jitted) compiled for ``args``: loaded from ``cache_dir`` where
  an entry is there, else compiled and written there (where compiling took
  at least ``jax_persistent_cache_min_compile_time_secs``, as jax's own
  cache writes)."""
  lowered = fn.lower(*args)
  devices = _devices(args)
  path = os.path.join(cache_dir, entry_key(lowered, devices) + ".executable")
  compiled = _load(path, lowered, devices)
  if compiled is not None:
    logging.info(
      "compiled program loaded: %s from %s",
      getattr(fn, "__name__", "program"),
      cache_dir,
    )
    return compiled
  start = time.monotonic()
  compiled = lowered.compile()
  took = time.monotonic() - start
  if took >= jax.config.values["jax_persistent_cache_min_compile_time_secs"]:
    if _write(path, compiled):
      logging.info(
        "compiled program kept: %s in %s",
        getattr(fn, "__name__", "program"),
        cache_dir,
      )
  return compiled


def cached(fn: Callable) -> Callable:
  """``fn`` (a ``jax.jit`` function), its compiled programs kept for every
  process (see the module's docstring); ``fn`` itself where this process
  keeps none (:func:`directory`).

  Args:
    fn: a jitted function called with positional arguments only.

  Returns:
    A function called as ``fn`` is, returning what ``fn`` returns.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = cached(jax.jit(lambda x: x + 1))
    >>> int(f(jnp.int32(1)))
    2
  """
  cache_dir = directory()
  if cache_dir is None:
    return fn
  programs: dict[Hashable, jax.stages.Compiled] = {}

  def call(*args: Any) -> Any:
    signature = _signature(args)
    compiled = programs.get(signature)
    if compiled is None:
      compiled = programs[signature] = load_or_compile(fn, args, cache_dir)
    return compiled(*args)

  return call
