"""How a CPU process's allocator treats XLA's large host buffers.

This module owns the host allocator policy of this project's programs.
XLA:CPU allocates every program's outputs and temporaries with glibc's
``malloc``. glibc serves a block above its mmap threshold (at most 32 MiB: a
raveled gradient of a 10M-parameter model is 42 MB) with a fresh ``mmap``,
and a thread's own arena cannot hold a block above 64 MiB at all, so it maps
those too; both are unmapped when freed. Every step then pays the kernel to
fault in and zero the same pages again, which can cost a step as much as its
compute.

``reuse`` (the default of the project's binaries) makes glibc keep freed
blocks for the next allocation of their size, as tcmalloc or jemalloc do:
no ``mmap`` for large blocks, one arena for all threads (so a block of any
size comes from the heap), and no trimming of the heap until 2 GiB at its
top are free. The process then keeps its peak heap (up to that) until it
exits. ``system`` leaves glibc's defaults.

:func:`configure` applies a mode to the running process with ``mallopt``.
Call it early, before JAX starts its threads: an arena a thread already has
stays. Nothing happens on a C library other than glibc.
"""

from __future__ import annotations

from collections.abc import Mapping
import ctypes
import ctypes.util
import os
import platform

#: The modes :func:`configure` takes.
MODES = ("reuse", "system")
#: The environment variable that picks the mode of a binary
#: (:func:`configure_from_env`); unset means ``reuse``.
ENV_VAR = "QSYNC_HOST_MALLOC"
# glibc's mallopt parameters (malloc.h) and the values of ``reuse``.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_REUSE = ((_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1), (_M_TRIM_THRESHOLD, 2**31 - 1))


def _glibc() -> ctypes.CDLL | None:
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return None
  return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def configure(mode: str = "reuse") -> bool:
  """Applies a host allocator mode to this process.

  Args:
    mode: ``"reuse"`` (keep freed large buffers for reuse) or ``"system"``
      (change nothing).

  Returns:
    Whether glibc's settings were changed (False for ``system`` and on a C
    library other than glibc).

  Raises:
    ValueError: an unknown mode.
    OSError: glibc refused a setting.
  """
  if mode not in MODES:
    raise ValueError(
      f"unknown host allocator mode {mode!r}; valid: {', '.join(MODES)}"
    )
  libc = _glibc() if mode == "reuse" else None
  if libc is None:
    return False
  for param, value in _REUSE:
    if libc.mallopt(param, value) != 1:
      raise OSError(f"glibc's mallopt({param}, {value}) failed")
  return True


def mode_from_env(environ: Mapping[str, str] | None = None) -> str:
  """The mode ``$QSYNC_HOST_MALLOC`` names (``reuse`` when unset or empty).

  Raises:
    ValueError: the variable names an unknown mode.
  """
  environ = os.environ if environ is None else environ
  mode = environ.get(ENV_VAR) or "reuse"
  if mode not in MODES:
    raise ValueError(
      f"{ENV_VAR}={mode!r} is not a host allocator mode; "
      f"valid: {', '.join(MODES)}"
    )
  return mode


def configure_from_env(environ: Mapping[str, str] | None = None) -> bool:
  """:func:`configure` with the mode of :func:`mode_from_env`: what every
  binary of this project does first."""
  return configure(mode_from_env(environ))
