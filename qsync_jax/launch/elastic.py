"""The elastic localhost launcher: worlds of a pool's slots, restarted as
slots are reclaimed, die and come back.

This module owns the supervisor of an elastic run on one host, the
reference for the protocol of :mod:`qsync_jax.process.membership` and the
launcher its tests use: which slots the next world holds, when a running
world is told to end (SIGTERM), how each way a world ends is read, and what
the next world is told about it. Starting processes, relaying their output
and killing them all is :class:`qsync_jax.launch.local.Processes`'s,
as for the plain launcher.

The pool has ``pool_size`` slots; a world is the slots available when it
starts, in ascending order, process ``i`` in slot ``slots[i]``; it starts
when at least ``min_processes`` are available. Every process gets the plain
launcher's ``QSYNC_*`` variables plus
:meth:`~qsync_jax.process.membership.ElasticWorld.to_env`.

* **Reclaim** (an :class:`Availability` interval of slot ``s`` begins):
  SIGTERM to slot ``s``'s process. The processes are expected to agree on a
  step, checkpoint it and all exit with
  :data:`~qsync_jax.process.membership.MEMBERSHIP_CHANGED_EXIT_CODE` (75);
  whatever still runs ``grace_s`` after the notice is SIGKILLed. The next
  world is started without ``s``.
* **Return** (the interval ends, or a dead slot's time out is over): SIGTERM
  to the world's process 0, the same agreed exit, the next world with it.
* Once a world is ending, later changes send no second notice; the next
  world is simply the slots available when it starts.
* **A world still starting:** a notice is sent at once all the same (a
  reclaim does not wait for the job). A process that dies of the SIGTERM
  the launcher sent it was not yet ready to take notices (its runtime's
  handler was not installed): the others are SIGKILLed at once and the next
  world is the one the notice asked for; steps since the last checkpoint
  are lost, the job is not.
* **Death** (a process killed by a signal the launcher did not send): the
  others are SIGKILLed at once, the next world is started without the
  slot. The slot comes back ``rejoin_after_s`` after the death, or when an
  availability interval of that slot that ends after the death ends (the
  provider hands the machine back), whichever is first; with neither it
  stays out. When several processes died before the launcher saw it and
  some of them by SIGKILL, only those count as dead (the others' runtime
  aborted because a peer vanished); likewise, once a process has exited 75
  (an agreed exit under way), a peer killed by another signal ended with
  the world and its slot stays.
* **Failure** (a process exits with a status other than 0 and 75): the
  others are SIGKILLed and the job ends with that status, with one line
  naming the process. All processes exit 0: the job is done, status 0.
  All exit 0 or 75 with no notice from this launcher (someone else sent
  SIGTERM): the job ends with 75, so that whatever runs the launcher can
  start it again to resume.
* **Below ``min_processes``:** the launcher waits for slots to come back,
  saying once for what; when not enough ever will, it ends with one
  ``error:`` line and status 1. More than ``max_restarts`` restarts: one
  ``error:`` line, status 1.

Every world's start is one line on stderr, e.g. ``elastic: world 3: slots
0,1,3 (slot 2 reclaimed at 31.2 s); restart 2``, times in seconds since the
job started; process ``i`` in slot ``s`` has its lines relayed as
``[p<i> s<s>] ``. SIGINT and SIGTERM to the launcher kill every process and
end it with 128 + the signal; ``timeout_s`` bounds the whole job (status
124).

The job's processes share a persistent XLA compilation cache for its
lifetime (``JAX_COMPILATION_CACHE_DIR``: a temporary directory the launcher
removes at the end; every program kept however fast it compiled), so that a
restarted world loads what earlier worlds compiled instead of compiling it
again. jax writes entries from process 0 only and every process reads them:
process 0's programs, the programs every process compiles alike (the update
across workers) and, on GPUs, where device assignments are left out of the
key, every program equal to one of process 0's. An environment that names
its own cache keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from qsync_jax.launch import local
from qsync_jax.process import membership

#: How often the supervisor looks at its processes and the pool.
_TICK_S = 0.05
#: JAX's variable naming its persistent compilation cache directory.
COMPILATION_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"
#: JAX's variable: the shortest compile the cache keeps (seconds). Its
#: default (1 s) would leave out the many short compiles of a start.
CACHE_MIN_COMPILE_TIME_VAR = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
#: Which cause names a change that had several: the least orderly wins.
_PRECEDENCE = ("died", "reclaimed", "returned")


def _number(value: Any) -> bool:
  return (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
  )


@dataclasses.dataclass(frozen=True)
class Availability:
  """When each slot of a pool is reclaimed: the ``--availability`` trace.

  Attributes:
    intervals: per slot, sorted ``(start, end)`` pairs in seconds since the
      job started; the slot is reclaimed while ``start <= t < end``. A slot
      not named is always available.
  """

  intervals: Mapping[int, tuple[tuple[float, float], ...]] = dataclasses.field(
    default_factory=dict
  )

  @classmethod
  def parse(cls, data: Any, pool_size: int) -> Availability:
    """Reads the JSON form, ``{"2": [[30, 60], [90, 100]], ...}``.

    Raises:
      ValueError: not an object, a key that is not a slot of the pool, or
        an interval that is not ``[start, end]`` with ``0 <= start < end``;
        the message reads on from "the availability file".
    """
    if not isinstance(data, dict):
      raise ValueError(
        'is not a JSON object of slot: intervals, as {"2": [[30, 60]]}'
      )
    out: dict[int, tuple[tuple[float, float], ...]] = {}
    for key, value in data.items():
      try:
        slot = int(key)
      except ValueError:
        slot = -1
      if not 0 <= slot < pool_size or str(slot) != key.strip():
        raise ValueError(
          f"names slot {key!r}; the pool's slots are 0..{pool_size - 1}"
        )
      if not isinstance(value, list):
        raise ValueError(
          f"has slot {slot} intervals that are not a list of [start, end]"
        )
      pairs = []
      for pair in value:
        if not (
          isinstance(pair, list)
          and len(pair) == 2
          and all(_number(v) for v in pair)
        ):
          raise ValueError(
            f"has slot {slot} interval {pair!r}, which is not [start, end] "
            "in seconds"
          )
        start, end = float(pair[0]), float(pair[1])
        if start < 0 or end <= start:
          raise ValueError(
            f"has slot {slot} interval [{start:g}, {end:g}], which must "
            "have 0 <= start < end"
          )
        pairs.append((start, end))
      out[slot] = tuple(sorted(pairs))
    return cls(out)

  def reclaimed(self, slot: int, t: float) -> bool:
    """Whether ``slot`` is reclaimed at ``t`` seconds into the job."""
    return any(s <= t < e for s, e in self.intervals.get(slot, ()))

  def ends_after(self, slot: int, t: float) -> list[float]:
    """The ends of ``slot``'s intervals later than ``t``, ascending."""
    return sorted(e for _, e in self.intervals.get(slot, ()) if e > t)


