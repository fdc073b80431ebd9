"""Preemption notices: SIGTERM, agreed on a step by every process.

This module owns how a training loop learns that it should checkpoint and
stop. SLURM and Kubernetes send SIGTERM some time before they kill a job.
In a multi-process run the ``jax.distributed`` runtime's preemption notifier
takes the signal (which is why a worker survives SIGTERM once initialized),
tells every process, and
``jax.experimental.multihost_utils.reached_preemption_sync_point`` answers
True on every process at the same step boundary: the one after the furthest
any process had passed when the notice came (boundaries counted in this
process from 1, so that a notice that comes before a resumed world's first
step stops it at that step). A single-process run has no such runtime, so a
Python
signal handler sets a flag that the next step boundary reads.

Under the elastic launcher a process also records each SIGTERM it receives
(:func:`qsync_jax.process.membership.notice_path`, in the directory
:data:`~qsync_jax.process.membership.ENV_NOTICES` names) before the
processes agree on a step: the launcher reads these files when the world
has exited 75 to tell a reclaim of some slots by someone else (those
processes alone got a SIGTERM it did not send) from a job-wide preemption
(every process got one). In a multi-process run the runtime's notifier
keeps the signal: the handler installed here records it and then calls the
notifier's own handler, which it saved. A process also records its progress
(:func:`record_progress`): holding notices, then its first step done, so
that the launcher can end at once a world that has trained nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import ctypes
import itertools
import os
import signal
import sys
import threading
import time
from typing import Any

import jax
from jax.experimental import multihost_utils

from qsync_jax import files
from qsync_jax.process import detection
from qsync_jax.process import membership

# The sync points this process has passed, counted from 1 (see
# PreemptionWatch.reached).
_sync_point_calls = itertools.count(1)

#: ``sizeof(struct sigaction)`` is 152 on glibc; room to spare. The handler
#: is its first field and ``sa_flags`` follows the 128-byte mask.
_SIGACTION_SIZE = 256
_SA_FLAGS_OFFSET = 8 + 128
_SA_SIGINFO = 4


def _native_handler() -> tuple[Any, Callable[[int], None]] | None:
  """The SIGTERM handler installed outside Python (the ``jax.distributed``
  runtime's notifier), as (its saved ``struct sigaction``, a callable that
  runs it); None where there is none (default, ignored) or no glibc."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    saved = ctypes.create_string_buffer(_SIGACTION_SIZE)
    if libc.sigaction(int(signal.SIGTERM), None, saved) != 0:
      return None
  except (OSError, AttributeError):
    return None
  address = ctypes.c_void_p.from_buffer(saved, 0).value
  if address in (None, 0, 1):  # SIG_DFL, SIG_IGN
    return None
  flags = ctypes.c_int.from_buffer(saved, _SA_FLAGS_OFFSET).value
  if flags & _SA_SIGINFO:
    info = ctypes.CFUNCTYPE(
      None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p
    )
    native = info(address)

    def run(signum: int) -> None:
      native(signum, None, None)

  else:
    run = ctypes.CFUNCTYPE(None, ctypes.c_int)(address)
  return saved, run


def _restore_native(saved: Any) -> None:
  """Puts back a handler :func:`_native_handler` saved."""
  ctypes.CDLL(None, use_errno=True).sigaction(int(signal.SIGTERM), saved, None)


def record_notice(environ: Mapping[str, str] = os.environ) -> None:
  """Records that this process received SIGTERM, for the elastic launcher.

  Writes :func:`~qsync_jax.process.membership.notice_path` of this world
  and process where :data:`~qsync_jax.process.membership.ENV_NOTICES` names
  a directory; nothing otherwise. A failure to write is ignored: the
  launcher then reads the notice as a job-wide one, as before.

  Args:
    environ: the process's environment.
  """
  directory = environ.get(membership.ENV_NOTICES)
  if not directory:
    return
  try:
    restart = int(environ.get(membership.ENV_RESTART) or 0)
    process = int(environ.get(detection.ENV_PROCESS_ID) or 0)
    path = membership.notice_path(directory, restart, process)
    files.write_json(path, {"time": time.time()})
  except (OSError, ValueError):
    pass


