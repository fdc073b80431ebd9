"""Faults around the launchers: reclaims they did not start, their own
deaths and signals, bad pools, and checkpoints across process layouts.

The elastic launcher runs in this process where its exit status is the
point; the workers are small scripts (JAX only where the runtime's agreed
exit is what is checked). Every test checks that no process it started is
left. The elastic runs start no hot standbys (``hot_standby=False``): the
standbys are tested in test_standby.py and test_elastic_launcher.py, and
each would import JAX beside the run.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_distributed import _is_running
from test_elastic_launcher import _env as _launcher_env

from qsync_jax.launch import elastic
from qsync_jax.launch import local
from qsync_jax.launch import pool
from qsync_jax.process import membership
from qsync_jax.process import preemption
from qsync_jax.rundir import directory
from qsync_jax.rundir import metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "elastic_loop.py")


def _env(**extra):
  return {**_launcher_env(), "JAX_PLATFORMS": "cpu", **extra}


def _pids(tmp_path):
  """Every worker pid the scripts recorded (``pid-<restart>-<i>`` files)."""
  return {
    f.name: int(f.read_text()) for f in tmp_path.glob("pid-*") if f.read_text()
  }


def _wait_for(tmp_path, name, within_s=60):
  deadline = time.monotonic() + within_s
  path = tmp_path / name
  while time.monotonic() < deadline:
    if path.exists() and path.read_text():
      return int(path.read_text())
    time.sleep(0.05)
  raise AssertionError(f"{name} did not appear within {within_s} s")


def _kill_leftovers(tmp_path):
  for pid in _pids(tmp_path).values():
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if str(tmp_path).encode() not in f.read():
          continue
      os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
      pass


def _assert_nothing_left(tmp_path):
  pids = _pids(tmp_path)
  assert pids
  assert [p for p in pids.values() if _is_running(p)] == []


def _elastic_lines(err):
  return [line for line in err.splitlines() if line.startswith("elastic: ")]


# A JAX process of an elastic world: it takes notices through the library's
# PreemptionWatch (which records a SIGTERM it receives for the launcher),
# steps until the processes agree on a step, and "checkpoints" it in a file
# that the next world (or the same command run again) resumes from; the job
# is done in the first world from the one numbered ``argv[2]`` on that
# finds a checkpoint.
_JAX_WORKER = """\
import json, os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
out = sys.argv[1]
restart = int(os.environ["QSYNC_ELASTIC_RESTART"])
i = int(os.environ["QSYNC_PROCESS_ID"])
n = int(os.environ["QSYNC_NUM_PROCESSES"])
change = json.loads(os.environ.get("QSYNC_ELASTIC_CHANGE") or "null")
open(os.path.join(out, f"pid-{restart}-{i}"), "w").write(str(os.getpid()))
with open(os.path.join(out, "log.jsonl"), "a") as f:
  f.write(json.dumps({"restart": restart, "process": i, "num": n,
                      "slots": os.environ["QSYNC_ELASTIC_SLOTS"],
                      "change": change}) + "\\n")
ckpt = os.path.join(out, "ckpt")
step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
if step and restart >= int(sys.argv[2]):
  sys.exit(0)  # Resumed in the world that finishes the job.
if n == 1:
  # One process needs no runtime to agree: a plain handler is its notice
  # (the library's single-process PreemptionWatch), without JAX's start.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
  signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
  while True:
    time.sleep(0.05)
from qsync_jax.process import initialize, preemption
initialize.initialize()
with preemption.PreemptionWatch() as watch:
  open(os.path.join(out, f"ready-{restart}-{i}"), "w").write(str(os.getpid()))
  while True:
    step += 1
    time.sleep(0.05)
    if watch.reached(step):
      if i == 0:
        open(ckpt, "w").write(str(step))
      open(os.path.join(out, f"agreed-{restart}-{i}"), "w").write(str(step))
      sys.exit(75)
