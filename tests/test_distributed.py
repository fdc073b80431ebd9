"""Tests for qsync_jax.process.initialize and qsync_jax.launch.local: the env
contract, joining a run, and the localhost launcher.

Multi-process runs use real JAX workers on localhost CPU (one device each).
Every worker writes its PID to a file first, so that a failing test can
SIGKILL whatever it left behind; launches run under a hard timeout.
"""

import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest

from experiments.configs import default as default_config
from qsync_jax.launch import local
from qsync_jax.process import detection
from qsync_jax.process import initialize

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every worker script starts by recording its PID, before anything can hang.
_PREAMBLE = """\
import os, sys
out = sys.argv[1]
with open(os.path.join(out, "pid" + os.environ["QSYNC_PROCESS_ID"]), "w") as f:
  f.write(str(os.getpid()))
"""

_PSUM_WORKER = (
  _PREAMBLE
  + """\
import time
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from qsync_jax.process import initialize

assert initialize.initialize()
assert initialize.initialize()  # Idempotent.
pid = jax.process_index()
mesh = jax.make_mesh((jax.device_count(),), ("workers",),
                     axis_types=(AxisType.Auto,), devices=jax.devices())
local = np.array([[pid + 1.0]], np.float32)
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("workers")), local)
psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "workers"), mesh=mesh,
                             in_specs=P("workers"), out_specs=P()))
mode = sys.argv[2]
if mode == "die" and pid == 1:
  # Leave process 0 alone in the collective, where it would wait forever.
  while not os.path.exists(os.path.join(out, "entering0")):
    time.sleep(0.05)
  time.sleep(0.3)
  with open(os.path.join(out, "died_at"), "w") as f:
    f.write(repr(time.time()))
  os._exit(3)
if mode == "die":
  open(os.path.join(out, "entering0"), "w").close()
total = float(np.asarray(psum(x).addressable_data(0)).ravel()[0])
print("psum", total, "on", jax.process_count(), "processes")
with open(os.path.join(out, f"result{pid}"), "w") as f:
  f.write(repr(total))
initialize.shutdown()
"""
)

_SLEEP_WORKER = (
  _PREAMBLE
  + """\
import time
time.sleep(120)
"""
)


# A resumed world whose notice arrives while it starts, before its first
# step: every process must stop at its first step boundary (the checkpoint's
# step plus one), as the runtime agreed on before any process passed one.
_EARLY_NOTICE_WORKER = (
  _PREAMBLE
  + """\
import signal, time
import jax
from qsync_jax.process import initialize
from qsync_jax.process import preemption

assert initialize.initialize()
if jax.process_index() == 0:
  os.kill(os.getpid(), signal.SIGTERM)  # taken by the runtime's notifier
time.sleep(4)  # the processes agree on the point meanwhile
with preemption.PreemptionWatch() as watch:
  reached = [watch.reached(step) for step in range(46, 52)]
with open(os.path.join(out, f"reached{jax.process_index()}"), "w") as f:
  f.write(repr(reached))
initialize.shutdown()
"""
)


def _write_worker(tmp_path, source):
  script = tmp_path / "worker.py"
  script.write_text(source)
  return str(script)


def _worker_env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
  )
  return env


def _pids(tmp_path):
  return {
    int(f.name[3:]): int(f.read_text())
    for f in tmp_path.glob("pid*")
    if f.read_text()
  }