def load_availability(path: str, pool_size: int) -> Availability:
  """Reads an ``--availability`` file (see :meth:`Availability.parse`).

  Raises:
    ValueError: unreadable, not JSON, or malformed; the message names the
      file and what is wrong.
  """
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise ValueError(
      f"cannot read the availability file {path}: {e.strerror}"
    ) from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"the availability file {path} is not JSON: {e}") from None
  try:
    return Availability.parse(data, pool_size)
  except ValueError as e:
    raise ValueError(f"the availability file {path} {e}") from None


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
  """How an elastic launch treats its pool (the launcher's elastic flags).

  Attributes:
    pool_size: how many slots (``--num_processes``).
    min_processes: the fewest processes a world may have.
    availability: when slots are reclaimed.
    rejoin_after_s: seconds after which a dead slot comes back; None: only
      when an availability interval of it ends.
    max_restarts: the most worlds started after the first.
    grace_s: seconds a world has to exit after a notice.
    compilation_cache: give the processes a persistent XLA compilation
      cache that lasts the job (:data:`COMPILATION_CACHE_VAR`), unless the
      environment names one already.
  """

  pool_size: int
  min_processes: int = 1
  availability: Availability = dataclasses.field(default_factory=Availability)
  rejoin_after_s: float | None = None
  max_restarts: int = 100
  grace_s: float = 60.0
  compilation_cache: bool = True

  def __post_init__(self) -> None:
    if self.pool_size < 1:
      raise ValueError(f"--num_processes must be >= 1, got {self.pool_size}")
    if not 1 <= self.min_processes <= self.pool_size:
      raise ValueError(
        f"--min_processes must be in [1, --num_processes={self.pool_size}], "
        f"got {self.min_processes}"
      )
    if self.rejoin_after_s is not None and not (
      math.isfinite(self.rejoin_after_s) and self.rejoin_after_s > 0
    ):
      raise ValueError(
        f"--rejoin_after must be a finite number > 0, got {self.rejoin_after_s}"
      )
    if self.max_restarts < 0:
      raise ValueError(f"--max_restarts must be >= 0, got {self.max_restarts}")
    if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
      raise ValueError(
        f"--grace_s must be a finite number >= 0, got {self.grace_s}"
      )
    bad = [s for s in self.availability.intervals if s >= self.pool_size]
    if bad:
      raise ValueError(
        f"the availability names slot {bad[0]}; the pool's slots are "
        f"0..{self.pool_size - 1}"
      )