"""


def _jax_command(tmp_path, done_from):
  script = tmp_path / "jax_worker.py"
  script.write_text(_JAX_WORKER)
  return [sys.executable, str(script), str(tmp_path), str(done_from)]


def _log(tmp_path):
  path = tmp_path / "log.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_outside_sigterm_to_one_process_reclaims_its_slot(tmp_path, capsys):
  # Something that shares the host takes slot 1's device back: SIGTERM to
  # that process alone, not from the launcher. The world agrees on a step
  # and exits 75; the job goes on with slot 0, and slot 1 returns after
  # --rejoin_after.
  def reclaim():
    pid = _wait_for(tmp_path, "ready-0-1")
    os.kill(pid, signal.SIGTERM)

  thread = threading.Thread(target=reclaim, daemon=True)
  thread.start()
  try:
    code = elastic.launch_elastic(
      _jax_command(tmp_path, done_from=2),
      pool.ElasticOptions(2, 1, rejoin_after_s=1.0, hot_standby=False),
      env=_env(),
      timeout_s=150,
    )
  finally:
    _kill_leftovers(tmp_path)
  thread.join()
  err = capsys.readouterr().err
  assert code == 0, err[-3000:]
  # Both processes took the notice at the same step.
  agreed = [(tmp_path / f"agreed-0-{i}").read_text() for i in (0, 1)]
  assert agreed[0] == agreed[1]
  lines = _elastic_lines(err)
  assert lines[0] == "elastic: world 1: slots 0,1 (start)"
  assert lines[1].startswith(
    "elastic: world 2: slots 0 (slot 1 reclaimed at"
  ), lines
  assert "(a SIGTERM not from this launcher)" in lines[1]
  assert lines[2].startswith("elastic: world 3: slots 0,1 (slot 1 returned")
  worlds = {r["restart"]: r for r in _log(tmp_path)}
  change = worlds[1]["change"]
  assert change["cause"] == "reclaimed"
  assert change["slots_before"] == [0, 1] and change["slots_after"] == [0]
  assert worlds[2]["change"]["cause"] == "returned"
  _assert_nothing_left(tmp_path)


def test_sigterm_to_the_launcher_checkpoints_and_ends_75(tmp_path, capsys):
  # A job-wide preemption: the launcher passes its SIGTERM on, every process
  # checkpoints the step they agree on, the launcher ends with 75, and the
  # same command resumes.
  def stop_the_launcher():
    _wait_for(tmp_path, "ready-0-0")
    _wait_for(tmp_path, "ready-0-1")
    os.kill(os.getpid(), signal.SIGTERM)

  command = _jax_command(tmp_path, done_from=0)
  options = pool.ElasticOptions(2, 1, hot_standby=False)
  thread = threading.Thread(target=stop_the_launcher, daemon=True)
  thread.start()
  try:
    code = elastic.launch_elastic(command, options, env=_env(), timeout_s=120)
  finally:
    _kill_leftovers(tmp_path)
  thread.join()
  err = capsys.readouterr().err
  assert code == membership.MEMBERSHIP_CHANGED_EXIT_CODE, err[-3000:]
  agreed = [(tmp_path / f"agreed-0-{i}").read_text() for i in (0, 1)]
  assert agreed[0] == agreed[1] == (tmp_path / "ckpt").read_text()
  assert err.splitlines()[-1] == (
    "elastic: launcher got SIGTERM: every process checkpointed the step "
    "they agreed on; ending with 75 (run the same command again to resume)"
  )
  _assert_nothing_left(tmp_path)
  # The same command again: it resumes from the checkpoint and finishes.
  try:
    again = elastic.launch_elastic(command, options, env=_env(), timeout_s=60)
  finally:
    _kill_leftovers(tmp_path)
  assert again == 0, capsys.readouterr().err[-3000:]


def test_a_checkpoint_resumes_across_process_layouts(tmp_path):
  # The same two workers, split as one process of two devices, then as two
  # processes of one device (the launcher). The other direction, saved by
  # two processes and read by one, is the next test's.
  out = tmp_path / "run"
  common = [f"--out_dir={out}", "--checkpoint_every=2"]

  def run(steps, *launcher):
    return subprocess.run(
      [*launcher, sys.executable, EXAMPLE, *common, f"--steps={steps}"],
      cwd=REPO_ROOT,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=240,
      check=False,
    )

  result = run(2)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((out / "summary.json").read_text())["steps"] == 2
  result = run(
    4,
    sys.executable,
    "-m",
    "qsync_jax.distributed",
    "--num_processes=2",
    "--timeout_s=200",
    "--",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "corrupt" not in result.stderr
  assert json.loads((out / "summary.json").read_text())["steps"] == 4
  assert not (out / "checkpoints" / "corrupt-2").exists()
  taken = [int(s) for s in (out / "steps.log").read_text().split()[3::4]]
  assert taken == [1, 2, 3, 4]


def test_shard_checksums_are_checked_by_index_whoever_saved_them(
  monkeypatch,
):
  # Two shards of one array over two devices: saved by two processes (one
  # shard each) and read by one, or saved by one and read by process 1.
  import jax
  import numpy as np

  from qsync_jax.train import integrity

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("w",))
  spec = jax.sharding.PartitionSpec("w")
  tree = {
    "anchor": jax.device_put(
      np.arange(8.0).reshape(2, 4), jax.sharding.NamedSharding(mesh, spec)
    )
  }
  ((key, shards),) = integrity.array_digests(tree).items()
  assert len(shards) == 2
  by_process = {
    str(p): {key: {index: digest}}
    for p, (index, digest) in enumerate(sorted(shards.items()))
  }
  two = {integrity.INTEGRITY: {"arrays": by_process}}
  assert integrity.array_problem(two, tree) is None
  one = {integrity.INTEGRITY: {"arrays": {"0": {key: dict(shards)}}}}
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert integrity.array_problem(one, tree) is None
  # A changed shard is still caught, whichever process saved it.
  by_process["1"][key] = dict.fromkeys(by_process["1"][key], "0" * 64)
  assert integrity.array_problem(two, tree) == f"checksum mismatch in {key}"


# A worker without JAX that follows the protocol: on SIGTERM it records the
# notice where the library's PreemptionWatch does (the template is
# membership.notice_path's) and every process of its world exits 75; it
# exits 0 in the world numbered argv[2].
_WORKER = """\
import json, os, signal, sys, time
out, done_at, template = sys.argv[1], int(sys.argv[2]), sys.argv[3]
restart = int(os.environ["QSYNC_ELASTIC_RESTART"])
i = int(os.environ["QSYNC_PROCESS_ID"])
with open(os.path.join(out, "log.jsonl"), "a") as f:
  f.write(json.dumps({"restart": restart, "process": i,
                      "slots": os.environ["QSYNC_ELASTIC_SLOTS"],
                      "change": json.loads(
                        os.environ.get("QSYNC_ELASTIC_CHANGE") or "null")})
          + "\\n")
