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
key, every program equal to one of process 0's. The other processes'
per-device programs (a worker's gradient pass) are kept in the same
directory by the trainer (:mod:`qsync_jax.train.executable_cache`). An
environment that names its own cache keeps it.

Once every process of a world has stepped, the launcher starts hot
standbys for the next world (:mod:`qsync_jax.launch.standby`), two per slot
unless ``standbys_per_slot`` says otherwise: each an interpreter with the
program's imports done, waiting for its world. The second covers a world
that ends before its first step, which starts none. The
next world's processes are these standbys where they still run, and the
world's line says how many (``; 4 from hot standbys``). Without
``hot_standby`` (``--nohot_standby``) every process starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from qsync_jax.launch import local
from qsync_jax.launch import standby
from qsync_jax.launch.pool import ElasticOptions
from qsync_jax.launch.pool import Pool
from qsync_jax.launch.world import Event
from qsync_jax.launch.world import Stop
from qsync_jax.launch.world import World
from qsync_jax.process import membership

#: How often the supervisor looks at its processes and the pool.
_TICK_S = 0.05
#: JAX's variable naming its persistent compilation cache directory.
COMPILATION_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"
#: JAX's variable: the shortest compile the cache keeps (seconds). Its
#: default (1 s) would leave out the many short compiles of a start.
CACHE_MIN_COMPILE_TIME_VAR = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


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
    #: The next world's processes, started ahead (``hot_standby``).
    self.standbys: standby.Standbys | None = None

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
    world: World | None = None
    if (
      self.options.compilation_cache
      and COMPILATION_CACHE_VAR not in self.base_env
    ):
      self.cache_dir = tempfile.mkdtemp(prefix="qsync_elastic_xla_")
    self.notices_dir = tempfile.mkdtemp(prefix="qsync_elastic_notices_")
    if self.options.hot_standby:
      # The environment every world shares: the world's QSYNC_* aside.
      shared = local.launch_env(self.base_env, "", 0) | self.cache_env()
      self.standbys = standby.Standbys.of(
        self.command, shared, self.wrap, self.options.standbys_per_slot
      )
    try:
      with local.stop_signals() as self.received:
        restart = 0
        while True:
          slots, waited = self._wait_for_slots()
          events = [] if world is None else world.events + waited
          if restart > self.options.max_restarts:
            raise Stop(
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
    except Stop as stop:
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
      if self.standbys is not None:
        self.standbys.close()
      if self.cache_dir is not None:
        shutil.rmtree(self.cache_dir, ignore_errors=True)
      if self.notices_dir is not None:
        shutil.rmtree(self.notices_dir, ignore_errors=True)

  def _check_stop(self, world: World | None = None) -> None:
    """Ends the job on a signal or the timeout; a first SIGTERM to the
    launcher while ``world`` runs is passed on to it instead (a job-wide
    preemption, :meth:`_preempt`).

    Raises:
      Stop: SIGINT, a second signal, SIGTERM between worlds, or timeout.
    """
    if self.received:
      signum = self.received[0]
      if signum == signal.SIGTERM and len(self.received) == 1:
        if world is not None:
          self._preempt(world)
        else:
          changed = membership.MEMBERSHIP_CHANGED_EXIT_CODE
          raise Stop(
            changed,
            "elastic: launcher got SIGTERM between worlds (the last one "
            f"checkpointed); ending with {changed} (run the same command "
            "again to resume)",
          )
      else:
        name = signal.Signals(signum).name
        raise Stop(128 + signum, f"error: launcher got {name}", True)
    if self.timeout_s is not None and self.now() >= self.timeout_s:
      raise Stop(
        local.TIMEOUT_EXIT_CODE,
        f"error: timed out after {self.timeout_s:g} s",
        True,
      )

  def _wait_for_slots(self) -> tuple[tuple[int, ...], list[Event]]:
    """Waits until at least ``min_processes`` slots are available.

    Returns:
      The slots, and the returns that happened while waiting.

    Raises:
      Stop: not enough slots will ever be available.
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
          Event("returned", s, t, wall)
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
        raise Stop(
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
    ended: World | None,
    events: list[Event],
  ) -> World:
    """Starts the world ``slots``; logs it; returns it."""
    port = local.free_port() if self.port is None else self.port
    start_wall = time.time()
    change = (
      None if ended is None else ended.next_change(events, slots, start_wall)
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
    world = World(
      restart + 1,
      slots,
      local.Processes(self.dead_peer_timeout_s, lock=self.lock),
      notices_dir=self.notices_dir,
      change=change,
    )
    envs = []
    for i in range(len(slots)):
      own = {local.ENV_PROCESS_ID: str(i)}
      if self.notices_dir is not None:
        own[membership.ENV_PROGRESS] = membership.progress_path(
          self.notices_dir, restart, i
        )
      envs.append({**env, **self.cache_env(), **own})
    ready = [
      None if self.standbys is None else self.standbys.take(s, envs[i])
      for i, s in enumerate(slots)
    ]
    hot = len(ready) - ready.count(None)
    why = f" ({change.detail})" if change else " (start)"
    self.log(
      f"elastic: world {world.number}: slots {','.join(map(str, slots))}"
      f"{why}"
      + (f"; restart {restart}" if restart else "")
      + (f"; {hot} from hot standbys" if hot else "")
    )
    try:
      for i, s in enumerate(slots):
        names = (f"process {i} (slot {s})", f"[p{i} s{s}] ")
        p = ready[i]
        if p is not None:
          world.procs.adopt(p, *names)
          continue
        argv = self.command if self.wrap is None else self.wrap(s, self.command)
        world.procs.start(argv, envs[i], *names)
    except BaseException:
      world.procs.close()  # Those started before the failure go too.
      for p in ready:
        if p is not None and p not in world.procs.procs:
          standby.reap(p)
      raise
    return world

  def _preempt(self, world: World) -> None:
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

  def _watch(self, world: World) -> bool:
    """Watches ``world`` until it ends.

    Returns:
      True when every process exited 0 (the job is done); False when the
      next world is to start (``world.events`` says why).

    Raises:
      Stop: the job ends (a failure, the launcher stopped, timed out, or
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
        self.standbys is not None
        and not world.standbys_started
        and world.ending_since is None
        and all(p == membership.STEPPED for p in world.progress() or [None])
      ):
        # Past the world's start: the standbys' imports no longer delay it.
        world.standbys_started = True
        self.standbys.fill(range(self.options.pool_size))
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

  def _notify(self, world: World) -> None:
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
      world.events.append(Event("reclaimed", s, t, wall))
    for s in joining:
      world.events.append(Event("returned", s, t, wall))
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
