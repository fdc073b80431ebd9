"""Tests for qsync_jax.launch.elastic and ``--elastic`` of the launcher.

Most runs use a small worker written into ``tmp_path`` that follows the
protocol without JAX: it logs each start (its slots, restart and change) as
one JSON line, steps a counter kept in a file (its "checkpoint"), exits 75
on every process once any got SIGTERM, and exits 0 when the counter reaches
its target; with ``progress`` it writes its progress file (empty from its
start, ``stepped`` after its first step). One test runs real JAX processes to check the agreed exit the
launcher relies on. Every test checks that no process it started is left.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from absl import flags
import pytest

from qsync_jax import cli
from qsync_jax.launch import cli as launcher_cli
from qsync_jax.launch import elastic
from qsync_jax.launch import links
from qsync_jax.launch import pool
from qsync_jax.process import membership

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = """\
import json, os, signal, sys, time
cfg = json.loads(sys.argv[1])
if cfg.get("hold", True):
  # A notice that comes before the handler below is taken then.
  signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
d = cfg["dir"]
slots = [int(s) for s in os.environ["QSYNC_ELASTIC_SLOTS"].split(",")]
i = int(os.environ["QSYNC_PROCESS_ID"])
slot, restart = slots[i], int(os.environ["QSYNC_ELASTIC_RESTART"])

def log(**rec):
  rec.update(pid=os.getpid(), slot=slot, restart=restart, time=time.time())
  with open(os.path.join(d, "log.jsonl"), "a") as f:
    f.write(json.dumps(rec) + "\\n")

with open("/proc/self/cgroup") as f:
  cgroup = f.read()
with open("/proc/self/cmdline") as f:
  standby = "standby.py" in f.read()  # started ahead, as a hot standby
