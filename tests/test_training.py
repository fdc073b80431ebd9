"""End-to-end: the main job's library function and the experiment binary."""

import json
import os
import signal
import subprocess
import sys
import time

import binaries
import optax
import pytest

from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
import qsync_jax as qs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run(module, *args, timeout=600):
  return binaries.run(module, *args, env=_env(), timeout=timeout)


def _train(out, *args, timeout=600):
  return _run("experiments.train", f"--out_dir={out}", *args, timeout=timeout)


def _train_two_processes(out, *args, env=None):
  """The train binary in two processes under the local launcher."""
  return binaries.run(
    "qsync_jax.distributed",
    "--num_processes=2",
    "--timeout_s=300",
    "--",
    sys.executable,
    "-m",
    "experiments.train",
    f"--out_dir={out}",
    *args,
    env=env or _env(),
    timeout=600,
  )


def _failure_lines(output: str) -> str:
  """What names a crash in a run's output: its error and fatal-log lines (a
  faulthandler dump ends with a long list of extension modules, which would
  fill a tail), then the last lines."""
  keys = ("error", "Error", "Fatal", "Check failed", "Abort", "terminate")
  named = [
    l
    for l in output.splitlines()
    if any(k in l for k in keys) and "Extension modules" not in l
  ]
  return "\n".join(named)[-2500:] + "\n...\n" + output[-800:]


def _summary(out):
  return json.loads((out / "summary.json").read_text())


def test_small_cnn_with_half_its_layers_int8_learns_digits(tmp_path):
  config = default_config.get_config()
  config.cluster = "t4:1"
  # Half of the four layers INT8 (both convolutions); the rest FP32.
  config.plan_mode = "manual"
  config.plans = {"t4": {"rules": [[r"conv\d", "int8"]], "default": "fp32"}}
  config.batch_size = 64
  config.eval_every = 0
  config.checkpoint_every = 0
  summary = train_lib.train_and_evaluate(
    config_lib.parse(config), str(tmp_path)
  )
  assert summary["precisions"] == [
    {"conv1": "int8", "conv2": "int8", "fc": "fp32", "head": "fp32"}
  ]
  print(
    "digits test accuracy with conv1/conv2 INT8:",
    summary["final_eval_accuracy"],
  )
  assert summary["final_eval_accuracy"] >= 0.93


