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
* **A world still starting:** where a world started after a change has
  processes that all hold notices and none has finished a step (each
  process's :data:`~qsync_jax.process.membership.ENV_PROGRESS` file), it
  has trained nothing since the checkpoint it restored: it is SIGKILLed at
  once and the next world started, its change carried into the next one's
  (one change from the world before, its events and details joined). The
  job's first world always gets the notice: the step it agrees on is the
  checkpoint the next one resumes from, where the change is recorded.
  Otherwise a notice is sent at once all the same (a reclaim does not wait
  for the job). A process that dies of the SIGTERM the launcher sent it
  was not yet ready to take notices (its runtime's handler was not
  installed): the others are SIGKILLed at once and the next world is the
  one the notice asked for; steps since the last checkpoint are lost, the
  job is not.
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
* **A reclaim this launcher did not start** (whatever shares the host
  takes a device back with a SIGTERM to its process): each process records
  a SIGTERM it receives in the job's notices directory
  (:data:`~qsync_jax.process.membership.ENV_NOTICES`, written by
  :class:`~qsync_jax.process.preemption.PreemptionWatch`) before the
  processes agree on a step. When every process exited 0 or 75 and some,
  not all, recorded a SIGTERM this launcher did not send, their slots are
  reclaimed: out as a dead slot is (back after ``rejoin_after_s`` or when
  an availability interval of it ends), the change's cause ``reclaimed``.
  A process killed by such a SIGTERM before it could take it counts the
  same. All exit 0 or 75 and every process got such a SIGTERM, or none
  recorded one: a job-wide preemption, the job ends with 75, so that
  whatever runs the launcher can start it again to resume.
* **Below ``min_processes``:** the launcher waits for slots to come back,
  saying once for what; when not enough ever will, it ends with one
  ``error:`` line and status 1. More than ``max_restarts`` restarts: one
  ``error:`` line, status 1.

Every world's start is one line on stderr, e.g. ``elastic: world 3: slots
0,1,3 (slot 2 reclaimed at 31.2 s); restart 2``, times in seconds since the
job started; process ``i`` in slot ``s`` has its lines relayed as
``[p<i> s<s>] ``. SIGTERM to the launcher is a job-wide preemption: it is
passed on to every process, they checkpoint the step they agree on, and
the launcher ends with 75 once all exited 0 or 75 (with 143 and one
``error:`` line when one did not; between worlds at once with 75). SIGINT,
or a second signal, kills every process and ends it with 128 + the signal;
``timeout_s`` bounds the whole job (status 124). A launcher killed by
SIGKILL takes its processes with it (a parent-death signal and a process
group each, :class:`qsync_jax.launch.local.Processes`).

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
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from qsync_jax.launch import local
from qsync_jax.launch.pool import ElasticOptions
from qsync_jax.launch.pool import Pool
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

  def unstepped(self) -> bool:
    """Whether every process holds notices and none has finished a step
    (their :func:`~qsync_jax.process.membership.progress_path` files)."""
    if self.notices_dir is None:
      return False
    for i in range(len(self.slots)):
      path = membership.progress_path(self.notices_dir, self.number - 1, i)
      try:
        with open(path) as f:
          if f.read().strip() == membership.STEPPED:
            return False
      except OSError:
        return False  # Not started, or a program that writes none.
    return True

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
      _Stop: a failure, or an agreed exit without notice, ends the job.
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
        note = f" ({_signal_name(codes[i] or 0)} not from this launcher)"
        if cause == "died":
          note = f" ({_signal_name(codes[i] or 0)})"
        self.events.append(_Event(cause, self.slots[i], t, wall, note))
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
    outside = self.outside_notices()
    if outside and len(outside) < len(codes):
      # Some processes alone got a SIGTERM from someone else (whatever
      # shares the host taking its device back): a reclaim of their slots.
      now = time.time()
      for i, when in sorted(outside.items()):
        pool.died(self.slots[i], t, "reclaimed")
        self.events.append(
          _Event(
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
    raise _Stop(
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
      raise _Stop(
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
    raise _Stop(
      changed,
      f"elastic: launcher got SIGTERM: every process checkpointed the step "
      f"they agreed on; ending with {changed} (run the same command again "
      "to resume)",
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
    #: Where the processes record the SIGTERMs they receive, while the job
    #: runs (:data:`~qsync_jax.process.membership.ENV_NOTICES`).
    self.notices_dir: str | None = None

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
    self.notices_dir = tempfile.mkdtemp(prefix="qsync_elastic_notices_")
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
      if self.notices_dir is not None:
        shutil.rmtree(self.notices_dir, ignore_errors=True)

  def _check_stop(self, world: _World | None = None) -> None:
    """Ends the job on a signal or the timeout; a first SIGTERM to the
    launcher while ``world`` runs is passed on to it instead (a job-wide
    preemption, :meth:`_preempt`).

    Raises:
      _Stop: SIGINT, a second signal, SIGTERM between worlds, or timeout.
    """
    if self.received:
      signum = self.received[0]
      if signum == signal.SIGTERM and len(self.received) == 1:
        if world is not None:
          self._preempt(world)
        else:
          changed = membership.MEMBERSHIP_CHANGED_EXIT_CODE
          raise _Stop(
            changed,
            "elastic: launcher got SIGTERM between worlds (the last one "
            f"checkpointed); ending with {changed} (run the same command "
            "again to resume)",
          )
      else:
        name = signal.Signals(signum).name
        raise _Stop(128 + signum, f"error: launcher got {name}", True)
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
      slots_before = ended.slots
      event_time = min(e.wall for e in events)
      details = [*map(str, events), *ended.notes]
      carried = ended.change if ended.ended_unstepped else None
      if carried is not None:
        # The ended world trained nothing: one change, from the world
        # before it to this one.
        causes.add(carried.cause)
        slots_before = carried.slots_before
        event_time = min(event_time, carried.event_time)
        details.insert(0, carried.detail)
      change = membership.Change(
        cause=next(c for c in _PRECEDENCE if c in causes),
        slots_before=slots_before,
        slots_after=slots,
        event_time=event_time,
        exit_time=max(exit_times, default=start_wall),
        start_time=start_wall,
        detail="; ".join(details),
      )
    world_env = membership.ElasticWorld(
      slots, self.options.pool_size, restart, change
    ).to_env()
    if self.notices_dir is not None:
      world_env[membership.ENV_NOTICES] = self.notices_dir
    env = local.launch_env(
      {**self.base_env, **world_env},
      f"{self.address(slots[0])}:{port}",
      len(slots),
    )
    world = _World(
      restart + 1,
      slots,
      local.Processes(self.dead_peer_timeout_s, lock=self.lock),
      notices_dir=self.notices_dir,
      change=change,
    )
    why = f" ({change.detail})" if change else " (start)"
    self.log(
      f"elastic: world {world.number}: slots {','.join(map(str, slots))}"
      f"{why}" + (f"; restart {restart}" if restart else "")
    )
    try:
      for i, s in enumerate(slots):
        argv = self.command if self.wrap is None else self.wrap(s, self.command)
        own = {local.ENV_PROCESS_ID: str(i)}
        if self.notices_dir is not None:
          own[membership.ENV_PROGRESS] = membership.progress_path(
            self.notices_dir, restart, i
          )
        world.procs.start(
          argv,
          {**env, **self.cache_env(), **own},
          f"process {i} (slot {s})",
          f"[p{i} s{s}] ",
        )
    except BaseException:
      world.procs.close()  # Those started before the failure go too.
      raise
    return world

  def _preempt(self, world: _World) -> None:
    """Passes the launcher's SIGTERM on to every process of ``world`` (once):
    they checkpoint the step they agree on and exit 75, and the job ends
    with the world."""
    if world.preempting:
      return
    world.preempting = True
    if world.ending_since is None:
      world.ending_since = time.monotonic()
    self.log(
      f"elastic: world {world.number}: launcher got SIGTERM; every process "
      "checkpoints the step they agree on (a job-wide preemption)"
    )
    for i in range(len(world.slots)):
      if i not in world.signalled:
        world.signalled.add(i)
        world.procs.send(i, signal.SIGTERM)

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
      self._check_stop(world)
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
    if world.change is not None and world.unstepped():
      n = world.procs.kill_running()
      world.ended_unstepped = True
      world.notes.append(
        f"world {world.number} ended at once, before its first step "
        f"({n} process{'' if n == 1 else 'es'} killed, nothing to checkpoint)"
      )
      return
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
    status; 75 after a job-wide preemption (the launcher got SIGTERM, or
    every process got one from someone else) or an agreed exit this
    launcher cannot explain; 1 when too few slots will ever be available
    or the restarts are used up; 124 on timeout; 128 + the signal number
    when the launcher is interrupted (SIGINT, a second signal, or a
    process that did not checkpoint after its SIGTERM).

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