log(event="start", process=i, slots=slots,
    num=int(os.environ["QSYNC_NUM_PROCESSES"]),
    pool=int(os.environ["QSYNC_ELASTIC_POOL_SIZE"]),
    coordinator=os.environ["QSYNC_COORDINATOR_ADDRESS"],
    change=json.loads(os.environ.get("QSYNC_ELASTIC_CHANGE") or "null"),
    netns=os.readlink("/proc/self/ns/net"), cgroup=cgroup, standby=standby,
    cache=os.environ.get("JAX_COMPILATION_CACHE_DIR"),
    cache_min_s=os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"))
print(f"slot {slot} started", flush=True)
# The progress file of the protocol (membership.ENV_PROGRESS): empty while
# it holds notices and has not stepped, "stepped" after its first step.
progress = os.environ.get("QSYNC_ELASTIC_PROGRESS") if cfg.get("progress") else None
if progress:
  open(progress, "a").close()
time.sleep(cfg.get("init_s", 0))  # A runtime starting.
stop = os.path.join(d, f"stop{restart}")

def on_term(signum, frame):
  log(event="sigterm", process=i)
  open(stop, "w").close()  # Every process learns of the notice.

signal.signal(signal.SIGTERM, on_term)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
step_file = os.path.join(d, "step")
while True:
  if os.path.exists(stop):
    if cfg.get("abort") == [slot, restart]:
      time.sleep(0.5)  # Its peers leave first; then its runtime aborts.
      import resource
      resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
      os.abort()
    log(event="exit", code=75)
    sys.exit(75)
  step = int(open(step_file).read()) if os.path.exists(step_file) else 0
  if step >= cfg["steps"]:
    log(event="exit", code=0)
    sys.exit(0)
  if cfg.get("fail") == [slot, restart] and step >= 3:
    sys.exit(3)
  if cfg.get("die") == [slot, restart] and step >= cfg.get("die_step", 3):
    os.kill(os.getpid(), signal.SIGKILL)
  if i == 0:
    with open(step_file + ".tmp", "w") as f:
      f.write(str(step + 1))
    os.replace(step_file + ".tmp", step_file)
  if progress:
    with open(progress, "w") as f:
      f.write("stepped")
    progress = None
  time.sleep(0.05)
"""


def _env():
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("QSYNC_", "SLURM_", "OMPI_", "PMIX_"))
  }
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
  )
  return env


def _command(tmp_path, steps, **cfg):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  cfg = {"dir": str(tmp_path), "steps": steps, **cfg}
  return [sys.executable, str(script), json.dumps(cfg)]


def _log(tmp_path):
  path = tmp_path / "log.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]


def _starts(tmp_path):
  """Per restart, the slots and change its processes logged (a process
  killed early may not have logged)."""
  worlds = {}
  for rec in _log(tmp_path):
    if rec["event"] == "start":
      world = worlds.setdefault(rec["restart"], {"procs": {}})
      world["procs"][rec["process"]] = rec
  for world in worlds.values():
    procs = world["procs"]
    world["slots"] = next(iter(procs.values()))["slots"]
    world["change"] = next(iter(procs.values()))["change"]
    for i, rec in procs.items():
      # Process i runs slot slots[i], in a world of len(slots) processes,
      # and all were told the same.
      assert rec["slots"] == world["slots"]
      assert rec["slot"] == world["slots"][i]
      assert rec["num"] == len(world["slots"]) and rec["pool"] >= rec["num"]
      assert rec["change"] == world["change"]
  return [worlds[r] for r in sorted(worlds)]


def _is_running(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rpartition(")")[2].split()[0] != "Z"


def _assert_nothing_left(tmp_path):
  pids = {rec["pid"] for rec in _log(tmp_path)}
  assert pids
  assert [p for p in pids if _is_running(p)] == []


def _kill_leftovers(tmp_path):
  for pid in {rec["pid"] for rec in _log(tmp_path)}:
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if str(tmp_path).encode() not in f.read():
          continue
      os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
      pass


def _run(tmp_path, command, options, **kwargs):
  """``launch_elastic`` in this process, bounded; returns its status."""
  try:
    return elastic.launch_elastic(
      command, options, env=_env(), timeout_s=40, **kwargs
    )
  finally:
    _kill_leftovers(tmp_path)


def _options(size, min_processes=1, availability=None, **kwargs):
  return pool.ElasticOptions(
    size,
    min_processes,
    pool.Availability.parse(availability or {}, size),
    **kwargs,
  )


def _elastic_lines(err):
  return [line for line in err.splitlines() if line.startswith("elastic: ")]


def test_reclaim_and_return_follow_the_availability_file(tmp_path, capsys):
  # Every world has stepped when its notice comes: each gets the notice and
  # checkpoints, progress files or not. Every process starts afresh.
  command = _command(tmp_path, steps=60, progress=True)
  options = _options(3, 2, {"1": [[1.0, 2.0]]}, hot_standby=False)
  start = time.time()
  assert _run(tmp_path, command, options) == 0
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1, 2], [0, 2], [0, 1, 2]]
  first, second, third = (w["change"] for w in worlds)
  assert first is None
  assert second["cause"] == "reclaimed" and third["cause"] == "returned"
  assert second["slots_before"] == [0, 1, 2] and second["slots_after"] == [0, 2]
  assert third["slots_before"] == [0, 2] and third["slots_after"] == [0, 1, 2]
  for change in (second, third):
    assert start <= change["event_time"] <= change["exit_time"]
    assert change["exit_time"] <= change["start_time"]
  # The reclaim's notice went to slot 1's process, the return's to process
  # 0; each world's processes all exited 75.
  terms = [
    (r["restart"], r["slot"]) for r in _log(tmp_path) if r["event"] == "sigterm"
  ]
  assert terms == [(0, 1), (1, 0)]
  # The trace's times count from the job's start (just after ``start``).
  assert 2.0 <= third["event_time"] - start < 4.0
  exits = [(r["restart"], r["code"]) for r in _log(tmp_path) if "code" in r]
  assert sorted(exits) == [(0, 75)] * 3 + [(1, 75)] * 2 + [(2, 0)] * 3
  out, err = capsys.readouterr()
  # Output relayed with the process and its slot: world 2's process 1 is
  # slot 2.
  assert "[p1 s2] slot 2 started" in out.splitlines()
  lines = _elastic_lines(err)
  assert lines[0] == "elastic: world 1: slots 0,1,2 (start)"
  assert lines[1].startswith("elastic: world 2: slots 0,2 (slot 1 reclaimed at")
  assert lines[1].endswith(" s); restart 1")
  assert lines[2].startswith("elastic: world 3: slots 0,1,2 (slot 1 returned")
  assert second["detail"] in lines[1] and third["detail"] in lines[2]
  _assert_nothing_left(tmp_path)


def _left_running(tmp_path):
  """The processes still running whose command names ``tmp_path``."""
  left = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        if str(tmp_path).encode() in f.read() and _is_running(int(name)):
          left.append(int(name))
    except OSError:
      continue
  return left


def test_the_next_world_starts_from_hot_standbys(tmp_path, capsys):
  # Slot 1 is reclaimed from 1.5 s to 3.5 s: world 2 (slot 0) and world 3
  # (slots 0, 1) start once their world before has stepped.
  command = _command(tmp_path, steps=120, progress=True)
  options = _options(2, 1, {"1": [[1.5, 3.5]]})
  try:
    assert (
      elastic.launch_elastic(command, options, env=_env(), timeout_s=60) == 0
    )
    # The standbys nobody took were ended with the job.
    assert _left_running(tmp_path) == []
  finally:
    _kill_leftovers(tmp_path)
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1], [0], [0, 1]]
  lines = _elastic_lines(capsys.readouterr().err)
  assert lines[0] == "elastic: world 1: slots 0,1 (start)"
  suffixes = [line.rpartition(";")[2] for line in lines[1:]]
  assert suffixes == [" 1 from hot standbys", " 2 from hot standbys"]
  # A standby runs the worker in itself, the process the worker logged.
  assert [
    [rec["standby"] for rec in world["procs"].values()] for world in worlds
  ] == [[False, False], [True], [True, True]]
  _assert_nothing_left(tmp_path)


def test_a_world_that_ends_before_its_first_step_leaves_standbys(
  tmp_path, capsys
):
  # Slot 1 dies in world 1 and is back 0.3 s later, while world 2 (slot 0)
  # is still starting (1 s): world 2 ends before its first step, and world
  # 3 still finds a ready standby in each slot, two being kept per slot.
  command = _command(
    tmp_path, steps=30, progress=True, init_s=1.0, die=[1, 0], die_step=20
  )
  options = _options(2, 1, rejoin_after_s=0.3)
  assert options.standbys_per_slot == 2
  try:
    assert _run(tmp_path, command, options) == 0
    assert _left_running(tmp_path) == []
  finally:
    _kill_leftovers(tmp_path)
  lines = _elastic_lines(capsys.readouterr().err)
  assert [line.partition(":")[2].split("(")[0] for line in lines[:3]] == [
    " world 1: slots 0,1 ",
    " world 2: slots 0 ",
    " world 3: slots 0,1 ",
  ]
  assert "world 2 ended at once, before its first step" in lines[2]
  assert lines[1].endswith("; 1 from hot standbys")
  assert lines[2].endswith("; 2 from hot standbys")
  _assert_nothing_left(tmp_path)


def test_the_job_keeps_one_compilation_cache_across_worlds(tmp_path):
  # The suite's own cache (tests/conftest.py) left out of the environment.
  env = {k: v for k, v in _env().items() if not k.startswith("JAX_PERSIST")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)

  def run(name, steps, options, env=env):
    path = tmp_path / name
    path.mkdir()
    code = elastic.launch_elastic(
      _command(path, steps), options, env=env, timeout_s=40
    )
    return code, [r for r in _log(path) if r["event"] == "start"]

  # Slot 1 out and back: three worlds.
  code, starts = run("a", 40, _options(2, 1, {"1": [[1.0, 2.0]]}))
  assert code == 0
  assert sorted((r["restart"], r["slot"]) for r in starts) == [
    (0, 0),
    (0, 1),
    (1, 0),
    (2, 0),
    (2, 1),
  ]
  # One directory for every process of every world, which the launcher
  # removed at the end; every compile is kept.
  (cache,) = {r["cache"] for r in starts}
  assert cache is not None and "qsync_elastic_xla_" in cache
  assert not os.path.exists(cache)
  assert {r["cache_min_s"] for r in starts} == {"0"}

  # A cache the environment names is kept, for every slot.
  mine = str(tmp_path / "my_cache")
  code, starts = run(
    "b", 10, _options(2), {**env, "JAX_COMPILATION_CACHE_DIR": mine}
  )
  assert code == 0 and len(starts) == 2
  assert {r["cache"] for r in starts} == {mine}
  assert {r["cache_min_s"] for r in starts} == {None}

  # Without the launcher's cache (--nocompilation_cache) none is set.
  code, starts = run("c", 10, _options(2, compilation_cache=False))
  assert code == 0 and len(starts) == 2
  assert {r["cache"] for r in starts} == {None}


def _pids_when_started(tmp_path, restart, count, within_s=20):
  """Slot -> PID of the ``count`` processes of world ``restart`` + 1, once
  all of them have started."""
  deadline = time.monotonic() + within_s
  while time.monotonic() < deadline:
    pids = {
      rec["slot"]: rec["pid"]
      for rec in _log(tmp_path)
      if (rec["event"], rec["restart"]) == ("start", restart)
    }
    if len(pids) == count:
      return pids
    time.sleep(0.05)
  raise AssertionError(f"world {restart + 1} never started")


def _kill_slot_1_back_after_1_s(tmp_path, command):
  """Runs ``command`` on a pool of 3 (at least 2) whose slot 1 is SIGKILLed
  as world 1 starts and comes back 1 s later (``--rejoin_after``); returns
  the changes that started worlds 2 and 3."""
  options = _options(3, 2, rejoin_after_s=1.0)

  def kill_slot_1():
    os.kill(_pids_when_started(tmp_path, 0, 3)[1], signal.SIGKILL)

  killer = threading.Thread(target=kill_slot_1, daemon=True)
  killer.start()
  assert _run(tmp_path, command, options) == 0
  killer.join()
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1, 2], [0, 2], [0, 1, 2]]
  return worlds[1]["change"], worlds[2]["change"]


def test_a_killed_worker_restarts_without_it_until_rejoin_after(
  tmp_path, capsys
):
  command = _command(tmp_path, steps=60)
  died, back = _kill_slot_1_back_after_1_s(tmp_path, command)
  assert died["cause"] == "died" and "slot 1 died at" in died["detail"]
  assert "(SIGKILL)" in died["detail"]
  assert back["cause"] == "returned"
  # Back no sooner than --rejoin_after after the death was seen.
  assert back["event_time"] - died["event_time"] >= 1.0
  # The others were SIGKILLed at once: no agreed exit in world 1.
  assert not any(r["restart"] == 0 and "code" in r for r in _log(tmp_path))
  assert died["exit_time"] - died["event_time"] < 2
  err = capsys.readouterr().err
  assert "elastic: world 2: slots 0,2 (slot 1 died at" in err
  _assert_nothing_left(tmp_path)


def test_a_notice_to_a_world_that_has_not_stepped_ends_it_at_once(
  tmp_path, capsys
):
  # Each world takes 3 s to start. Slot 1 dies as world 1 starts and comes
  # back 1 s later, while world 2 (slots 0, 2) is still starting.
  command = _command(tmp_path, steps=20, init_s=3.0, progress=True)
  died, back = _kill_slot_1_back_after_1_s(tmp_path, command)
  # World 2 got no notice: it was ended at once, having trained nothing,
  # and world 3's change is the one from world 1 (the death, then the
  # return).
  assert not any(r["event"] == "sigterm" for r in _log(tmp_path))
  assert not any(r["restart"] == 1 and "code" in r for r in _log(tmp_path))
  assert back["cause"] == "died"
  assert back["slots_before"] == [0, 1, 2] and back["slots_after"] == [0, 1, 2]
  assert back["event_time"] == died["event_time"]
  assert "slot 1 died at" in back["detail"]
  assert "slot 1 returned at" in back["detail"]
  assert back["detail"].endswith(
    "world 2 ended at once, before its first step (2 processes killed, "
    "nothing to checkpoint)"
  )
  # The return's world started at once: no wait for world 2's 3 s start.
  returned = died["event_time"] + 1.0
  assert back["start_time"] - returned < 1.5
  err = capsys.readouterr().err
  assert "error" not in err
  _assert_nothing_left(tmp_path)


def test_the_first_world_takes_its_notice_even_before_its_first_step(
  tmp_path, capsys
):
  # Its agreed step is the checkpoint the next world resumes from. The
  # notice comes at 1 s, after the workers hold notices (their interpreters
  # started) and before they step (1.8 s).
  command = _command(tmp_path, steps=10, init_s=1.8, progress=True)
  options = _options(2, 1, {"1": [[1.0, 1.3]]})
  assert _run(tmp_path, command, options) == 0
  terms = [
    (r["restart"], r["slot"]) for r in _log(tmp_path) if r["event"] == "sigterm"
  ]
  assert terms[0] == (0, 1)
  exits = [
    r["code"] for r in _log(tmp_path) if r["restart"] == 0 and "code" in r
  ]
  assert exits == [75, 75]
  assert "ended at once" not in capsys.readouterr().err
  _assert_nothing_left(tmp_path)


def test_a_notice_to_a_world_still_starting_loses_nothing(tmp_path, capsys):
  # The workers take 1 s to take notices, and die of SIGTERM meanwhile;
  # slot 1 is reclaimed before.
  command = _command(tmp_path, steps=10, init_s=1.0, hold=False)
  options = _options(2, 1, {"1": [[0.3, 0.6]]})
  assert _run(tmp_path, command, options) == 0
  err = capsys.readouterr().err
  lines = _elastic_lines(err)
  assert lines[0] == "elastic: world 1: slots 0,1 (start)"
  # Not a death: the slot leaves as the notice said, its peer is killed.
  assert lines[1].startswith("elastic: world 2: slots 0 (slot 1 reclaimed at")
  assert lines[1].endswith(
    "; process 1 (slot 1) died of the notice before it could take it; "
    "killed 1 other process); restart 1"
  )
  # The job goes on, and ends with slot 1 back.
  assert lines[-1].startswith(f"elastic: world {len(lines)}: slots 0,1 (")
  assert _starts(tmp_path)[-1]["slots"] == [0, 1]
  assert "error" not in err
  _assert_nothing_left(tmp_path)


def test_a_peer_aborting_during_the_agreed_exit_keeps_its_slot(
  tmp_path, capsys
):
  # The notice comes once every process has surely started (at 2 s, inside
  # the first world's 100 steps of 0.05 s), even on a loaded host.
  command = _command(tmp_path, steps=100, abort=[1, 0])
  options = _options(3, 2, {"2": [[2.0, 100]]})
  assert _run(tmp_path, command, options) == 0
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1, 2], [0, 1]]
  change = worlds[1]["change"]
  assert change["cause"] == "reclaimed"
  assert change["detail"].endswith(
    "process 1 (slot 1) was killed by SIGABRT (code -6) as the world ended"
  )
  assert "died" not in change["detail"]
  _assert_nothing_left(tmp_path)


def test_below_min_processes_the_launcher_waits_then_resumes(tmp_path, capsys):
  command = _command(tmp_path, steps=40)
  options = _options(2, 2, {"1": [[0.8, 2.0]]})
  start = time.time()
  assert _run(tmp_path, command, options) == 0
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1], [0, 1]]
  change = worlds[1]["change"]
  assert change["cause"] == "reclaimed"
  assert "slot 1 reclaimed at" in change["detail"]
  assert "slot 1 returned at" in change["detail"]
  assert change["start_time"] - start >= 2.0  # It waited for slot 1.
  lines = _elastic_lines(capsys.readouterr().err)
  assert lines[1] == (
    "elastic: 1 slot available (0) and --min_processes=2; waiting for slot "
    "1 (back at 2.0 s)"
  )
  _assert_nothing_left(tmp_path)


@pytest.mark.parametrize(
  "case,expected_code,message",
  [
    ("fail", 3, "error: process 1 (slot 1, pid"),
    ("die", 1, "error: elastic: 1 slot available (0) and --min_processes=2"),
    ("max_restarts", 1, "--max_restarts=0 restarts are used up"),
  ],
)
def test_the_job_ends_with_one_error_line(
  tmp_path, capsys, case, expected_code, message
):
  if case == "fail":
    command = _command(tmp_path, steps=100, fail=[1, 0])
    options = _options(3, 1)
  elif case == "die":
    command = _command(tmp_path, steps=100, die=[1, 0])
    options = _options(2, 2)
  else:
    command = _command(tmp_path, steps=100)
    options = _options(2, 1, {"1": [[0.5, 100]]}, max_restarts=0)
  assert _run(tmp_path, command, options) == expected_code
  err = capsys.readouterr().err
  errors = [line for line in err.splitlines() if "error" in line]
  assert len(errors) == 1 and errors[0] == err.splitlines()[-1]
  assert message in errors[0]
  if case == "fail":
    assert errors[0].endswith("exited with code 3; killed 2 other processes")
  if case == "die":
    assert ", and slot 1 died at " in errors[0]
    assert errors[0].endswith(
      " s and never comes back (no --rejoin_after, and no availability "
      "interval of it ends later)"
    )
  assert len(_starts(tmp_path)) == 1  # No restart.
  _assert_nothing_left(tmp_path)


@pytest.mark.parametrize(
  "data,message",
  [
    ([], "is not a JSON object"),
    ({"3": []}, "names slot '3'"),
    ({"x": []}, "names slot 'x'"),
    ({"1": [[5, 5]]}, "has slot 1 interval [5, 5], which must have 0 <="),
    ({"1": [[-1, 5]]}, "interval [-1, 5], which must have 0 <= start < end"),
    ({"1": [[1, 2, 3]]}, "interval [1, 2, 3], which is not [start, end]"),
    ({"1": [["1", 2]]}, "which is not [start, end]"),
    ({"1": {"1": 2}}, "has slot 1 intervals that are not a list"),
  ],
)
def test_malformed_availability_is_refused(data, message):
  with pytest.raises(ValueError) as err:
    pool.Availability.parse(data, 3)
  assert message in str(err.value)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(min_processes=4), "--min_processes must be in [1, --num_processes"),
    (dict(min_processes=0), "--min_processes must be in [1,"),
    (dict(rejoin_after_s=0.0), "--rejoin_after must be a finite number > 0"),
    (dict(max_restarts=-1), "--max_restarts must be >= 0"),
    (dict(grace_s=float("nan")), "--grace_s must be a finite number >= 0"),
  ],
)
def test_bad_options_are_refused(kwargs, message):
  with pytest.raises(ValueError) as err:
    pool.ElasticOptions(3, **kwargs)
  assert message in str(err.value)


def test_pool_dead_slots_come_back_after_rejoin_or_an_interval_end():
  trace = pool.Availability.parse({"1": [[5, 8]], "2": [[1, 2]]}, 3)
  slots = pool.Pool(pool.ElasticOptions(3, availability=trace))
  assert slots.slots(0) == (0, 1, 2) and slots.slots(1.5) == (0, 1)
  slots.died(1, 3.0)  # No --rejoin_after: back when its interval ends.
  assert slots.back_at(1, 3.0) == 8.0 and slots.slots(8.0) == (0, 1, 2)
  slots.died(0, 3.0)  # Nothing brings it back.
  assert slots.back_at(0, 3.0) is None and "never comes back" in slots.why_out(
    0, 3.0
  )
  rejoin = pool.Pool(
    pool.ElasticOptions(3, availability=trace, rejoin_after_s=1.0)
  )
  rejoin.died(1, 4.5)  # Back at 5.5, but reclaimed then until 8.
  assert rejoin.back_at(1, 4.5) == 8.0
  rejoin.died(0, 4.5)
  assert rejoin.back_at(0, 4.5) == 5.5


def _cli(*args):
  return subprocess.Popen(
    [sys.executable, "-m", "qsync_jax.distributed", *args],
    env=_env(),
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _parse_flags(*args):
  """The launcher's flags as ``python -m qsync_jax.distributed`` parses
  them, in a FlagValues of their own."""
  fv = flags.FlagValues()
  launcher_cli._define_flags(fv)
  fv(["qsync_jax.distributed", "--num_processes=4", *args])
  return fv


def test_bad_flags_are_refused_before_anything_starts(tmp_path):
  bad_json = tmp_path / "bad.json"
  bad_json.write_text("{not json")
  outside = tmp_path / "outside.json"
  outside.write_text('{"4": [[1, 2]]}')
  cases = [
    (["--min_processes=5", "--elastic"], "--min_processes must be in [1,"),
    (["--min_processes=2"], "--min_processes only applies to an elastic"),
    (
      ["--rejoin_after=3", "--grace_s=1"],
      "--rejoin_after, --grace_s only apply to an elastic pool",
    ),
    (["--elastic", "--rejoin_after=0"], "--rejoin_after must be a finite"),
    (
      ["--elastic", f"--availability={tmp_path}/none.json"],
      "cannot read the availability file",
    ),
    (["--elastic", f"--availability={bad_json}"], "is not JSON"),
    (["--elastic", f"--availability={outside}"], "names slot '4'"),
    (
      ["--nocompilation_cache"],
      "--compilation_cache only applies to an elastic pool: add --elastic, "
      "or leave it out",
    ),
  ]
  for args, message in cases:
    fv = _parse_flags(*args)
    with pytest.raises(ValueError) as err:
      launcher_cli._check_flags(fv)
      launcher_cli._runner(fv, ["true"])
    assert message in str(err.value), args
  options = launcher_cli._elastic_options(
    _parse_flags("--elastic", "--min_processes=2", "--rejoin_after=3")
  )
  assert (options.pool_size, options.min_processes) == (4, 2)
  assert options.rejoin_after_s == 3.0 and options.grace_s == 60
  assert options.compilation_cache
  assert not launcher_cli._elastic_options(
    _parse_flags("--elastic", "--nocompilation_cache")
  ).compilation_cache


def test_cli_runs_a_pool_and_refuses_bad_input_in_one_line(tmp_path):
  marker = tmp_path / "started"
  (tmp_path / "bad.json").write_text('{"0": [[2, 1]]}')
  (tmp_path / "avail.json").write_text('{"1": [[1.0, 1.5]]}')
  # Below --min_processes=2 until slot 1 is back: the next world is 0,1.
  bad = _cli(
    "--num_processes=2",
    "--elastic",
    f"--availability={tmp_path / 'bad.json'}",
    "--",
    "touch",
    str(marker),
  )
  good = _cli(
    "--num_processes=2",
    "--elastic",
    f"--availability={tmp_path / 'avail.json'}",
    "--min_processes=2",
    "--grace_s=10",
    "--timeout_s=60",
    "--",
    *_command(tmp_path, steps=40),
  )
  try:
    _, bad_err = bad.communicate(timeout=60)
    _, good_err = good.communicate(timeout=60)
  finally:
    for p in (bad, good):
      p.kill()
      p.communicate()
    _kill_leftovers(tmp_path)
  assert bad.returncode == 1 and bad_err.count("\n") == 1, bad_err
  assert bad_err.startswith("error: the availability file ")
  assert bad_err.endswith(
    "bad.json has slot 0 interval [2, 1], which must have 0 <= start < end\n"
  )
  assert not marker.exists()
  assert good.returncode == 0, good_err
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1], [0, 1]]
  assert worlds[1]["change"]["cause"] == "reclaimed"
  assert "elastic: world 2: slots 0,1 (slot 1 reclaimed at 1." in good_err
  _assert_nothing_left(tmp_path)


def test_sigint_to_the_launcher_kills_every_process(tmp_path, capsys):
  # (A SIGTERM is a job-wide preemption: tests/test_launcher_faults.py.)
  def stop_the_launcher():
    _pids_when_started(tmp_path, 0, 2)
    os.kill(os.getpid(), signal.SIGINT)  # Its handler runs by then.

  stopper = threading.Thread(target=stop_the_launcher, daemon=True)
  stopper.start()
  code = _run(tmp_path, _command(tmp_path, steps=10_000), _options(2))
  stopper.join()
  assert code == 128 + signal.SIGINT
  assert capsys.readouterr().err.splitlines()[-1] == (
    "error: launcher got SIGINT; killed 2 processes"
  )
  _assert_nothing_left(tmp_path)


def test_start_binary_names_a_malformed_elastic_variable(monkeypatch, capsys):
  monkeypatch.setenv(membership.ENV_SLOTS, "0,x")
  monkeypatch.setenv(membership.ENV_POOL_SIZE, "2")
  monkeypatch.setenv(membership.ENV_RESTART, "0")
  with pytest.raises(SystemExit) as exit_info:
    cli.start_binary()
  assert exit_info.value.code == 1
  err = capsys.readouterr().err
  assert (
    err.startswith("error: QSYNC_ELASTIC_SLOTS must be")
    and err.count("\n") == 1
  )


@pytest.mark.skipif(
  links.unavailable_reason() is not None,
  reason=str(links.unavailable_reason()),
)
def test_with_links_each_slot_keeps_its_namespace_and_cgroup(tmp_path):
  spec = links.LinkSpec.parse("1gbit", cpu_quota="1,1,0.5", num_processes=3)
  with links.LinkEmulator(3, spec) as emulator:
    code = _run(
      tmp_path,
      _command(tmp_path, steps=30),
      _options(3, 2, {"0": [[1.0, 100]]}),
      address=emulator.address,
      wrap=emulator.wrap,
    )
    tag = emulator.tag
  assert code == 0
  worlds = _starts(tmp_path)
  assert [w["slots"] for w in worlds] == [[0, 1, 2], [1, 2]]
  # The coordinator is the address of the world's process 0's slot.
  coordinators = [
    next(iter(w["procs"].values()))["coordinator"] for w in worlds
  ]
  assert coordinators[0].startswith("10.77.0.1:")
  assert coordinators[1].startswith("10.77.0.2:")
  by_slot = {}
  for world in worlds:
    for rec in world["procs"].values():
      by_slot.setdefault(rec["slot"], set()).add((rec["netns"], rec["cgroup"]))
  # One namespace and cgroup per slot, kept across worlds, none shared.
  assert all(len(places) == 1 for places in by_slot.values())
  assert len(set().union(*by_slot.values())) == 3
  for slot, places in by_slot.items():
    ((_, cgroup),) = places
    assert emulator.namespace(slot) in cgroup
  assert links.leftovers(tag) == []
  _assert_nothing_left(tmp_path)


_JAX_WORKER = """\
import os, signal, sys, time
# Held until the runtime's notifier is installed: a notice that comes while
# JAX starts is taken then, not fatal.
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
out = sys.argv[1]
if int(os.environ["QSYNC_ELASTIC_RESTART"]) > 0:
  sys.exit(0)  # The next world: the run would resume and finish here.
from qsync_jax.process import initialize, preemption
assert initialize.initialize()
import jax
pid = jax.process_index()
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
with preemption.PreemptionWatch() as watch:
  step = 0
  while step < 100_000:
    step += 1
    time.sleep(0.02)
    if watch.reached(step):
      open(os.path.join(out, f"step{pid}"), "w").write(str(step))
      sys.exit(75)
"""


def test_jax_processes_exit_75_at_the_same_step_on_a_reclaim(tmp_path, capsys):
  script = tmp_path / "jax_worker.py"
  script.write_text(_JAX_WORKER)
  env = _env()
  env["JAX_PLATFORMS"] = "cpu"
  code = elastic.launch_elastic(
    [sys.executable, str(script), str(tmp_path)],
    _options(2, 1, {"1": [[2.0, 100]]}),
    env=env,
    timeout_s=50,
  )
  err = capsys.readouterr().err
  assert code == 0, err[-3000:]
  # The launcher's SIGTERM went to process 1 alone; both processes took the
  # notice at the same step and exited 75, and the next world is slot 0.
  steps = [int((tmp_path / f"step{p}").read_text()) for p in (0, 1)]
  assert steps[0] == steps[1] > 0
  lines = _elastic_lines(err)
  assert lines[0] == "elastic: world 1: slots 0,1 (start)"
  assert lines[1].startswith("elastic: world 2: slots 0 (slot 1 reclaimed at")
  assert "died" not in lines[1] and "killed" not in lines[1]
