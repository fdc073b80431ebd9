"""Progress lines for long studies and benches, with the time left.

This module owns :class:`Progress`, which the studies
(:mod:`experiments.studies.qsr`, :mod:`experiments.studies.qsync`,
:mod:`experiments.studies.predictor_accuracy`) and the compression bench
(:mod:`experiments.benches.compression`) call after each unit of work (a
run, a phase, a size) to print one line such as::

  [3/12] qsr cnn seed 1 done in 41 s; about 6 min left

The estimate is the mean time per finished unit times the units left: units
of one study are alike (the same steps, the same sizes in every setting),
and the mean over all finished units smooths a first unit slowed by
compilation better than the last unit's time would.
"""

from __future__ import annotations

from collections.abc import Callable
import math
import time


def _print(line: str) -> None:
  print(line, flush=True)  # seen at once when piped to a log file


def format_duration(seconds: float) -> str:
  """A duration as a person reads it: ``41 s``, ``6 min`` or ``2.5 h``.

  Args:
    seconds: a finite, non-negative duration.

  Returns:
    Whole seconds below 100 s, whole minutes below 100 min, else hours
    with one decimal.

  Raises:
    ValueError: a negative or non-finite duration.
  """
  if not math.isfinite(seconds) or seconds < 0:
    raise ValueError(f"a duration must be finite and >= 0, got {seconds}")
  if round(seconds) < 100:
    return f"{seconds:.0f} s"
  if round(seconds / 60) < 100:
    return f"{seconds / 60:.0f} min"
  return f"{seconds / 3600:.1f} h"


class Progress:
  """Counts finished units of work and reports each with the time left.

  Attributes:
    total: the units of work in all.
    finished: the units reported so far.
  """

  def __init__(
    self,
    total: int,
    log: Callable[[str], None] = _print,
    clock: Callable[[], float] = time.monotonic,
  ):
    """Starts the clock.

    Args:
      total: the units of work in all (at least 1).
      log: where each line goes (default: stdout, flushed).
      clock: seconds, monotonic (tests pass a fake one).

    Raises:
      ValueError: ``total`` is below 1.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
      raise ValueError(f"progress needs at least 1 unit of work, got {total!r}")
    self.total = total
    self.finished = 0
    self._log = log
    self._clock = clock
    self._start = self._last = clock()

  def seconds_left(self) -> float:
    """Mean seconds per finished unit times the units left (0 when done).

    Raises:
      ValueError: no unit has finished yet, so there is nothing to go on.
    """
    if self.finished == 0:
      raise ValueError("no unit of work has finished yet")
    elapsed = self._last - self._start
    return elapsed / self.finished * (self.total - self.finished)

  def done(self, what: str) -> str:
    """Reports that the unit ``what`` has just finished.

    Args:
      what: names the unit, e.g. ``"qsr cnn seed 1"``.

    Returns:
      The line logged: ``[k/total] WHAT done in T; about L left``, or on
      the last unit ``...; all done in T_total``.

    Raises:
      ValueError: more units reported than ``total``.
    """
    if self.finished >= self.total:
      raise ValueError(
        f"all {self.total} units of work were already "
        f"reported; {what!r} is one too many"
      )
    now = self._clock()
    took, self._last = now - self._last, now
    self.finished += 1
    if self.finished < self.total:
      tail = f"about {format_duration(self.seconds_left())} left"
    else:
      tail = f"all done in {format_duration(now - self._start)}"
    line = (
      f"[{self.finished}/{self.total}] {what} done in "
      f"{format_duration(took)}; {tail}"
    )
    self._log(line)
    return line
