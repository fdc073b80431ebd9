r"""The localhost launcher: N processes of one run, none left behind.

This module owns starting the processes of a multi-process run on one host
(:func:`launch`): each gets the ``QSYNC_*`` variables that
:func:`qsync_jax.process.initialize.initialize` reads, its output is relayed
line by line, and none is ever left behind: when any process dies, the others
are SIGKILLed (a JAX worker ignores SIGTERM once initialized, and its peers
would otherwise block forever in the next collective). Each process runs in
its own process group, which the launcher SIGKILLs when it stops or is
interrupted, and on Linux it also dies when the launcher dies, even by
SIGKILL (the parent-death signal). :class:`Processes` and
:func:`stop_signals` hold these guarantees; the elastic launcher
(:mod:`qsync_jax.launch.elastic`) reuses them.

Usage:
  python -m qsync_jax.distributed --num_processes=4 [--port=N] \
      [--timeout_s=S] -- python -m experiments.train --out_dir=/tmp/run

Each process gets QSYNC_COORDINATOR_ADDRESS, QSYNC_NUM_PROCESSES and
QSYNC_PROCESS_ID, which ``initialize()`` reads. The launcher exits with 0 when
every process exits 0, with the failing process's code (1 if it was killed by
a signal) when one fails, with 75 when every process exited 0 or 75 (each
checkpointed the step they agreed on after a SIGTERM: an orderly preemption,
said in one ``launch:`` line that is not an error), and with 124 when
--timeout_s runs out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import contextlib
import ctypes
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, IO

from qsync_jax.process import detection
from qsync_jax.process import membership

#: The variables each process gets (``initialize()`` reads them).
ENV_COORDINATOR_ADDRESS = detection.ENV_COORDINATOR_ADDRESS
ENV_NUM_PROCESSES = detection.ENV_NUM_PROCESSES
ENV_PROCESS_ID = detection.ENV_PROCESS_ID

#: Exit status of a launch that ran past its timeout (as timeout(1) uses).
TIMEOUT_EXIT_CODE = 124

#: How often a launcher looks at its processes.
POLL_INTERVAL_S = 0.2

#: The exit status of a process that checkpointed the step every process
#: agreed on after a notice (SIGTERM): not a failure.
PREEMPTED = membership.MEMBERSHIP_CHANGED_EXIT_CODE

# From <linux/prctl.h>: deliver a signal to this process when its parent dies.
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
  """Returns a localhost TCP port that was free a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def check_port_free(port: int) -> None:
  """Checks that the coordinator could listen on ``port`` now.

  Process 0's coordination service crashes (SIGSEGV) on a port in use, so
  the launcher asks first. The probe binds every IPv4 address, with
  SO_REUSEADDR as the service does, so only a live socket counts as taken.

  Args:
    port: A TCP port.

  Raises:
    ValueError: The port cannot be bound; the message says why.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("", port))
    except OSError as e:
      reason = (
        "is already in use"
        if e.errno == errno.EADDRINUSE
        else f"cannot be bound ({e.strerror})"
      )
      raise ValueError(
        f"coordinator port {port} {reason}; pick another port or leave "
        "it out to use a free one"
      ) from None


def check_program(program: str, env: Mapping[str, str]) -> str:
  """The path of ``program`` as ``exec`` would find it (``PATH`` of ``env``).

  Checked before any process starts, so a typo is one line naming the
  program instead of the first ``Popen``'s traceback.

  Raises:
    FileNotFoundError: no such file (on ``PATH``, for a bare name).
    ValueError: it is a directory, or not executable.
  """
  if os.sep in program:
    path = program
    if not os.path.exists(program):
      raise FileNotFoundError(
        f"the command to launch, {program!r}, does not exist"
      )
  else:
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
      raise FileNotFoundError(
        f"the command to launch, {program!r}, is not on PATH"
      )
    path = found
  if os.path.isdir(path):
    raise ValueError(f"the command to launch, {program!r}, is a directory")
  if not os.access(path, os.X_OK):
    raise ValueError(
      f"the command to launch, {program!r}, is not executable (chmod +x it, "
      "or run it through its interpreter, e.g. -- python script.py)"
    )
  return path


def _die_with_parent() -> Callable[[], None] | None:
  """Returns a ``preexec_fn`` that ties a child's life to the launcher's.

  On Linux the child gets SIGKILL when the launcher dies, by any signal
  (``prctl(PR_SET_PDEATHSIG)``). The kernel sends it when the *thread* that
  started the child exits, so ``launch`` starts and waits for its processes
  in one thread. Elsewhere there is no such call and None is returned: the
  process group is then the only tie.
  """
  if not sys.platform.startswith("linux"):
    return None
  # Looked up here, in the parent: between fork and exec the child must not
  # load libraries or take locks another thread may have held at the fork.
  prctl = ctypes.CDLL(None, use_errno=True).prctl
  launcher = os.getpid()

  def preexec() -> None:
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
      os._exit(126)
    if os.getppid() != launcher:  # It died before the call above.
      os._exit(126)

  return preexec


def popen_kwargs() -> dict[str, Any]:
  """How a launcher starts a process: its output piped (relayed with a
  prefix), its own process group, and the parent-death signal tied to the
  calling thread (:func:`_die_with_parent`)."""
  return {
    "stdout": subprocess.PIPE,
    "stderr": subprocess.PIPE,
    "process_group": 0,
    "preexec_fn": _die_with_parent(),
  }


def _relay(
  pipe: IO[bytes], out: str, prefix: str, lock: threading.Lock
) -> None:
  """Copies ``pipe`` line by line to ``sys.<out>``, each line prefixed."""
  with pipe:
    for line in iter(pipe.readline, b""):
      text = line.decode(errors="replace")
      if not text.endswith("\n"):
        text += "\n"
      stream = getattr(sys, out)  # Looked up late: tests swap sys.stdout.
      with lock:
        stream.write(prefix + text)
        stream.flush()


def describe_exit(code: int) -> str:
  """How a process ended, for one line: ``exited with code 3`` or ``was
  killed by SIGKILL (code -9)`` (``code`` as ``Popen.returncode`` has it)."""
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name} (code {code})"
    except ValueError:
      pass
  return f"exited with code {code}"


@contextlib.contextmanager
def stop_signals() -> Iterator[list[int]]:
  """Records SIGINT and SIGTERM sent to the launcher instead of dying of them.

  A launcher's loop reads the list this yields and kills its processes
  itself, so that none is left behind. The handlers are installed only in
  the main thread (elsewhere the list stays empty), and the previous ones
  come back on exit.

  Yields:
    The signal numbers received, in order.
  """
  received: list[int] = []

  def on_signal(signum, frame):
    del frame
    received.append(signum)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {
      s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)
    }
  try:
    yield received
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


class Processes:
  """The processes a launcher started, and the guarantee that none outlives it.

  Each process leads its own process group, so that a terminal's Ctrl-C
  reaches only the launcher and every kill takes whatever the process
  started too. Its stdout and stderr lines are relayed with a prefix; a
  thread per process records its exit status and wall time as it exits. On
  Linux a process also gets SIGKILL when the thread that started it ends
  (the parent-death signal), so start them all from one thread that lives
  as long as the launcher. :meth:`close` SIGKILLs whatever still runs.
  """

  def __init__(
    self, dead_peer_timeout_s: float = 60, lock: threading.Lock | None = None
  ):
    """No process yet.

    Args:
      dead_peer_timeout_s: The longest to wait for SIGKILLed processes to
        be reaped (SIGKILL makes this near-instant).
      lock: Held while a whole line is written to the launcher's streams;
        share one between several of these and the launcher's own lines.
    """
    self.dead_peer_timeout_s = dead_peer_timeout_s
    self.procs: list[subprocess.Popen] = []
    self.names: list[str] = []
    self._codes: list[int | None] = []
    self._exit_times: list[float | None] = []
    self._waiters: list[threading.Thread] = []
    self._relays: list[threading.Thread] = []
    self._killed: set[int] = set()
    self._state = threading.Lock()
    self.lock = threading.Lock() if lock is None else lock
    self._popen_kwargs = popen_kwargs()

  def start(
    self, argv: Sequence[str], env: Mapping[str, str], name: str, prefix: str
  ) -> int:
    """Starts one process.

    Args:
      argv: The command to run.
      env: Its whole environment.
      name: How error lines name it, e.g. ``"process 1"``.
      prefix: Put before each of its relayed lines, e.g. ``"[p1] "``.

    Returns:
      Its index in :attr:`procs`.
    """
    p = subprocess.Popen(list(argv), env=dict(env), **self._popen_kwargs)
    return self.adopt(p, name, prefix)

  def adopt(self, p: subprocess.Popen, name: str, prefix: str) -> int:
    """Takes on a process started with :func:`popen_kwargs` from the same
    thread, as if :meth:`start` had started it (a hot standby,
    :mod:`qsync_jax.launch.standby`); returns its index in :attr:`procs`."""
    index = len(self.procs)
    self.procs.append(p)
    self.names.append(name)
    self._codes.append(None)
    self._exit_times.append(None)
    waiter = threading.Thread(target=self._wait, args=(index,), daemon=True)
    waiter.start()
    self._waiters.append(waiter)
    for pipe, out in ((p.stdout, "stdout"), (p.stderr, "stderr")):
      t = threading.Thread(
        target=_relay, args=(pipe, out, prefix, self.lock), daemon=True
      )
      t.start()
      self._relays.append(t)
    return index

  def _wait(self, index: int) -> None:
    code = self.procs[index].wait()
    exited = time.time()
    with self._state:
      self._codes[index] = code
      self._exit_times[index] = exited

  def returncodes(self) -> list[int | None]:
    """Each process's exit status (``Popen.returncode``), None while it runs."""
    with self._state:
      return list(self._codes)

  def exit_times(self) -> list[float | None]:
    """Each process's ``time.time()`` when it exited, None while it runs."""
    with self._state:
      return list(self._exit_times)

  def killed(self, index: int) -> bool:
    """Whether :meth:`kill_running` SIGKILLed process ``index``."""
    return index in self._killed

  def send(self, index: int, signum: int) -> None:
    """Sends ``signum`` to process ``index`` alone (not its group), if it
    still runs."""
    if self.returncodes()[index] is None:
      try:
        self.procs[index].send_signal(signum)
      except ProcessLookupError:
        pass

  def kill_running(self) -> int:
    """SIGKILLs every process still running, reaps it; returns the count."""
    codes = self.returncodes()
    running = [i for i, c in enumerate(codes) if c is None]
    for i in running:
      self._killed.add(i)
      p = self.procs[i]
      # SIGKILL, as a JAX worker ignores SIGTERM; to the whole group, so
      # that whatever the process started goes too.
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        p.kill()
    deadline = time.monotonic() + self.dead_peer_timeout_s
    for i in running:
      self._waiters[i].join(timeout=max(0.0, deadline - time.monotonic()))
      if self._waiters[i].is_alive():
        self.print(
          f"error: {self.names[i]} (pid {self.procs[i].pid}) survived SIGKILL"
        )
    return len(running)

  def join_output(self, timeout_s: float = 2.0) -> None:
    """Waits for the relayed output of the processes that exited.

    Bounded: a grandchild may still hold a pipe open.
    """
    deadline = time.monotonic() + timeout_s
    for t in self._relays:
      t.join(timeout=max(0.0, deadline - time.monotonic()))
    self._relays = [t for t in self._relays if t.is_alive()]

  def print(self, line: str) -> None:
    """Writes ``line`` to stderr between relayed lines, never inside one."""
    with self.lock:
      print(line, file=sys.stderr, flush=True)

  def close(self) -> None:
    """SIGKILLs whatever still runs and waits for the relayed output."""
    self.kill_running()
    self.join_output()


