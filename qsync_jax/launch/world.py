"""One world of an elastic job: its processes, and how its end is read.

This module owns what :mod:`qsync_jax.launch.elastic`'s supervisor knows of
a running world (:class:`World`): its slots and processes, the membership
events and notices sent to it, its processes' progress files, and
:meth:`World.judge`, which reads how it ended (done, the next world, or the
job's end, :class:`Stop`). The protocol it follows is described there.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time

from qsync_jax.launch import local
from qsync_jax.launch.pool import Pool
from qsync_jax.process import membership

#: Which cause names a change that had several: the least orderly wins.
CAUSE_PRECEDENCE = ("died", "reclaimed", "returned")


@dataclasses.dataclass(frozen=True)
class Event:
  """One membership event: a notice sent, a death seen, a slot back."""

  cause: str
  slot: int
  t: float  # Seconds since the job started.
  wall: float  # time.time().
  note: str = ""

  def __str__(self) -> str:
    return f"slot {self.slot} {self.cause} at {self.t:.1f} s{self.note}"


def signal_name(code: int) -> str:
  """``SIGKILL`` for a ``Popen.returncode`` of -9."""
  try:
    return signal.Signals(-code).name
  except ValueError:
    return f"signal {-code}"


class Stop(Exception):
  """Ends the job with ``code``; ``line`` is its last line on stderr.

  ``count_kills``: the line goes on with how many processes were killed.
  """

  def __init__(self, code: int, line: str, count_kills: bool = False):
    super().__init__(line)
    self.code = code
    self.line = line
    self.count_kills = count_kills


@dataclasses.dataclass
class World:
  """One world's processes and what happened to it."""

  number: int
  slots: tuple[int, ...]
  procs: local.Processes
  events: list[Event] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  signalled: set[int] = dataclasses.field(default_factory=set)
  ending_since: float | None = None  # Monotonic time of the first notice.
  excused: set[int] = dataclasses.field(default_factory=set)
  #: Where the processes record the SIGTERMs they receive, or None.
  notices_dir: str | None = None
  #: The launcher got SIGTERM: every process was told to checkpoint and
  #: the job ends with the world.
  preempting: bool = False
  #: The change that started this world (None for the first).
  change: membership.Change | None = None
  #: Ended on a notice before any process had stepped (:meth:`unstepped`):
  #: its change is carried into the next world's.
  ended_unstepped: bool = False
  #: The next world's hot standbys were started (once every process of
  #: this one had stepped).
  standbys_started: bool = False

  def next_change(
    self, events: list[Event], slots: tuple[int, ...], start_wall: float
  ) -> membership.Change:
    """The change from this world, ended on ``events``, to the next one
    (``slots``, started at ``start_wall``). Where this world trained
    nothing (:attr:`ended_unstepped`), its own change is carried: one
    change from the world before it, its events and details joined."""
    causes = {e.cause for e in events}
    exit_times = [t for t in self.procs.exit_times() if t is not None]
    slots_before = self.slots
    event_time = min(e.wall for e in events)
    details = [*map(str, events), *self.notes]
    carried = self.change if self.ended_unstepped else None
    if carried is not None:
      causes.add(carried.cause)
      slots_before = carried.slots_before
      event_time = min(event_time, carried.event_time)
      details.insert(0, carried.detail)
    return membership.Change(
      cause=next(c for c in CAUSE_PRECEDENCE if c in causes),
      slots_before=slots_before,
      slots_after=slots,
      event_time=event_time,
      exit_time=max(exit_times, default=start_wall),
      start_time=start_wall,
      detail="; ".join(details),
    )

  def progress(self) -> list[str | None]:
    """:func:`~qsync_jax.process.membership.read_progress` of the world's
    processes ([] without a notices directory)."""
    if self.notices_dir is None:
      return []
    n = len(self.slots)
    return membership.read_progress(self.notices_dir, self.number - 1, n)

  def unstepped(self) -> bool:
    """Whether every process holds notices and none has finished a step."""
    progress = self.progress()
    return (
      bool(progress)
      and None not in progress
      and (membership.STEPPED not in progress)
    )

  def outside_notices(self) -> dict[int, float]:
    """The processes that recorded a SIGTERM this launcher did not send
    them (:func:`~qsync_jax.process.membership.notice_path`): process index
    -> ``time.time()`` when it came."""
    if self.notices_dir is None:
      return {}
    out = {}
    for i in range(len(self.slots)):
      if i in self.signalled:
        continue
      path = membership.notice_path(self.notices_dir, self.number - 1, i)
      try:
        with open(path) as f:
          out[i] = float(json.load(f)["time"])
      except (OSError, ValueError, KeyError, TypeError):
        continue
    return out

  def judge(self, codes: list[int | None], pool: Pool, t: float) -> str | None:
    """Reads the exit statuses so far; marks the slots that died in ``pool``.

    Args:
      codes: each process's exit status, None while it runs.
      pool: the pool, told of deaths.
      t: seconds since the job started.

    Returns:
      None while the world runs, ``"done"`` when every process exited 0,
      ``"next"`` when the next world is to start.

    Raises:
      Stop: a failure, or an agreed exit without notice, ends the job.
    """
    procs = self.procs
    changed = membership.MEMBERSHIP_CHANGED_EXIT_CODE
    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    if self.preempting:
      return self._judge_preemption(codes)
    dead = [
      i
      for i, c in enumerate(codes)
      if c is not None
      and c < 0
      and i not in self.excused
      and not procs.killed(i)
      and not (c == term and i in self.signalled)
    ]
    if changed in codes:
      # An agreed exit is under way: a peer that aborted as the others left
      # (its coordinator gone) ended with the world; only a SIGKILL is a loss.
      for i in dead:
        if codes[i] != kill:
          self.excused.add(i)
          self.notes.append(
            f"{procs.names[i]} {local.describe_exit(codes[i] or 0)} "
            "as the world ended"
          )
      dead = [i for i in dead if codes[i] == kill]
    if dead:
      # A peer whose runtime aborted because one vanished died of its own
      # signal; a SIGKILL is the node loss.
      dead = [i for i in dead if codes[i] == kill] or dead
      wall = time.time()
      for i in dead:
        # A SIGTERM this launcher did not send, fatal before the process
        # could take it: a reclaim of its slot by someone else.
        cause = "reclaimed" if codes[i] == term else "died"
        pool.died(self.slots[i], t, cause)
        note = f" ({signal_name(codes[i] or 0)} not from this launcher)"
        if cause == "died":
          note = f" ({signal_name(codes[i] or 0)})"
        self.events.append(Event(cause, self.slots[i], t, wall, note))
      procs.kill_running()
      return "next"
    failed = next(
      (
        i
        for i, c in enumerate(codes)
        if c is not None and c > 0 and c != changed
      ),
      None,
    )
    if failed is not None:
      code = codes[failed]
      assert code is not None
      n = procs.kill_running()
      raise Stop(
        code,
        f"error: process {failed} (slot {self.slots[failed]}, pid "
        f"{procs.procs[failed].pid}) {local.describe_exit(code)}; "
        f"killed {n} other process{'' if n == 1 else 'es'}",
      )
    unready = [
      i for i, c in enumerate(codes) if c == term and i in self.signalled
    ]
    if unready:
      n = procs.kill_running()
      self.notes.extend(
        f"{procs.names[i]} died of the notice before it could take it"
        for i in unready
      )
      if n:
        self.notes.append(f"killed {n} other process{'' if n == 1 else 'es'}")
      return "next"
    if any(c is None for c in codes):
      if changed in codes and self.ending_since is None:
        self.ending_since = time.monotonic()
      return None
    if all(c == 0 for c in codes):
      return "done"
    outside = self.outside_notices()
    if outside and len(outside) < len(codes):
      # Some processes alone got a SIGTERM from someone else (whatever
      # shares the host taking its device back): a reclaim of their slots.
      now = time.time()
      for i, when in sorted(outside.items()):
        pool.died(self.slots[i], t, "reclaimed")
        self.events.append(
          Event(
            "reclaimed",
            self.slots[i],
            max(0.0, t - (now - when)),
            when,
            " (a SIGTERM not from this launcher)",
          )
        )
      return "next"
    if self.events:
      return "next"
    who = (
      "every process got SIGTERM from outside this launcher"
      if outside
      else f"every process exited 0 or {changed} with no notice from this "
      "launcher"
    )
    raise Stop(
      changed,
      f"elastic: world {self.number}: {who} (a job-wide preemption); "
      f"ending with {changed} (run it again to resume)",
    )

  def _judge_preemption(self, codes: list[int | None]) -> str | None:
    """:meth:`judge` once the launcher got SIGTERM and passed it on to every
    process: the job ends with the world, with 75 when every process
    checkpointed the step they agreed on and exited 75 (or 0)."""
    changed = membership.MEMBERSHIP_CHANGED_EXIT_CODE
    procs = self.procs
    bad = next(
      (
        i
        for i, c in enumerate(codes)
        if c is not None and c not in (0, changed)
      ),
      None,
    )
    if bad is not None:
      code = codes[bad]
      assert code is not None
      n = procs.kill_running()
      raise Stop(
        128 + int(signal.SIGTERM),
        f"error: launcher got SIGTERM; process {bad} (slot "
        f"{self.slots[bad]}) {local.describe_exit(code)} before it "
        f"checkpointed; killed {n} other process{'' if n == 1 else 'es'} "
        "(the steps since the last checkpoint are lost)",
      )
    if any(c is None for c in codes):
      return None
    if all(c == 0 for c in codes):
      return "done"
    raise Stop(
      changed,
      f"elastic: launcher got SIGTERM: every process checkpointed the step "
      f"they agreed on; ending with {changed} (run the same command again "
      "to resume)",
    )