def _is_running(pid):
  """True while ``pid`` exists and is not a zombie (dead, not yet reaped)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f"/proc/{pid}/stat") as f:
      # The state follows the parenthesized command name.
      return f.read().rpartition(")")[2].split()[0] != "Z"
  except FileNotFoundError:  # Just reaped, or no /proc (not Linux).
    return not os.path.isdir("/proc")


def _kill_leftovers(tmp_path, script):
  """SIGKILLs workers still running ``script`` (checked, as PIDs recycle)."""
  for pid in _pids(tmp_path).values():
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if script.encode() not in f.read():
          continue
      os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
      pass


def _launch(
  tmp_path, script, num_processes, *args, hard_timeout_s=50, **kwargs
):
  """Runs ``launch`` on ``script`` under a hard timeout; returns its code."""
  result = []
  command = [sys.executable, script, str(tmp_path), *args]
  thread = threading.Thread(
    target=lambda: result.append(
      local.launch(command, num_processes, env=_worker_env(), **kwargs)
    ),
    daemon=True,
  )
  try:
    thread.start()
    thread.join(hard_timeout_s)
    assert not thread.is_alive(), f"launch ran past {hard_timeout_s} s"
    assert result, "launch raised (see the thread's traceback)"
    return result[0]
  finally:
    _kill_leftovers(tmp_path, script)


def test_config_from_env_unset():
  assert initialize.config_from_env({}) is None
  assert initialize.config_from_env({"PATH": "/bin"}) is None


def test_config_from_env_parses():
  config = initialize.config_from_env(
    {
      "QSYNC_COORDINATOR_ADDRESS": "127.0.0.1:1234",
      "QSYNC_NUM_PROCESSES": "4",
      "QSYNC_PROCESS_ID": "3",
    }
  )
  # Every process of the localhost launcher is on this host.
  assert config == detection.Launch("qsync", 4, 3, "127.0.0.1:1234", 3, 4)


@pytest.mark.parametrize(
  "address,num,pid,bad_var",
  [
    ("127.0.0.1:1234", None, None, "QSYNC_NUM_PROCESSES"),
    (None, "2", "0", "QSYNC_COORDINATOR_ADDRESS"),
    ("127.0.0.1:1234", "2", None, "QSYNC_PROCESS_ID"),
    ("127.0.0.1:1234", "two", "0", "QSYNC_NUM_PROCESSES"),
    ("127.0.0.1:1234", "2", "1.0", "QSYNC_PROCESS_ID"),
    ("127.0.0.1:1234", "2", "2", "QSYNC_PROCESS_ID"),
    ("127.0.0.1:1234", "2", "-1", "QSYNC_PROCESS_ID"),
    ("127.0.0.1:1234", "0", "0", "QSYNC_NUM_PROCESSES"),
    ("127.0.0.1", "2", "0", "QSYNC_COORDINATOR_ADDRESS"),
    ("127.0.0.1:port", "2", "0", "QSYNC_COORDINATOR_ADDRESS"),
  ],
)
def test_config_from_env_errors_name_the_variable(address, num, pid, bad_var):
  values = zip(
    ("QSYNC_COORDINATOR_ADDRESS", "QSYNC_NUM_PROCESSES", "QSYNC_PROCESS_ID"),
    (address, num, pid),
  )
  environ = {name: value for name, value in values if value is not None}
  with pytest.raises(ValueError, match=bad_var):
    initialize.config_from_env(environ)


def test_initialize_single_process_is_a_no_op(monkeypatch):
  for name in (
    "QSYNC_COORDINATOR_ADDRESS",
    "QSYNC_NUM_PROCESSES",
    "QSYNC_PROCESS_ID",
  ):
    monkeypatch.delenv(name, raising=False)
  assert not initialize.initialize()
  assert not initialize.initialize(
    detection.Launch("explicit", 1, 0, "127.0.0.1:1")
  )
  initialize.shutdown()  # Nothing to leave; must not raise.


@pytest.fixture
def joined(monkeypatch):
  """What ``initialize`` passes to ``jax.distributed.initialize``, which is
  not called (nor is the jax config changed)."""
  calls = []
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(
    jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs)
  )
  monkeypatch.setattr(jax.config, "update", lambda name, value: None)
  return calls


def test_initialize_explicit_arguments_win_over_config(joined):
  config = detection.Launch("explicit", 2, 0, "127.0.0.1:1")
  assert initialize.initialize(
    config, coordinator_address="10.0.0.1:2", num_processes=4, process_id=3
  )
  (kwargs,) = joined
  assert (
    kwargs["coordinator_address"],
    kwargs["num_processes"],
    kwargs["process_id"],
  ) == ("10.0.0.1:2", 4, 3)
  # Each alone wins too; the config fills in the rest.
  assert initialize.initialize(config, process_id=1)
  assert (
    joined[-1]["coordinator_address"],
    joined[-1]["num_processes"],
    joined[-1]["process_id"],
  ) == ("127.0.0.1:1", 2, 1)
  # One process, explicitly: nothing to join.
  assert not initialize.initialize(config, num_processes=1)
  assert len(joined) == 2


@pytest.mark.parametrize(
  "kwargs,flag",
  [
    ({"process_id": 2}, "--process_id"),
    ({"num_processes": 0}, "--num_processes"),
    ({"coordinator_address": "nohost"}, "--coordinator_address"),
  ],
)
def test_initialize_checks_explicit_arguments_beside_config(
  joined, kwargs, flag
):
  config = detection.Launch("explicit", 2, 0, "127.0.0.1:1")
  with pytest.raises(ValueError, match=flag):
    initialize.initialize(config, **kwargs)
  assert joined == []


def test_initialize_timeouts_default_to_the_main_jobs():
  # One default: a library caller and the binary wait as long.
  dist = default_config.get_config().distributed
  defaults = {
    name: p.default
    for name, p in inspect.signature(initialize.initialize).parameters.items()
  }
  assert defaults["timeout_s"] == dist.initialization_timeout_s == 300
  assert defaults["heartbeat_timeout_s"] == dist.heartbeat_timeout_s
  assert defaults["shutdown_timeout_s"] == dist.shutdown_timeout_s


@pytest.mark.parametrize(
  "command,num_processes,port",
  [([], 2, None), (["true"], 0, None), (["true"], 2, 70000)],
)
def test_launch_rejects_bad_arguments(command, num_processes, port):
  with pytest.raises(ValueError):
    local.launch(command, num_processes, port=port)


def test_launch_two_processes_psum(tmp_path):
  script = _write_worker(tmp_path, _PSUM_WORKER)
  start = time.monotonic()
  code = _launch(tmp_path, script, 2, "ok", timeout_s=45)
  elapsed = time.monotonic() - start
  print(f"2-process psum run took {elapsed:.2f} s")
  assert code == 0
  for pid in (0, 1):
    assert float((tmp_path / f"result{pid}").read_text()) == 3.0


def test_a_notice_before_a_resumed_worlds_first_step_stops_it_there(tmp_path):
  script = _write_worker(tmp_path, _EARLY_NOTICE_WORKER)
  code = _launch(tmp_path, script, 2, timeout_s=60, hard_timeout_s=80)
  assert code == 0
  for pid in (0, 1):
    reached = (tmp_path / f"reached{pid}").read_text()
    assert reached == repr([True, False, False, False, False, False])


def test_launch_kills_peers_when_one_dies(tmp_path):
  script = _write_worker(tmp_path, _PSUM_WORKER)
  start = time.monotonic()
  code = _launch(tmp_path, script, 2, "die", timeout_s=55)
  returned_at = time.time()
  elapsed = time.monotonic() - start
  abort = returned_at - float((tmp_path / "died_at").read_text())
  print(
    f"launch returned after {elapsed:.2f} s, {abort:.2f} s after process 1 died"
  )
  assert code != 0 and code != local.TIMEOUT_EXIT_CODE
  assert elapsed < 60
  assert abort < 10
  assert not (tmp_path / "result0").exists()  # Process 0 never finished.
  pids = _pids(tmp_path)
  assert set(pids) == {0, 1}
  assert not any(_is_running(pid) for pid in pids.values())


def test_launch_timeout_kills_everything(tmp_path):
  script = _write_worker(tmp_path, _SLEEP_WORKER)
  code = _launch(tmp_path, script, 3, timeout_s=2)
  assert code == local.TIMEOUT_EXIT_CODE
  pids = _pids(tmp_path)
  assert set(pids) == {0, 1, 2}
  assert not any(_is_running(pid) for pid in pids.values())


def _run_cli(*args, **kwargs):
  return subprocess.Popen(
    [sys.executable, "-m", "qsync_jax.distributed", *args],
    env=_worker_env(),
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    **kwargs,
  )


def test_cli_sigterm_kills_children(tmp_path):
  script = _write_worker(tmp_path, _SLEEP_WORKER)
  launcher = _run_cli(
    "--num_processes=2", "--", sys.executable, script, str(tmp_path)
  )
  try:
    deadline = time.monotonic() + 30
    while len(_pids(tmp_path)) < 2:
      assert time.monotonic() < deadline, "workers never started"
      assert launcher.poll() is None, launcher.communicate()
      time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "error: launcher got SIGTERM; killed 2 processes" in stderr
    assert not any(_is_running(pid) for pid in _pids(tmp_path).values())
  finally:
    launcher.kill()
    launcher.wait()
    _kill_leftovers(tmp_path, script)


# A worker that starts a grandchild in its process group, then sleeps.
_SPAWN_WORKER = (
  _PREAMBLE
  + """\
