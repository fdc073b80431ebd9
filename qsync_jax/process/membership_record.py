"""The membership changes a run directory went through, and what each cost.

This module owns :class:`MembershipRecord`: one entry per change of the
workers from one run of a directory to the next (a reclaim, a death, a
return under an elastic launcher; a resume onto other workers without one),
with the steps and seconds it cost and where they went. The entries travel
in the checkpoints' metadata (:meth:`MembershipRecord.checkpoint_meta`), so
a run resumed anywhere keeps its history; :func:`describe` is one log line
of an entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
import time
from typing import Any

from absl import logging

from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.process.membership import ElasticWorld
from qsync_jax.process.membership import NOTICE_CAUSES
from qsync_jax.process.previous_run import PreviousRun

#: The cause of an entry for a resume onto other workers without an elastic
#: launcher (the same command resumed with other workers).
RESUME_CAUSE = "resume"

#: The phases of the restart timeline :class:`MembershipRecord` measures,
#: each from its mark to the next.
PHASES = ("plan", "restore", "compile")


def _seconds(value: float) -> float | None:
  return None if math.isnan(value) else value


def _spec(kinds: Sequence[str]) -> str:
  return cluster_lib.cluster_string(cluster_lib.ClusterSpec(tuple(kinds)))


class MembershipRecord:
  """The membership changes of a run directory, and this run's own.

  Every checkpoint carries the list (:meth:`checkpoint_meta`); a resume reads
  it back (:meth:`resumed`) and, where its workers differ from the
  checkpoint's or an elastic launcher started it after a change, adds an
  entry for the change: ``{"step", "workers_before", "cluster_before",
  "workers_after", "cluster_after", "cause", "detail", "steps_lost",
  "seconds_lost", "breakdown"}``. The entry is completed at the end of the
  first step after the resume (:meth:`first_step_done`).

  The seconds are wall-clock times (``time.time()``, process 0's) and
  follow one another, so that the breakdown adds up to ``seconds_lost``,
  from the change's event to the end of the first step:

  - ``detect_s``: the event (the launcher's notice) until the processes
    agreed on a step (the ``PREEMPTED`` record's time); after a death, or
    a world that ended with no agreed step (ended at once before its first
    step), the event until the last process exited;
  - ``checkpoint_s``: that agreed step's checkpoint (None after a death);
  - ``restart_s``: the end of the checkpoint (after a death: the last exit)
    until this process starts building its workers: the processes' exit,
    the launcher's restart, the interpreter, JAX and the distributed
    runtime starting, the data loaded and the model built;
  - ``plan_s``: building the workers: the checkpoint's metadata read, the
    batch re-split, the plans (planned again where they are automatic);
  - ``restore_s``: the trainer built and the checkpoint restored onto it;
  - ``compile_s``: the programs compiled and the first step run.

  Without an elastic launcher's change (``cause`` ``"resume"``: the same
  command resumed onto other workers), ``seconds_lost``, ``detect_s`` and
  ``restart_s`` are None (the time between two commands is not the run's);
  ``checkpoint_s`` is the ``PREEMPTED`` record's when the previous run
  ended on a notice.

  Args:
    world: the elastic world, or None.
  """

  def __init__(self, world: ElasticWorld | None = None):
    self.world = world
    self.entries: list[dict[str, Any]] = []
    self._pending: dict[str, Any] | None = None
    self._marks: dict[str, float] = {}

  def mark(self, phase: str) -> None:
    """Notes that ``phase`` (one of :data:`PHASES`) starts now.

    Raises:
      ValueError: an unknown phase.
    """
    if phase not in PHASES:
      raise ValueError(f"unknown phase {phase!r}; valid: {PHASES}")
    self._marks[phase] = time.time()

  def resumed(
    self,
    meta: Mapping[str, Any],
    kinds: Sequence[str],
    previous: PreviousRun,
  ) -> dict[str, Any] | None:
    """Takes the list from a restored checkpoint; adds this run's change.

    Marks the start of the ``compile`` phase; ``plan`` and ``restore`` must
    be marked before.

    Args:
      meta: the restored checkpoint's metadata.
      kinds: this run's workers' kinds.
      previous: what the previous run left.

    Returns:
      The new entry (completed by :meth:`first_step_done`), or None where
      the workers are the checkpoint's and no change started this run.
    """
    self.mark("compile")
    self.entries = [dict(e) for e in meta.get("membership") or []]
    before = [str(k) for k in meta.get("kinds") or []]
    change = self.world.change if self.world is not None else None
    if before == list(kinds) and change is None:
      return None
    step = int(meta["step"])
    last = previous.last_step()
    agreed, saved_s = previous.notice(step, change)
    detect = restart = math.nan
    if (
      change is not None
      and change.cause in NOTICE_CAUSES
      and not math.isnan(agreed)
    ):
      detect = agreed - change.event_time
      restart = self._marks["plan"] - (agreed + saved_s)
    elif change is not None:
      # Died (the launcher saw the death at once), or a world ended with no
      # agreed step (at once before its first step, or its processes killed
      # by the notice): from the event to the last exit.
      detect = change.exit_time - change.event_time
      restart = self._marks["plan"] - change.exit_time
      saved_s = math.nan
    entry = {
      "step": step,
      "workers_before": len(before),
      "cluster_before": _spec(before) if before else "",
      "workers_after": len(kinds),
      "cluster_after": _spec(kinds),
      "cause": change.cause if change is not None else RESUME_CAUSE,
      "detail": (
        change.detail
        if change is not None and change.detail
        else f"resumed on {len(kinds)} workers from a checkpoint of "
        f"{len(before)}"
      ),
      "steps_lost": max(0, (last if last is not None else step) - step),
      "seconds_lost": None,
      "breakdown": {
        "detect_s": _seconds(detect),
        "checkpoint_s": _seconds(saved_s),
        "restart_s": _seconds(restart),
        "plan_s": self._marks["restore"] - self._marks["plan"],
        "restore_s": self._marks["compile"] - self._marks["restore"],
        "compile_s": None,
      },
    }
    self.entries.append(entry)
    self._pending = entry
    return entry

  def first_step_done(self) -> None:
    """Completes the entry :meth:`resumed` added (if any) and logs it."""
    entry, self._pending = self._pending, None
    if entry is None:
      return
    now = time.time()
    entry["breakdown"]["compile_s"] = now - self._marks["compile"]
    change = self.world.change if self.world is not None else None
    if change is not None:
      entry["seconds_lost"] = now - change.event_time
    logging.info("%s", describe(entry))

  def checkpoint_meta(self) -> dict[str, Any]:
    """A checkpoint's extra metadata: the record."""
    return {"membership": self.entries}


def describe(entry: Mapping[str, Any]) -> str:
  """One log line of a membership entry.

  Args:
    entry: an entry of :attr:`MembershipRecord.entries`, completed.
  """
  lost = f"{entry['steps_lost']} step(s)"
  if entry.get("seconds_lost") is not None:
    lost += f" and {entry['seconds_lost']:.2f} s"
  parts = ", ".join(
    f"{name[:-2]} {value:.2f} s"
    for name, value in entry["breakdown"].items()
    if value is not None
  )
  return (
    f"membership change at step {entry['step']}: "
    f"{entry['cluster_before']} ({entry['workers_before']} workers) -> "
    f"{entry['cluster_after']} ({entry['workers_after']} workers), "
    f"{entry['cause']} ({entry['detail']}); {lost} lost ({parts})"
  )