class Pool:
  """Which slots are available when: the trace, and the deaths seen."""

  def __init__(self, options: ElasticOptions):
    self.options = options
    #: A dead slot -> (when it died, when it is back or None: never).
    self.dead: dict[int, tuple[float, float | None]] = {}

  def died(self, slot: int, t: float) -> None:
    """Slot ``slot``'s process died at ``t`` seconds into the job."""
    back = (
      [t + self.options.rejoin_after_s] if self.options.rejoin_after_s else []
    )
    back += self.options.availability.ends_after(slot, t)[:1]
    self.dead[slot] = (t, min(back) if back else None)

  def available(self, slot: int, t: float) -> bool:
    """Whether ``slot`` may run at ``t`` seconds into the job."""
    if self.options.availability.reclaimed(slot, t):
      return False
    if slot in self.dead:
      _, back = self.dead[slot]
      return back is not None and t >= back
    return True

  def slots(self, t: float) -> tuple[int, ...]:
    """The slots available at ``t``, ascending."""
    return tuple(
      s for s in range(self.options.pool_size) if self.available(s, t)
    )

  def back_at(self, slot: int, t: float) -> float | None:
    """When ``slot``, out at ``t``, is next available; None: never."""
    # Availability changes only where an interval ends or a death's time
    # out is over, so the earliest such time it is available at is the one.
    times = self.options.availability.ends_after(slot, t)
    back = self.dead[slot][1] if slot in self.dead else None
    if back is not None and back > t:
      times.append(back)
    return next((c for c in sorted(times) if self.available(slot, c)), None)

  def why_out(self, slot: int, t: float) -> str:
    """Why ``slot`` is not available at ``t``, for one line."""
    if self.options.availability.reclaimed(slot, t):
      return f"slot {slot} reclaimed"
    died, back = self.dead[slot]
    if back is None:
      return (
        f"slot {slot} died at {died:.1f} s and never comes back (no "
        "--rejoin_after, and no availability interval of it ends later)"
      )
    return f"slot {slot} died at {died:.1f} s"


@dataclasses.dataclass(frozen=True)
class _Event:
  """One membership event: a notice sent, a death seen, a slot back."""

  cause: str
  slot: int
  t: float  # Seconds since the job started.
  wall: float  # time.time().
  note: str = ""

  def __str__(self) -> str:
    return f"slot {self.slot} {self.cause} at {self.t:.1f} s{self.note}"


def _signal_name(code: int) -> str:
  """``SIGKILL`` for a ``Popen.returncode`` of -9."""
  try:
    return signal.Signals(-code).name
  except ValueError:
    return f"signal {-code}"


