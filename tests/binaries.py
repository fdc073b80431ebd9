"""Running the project's binaries from the tests: ``run`` is
``subprocess.run([sys.executable, "-m", module, *args], ...)``, started fast.

A binary spends about 2 s importing jax, flax, optax, orbax and the library
before it reads its flags, and most of the tests that start one check what
it does with bad input, a fraction of a second later. So ``run`` forks the
binary from a *zygote*: a process that has imported those modules once and
started nothing (no JAX backend, no thread but the BLAS pool), as
multiprocessing's forkserver does. The forked child then is what ``python -m
module`` would be: its own pid, ``sys.argv``, environment (``os.environ``
replaced, so ``getenv`` sees it too), working directory and ``sys.path``
(the working directory, then ``PYTHONPATH``); the module runs as
``__main__`` (:func:`runpy.run_module`, which ``-m`` uses), an uncaught
exception prints its traceback and exits 1, ``SystemExit`` exits as the
interpreter would, non-daemon threads are joined and ``atexit`` runs.
Standard input is ``/dev/null``.

What a fork cannot give is an import that reads the environment: jax reads
its ``JAX_*`` settings when it is imported, glibc its ``MALLOC_*`` ones when
the process starts. A zygote is started per distinct value of those
variables (:data:`_IMPORT_TIME_PREFIXES`), with them, and reused for every
run that has the same. The binaries' own modules (``experiments.train``,
whose import reads ``QSYNC_ELASTIC_SLOTS``) are never imported by a zygote:
they run afresh in each child.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Environment variables read at import or at process start, by jax, XLA,
# Python itself, the C library or the BLAS pool: a run whose values differ
# gets a zygote of its own.
_IMPORT_TIME_PREFIXES = (
  "JAX_",
  "XLA_",
  "TF_",
  "PYTHON",
  "LD_",
  "MALLOC_",
  "GLIBC_TUNABLES",
  "OMP_",
  "OPENBLAS_",
  "MKL_",
  "CUDA_",
  "NVIDIA_",
  "TPU_",
)

# What the zygote imports: the libraries the binaries import, not the
# binaries' own modules.
_PRELOAD = (
  "absl.app",
  "absl.flags",
  "ml_collections.config_flags",
  "jax",
  "flax.nnx",
  "optax",
  "orbax.checkpoint",
  "qsync_jax",
  "experiments.config_files",
  "experiments.flag_aliases",
  "experiments.train_lib",
)

# The zygote's program: one request per line on stdin (JSON), one reply per
# line on the protocol descriptor: the child's pid, then its status.
_ZYGOTE = r"""
import importlib, json, os, runpy, sys, threading, traceback, atexit

proto = os.fdopen(int(sys.argv[1]), "w", buffering=1)
for name in json.loads(sys.argv[2]):
  importlib.import_module(name)
base_path = [p for p in sys.path[1:] if p not in
             os.environ.get("PYTHONPATH", "").split(os.pathsep)]
proto.write("ready\n")


def child(req):
  os.setpgid(0, 0)
  os.chdir(req["cwd"])
  os.environ.clear()
  os.environ.update(req["env"])
  extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
  sys.path[:] = [req["cwd"], *extra, *base_path]
  null = os.open(os.devnull, os.O_RDONLY)
  flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
  out = os.open(req["stdout"], flags)
  err = out if req["merge"] else os.open(req["stderr"], flags)
  for fd, to in ((null, 0), (out, 1), (err, 2)):
    os.dup2(fd, to)
  os.closerange(3, 256)
  sys.stdin = open(0, closefd=False)
  sys.argv = [req["module"], *req["args"]]
  code = 0
  try:
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if e.code is None:
      code = 0
    elif isinstance(e.code, int):
      code = e.code
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:
    traceback.print_exc()
    code = 1
  try:
    threading._shutdown()
    atexit._run_exitfuncs()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:
        pass
    os._exit(code & 0xFF)


for line in sys.stdin:
  req = json.loads(line)
  pid = os.fork()
  if pid == 0:
    proto.close()
    child(req)
  proto.write(f"{pid}\n")
  _, status, usage = os.wait4(pid, 0)
  proto.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}\n")
