"""Preemption notices: SIGTERM, agreed on a step by every process.

This module owns how a training loop learns that it should checkpoint and
stop. SLURM and Kubernetes send SIGTERM some time before they kill a job.
In a multi-process run the ``jax.distributed`` runtime's preemption notifier
takes the signal (which is why a worker survives SIGTERM once initialized),
tells every process, and
``jax.experimental.multihost_utils.reached_preemption_sync_point`` answers
True on every process at the same step: the one after the largest step any
process had reached. A single-process run has no such runtime, so a Python
signal handler sets a flag that the next step boundary reads.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
  """Answers, at each step boundary, whether to checkpoint and stop.

  Use it as a context manager around the training loop and call
  :meth:`reached` after every step, with the same step numbers on every
  process. Entering it installs the single-process SIGTERM handler (only in
  the main thread of a single-process run); leaving it restores the previous
  one.
  """

  def __init__(self) -> None:
    self._notified = threading.Event()
    self._previous: Any = None
    self._installed = False

  def __enter__(self) -> PreemptionWatch:
    if (
      jax.process_count() == 1
      and threading.current_thread() is threading.main_thread()
    ):
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)
      self._installed = True
    if threading.current_thread() is threading.main_thread():
      # A notice a binary held back while it started (SIGTERM blocked
      # before its imports, experiments/train.py) arrives now, to the
      # handler above or to jax.distributed's notifier.
      signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    return self

  def __exit__(self, *exc_info) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous)
      self._installed = False

  def _on_signal(self, signum, frame) -> None:
    del signum, frame
    self._notified.set()

  def reached(self, step: int) -> bool:
    """Whether every process should checkpoint ``step`` and stop now.

    Args:
      step: The step just completed; every process passes the same one.

    Returns:
      True once a preemption notice arrived (on any process) and ``step`` is
      the step the processes agreed on.
    """
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._notified.is_set()