if restart >= done_at:
  sys.exit(0)
stop = os.path.join(out, f"stop-{restart}")

def on_term(signum, frame):
  notices = os.environ.get("QSYNC_ELASTIC_NOTICES")
  if notices:
    with open(template.format(dir=notices, restart=restart, i=i), "w") as f:
      json.dump({"time": time.time()}, f)
  open(stop, "w").close()

signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, f"pid-{restart}-{i}"), "w").write(str(os.getpid()))
while not os.path.exists(stop):
  time.sleep(0.02)
sys.exit(75)
"""


def _command(tmp_path, done_at):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  template = membership.notice_path("{dir}", "{restart}", "{i}")
  return [sys.executable, str(script), str(tmp_path), str(done_at), template]


def _run_elastic(tmp_path, command, options, signals):
  """``launch_elastic`` here, with ``signals`` [(process, signum)] sent to
  the first world's processes once all have started; returns its status."""

  def send():
    pids = [
      _wait_for(tmp_path, f"pid-0-{i}", within_s=30)
      for i in range(options.pool_size)
    ]
    for i, signum in signals:
      os.kill(pids[i], signum)

  thread = threading.Thread(target=send, daemon=True)
  thread.start()
  try:
    return elastic.launch_elastic(command, options, env=_env(), timeout_s=40)
  finally:
    thread.join(timeout=35)
    _kill_leftovers(tmp_path)


def test_two_slots_reclaimed_at_once_by_outside_sigterms(tmp_path, capsys):
  code = _run_elastic(
    tmp_path,
    _command(tmp_path, done_at=1),
    pool.ElasticOptions(3, 1, hot_standby=False),
    [(1, signal.SIGTERM), (2, signal.SIGTERM)],
  )
  err = capsys.readouterr().err
  assert code == 0, err
  lines = _elastic_lines(err)
  assert lines[1].startswith("elastic: world 2: slots 0 (slot 1 reclaimed at")
  assert "; slot 2 reclaimed at" in lines[1]
  change = next(r for r in _log(tmp_path) if r["restart"] == 1)["change"]
  assert change["cause"] == "reclaimed" and change["slots_after"] == [0]
  _assert_nothing_left(tmp_path)


def test_an_outside_sigterm_to_every_process_is_a_preemption(tmp_path, capsys):
  code = _run_elastic(
    tmp_path,
    _command(tmp_path, done_at=1),
    pool.ElasticOptions(2, 1, hot_standby=False),
    [(0, signal.SIGTERM), (1, signal.SIGTERM)],
  )
  err = capsys.readouterr().err
  assert code == membership.MEMBERSHIP_CHANGED_EXIT_CODE, err
  assert err.splitlines()[-1] == (
    "elastic: world 1: every process got SIGTERM from outside this launcher "
    "(a job-wide preemption); ending with 75 (run it again to resume)"
  )
  _assert_nothing_left(tmp_path)