"""


class Completed(subprocess.CompletedProcess):
  """``subprocess.CompletedProcess``, with the run's peak resident memory
  (``wait4``'s ``ru_maxrss``, KiB): ``RUSAGE_CHILDREN`` of the caller does
  not see a process the zygote forked."""

  def __init__(self, args, returncode, stdout, stderr, max_rss_kib: int):
    super().__init__(args, returncode, stdout, stderr)
    self.max_rss_kib = max_rss_kib


class _Zygote:
  """One zygote process and its two pipes."""

  def __init__(self, env: dict[str, str]):
    read, write = os.pipe()
    self.process = subprocess.Popen(
      [sys.executable, "-c", _ZYGOTE, str(write), json.dumps(_PRELOAD)],
      stdin=subprocess.PIPE,
      stdout=subprocess.DEVNULL,
      env=env,
      cwd=ROOT,
      pass_fds=(write,),
      text=True,
    )
    os.close(write)
    self.replies = read
    self.pending = b""
    if self.read_line(None) != "ready":
      raise RuntimeError("the zygote did not start")

  def read_line(self, deadline: float | None) -> str | None:
    """The next reply, or None once ``deadline`` (monotonic) has passed."""
    while b"\n" not in self.pending:
      wait = None if deadline is None else deadline - time.monotonic()
      if wait is not None and wait <= 0:
        return None
      ready, _, _ = select.select([self.replies], [], [], wait)
      if ready:
        chunk = os.read(self.replies, 4096)
        if not chunk:
          raise RuntimeError("the zygote died")
        self.pending += chunk
    line, self.pending = self.pending.split(b"\n", 1)
    return line.decode()

  def close(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
    os.close(self.replies)


_ZYGOTES: dict[tuple[tuple[str, str], ...], _Zygote] = {}


def _close_all() -> None:
  for zygote in _ZYGOTES.values():
    zygote.close()


atexit.register(_close_all)


def _key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
  return tuple(
    sorted(
      (k, v)
      for k, v in env.items()
      if k.startswith(_IMPORT_TIME_PREFIXES) and k != "PYTHONPATH"
    )
  )


def _zygote_for(env: dict[str, str]) -> _Zygote:
  key = _key(env)
  zygote = _ZYGOTES.get(key)
  if zygote is None or zygote.process.poll() is not None:
    zygote_env = dict(env)
    zygote_env["PYTHONPATH"] = os.pathsep.join(
      [ROOT, os.environ.get("PYTHONPATH", "")]
    )
    zygote = _ZYGOTES[key] = _Zygote(zygote_env)
  return zygote


def run(
  module: str,
  *args: str,
  env: dict[str, str] | None = None,
  cwd: str = ROOT,
  timeout: float | None = None,
  merge_stderr: bool = False,
) -> Completed:
  """Runs ``python -m module *args`` and returns what it printed.

  Args:
    module: the module to run as ``__main__``.
    *args: its command-line arguments.
    env: its environment (default: this process's).
    cwd: its working directory.
    timeout: seconds before it is killed (with its process group) and
      ``subprocess.TimeoutExpired`` raised.
    merge_stderr: stderr into stdout, as ``stderr=subprocess.STDOUT``.

  Returns:
    A :class:`Completed`: text ``stdout`` and ``stderr`` (``stderr`` None
    with ``merge_stderr``), ``returncode`` negative for a signal as
    ``subprocess`` reports it, and ``max_rss_kib``.
  """
  env = dict(os.environ if env is None else env)
  zygote = _zygote_for(env)
  with tempfile.TemporaryDirectory(prefix="qsync_jax_test_run_") as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    request = {
      "module": module,
      "args": list(args),
      "env": env,
      "cwd": os.path.abspath(cwd),
      "stdout": out,
      "stderr": err,
      "merge": merge_stderr,
    }
    assert zygote.process.stdin is not None
    zygote.process.stdin.write(json.dumps(request) + "\n")
    zygote.process.stdin.flush()
    deadline = None if timeout is None else time.monotonic() + timeout
    pid = int(zygote.read_line(None) or 0)
    reply = zygote.read_line(deadline)
    if reply is None:
      try:
        os.killpg(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      zygote.read_line(None)
      raise subprocess.TimeoutExpired([module, *args], timeout or 0)
    with open(out, errors="replace") as f:
      stdout = f.read()
    stderr = None
    if not merge_stderr:
      with open(err, errors="replace") as f:
        stderr = f.read()
  status, max_rss_kib = (int(x) for x in reply.split())
  return Completed(
    [sys.executable, "-m", module, *args], status, stdout, stderr, max_rss_kib
  )
