"""Hot standbys: the elastic launcher's next world, started ahead of need.

This module owns a process started before it is needed. It is a Python
interpreter that imports what the program imports at its top, then waits
for the environment of the world it will join, then runs the program in
itself, as ``python -m MODULE`` or ``python SCRIPT`` would. While a world
trains, the elastic launcher keeps standbys in each pool slot, two by
default (:class:`Standbys`). The next world's processes then skip the
interpreter's start and those imports: about 2.5 s of CPU each for this
library's train binary, most of it jax and flax.

The program sees what a fresh interpreter gives it:

* its argv;
* the world's environment (``os.environ`` replaced, so ``getenv`` agrees),
  the working directory, and ``sys.path[0]``;
* stdin ``/dev/null``;
* ``__main__`` run by ``runpy``;
* the interpreter's exit semantics.

Two things differ:

* The modules the program imports at its top are imported before the
  world is known. They see the job's environment without the world's
  ``QSYNC_*`` variables. A program whose imports read a world's variable at
  import time must run without standbys (``--nohot_standby``).
* ``/proc/<pid>/environ`` shows the environment the standby started with,
  as it does for any process that changed its own.

Only ``[python, "-m", MODULE, ...]`` and ``[python, SCRIPT, ...]`` get a
standby, where ``python`` is the launcher's own interpreter. A standby
imports nothing of its own beyond the standard library, and imports the
program's top-level modules only up to its first statement that changes the
environment or ``sys.path`` (:func:`top_level_imports`): a program that
sets, e.g., ``JAX_PLATFORMS`` before it imports jax gets jax imported after
it, as without a standby.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import subprocess
import sys
from typing import Any, NoReturn

#: A variable a world may set differently from the standby's start. Every
#: other variable must be as the standby started with it.
WORLD_PREFIX = "QSYNC_"
#: The signals the preloaded modules' threads block, so that none of them
#: takes one the program's main thread blocks.
_DEFERRED_SIGNALS = frozenset(
  (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
  + (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
)
#: The standby's first argument: the pipe it writes to once its imports
#: are done (its launcher takes only a standby that has written).
READY_FD_FLAG = "--ready_fd="
#: The status of a standby told to run in an environment that differs from
#: its own beyond the world's variables (a launcher's bug, never a fallback).
REFUSED_EXIT_CODE = 3


@dataclasses.dataclass(frozen=True)
class Program:
  """What a standby runs: a module (``-m``) or a script, with its args."""

  module: str | None
  script: str | None
  args: tuple[str, ...]

  @classmethod
  def parse(cls, argv: Sequence[str]) -> Program | None:
    """The program of ``argv`` (a command less its interpreter), or None
    for another form (interpreter options, ``-c``, nothing)."""
    if len(argv) >= 2 and argv[0] == "-m":
      return cls(argv[1], None, tuple(argv[2:]))
    if argv and not argv[0].startswith("-"):
      return cls(None, argv[0], tuple(argv[1:]))
    return None

  def source(self) -> str | None:
    """The program's source file, or None where there is none."""
    if self.script is not None:
      return self.script
    try:
      spec = importlib.util.find_spec(self.module or "")
    except (ImportError, ValueError):
      return None
    return None if spec is None else spec.origin


def command(python_command: Sequence[str]) -> list[str] | None:
  """The standby's command for ``python_command``, or None where it gets
  none: not this interpreter, or not ``-m MODULE`` or a script."""
  if not python_command or Program.parse(python_command[1:]) is None:
    return None
  try:
    same = os.path.samefile(python_command[0], sys.executable)
  except OSError:
    return None
  if not same:
    return None
  # Run as a file, not with -m: importing this package would import jax
  # ahead of the program's own code.
  return [python_command[0], os.path.abspath(__file__), *python_command[1:]]


#: Methods that change the dict or list they are called on.
_MUTATORS = frozenset(
  ("update", "setdefault", "pop", "popitem", "clear", "insert", "append")
  + ("extend", "remove", "__setitem__", "__delitem__")
)


def _names_environment(node: ast.AST) -> bool:
  """Whether ``node`` mentions ``<x>.environ`` or ``sys.path``."""
  return any(
    isinstance(n, ast.Attribute)
    and (
      n.attr == "environ"
      or (
        n.attr == "path"
        and isinstance(n.value, ast.Name)
        and n.value.id == "sys"
      )
    )
    for n in ast.walk(node)
  )


def changes_environment(statement: ast.stmt) -> bool:
  """Whether ``statement`` may change what a later import sees: it assigns
  to, deletes from or calls a mutating method of ``os.environ`` or
  ``sys.path``, or calls ``putenv``, ``unsetenv`` or ``chdir``."""
  for n in ast.walk(statement):
    if isinstance(n, (ast.Assign, ast.Delete)):
      if any(_names_environment(t) for t in n.targets):
        return True
    elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
      if _names_environment(n.target):
        return True
    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
      if n.func.attr in ("putenv", "unsetenv", "chdir"):
        return True
      if n.func.attr in _MUTATORS and _names_environment(n.func.value):
        return True
  return False