def record_progress(
  stepped: bool, environ: Mapping[str, str] = os.environ
) -> None:
  """Tells the elastic launcher how far this process got.

  Where :data:`~qsync_jax.process.membership.ENV_PROGRESS` names a file:
  creates it empty (``stepped`` False: this process holds notices and has
  taken no step; an existing file is left as it is), or writes
  :data:`~qsync_jax.process.membership.STEPPED` into it. Nothing otherwise;
  a failure to write is ignored (the launcher then sends its notice and
  waits for the agreed step, as it does for a program that writes none).

  Args:
    stepped: whether this process has finished a step.
    environ: the process's environment.
  """
  path = environ.get(membership.ENV_PROGRESS)
  if not path:
    return
  try:
    if stepped:
      files.write_text(path, membership.STEPPED)
    else:
      open(path, "a").close()
  except OSError:
    pass


class PreemptionWatch:
  """Answers, at each step boundary, whether to checkpoint and stop.

  Use it as a context manager around the training loop and call
  :meth:`reached` after every step, with the same step numbers on every
  process. Entering it installs the single-process SIGTERM handler (only in
  the main thread of a single-process run); leaving it restores the previous
  one. Under the elastic launcher, entering it and the first :meth:`reached`
  record this process's progress (:func:`record_progress`).
  """

  def __init__(self) -> None:
    self._stepped = False
    self._notified = threading.Event()
    self._previous: Any = None
    self._installed = False
    self._native: tuple[Any, Callable[[int], None]] | None = None

  def __enter__(self) -> PreemptionWatch:
    main = threading.current_thread() is threading.main_thread()
    if main and jax.process_count() == 1:
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)
      self._installed = True
    elif main and os.environ.get(membership.ENV_NOTICES):
      # The runtime's notifier keeps the signal; the notice is recorded
      # first, then passed on to it.
      self._native = _native_handler()
      if self._native is not None:
        self._previous = signal.signal(signal.SIGTERM, self._on_forward)
        self._installed = True
    if main:
      # A notice a binary held back while it started (SIGTERM blocked
      # before its imports, experiments/train.py) arrives now, to the
      # handler above or to jax.distributed's notifier.
      signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    record_progress(stepped=False)
    return self

  def __exit__(self, *exc_info) -> None:
    if self._installed:
      if self._native is not None:
        # Held while Python's table is reset and the notifier's handler put
        # back, so that no SIGTERM meets the default action between.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
          signal.signal(signal.SIGTERM, signal.SIG_DFL)
          _restore_native(self._native[0])
        finally:
          signal.pthread_sigmask(signal.SIG_SETMASK, held)
        self._native = None
      else:
        signal.signal(signal.SIGTERM, self._previous)
      self._installed = False

  def _on_signal(self, signum, frame) -> None:
    del signum, frame
    record_notice()
    self._notified.set()

  def _on_forward(self, signum, frame) -> None:
    del frame
    record_notice()
    if self._native is not None:
      self._native[1](signum)

  def reached(self, step: int) -> bool:
    """Whether every process should checkpoint ``step`` and stop now.

    Args:
      step: The step just completed; every process passes the same one.

    Returns:
      True once a preemption notice arrived (on any process) and ``step`` is
      the step the processes agreed on.
    """
    del step  # every process calls at the same steps: the calls count them
    if not self._stepped:
      self._stepped = True
      record_progress(stepped=True)
    if jax.process_count() > 1:
      # The runtime agrees on "the largest counter any process last passed,
      # plus one", and a process that has not passed one yet reports 0. A
      # step number there would never be reached in a resumed world whose
      # notice came while it started (the agreed point 1, its steps from
      # the checkpoint's on): the calls are counted instead, from 1.
      return multihost_utils.reached_preemption_sync_point(
        next(_sync_point_calls)
      )
    return self._notified.is_set()
