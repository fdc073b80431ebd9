"""What a run leaves for the next one in its run directory: the notice file.

This module owns the ``PREEMPTED`` file (:data:`PREEMPTED`): a run that
checkpointed the step its processes agreed on after a notice (SIGTERM: a
reclaim, a return, a preemption) writes it (:func:`write_preempted`), and the
same command started again resumes from that checkpoint without being told
to. :class:`PreviousRun` is what the next run reads of the run before it
(that file and the last step its ``metrics.jsonl`` logged), before it
changes anything there: how far the previous run got, and when its notice
was agreed and checkpointed, for the membership record
(:mod:`qsync_jax.process.membership_record`).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import json
import math
import os
from typing import Any

from qsync_jax import files
from qsync_jax.process.membership import Change
from qsync_jax.rundir import metrics

#: The file a run that checkpointed on a notice (SIGTERM) leaves in its
#: directory: the same command then resumes from that checkpoint without
#: being told to. It records ``{"step", "time", "checkpoint_s"}``: the step
#: the processes agreed on, ``time.time()`` when they did, and the seconds
#: from then until the checkpoint of that step was complete.
PREEMPTED = "PREEMPTED"


def write_preempted(
  path: str, step: int, agreed: float, seconds: float
) -> None:
  """Writes the :data:`PREEMPTED` file (whole: :mod:`qsync_jax.files`).

  Args:
    path: the file (``<run directory>/PREEMPTED``).
    step: the checkpointed step, agreed by every process.
    agreed: ``time.time()`` when the step was agreed.
    seconds: from then until its checkpoint was complete.

  Raises:
    OSError: the file system refused the write, naming the file.
  """
  files.write_json(
    path, {"step": step, "time": agreed, "checkpoint_s": seconds}, indent=2
  )


def _number(value: Any) -> float | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value) if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class PreviousRun:
  """What the run before this one left in the run directory.

  Read before this run changes anything there.

  Attributes:
    preempted: the :data:`PREEMPTED` file's record (``step``, ``time``,
      ``checkpoint_s``; fields an older file lacks are absent), or None.
    last_logged_step: the largest step of ``metrics.jsonl`` (its whole
      records), or None.
  """

  preempted: Mapping[str, Any] | None
  last_logged_step: int | None

  @classmethod
  def read(cls, out_dir: str) -> PreviousRun:
    """Reads ``out_dir``'s :data:`PREEMPTED` and ``metrics.jsonl``.

    Args:
      out_dir: the run directory; files it lacks, or cannot read, are none.
    """
    preempted = None
    try:
      with open(os.path.join(out_dir, PREEMPTED)) as f:
        record = json.load(f)
      if isinstance(record, dict):
        preempted = record
    except (OSError, ValueError):
      pass
    last = metrics.last_logged_step(os.path.join(out_dir, metrics.METRICS_FILE))
    return cls(preempted, last)

  def last_step(self) -> int | None:
    """The last step the previous run reached, as far as its files tell."""
    steps = [
      s
      for s in (
        self.last_logged_step,
        (self.preempted or {}).get("step"),
      )
      if isinstance(s, int) and not isinstance(s, bool)
    ]
    return max(steps) if steps else None

  def notice(self, step: int, change: Change | None) -> tuple[float, float]:
    """When the notice that ended the previous run at ``step`` was agreed.

    The :data:`PREEMPTED` record counts where it is of ``step`` and, for a
    change, was written after the change's event (not one left by an
    earlier world).

    Args:
      step: the step this run resumes from.
      change: the change that started this world, or None.

    Returns:
      ``(agreed time, checkpoint seconds)``, or ``(nan, nan)`` where no
      such record counts.
    """
    record = self.preempted or {}
    agreed = _number(record.get("time"))
    seconds = _number(record.get("checkpoint_s"))
    if (
      record.get("step") != step
      or agreed is None
      or seconds is None
      or (change is not None and agreed < change.event_time)
    ):
      return math.nan, math.nan
    return agreed, seconds