def top_level_imports(path: str) -> list[str]:
  """The absolute modules the file ``path`` imports in its own body, in
  order, up to its first statement that :func:`changes_environment`.

  ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and
  ``a.b`` (imported only where ``b`` is a module). Imports inside
  functions, classes or blocks are left out.
  """
  try:
    with open(path, "rb") as f:
      tree = ast.parse(f.read(), path)
  except (OSError, SyntaxError, ValueError):
    return []
  names: list[str] = []
  for node in tree.body:
    if changes_environment(node):
      break
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.append(node.module)
      names += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
  return list(dict.fromkeys(names))


def _preload(names: Iterable[str]) -> None:
  """Imports ``names``; a failure is left for the program's own import to
  raise (``from a import b`` where ``b`` is not a module is no failure)."""
  for name in names:
    try:
      importlib.import_module(name)
    except Exception:  # pylint: disable=broad-except
      pass


def differences(
  started: Mapping[str, str], env: Mapping[str, str]
) -> list[str]:
  """The variables outside the world's (:data:`WORLD_PREFIX`) whose values
  differ between the standby's start and the world's environment."""
  return sorted(
    k
    for k in set(started) | set(env)
    if not k.startswith(WORLD_PREFIX) and started.get(k) != env.get(k)
  )


def serve(program: Program, ready_fd: int | None = None) -> NoReturn:
  """The standby itself: preloads, waits for the world's environment as one
  JSON line on stdin, and runs ``program`` as ``__main__``. Writes one
  byte to ``ready_fd`` (then closes it) once its imports are done.

  Ends with status 0 without running anything when stdin closes first (the
  launcher no longer needs it), and with :data:`REFUSED_EXIT_CODE` and one
  ``error:`` line when the environment differs outside the world's
  variables.
  """
  if not sys.flags.safe_path:
    # As the interpreter sets it: the working directory for -m, the
    # script's directory for a script (this file's directory until now).
    sys.path[0] = (
      os.getcwd()
      if program.script is None
      else os.path.dirname(os.path.abspath(program.script))
    )
  started = dict(os.environ)
  # Threads the imports start inherit this mask: a signal to the process
  # then reaches the program's main thread, which unblocks them below, or
  # stays pending where the program blocks it again (as a fresh process's
  # threads would, started after the program's own mask).
  mask = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
  source = program.source()
  if source is not None:
    _preload(top_level_imports(source))
  if ready_fd is not None:  # Told once the imports are done.
    os.write(ready_fd, b"r")
    os.close(ready_fd)
  line = sys.stdin.buffer.readline()
  if not line:
    raise SystemExit(0)
  env = json.loads(line)
  changed = differences(started, env)
  if changed:
    print(
      "error: standby: the world's environment differs from the one it "
      f"started with in {', '.join(changed)}",
      file=sys.stderr,
      flush=True,
    )
    raise SystemExit(REFUSED_EXIT_CODE)
  os.environ.clear()
  os.environ.update(env)
  signal.pthread_sigmask(signal.SIG_SETMASK, mask)
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.close(devnull)
  sys.stdin = open(0, closefd=False)  # pylint: disable=consider-using-with
  if program.module is not None:
    sys.argv = [program.module, *program.args]  # runpy sets argv[0]
    runpy.run_module(program.module, run_name="__main__", alter_sys=True)
  else:
    assert program.script is not None
    sys.argv = [program.script, *program.args]
    runpy.run_path(program.script, run_name="__main__")
  raise SystemExit(0)