def launch_env(
  base: Mapping[str, str], coordinator_address: str, num_processes: int
) -> dict[str, str]:
  """The environment every process of one localhost run shares.

  ``base`` plus the ``QSYNC_*`` variables ``initialize()`` reads (all but
  the process id), one CPU device per process, and unbuffered Python, so
  relayed lines arrive as they are printed.
  """
  env = dict(base)
  env.update(
    {
      ENV_COORDINATOR_ADDRESS: coordinator_address,
      ENV_NUM_PROCESSES: str(num_processes),
      "JAX_NUM_CPU_DEVICES": "1",
    }
  )
  env.setdefault("PYTHONUNBUFFERED", "1")
  return env


def check_launch(
  command: Sequence[str],
  num_processes: int,
  port: int | None,
  env: Mapping[str, str],
) -> None:
  """Checks a launch's arguments before any process starts.

  Raises:
    ValueError: ``command`` is empty, its program is a directory or not
      executable, ``num_processes`` or ``port`` is out of range, or
      ``port`` is in use.
    FileNotFoundError: The program does not exist.
  """
  if not command:
    raise ValueError("no command to launch")
  check_program(command[0], env)
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if port is not None:
    if not 0 < port < 65536:
      raise ValueError(f"port must be in [1, 65535], got {port}")
    check_port_free(port)