def test_main_job_defaults_reach_93_percent_and_write_every_file(tmp_path):
  result = _train(tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = _summary(tmp_path)
  print(
    "default main job:",
    {
      k: summary[k]
      for k in ("final_eval_accuracy", "wall_time_s", "examples_per_s")
    },
  )
  assert summary["final_eval_accuracy"] >= 0.93
  for key in (
    "final_eval_accuracy",
    "final_train_loss",
    "steps",
    "sync_rounds",
    "comm_bytes",
    "wall_time_s",
    "workers",
  ):
    assert key in summary
  assert summary["steps"] == summary["sync_rounds"] == 400
  assert [w["kind"] for w in summary["workers"]] == ["v100"] * 2 + ["t4"] * 2
  assert {"kind", "device", "batch_size", "plan"} <= set(summary["workers"][0])
  # The allocator chose the plans: the T4 workers run its T4 plan, the
  # training devices FP32, and some T4 layer is quantized.
  allocation = json.loads(
    (tmp_path / "allocation" / "summary.json").read_text()
  )
  assert allocation["training_kinds"] == ["v100"]
  t4 = qs.PrecisionPlan.from_json(
    (tmp_path / "allocation" / "t4.json").read_text()
  )
  assert summary["precisions"][2] == {
    p: t4.precision_of(p).value for p in summary["precisions"][2]
  }
  assert set(summary["precisions"][0].values()) == {"fp32"}
  assert allocation["quantized_layers"]["t4"] >= 1
  assert summary["loss_scaling"] == (
    "fp16" in summary["precisions"][2].values()
  )
  rows = [
    json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  assert rows[-1]["step"] == 400 and "eval_accuracy" in rows[-1]
  assert (tmp_path / "plans" / "t4.json").exists()
  assert (tmp_path / "curves.png").stat().st_size > 1000


def test_qsr_with_global_qsgd_logs_h_rounds_and_wire_bytes(tmp_path):
  result = _train(
    tmp_path,
    "--cluster=cpu:4",
    "--sync=qsr",  # alpha from the learning rate: 3e-3 * sqrt(h_base)
    "--h_base=2",
    "--compress=gqsgd",
    "--config.lr_schedule=cosine",
    "--config.steps=40",
    "--config.log_every=5",
    "--config.eval_every=20",
    "--config.checkpoint_every=0",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  summary = _summary(tmp_path)
  assert summary["sync"] == "qsr" and summary["compress"] == "gqsgd"
  lr = optax.cosine_decay_schedule(3e-3, 40)
  alpha = qs.parallel.schedules.default_alpha(3e-3, 2)
  planned = qs.parallel.schedules.QSR(lr, total_steps=40, alpha=alpha, h_base=2)
  assert summary["sync_rounds"] == len(planned.sync_steps(40)) < 20
  per_round = qs.parallel.averagers.GlobalQSGD().wire_bytes(_num_params(), 4)
  assert summary["comm_bytes"] == pytest.approx(
    summary["sync_rounds"] * per_round
  )
  rows = [
    json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  hs = [r["H"] for r in rows if "H" in r]
  assert hs == [planned.round_length(r["step"]) for r in rows if "H" in r]
  # Training time at each eval: after the first step, evals left out.
  times = [r["train_time_s"] for r in rows if "eval_accuracy" in r]
  assert len(times) == 2 and 0 < times[0] < times[1]
  assert times[1] == pytest.approx(summary["train_time_s"], abs=0.5)
  assert summary["train_time_s"] < summary["wall_time_s"]
  assert hs[0] == 2 and hs[-1] > 2  # the period grew as the LR decayed
  assert summary["final_eval_accuracy"] > 0.5


def _num_params():
  from flax import nnx
  from jax.flatten_util import ravel_pytree

  from qsync_jax import models

  model = models.create_model("cnn", rngs=nnx.Rngs(0))
  return ravel_pytree(nnx.state(model, nnx.Param))[0].size


def test_qsr_study_binary_writes_runs_and_plots(tmp_path):
  result = _run(
    "experiments.qsr_study",
    f"--out={tmp_path}",
    "--tasks=cnn",
    "--configs=dp,qsr,qsr_linear",
    "--seeds=1",
    "--steps=12",
    "--learning_rate=0.002",
    "--h_base=2",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  study = json.loads((tmp_path / "study.json").read_text())
  assert [r["name"] for r in study["runs"]] == ["dp", "qsr", "qsr_linear"]
  for r in study["runs"]:
    assert {
      "sync",
      "compress",
      "seed",
      "final_eval",
      "sync_rounds",
      "comm_bytes",
    } <= set(r)
  task = study["tasks"]["cnn"]
  assert task["learning_rate"] == 0.002 and task["h_base"] == 2
  dp, qsr, linear = study["runs"]
  assert dp["sync_rounds"] == 12
  # alpha is set from the round budget: floor(0.15 * 12) = 1 round.
  assert qsr["sync_rounds"] == task["qsr_rounds"] == 1
  assert linear["sync_rounds"] == qsr["sync_rounds"]
  assert task["summary"]["qsr"]["rounds_vs_dp"] == pytest.approx(1 / 12)
  assert len(task["h_curves"]["qsr"]) == 12
  for png in ("h.png", "eval.png"):
    assert (tmp_path / png).stat().st_size > 1000


def test_qsr_study_configs_set_the_averager():
  from experiments.studies import qsr as qsr_lib

  config = qsr_lib.task_config(
    default_config.get_config(), qsr_lib.TASKS["cnn"], seed=0
  )
  int16 = qsr_lib.configure(config, "dp_gqsgd_int16", {}, 1)
  averager = config_lib.make_averager(config_lib.parse(int16))
  assert isinstance(averager, qs.parallel.GlobalQSGD)
  assert averager.wire == "int16" and int16.sync == "dp"
  # The default int8 configuration keeps the strategy's own wire.
  gqsgd = config_lib.parse(qsr_lib.configure(config, "dp_gqsgd", {}, 1))
  assert config_lib.make_averager(gqsgd).wire == "int8"
  qsr = qsr_lib.configure(config, "qsr", {2.0: 0.01}, 1)
  assert (qsr.sync, qsr.gamma, qsr.alpha) == ("qsr", 2.0, 0.01)
  with pytest.raises(ValueError, match="unknown configuration"):
    qsr_lib.configure(config, "dp_int4", {}, 1)


def test_qsr_study_bad_overrides_write_nothing(tmp_path):
  from experiments.studies import qsr

  base = default_config.get_config()
  with pytest.raises(ValueError, match="learning_rate must be positive"):
    qsr.run(str(tmp_path / "a"), base, learning_rate=0.0)
  with pytest.raises(ValueError, match="h_base must be >= 1"):
    qsr.run(str(tmp_path / "b"), base, h_base=0)
  assert not list(tmp_path.iterdir())


def test_dynamic_batching_baseline_runs(tmp_path):
  result = _train(
    tmp_path,
    "--config.batch_mode=dynamic",
    "--config.steps=10",
    "--config.eval_every=0",
    "--config.checkpoint_every=0",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  sizes = [w["batch_size"] for w in _summary(tmp_path)["workers"]]
  assert sum(sizes) == 128 and sizes[0] > sizes[2]


def test_sigkilled_run_resumes_bit_identically(tmp_path):
  args = [
    "--config.steps=40",
    "--config.checkpoint_every=10",
    "--config.eval_every=0",
    "--config.log_every=10",
  ]
  straight = tmp_path / "straight"
  assert _train(straight, *args).returncode == 0
  killed = tmp_path / "killed"
  proc = subprocess.Popen(
    [sys.executable, "-m", "experiments.train", f"--out_dir={killed}", *args],
    cwd=ROOT,
    env=_env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "20").exists():
      assert proc.poll() is None, "the run ended before it could be killed"
      assert time.time() < deadline
      time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL
  assert not (killed / "summary.json").exists()
  # A fresh run into the same directory must not silently overwrite it.
  refused = _train(killed, *args)
  assert refused.returncode == 1 and "--resume" in refused.stderr
  resumed = _train(killed, *args, "--resume")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert _summary(killed)["steps_this_run"] < 40
  assert (
    _summary(killed)["params_sha256"] == _summary(straight)["params_sha256"]
  )
  steps = [
    json.loads(l)["step"]
    for l in (killed / "metrics.jsonl").read_text().splitlines()
  ]
  assert steps == list(range(10, 41, 10))


def test_two_processes_match_one_process_with_two_devices(tmp_path):
  args = [
    "--cluster=v100:1,t4:1",
    "--config.steps=12",
    "--config.eval_every=0",
    "--config.checkpoint_every=0",
    "--config.log_every=4",
  ]
  single = tmp_path / "single"
  result = _train(single, *args)
  assert result.returncode == 0, result.stderr[-3000:]
  multi = tmp_path / "multi"
  result = _train_two_processes(multi, *args)
  assert result.returncode == 0, _failure_lines(result.stdout + result.stderr)
  s, m = _summary(single), _summary(multi)
  assert m["num_processes"] == 2 and s["num_processes"] == 1
  assert m["params_sha256"] == s["params_sha256"]
  assert m["final_eval_accuracy"] == s["final_eval_accuracy"]


def test_an_evaluation_clock_counts_the_slowest_process(tmp_path):
  # Local SGD with no average before the end: the processes meet only at
  # the evaluations (no train row before the last step gathers metrics).
  # Process 1 reads each example slowly, so its steps take 5 x 0.05 s;
  # process 0's (a tiny linear model) take milliseconds, and its clock at
  # the step-4 evaluation still counts process 1's steps 2 to 4 (the clock
  # starts when every process has run step 1).
  import user_datasets

  env = _env()
  env["PYTHONPATH"] = os.pathsep.join([TESTS, env["PYTHONPATH"]])
  out = tmp_path / "run"
  result = _train_two_processes(
    out,
    "--cluster=cpu:2",
    "--config.dataset=user_datasets:slow_on_process_1",
    "--config.model=user_models:bare_linear",
    '--model_kwargs={"num_classes": 3}',
    "--config.plan_mode=manual",
    "--config.batch_size=5",
    "--config.sync=local",
    "--config.h_base=100",
    "--config.steps=8",
    "--config.eval_every=4",
    "--config.log_every=100",
    "--config.checkpoint_every=0",
    env=env,
  )
  assert result.returncode == 0, _failure_lines(result.stdout + result.stderr)
  rows = [
    json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
  ]
  evaluated = [r for r in rows if "eval_accuracy" in r]
  assert [r["step"] for r in evaluated] == [4, 8]
  assert evaluated[0]["train_time_s"] >= 3 * 5 * user_datasets.SLOW_READ_S


def test_launcher_ends_a_training_run_whose_worker_dies(tmp_path):
  launcher = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=2",
      "--",
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={tmp_path}",
      "--cluster=cpu:2",
      "--config.steps=100000",
      "--config.eval_every=0",
      "--config.checkpoint_every=0",
      "--config.log_every=1",
    ],
    cwd=ROOT,
    env=_env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  children = []
  try:
    deadline = time.time() + 120
    # Wait until both workers train (step lines appear), then kill one.
    seen = set()
    for line in launcher.stdout:
      if "step " in line and "/100000" in line:
        seen.add(line[:4])
      if len(seen) == 2 or time.time() > deadline:
        break
    assert len(seen) == 2, "the workers did not start training"
    children = [
      int(p)
      for p in subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
      ).stdout.split()
    ]
    assert len(children) == 2
    killed_at = time.time()
    os.kill(children[1], signal.SIGKILL)
    launcher.stdout.read()
    code = launcher.wait(timeout=90)
    elapsed = time.time() - killed_at
  finally:
    for pid in [launcher.pid, *children]:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  print(f"launcher exited {code} {elapsed:.1f} s after a worker was killed")
  assert code != 0 and elapsed < 60
  for pid in children:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--cluster=v100:2", "--plan=v100={int8}"],
      "'v100' does not support int8",
    ),
    (
      ["--plan=t4=/nonexistent/plan.json"],
      "plan file '/nonexistent/plan.json' does not exist",
    ),
    (["--plan=t4={bad}"], "malformed plan JSON"),
    (["--plan=t4"], "expected KIND=PLAN.json"),
    (["--model=nosuch"], "invalid model spec 'nosuch'"),
    (["--cluster=k80:1"], "unknown device kind 'k80'"),
    (["--cluster=t4:0"], "count must be positive"),
    (
      ["--cluster=cpu:1,t4:1", "--config.allocator.profiles=analytic"],
      "cannot profile cpu: analytic profiles were asked for, and the GPU "
      "catalog (a10, a100, h100, h200, l4, l40s, t4, v100) has no figures for it",
    ),
    (
      ["--config.allocator.profiles=never"],
      "config.allocator.profiles must be one of auto, measured, analytic",
    ),
    (["--plan=auto", "--plan=t4={int8}"], "--plan=auto cannot be combined"),
    (["--config.compress=zip"], "unknown averager 'zip'"),
    (["--cluster=cpu:3", "--compress=gqsgd_exp"], "power-of-two"),
    (["--config.optimizer=lamb"], "unknown optimizer 'lamb'"),
  ],
)
def test_binary_bad_input_is_one_clear_error(tmp_path, args, message):
  int8 = tmp_path / "int8.json"
  int8.write_text('{"rules": [["conv1", "int8"]]}')
  bad = tmp_path / "bad.json"
  bad.write_text('{"rules": [["conv1", ')
  args = [
    a.replace("{int8}", str(int8)).replace("{bad}", str(bad)) for a in args
  ]
  result = _train(tmp_path / "out", "--config.steps=5", *args)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last, last
  assert "Traceback" not in result.stderr