class _Stop(Exception):
  """Ends the job with ``code``; ``line`` is its last line on stderr.

  ``count_kills``: the line goes on with how many processes were killed.
  """

  def __init__(self, code: int, line: str, count_kills: bool = False):
    super().__init__(line)
    self.code = code
    self.line = line
    self.count_kills = count_kills


@dataclasses.dataclass
class _World:
  """One world's processes and what happened to it."""

  number: int
  slots: tuple[int, ...]
  procs: local.Processes
  events: list[_Event] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  signalled: set[int] = dataclasses.field(default_factory=set)
  ending_since: float | None = None  # Monotonic time of the first notice.
  excused: set[int] = dataclasses.field(default_factory=set)

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
      _Stop: a failure, or an agreed exit without notice, ends the job.
    """
    procs = self.procs
    changed = membership.MEMBERSHIP_CHANGED_EXIT_CODE
    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
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
        pool.died(self.slots[i], t)
        note = f" ({_signal_name(codes[i] or 0)})"
        self.events.append(_Event("died", self.slots[i], t, wall, note))
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
      raise _Stop(
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
    if self.events:
      return "next"
    raise _Stop(
      changed,
      f"elastic: world {self.number}: every process exited 0 or {changed} "
      "with no notice from this launcher; ending with "
      f"{changed} (run it again to resume)",
    )


class Supervisor:
  """Runs one elastic job: world after world, until it ends.

  Construct it with the checked arguments and call :meth:`run` once, from
  the thread that lives as long as the job (the processes' parent-death
  signal is tied to it).
  """

  def __init__(
    self,
    command: Sequence[str],
    options: ElasticOptions,
    *,
    env: Mapping[str, str],
    port: int | None,
    timeout_s: float | None,
    dead_peer_timeout_s: float,
    address: Callable[[int], str],
    wrap: Callable[[int, list[str]], list[str]] | None,
  ):
    self.command = list(command)
    self.options = options
    self.pool = Pool(options)
    self.base_env = {
      k: v for k, v in env.items() if k not in membership.ELASTIC_VARS
    }
    self.port = port
    self.timeout_s = timeout_s
    self.dead_peer_timeout_s = dead_peer_timeout_s
    self.address = address
    self.wrap = wrap
    self.lock = threading.Lock()
    self.received: list[int] = []
    self._t0 = time.monotonic()
    #: The job's compilation cache directory, while the job runs.
    self.cache_dir: str | None = None

  def cache_env(self) -> dict[str, str]:
    """The compilation cache variables of the processes ({} without the
    launcher's cache)."""
    if self.cache_dir is None:
      return {}
    env = {COMPILATION_CACHE_VAR: self.cache_dir}
    if CACHE_MIN_COMPILE_TIME_VAR not in self.base_env:
      env[CACHE_MIN_COMPILE_TIME_VAR] = "0"
    return env

  def now(self) -> float:
    """Seconds since the job started."""
    return time.monotonic() - self._t0

  def log(self, line: str) -> None:
    """One line on stderr, never inside a relayed one."""
    with self.lock:
      print(line, file=sys.stderr, flush=True)

  def run(self) -> int:
    """Runs the job; returns the launcher's exit status."""
    world: _World | None = None
    if (
      self.options.compilation_cache
      and COMPILATION_CACHE_VAR not in self.base_env
    ):
      self.cache_dir = tempfile.mkdtemp(prefix="qsync_elastic_xla_")
    try:
      with local.stop_signals() as self.received:
        restart = 0
        while True:
          slots, waited = self._wait_for_slots()
          events = [] if world is None else world.events + waited
          if restart > self.options.max_restarts:
            raise _Stop(
              1,
              f"error: elastic: {'; '.join(map(str, events))}, and "
              f"--max_restarts={self.options.max_restarts} restarts are "
              "used up",
            )
          world = self._start(restart, slots, world, events)
          done = self._watch(world)
          world.procs.close()
          if done:
            return 0
          restart += 1
    except _Stop as stop:
      n = 0 if world is None else world.procs.kill_running()
      if world is not None:
        world.procs.close()
      self.log(
        f"{stop.line}; killed {n} processes" if stop.count_kills else stop.line
      )
      return stop.code
    finally:
      if world is not None:
        world.procs.close()  # Nothing is left running, whatever happened.
      if self.cache_dir is not None:
        shutil.rmtree(self.cache_dir, ignore_errors=True)

  def _check_stop(self) -> None:
    if self.received:
      name = signal.Signals(self.received[0]).name
      raise _Stop(128 + self.received[0], f"error: launcher got {name}", True)
    if self.timeout_s is not None and self.now() >= self.timeout_s:
      raise _Stop(
        local.TIMEOUT_EXIT_CODE,
        f"error: timed out after {self.timeout_s:g} s",
        True,
      )

  def _wait_for_slots(self) -> tuple[tuple[int, ...], list[_Event]]:
    """Waits until at least ``min_processes`` slots are available.

    Returns:
      The slots, and the returns that happened while waiting.

    Raises:
      _Stop: not enough slots will ever be available.
    """
    want = self.options.min_processes
    said: tuple[int, ...] | None = None
    out_at_start = None
    while True:
      self._check_stop()
      t = self.now()
      slots = self.pool.slots(t)
      if out_at_start is None:
        out_at_start = set(range(self.options.pool_size)) - set(slots)
      if len(slots) >= want:
        wall = time.time()
        back = [
          _Event("returned", s, t, wall)
          for s in sorted(out_at_start & set(slots))
        ]
        return slots, back if said is not None else []
      out = [s for s in range(self.options.pool_size) if s not in slots]
      backs = sorted(
        (b, s) for s in out if (b := self.pool.back_at(s, t)) is not None
      )
      have = (
        f"{len(slots)} slot{'' if len(slots) == 1 else 's'} available "
        f"({','.join(map(str, slots)) or 'none'}) and --min_processes="
        f"{want}"
      )
      if len(slots) + len(backs) < want:
        never = [s for s in out if self.pool.back_at(s, t) is None]
        raise _Stop(
          1,
          f"error: elastic: {have}, and "
          + "; ".join(self.pool.why_out(s, t) for s in never),
        )
      if slots != said:
        needed = backs[: want - len(slots)]
        self.log(
          f"elastic: {have}; waiting for "
          + ", ".join(f"slot {s} (back at {b:.1f} s)" for b, s in needed)
        )
        said = slots
      time.sleep(_TICK_S)

  def _start(
    self,
    restart: int,
    slots: tuple[int, ...],
    ended: _World | None,
    events: list[_Event],
  ) -> _World:
    """Starts the world ``slots``; logs it; returns it."""
    port = local.free_port() if self.port is None else self.port
    start_wall = time.time()
    change = None
    if ended is not None:
      causes = {e.cause for e in events}
      exit_times = [t for t in ended.procs.exit_times() if t is not None]
      change = membership.Change(
        cause=next(c for c in _PRECEDENCE if c in causes),
        slots_before=ended.slots,
        slots_after=slots,
        event_time=min(e.wall for e in events),
        exit_time=max(exit_times, default=start_wall),
        start_time=start_wall,
        detail="; ".join([*map(str, events), *ended.notes]),
      )
    world_env = membership.ElasticWorld(
      slots, self.options.pool_size, restart, change
    ).to_env()
    env = local.launch_env(
      {**self.base_env, **world_env},
      f"{self.address(slots[0])}:{port}",
      len(slots),
    )
    world = _World(
      restart + 1,
      slots,
      local.Processes(self.dead_peer_timeout_s, lock=self.lock),
    )
    why = f" ({change.detail})" if change else " (start)"
    self.log(
      f"elastic: world {world.number}: slots {','.join(map(str, slots))}"
      f"{why}" + (f"; restart {restart}" if restart else "")
    )
    try:
      for i, s in enumerate(slots):
        argv = self.command if self.wrap is None else self.wrap(s, self.command)
        world.procs.start(
          argv,
          {**env, **self.cache_env(), local.ENV_PROCESS_ID: str(i)},
          f"process {i} (slot {s})",
          f"[p{i} s{s}] ",
        )
    except BaseException:
      world.procs.close()  # Those started before the failure go too.
      raise
    return world

  def _watch(self, world: _World) -> bool:
    """Watches ``world`` until it ends.

    Returns:
      True when every process exited 0 (the job is done); False when the
      next world is to start (``world.events`` says why).

    Raises:
      _Stop: the job ends (a failure, the launcher stopped, timed out, or
        an agreed exit this launcher did not ask for).
    """
    while True:
      self._check_stop()
      codes = world.procs.returncodes()
      ended = world.judge(codes, self.pool, self.now())
      if ended is not None:
        return ended == "done"
      self._notify(world)
      if (
        world.ending_since is not None
        and time.monotonic() - world.ending_since >= self.options.grace_s
      ):
        n = world.procs.kill_running()
        if n:
          world.notes.append(
            f"killed {n} process{'' if n == 1 else 'es'} still running "
            f"{self.options.grace_s:g} s after the notice"
          )
      time.sleep(_TICK_S)

  def _notify(self, world: _World) -> None:
    """Sends the notices the pool asks for now (one SIGTERM per world end)."""
    t = self.now()
    want = self.pool.slots(t)
    seen = {e.slot for e in world.events}
    leaving = [s for s in world.slots if s not in want and s not in seen]
    joining = [s for s in want if s not in world.slots and s not in seen]
    if not leaving and not joining:
      return
    wall = time.time()
    ending = world.ending_since is not None
    targets = [world.slots.index(s) for s in leaving] or [0]
    for s in leaving:
      world.events.append(_Event("reclaimed", s, t, wall))
    for s in joining:
      world.events.append(_Event("returned", s, t, wall))
    if ending:
      return  # The world is ending already: no second notice.
    world.ending_since = time.monotonic()
    for i in targets:
      world.signalled.add(i)
      world.procs.send(i, signal.SIGTERM)


def launch_elastic(
  command: Sequence[str],
  options: ElasticOptions,
  *,
  port: int | None = None,
  timeout_s: float | None = None,
  dead_peer_timeout_s: float = 60,
  env: Mapping[str, str] | None = None,
  address: Callable[[int], str] | None = None,
  wrap: Callable[[int, list[str]], list[str]] | None = None,
) -> int:
  """Runs ``command`` as an elastic job over ``options.pool_size`` slots.

  Args:
    command: The program and its arguments, run as is by every process of
      every world.
    options: The pool and how it is treated.
    port: The coordinator's port, the same for every world; None picks a
      free one per world.
    timeout_s: Kill everything after this many seconds of the whole job.
    dead_peer_timeout_s: The longest to wait for killed processes to be
      reaped.
    env: The processes' base environment; None uses ``os.environ``.
    address: Maps a slot to its address as the others reach it; the
      coordinator is the address of the world's process 0's slot (an
      emulated link's ``links.LinkEmulator.address``). None: 127.0.0.1.
    wrap: Maps (slot, command) to the command actually run, e.g. in the
      slot's network namespace and cgroup (``links.LinkEmulator.wrap``).

  Returns:
    0 when a world ends with every process exiting 0; a failing process's
    status; 75 after an agreed exit this launcher did not ask for; 1 when
    too few slots will ever be available or the restarts are used up; 124
    on timeout; 128 + the signal number when the launcher is interrupted.

  Raises:
    ValueError: ``command`` is empty, its program is a directory or not
      executable, or ``port`` is out of range or in use.
    FileNotFoundError: The program does not exist.
  """
  base_env = dict(os.environ if env is None else env)
  local.check_launch(command, options.pool_size, port, base_env)
  return Supervisor(
    command,
    options,
    env=base_env,
    port=port,
    timeout_s=timeout_s,
    dead_peer_timeout_s=dead_peer_timeout_s,
    address=address or (lambda slot: "127.0.0.1"),
    wrap=wrap,
  ).run()