def launch(
  command: Sequence[str],
  num_processes: int,
  *,
  port: int | None = None,
  timeout_s: float | None = None,
  dead_peer_timeout_s: float = 60,
  env: Mapping[str, str] | None = None,
  coordinator_host: str = "127.0.0.1",
  wrap: Callable[[int, list[str]], list[str]] | None = None,
) -> int:
  """Runs ``command`` as ``num_processes`` processes of one localhost run.

  Each process gets the ``QSYNC_*`` variables ``initialize()`` reads and
  ``JAX_NUM_CPU_DEVICES=1``; its stdout and stderr lines are relayed with a
  ``[p<id>] `` prefix. When a process exits non-zero or is killed, every other
  one is SIGKILLed at once and one line on stderr says which process died.
  SIGINT and SIGTERM sent to the launcher also kill every process (handlers
  are installed only when called from the main thread, and restored after).
  Each process leads its own process group, and every kill goes to the whole
  group. On Linux a process also gets SIGKILL when the thread that called
  ``launch`` ends, so a launcher killed by SIGKILL leaves no process behind.
  (:class:`Processes` holds these guarantees; the elastic launcher,
  :mod:`qsync_jax.launch.elastic`, reuses them.)

  Args:
    command: The program and its arguments, run as is by every process.
    num_processes: How many processes to start.
    port: The coordinator's port; None picks a free one.
    timeout_s: Kill every process after this many seconds; None waits.
    dead_peer_timeout_s: The longest to wait for killed processes to be
      reaped once one process failed (SIGKILL makes this near-instant).
    env: The processes' base environment; None uses ``os.environ``.
    coordinator_host: Process 0's address as the others reach it (an
      emulated link's namespace address, see ``links.LinkEmulator``).
    wrap: Maps (process id, command) to the command actually run, e.g.
      inside a network namespace (``links.LinkEmulator.wrap``).

  Returns:
    0 when every process exits 0; 75 when every process exits 0 or 75 (an
    orderly preemption: the processes checkpointed the step they agreed on;
    a process still running ``dead_peer_timeout_s`` after the first 75 is
    killed and the launch fails with 1); the failing process's exit code (1
    if a signal killed it) when one fails; 124 on timeout; 128 + the signal
    number when the launcher is interrupted.

  Raises:
    ValueError: ``command`` is empty, its program is a directory or not
      executable, ``num_processes`` or ``port`` is out of range, or
      ``port`` is in use.
    FileNotFoundError: The program does not exist.
  """
  base_env = dict(os.environ if env is None else env)
  check_launch(command, num_processes, port, base_env)
  if port is None:
    port = free_port()
  base_env = launch_env(base_env, f"{coordinator_host}:{port}", num_processes)
  procs = Processes(dead_peer_timeout_s)
  summary = []  # The one error line, printed after the relayed output.
  start = time.monotonic()
  first_out: float | None = None  # When the first process exited 75.
  with stop_signals() as received:
    try:
      for i in range(num_processes):
        argv = list(command) if wrap is None else wrap(i, list(command))
        procs.start(
          argv, {**base_env, ENV_PROCESS_ID: str(i)}, f"process {i}", f"[p{i}] "
        )
      while True:
        if received:
          n = procs.kill_running()
          name = signal.Signals(received[0]).name
          summary.append(f"error: launcher got {name}; killed {n} processes")
          return 128 + received[0]
        codes = procs.returncodes()
        failed = next(
          (i for i, c in enumerate(codes) if c not in (None, 0, PREEMPTED)),
          None,
        )
        if failed is not None:
          code = codes[failed]
          assert code is not None
          n = procs.kill_running()
          summary.append(
            f"error: process {failed} (pid {procs.procs[failed].pid}) "
            f"{describe_exit(code)}; killed {n} other "
            f"process{'' if n == 1 else 'es'}"
          )
          return code if code > 0 else 1
        if all(c == 0 for c in codes):
          return 0
        if all(c in (0, PREEMPTED) for c in codes):
          # An orderly end on a notice: every process checkpointed the step
          # they agreed on; whatever runs the launcher starts it again.
          summary.append(
            f"launch: every process exited 0 or {PREEMPTED} (checkpointed "
            f"the step they agreed on after a SIGTERM); ending with "
            f"{PREEMPTED} (run the same command again to resume)"
          )
          return PREEMPTED
        if PREEMPTED in codes:
          first_out = first_out or time.monotonic()
          if time.monotonic() - first_out >= dead_peer_timeout_s:
            i = codes.index(None)
            n = procs.kill_running()
            summary.append(
              f"error: process {codes.index(PREEMPTED)} exited "
              f"{PREEMPTED} on a notice and process {i} was still running "
              f"{dead_peer_timeout_s:g} s later; killed {n} "
              f"process{'' if n == 1 else 'es'}"
            )
            return 1
        if timeout_s is not None and time.monotonic() - start >= timeout_s:
          n = procs.kill_running()
          summary.append(
            f"error: timed out after {timeout_s:g} s; killed {n} processes"
          )
          return TIMEOUT_EXIT_CODE
        time.sleep(POLL_INTERVAL_S)
    finally:
      procs.close()  # Nothing is left running, whatever went wrong above.
      for line in summary:
        procs.print(line)