def test_an_outside_reclaim_without_rejoin_after_stays_out(tmp_path, capsys):
  # With --min_processes=2 the job cannot go on without the slot, and the
  # slot never comes back: one error line naming why.
  code = _run_elastic(
    tmp_path,
    _command(tmp_path, done_at=1),
    pool.ElasticOptions(2, 2, hot_standby=False),
    [(1, signal.SIGTERM)],
  )
  err = capsys.readouterr().err
  assert code == 1
  assert err.splitlines()[-1] == (
    "error: elastic: 1 slot available (0) and --min_processes=2, and slot 1 "
    "was reclaimed (a SIGTERM not from this launcher) at "
    + err.splitlines()[-1].split(" at ")[1]
  )
  assert "never comes back" in err.splitlines()[-1]
  _assert_nothing_left(tmp_path)


@pytest.mark.skipif(
  not sys.platform.startswith("linux"),
  reason="the parent-death signal is Linux only",
)
def test_the_elastic_launcher_killed_takes_its_workers(tmp_path):
  launcher = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=2",
      "--elastic",
      "--",
      *_command(tmp_path, done_at=5),
    ],
    cwd=REPO_ROOT,
    env=_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    pids = [_wait_for(tmp_path, f"pid-0-{i}") for i in (0, 1)]
    launcher.kill()  # SIGKILL: no handler of the launcher runs.
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(map(_is_running, pids)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert [p for p in pids if _is_running(p)] == []
  finally:
    launcher.kill()
    launcher.wait()
    _kill_leftovers(tmp_path)


@pytest.mark.parametrize(
  "data, message",
  [
    (
      {"1": [[10, 30], [20, 40]]},
      "has slot 1 intervals [10, 30] and [20, 40], which overlap",
    ),
    ({"1": [[10, 30]], " 1": [[40, 50]]}, "names slot 1 twice"),
    ({"0": [[-1, 3]]}, "must have 0 <= start < end"),
    ({"2": [[1, 3]]}, "names slot '2'; the pool's slots are 0..1"),
  ],
)
def test_a_malformed_availability_trace_is_refused(data, message):
  with pytest.raises(ValueError) as error:
    pool.Availability.parse(data, 2)
  assert message in str(error.value)
  # Intervals that only touch are one reclaim.
  pool.Availability.parse({"1": [[10, 20], [20, 30]]}, 2)


_PLAIN = """\
import os, sys, time
time.sleep(0.5 * int(os.environ["QSYNC_PROCESS_ID"]))
sys.exit(75)
"""


def test_the_plain_launcher_ends_an_orderly_preemption_with_75(
  tmp_path, capsys
):
  script = tmp_path / "plain.py"
  script.write_text(_PLAIN)
  code = local.launch(
    [sys.executable, str(script)], 2, env=_env(), timeout_s=30
  )
  err = capsys.readouterr().err
  assert code == 75
  assert "error" not in err
  assert err.splitlines()[-1] == (
    "launch: every process exited 0 or 75 (checkpointed the step they "
    "agreed on after a SIGTERM); ending with 75 (run the same command again "
    "to resume)"
  )


@pytest.mark.parametrize("again", [False, True])
def test_a_run_directory_removed_mid_run_stops_the_run(tmp_path, again):
  out = tmp_path / "run"
  out.mkdir()
  writer = metrics.MetricWriter(str(out), active=True)
  writer.write(1, {"loss": 1.0})
  for path in sorted(out.rglob("*"), reverse=True):
    path.unlink() if path.is_file() else path.rmdir()
  out.rmdir()
  if again:  # A save made it again, empty.
    (out / "checkpoints").mkdir(parents=True)
  with pytest.raises(directory.RunDirectoryRemoved) as error:
    writer.write(2, {"loss": 1.0})
  what = "was made again" if again else "is gone"
  assert str(error.value).startswith(
    f"the run directory {out} was removed while the run was training (it {what}"
  )
  # The run's end is not a success either: closing the writer says so.
  other = tmp_path / "other"
  other.mkdir()
  writer = metrics.MetricWriter(str(other), active=True)
  other.rename(tmp_path / "moved")
  with pytest.raises(directory.RunDirectoryRemoved):
    writer.close()


def test_the_watch_records_a_sigterm_for_the_launcher(tmp_path, monkeypatch):
  monkeypatch.setenv(membership.ENV_NOTICES, str(tmp_path))
  monkeypatch.setenv(membership.ENV_RESTART, "3")
  monkeypatch.setenv("QSYNC_PROCESS_ID", "1")
  with preemption.PreemptionWatch() as watch:
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not watch.reached(1) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert watch.reached(1)
  notice = json.loads(open(membership.notice_path(str(tmp_path), 3, 1)).read())
  assert abs(notice["time"] - time.time()) < 10