class Standbys:
  """Up to ``per_slot`` standbys per slot, each started in its slot's wrapper.

  More than one per slot covers a world that ends before its first step:
  it has used its slots' standbys, and the next world still finds one
  ready in each (new ones start only once a world has stepped).

  Start and take them from the thread that starts the launcher's processes:
  they share its parent-death signal.
  """

  def __init__(
    self,
    command: Sequence[str],
    env: Mapping[str, str],
    popen_kwargs: Mapping[str, Any],
    wrap: Callable[[int, list[str]], list[str]] | None = None,
    per_slot: int = 1,
  ):
    """No standby yet.

    Args:
      command: the standby's command (:func:`command`).
      env: the environment every world shares (no world's variables).
      popen_kwargs: how the launcher starts its processes (output pipes,
        process group, parent-death signal).
      wrap: maps (slot, command) to the command run in the slot (its
        network namespace and cgroup), or None.
      per_slot: how many standbys :meth:`fill` keeps per slot.

    Raises:
      ValueError: ``per_slot`` is below 1.
    """
    if per_slot < 1:
      raise ValueError(f"standbys per slot must be >= 1, got {per_slot}")
    self.command = list(command)
    self.env = dict(env)
    self.popen_kwargs = dict(popen_kwargs)
    self.wrap = wrap
    self.per_slot = per_slot
    #: Each slot's standbys, oldest first, each with the read end of the
    #: pipe on which it says that its imports are done.
    self.waiting: dict[int, list[tuple[subprocess.Popen, int]]] = {}

  @classmethod
  def of(
    cls,
    python_command: Sequence[str],
    env: Mapping[str, str],
    wrap: Callable[[int, list[str]], list[str]] | None = None,
    per_slot: int = 1,
  ) -> Standbys | None:
    """The standbys of ``python_command`` (:func:`command`), started as the
    launcher starts its processes (:func:`qsync_jax.launch.local.
    popen_kwargs`) with ``env`` less the world's variables, ``per_slot`` per
    slot; None where the command gets none."""
    from qsync_jax.launch import local  # pylint: disable=g-import-not-at-top

    standby_command = command(python_command)
    if standby_command is None:
      return None
    shared = {k: v for k, v in env.items() if not k.startswith(WORLD_PREFIX)}
    return cls(standby_command, shared, local.popen_kwargs(), wrap, per_slot)

  def fill(self, slots: Iterable[int]) -> int:
    """Starts standbys until each of ``slots`` has ``per_slot`` running
    (those that exited are reaped); returns how many were started."""
    started = 0
    for slot in slots:
      queue = self.waiting.setdefault(slot, [])
      for entry in [e for e in queue if e[0].poll() is not None]:
        queue.remove(entry)
        reap(*entry)
      while len(queue) < self.per_slot:
        queue.append(self._start(slot))
        started += 1
      if not queue:
        del self.waiting[slot]
    return started

  def _start(self, slot: int) -> tuple[subprocess.Popen, int]:
    """One standby in ``slot``'s wrapper, and its ready pipe's read end."""
    ready, ready_w = os.pipe()
    cmd = [*self.command[:2], f"{READY_FD_FLAG}{ready_w}", *self.command[2:]]
    try:
      p = subprocess.Popen(
        cmd if self.wrap is None else self.wrap(slot, cmd),
        env=self.env,
        stdin=subprocess.PIPE,
        pass_fds=(ready_w,),
        **self.popen_kwargs,
      )
    except BaseException:
      os.close(ready)
      raise
    finally:
      os.close(ready_w)
    return p, ready

  def take(self, slot: int, env: Mapping[str, str]) -> subprocess.Popen | None:
    """``slot``'s oldest ready standby, told to run with ``env``; None where
    it has none ready. One still importing is kept for a later world (a
    notice sent to it now would wait for its imports, then end the program
    as it starts); one that exited is reaped."""
    queue = self.waiting.get(slot, [])
    try:
      return self._take_from(queue, env)
    finally:
      if not queue:
        self.waiting.pop(slot, None)

  @staticmethod
  def _take_from(
    queue: list[tuple[subprocess.Popen, int]], env: Mapping[str, str]
  ) -> subprocess.Popen | None:
    """:meth:`take` on one slot's ``queue``."""
    for entry in list(queue):
      p, ready = entry
      if p.poll() is not None:
        queue.remove(entry)
        reap(p, ready)
        continue
      if not select.select([ready], [], [], 0)[0]:
        continue
      queue.remove(entry)
      os.close(ready)
      assert p.stdin is not None
      try:
        p.stdin.write(json.dumps(dict(env)).encode() + b"\n")
        p.stdin.close()
        p.stdin = None  # As a process started without it.
      except BrokenPipeError:  # It exited since the poll.
        reap(p)
        continue
      return p
    return None

  def close(self) -> None:
    """Ends every standby not taken."""
    for queue in self.waiting.values():
      for p, ready in queue:
        reap(p, ready)
    self.waiting.clear()


def reap(p: subprocess.Popen, ready: int | None = None) -> None:
  """SIGKILLs ``p``'s process group (it leads one) and reaps it; closes its
  ``ready`` pipe."""
  if ready is not None:
    os.close(ready)
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  for pipe in (p.stdin, p.stdout, p.stderr):
    if pipe is not None:
      pipe.close()
  p.wait()


if __name__ == "__main__":
  _args = sys.argv[1:]
  _ready_fd = None
  if _args and _args[0].startswith(READY_FD_FLAG):
    _ready_fd = int(_args.pop(0)[len(READY_FD_FLAG) :])
  _program = Program.parse(_args)
  if _program is None:
    print(
      f"error: standby: not a program to run: {sys.argv[1:]}", file=sys.stderr
    )
    raise SystemExit(2)
  serve(_program, _ready_fd)