import subprocess, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(out, "pid1" + os.environ["QSYNC_PROCESS_ID"]), "w") as f:
  f.write(str(child.pid))
time.sleep(120)
"""
)


def _wait_for_pids(tmp_path, launcher, count):
  deadline = time.monotonic() + 30
  while len(_pids(tmp_path)) < count:
    assert time.monotonic() < deadline, "workers never started"
    assert launcher.poll() is None, launcher.communicate()
    time.sleep(0.1)
  return _pids(tmp_path)


def _wait_gone(pids, within_s):
  """Returns the PIDs of ``pids`` still running after ``within_s`` seconds."""
  deadline = time.monotonic() + within_s
  while any(_is_running(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  return [p for p in pids if _is_running(p)]


@pytest.mark.skipif(
  not sys.platform.startswith("linux"),
  reason="the parent-death signal is Linux only",
)
def test_cli_sigkill_of_launcher_kills_workers(tmp_path):
  script = _write_worker(tmp_path, _SLEEP_WORKER)
  launcher = _run_cli(
    "--num_processes=2", "--", sys.executable, script, str(tmp_path)
  )
  try:
    pids = _wait_for_pids(tmp_path, launcher, 2)
    assert all(_is_running(p) for p in pids.values())
    launcher.kill()  # SIGKILL: no handler of the launcher runs.
    launcher.wait(timeout=10)
    start = time.monotonic()
    assert _wait_gone(pids.values(), within_s=5) == []
    print(
      f"workers gone {time.monotonic() - start:.3f} s after the "
      "launcher was reaped"
    )
  finally:
    launcher.kill()
    launcher.wait()
    _kill_leftovers(tmp_path, script)


def test_cli_sigterm_kills_each_workers_process_group(tmp_path):
  script = _write_worker(tmp_path, _SPAWN_WORKER)
  launcher = _run_cli(
    "--num_processes=2", "--", sys.executable, script, str(tmp_path)
  )
  try:
    pids = _wait_for_pids(tmp_path, launcher, 4)
    # Worker i's grandchild is recorded as pid1<i>, i.e. key 10 + i.
    assert set(pids) == {0, 1, 10, 11}
    assert all(_is_running(p) for p in pids.values())
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert _wait_gone(pids.values(), within_s=5) == []
  finally:
    launcher.kill()
    launcher.wait()
    for pid in _pids(tmp_path).values():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if b"time.sleep(120)" in f.read():
            os.kill(pid, signal.SIGKILL)
      except (FileNotFoundError, ProcessLookupError):
        pass
    _kill_leftovers(tmp_path, script)


def test_launch_refuses_a_port_in_use(tmp_path):
  marker = tmp_path / "started"
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(ValueError) as err:
      local.launch(["touch", str(marker)], 2, port=port)
    assert str(err.value) == (
      f"coordinator port {port} is already in use; pick another port or "
      "leave it out to use a free one"
    )
    launcher = _run_cli(
      "--num_processes=2", f"--port={port}", "--", "touch", str(marker)
    )
    try:
      _, stderr = launcher.communicate(timeout=30)
    finally:
      launcher.kill()
      launcher.wait()
  assert launcher.returncode == 1
  assert stderr == f"error: {err.value}\n"
  assert not marker.exists()  # No process was started.
  local.check_port_free(port)  # Free again once the socket closed.


@pytest.mark.parametrize(
  "args,message",
  [
    (("--num_processes=0", "--", "true"), "--num_processes must be >= 1"),
    (("--num_processes=2",), "no command to launch"),
  ],
)
def test_cli_bad_input_is_one_line(args, message):
  launcher = _run_cli(*args)
  try:
    _, stderr = launcher.communicate(timeout=30)
  finally:
    launcher.kill()
    launcher.wait()
  assert launcher.returncode == 1
  assert stderr.startswith("error: ") and message in stderr
  assert stderr.count("\n") == 1
