"""Bad input to the train and allocate binaries: one error line, exit 1.

Each case runs the binary with a user's command line and checks that it
ends with one line ``error: <what is wrong>``, exit status 1 and no
traceback. Most fail before a model is built (the config and flags are
checked first), so the binary is forked from a process that has imported
its libraries (tests/binaries.py), and a case costs a fraction of a second.
``config_lib.parse`` and the locked config's ``compress_kwargs`` are also
tested in-process.
"""

import fcntl
import json
import os
import socket

from absl import flags
import binaries
from ml_collections import config_flags
import pytest

from experiments import config_fields
from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
import qsync_jax as qs
from qsync_jax import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A module of user "factories", put on the binaries' PYTHONPATH.
_USER_MODELS = '''
from qsync_jax import models


def nan_cnn(*, rngs):
  """A tiny CNN whose head bias is NaN: training cannot end finite."""
  model = models.SmallCNN(models.SmallCNNConfig(widths=(2, 2), hidden=4),
                          rngs=rngs)
  model.head.bias.value = model.head.bias.value * float("nan")
  return model


def returns_int(*, rngs):
  return 3


def takes_nothing():
  return None
'''

# JSON nested far deeper than Python's recursion limit (and a command-line
# argument's size limit of 128 KiB).
_DEEP = "[" * 20000 + "]" * 20000


@pytest.fixture(name="user_models")
def _user_models(tmp_path):
  path = tmp_path / "user_models"
  path.mkdir()
  (path / "user_models.py").write_text(_USER_MODELS)
  return str(path)


def _run(module, *args, path=None, timeout=300):
  env = dict(os.environ)
  # As conftest.py does in-process: tiny programs compile faster unoptimized.
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
  env["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *([path] if path else []), env.get("PYTHONPATH", "")]
  )
  return binaries.run(module, *args, env=env, timeout=timeout)


def _error_line(result):
  """The one ``error:`` line of a run that failed as bad input should."""
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: "), last
  return last


# --------------------------------------------------------------------------
# experiments.train
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "arg, message",
  [
    (
      "--config.learning_rate=nan",
      "config.learning_rate must be a finite number > 0, got nan",
    ),
    (
      "--config.learning_rate=inf",
      "config.learning_rate must be a finite number > 0, got inf",
    ),
    (
      "--config.learning_rate=-0.1",
      "config.learning_rate must be a finite number > 0, got -0.1",
    ),
    ("--config.steps=-5", "config.steps must be an integer >= 1, got -5"),
    ("--config.batch_size=0", "config.batch_size must be an integer >= 1"),
    ("--config.log_every=0", "config.log_every must be an integer >= 1, got 0"),
    ("--config.eval_every=-1", "config.eval_every must be an integer >= 0"),
    (
      "--config.checkpoint_every=-1",
      "config.checkpoint_every must be an integer >= 0",
    ),
    ("--h_base=0", "config.h_base must be an integer >= 1, got 0"),
  ],
)
def test_train_bad_numbers_fail_before_anything_runs(tmp_path, arg, message):
  out = tmp_path / "out"
  last = _error_line(_run("experiments.train", f"--out_dir={out}", arg))
  assert message in last, last
  assert not out.exists()  # failed before even the output directory


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("momentum", 1.0, "config.momentum must be a finite number in [0, 1)"),
    (
      "final_learning_rate",
      -1.0,
      "config.final_learning_rate must be a finite number >= 0",
    ),
    ("alpha", float("-inf"), "config.alpha must be a finite number >= 0"),
    ("gamma", 0.0, "config.gamma must be a finite number > 0"),
    ("seed", -1, "config.seed must be an integer >= 0"),
    ("warmup_steps", -1, "config.warmup_steps must be an integer >= 0"),
    ("switch_step", -3, "config.switch_step must be an integer >= 0"),
    ("steps", 2.5, "config.steps must be an integer >= 1, got 2.5"),
    ("steps", True, "config.steps must be an integer >= 1, got True"),
    ("steps", None, "config.steps must be an integer >= 1, got None"),
    (
      "allocator.num_batches",
      0,
      "config.allocator.num_batches must be an integer >= 1",
    ),
    (
      "allocator.compression",
      1.5,
      "config.allocator.compression must be a finite number in [0, 1]",
    ),
    (
      "compress_kwargs.bucket_size",
      0,
      "config.compress_kwargs.bucket_size must be an integer >= 1",
    ),
    (
      "model_kwargs.dropout",
      float("nan"),
      "config.model_kwargs.dropout must be a finite number, got nan",
    ),
  ],
)
def test_parse_names_the_field_and_value(field, value, message):
  config = default_config.get_config()
  config_lib.parse(config)  # the defaults are valid
  *parents, name = field.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  with node.ignore_type():
    node[name] = value
  with pytest.raises(ValueError) as info:
    config_lib.parse(config)
  assert message in str(info.value)


def test_parse_leaves_unset_placeholders_alone():
  config = default_config.get_config()
  assert config.allocator.compression is None
  assert config.compress_kwargs.bucket_size is None
  job = config_lib.parse(config)
  assert job.allocator.compression is None
  assert job.compress_kwargs.bucket_size is None
  config.allocator.compression = 0.6
  assert config_lib.parse(config).allocator.compression == 0.6


def test_plan_for_a_kind_not_in_the_cluster_is_an_error(tmp_path):
  plan = tmp_path / "t4.json"
  plan.write_text('{"rules": [["conv1", "int8"]]}')
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={tmp_path}/o",
      "--cluster=v100:2",
      f"--plan=t4={plan}",
    )
  )
  assert "device kind(s) t4" in last and "(its kinds: v100)" in last, last
  # The same through config.plans, and through make_workers' argument.
  config = default_config.get_config()
  config.cluster, config.plan_mode = "v100:1,t4:1", "manual"
  config.plans = {"a100": {"rules": []}, "t4": {"rules": []}}
  with pytest.raises(ValueError, match=r"kind\(s\) a100, which the cluster"):
    config_lib.parse(config)
  config.plan_mode = "auto"  # the allocator's plans replace config.plans
  job = config_lib.parse(config)
  with pytest.raises(ValueError, match=r"its kinds: v100, t4"):
    train_lib.make_workers(job, plans={"h100": qs.PrecisionPlan()})


def test_train_existing_file_as_out_dir_is_an_error(tmp_path):
  taken = tmp_path / "taken"
  taken.write_text("not a directory")
  last = _error_line(_run("experiments.train", f"--out_dir={taken}"))
  assert last == (
    f"error: --out_dir '{taken}' is an existing file, not a directory"
  )
  last = _error_line(_run("experiments.train", f"--out_dir={taken}/run"))
  assert "a parent of it is an existing file" in last, last
  assert taken.read_text() == "not a directory"


@pytest.mark.parametrize(
  "spec, message",
  [
    (
      "user_models:returns_int",
      "model spec 'user_models:returns_int' is not "
      "a model factory: it returned a int, not an nnx.Module",
    ),
    (
      "user_models:takes_nothing",
      "model spec 'user_models:takes_nothing' is "
      "not a model factory: calling it with (rngs) raised TypeError",
    ),
  ],
)
def test_train_factory_that_is_not_a_model_factory(
  tmp_path, user_models, spec, message
):
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={tmp_path}/o",
      "--cluster=v100:1",
      f"--config.model={spec}",
      path=user_models,
    )
  )
  assert message in last, last


def test_train_deeply_nested_plan_json_is_an_error(tmp_path):
  deep = '{"rules": ' + _DEEP + "}"
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={tmp_path}/a",
      "--cluster=t4:1",
      f"--plan=t4={deep}",
    )
  )
  assert last == "error: plan JSON is nested too deeply", last
  plan = tmp_path / "deep.json"
  plan.write_text(deep)
  with pytest.raises(ValueError, match="plan file .* is nested too deeply"):
    config_fields.load_plan(str(plan))


def test_compress_kwargs_override_reaches_the_averager():
  # The binary's flag: the default config file, locked, and the overrides
  # (config_flags registers them from the command line it is given).
  argv = [
    "train",
    "--config.compress=gqsgd",
    "--config.compress_kwargs.wire=int16",
    "--config.compress_kwargs.bucket_size=256",
  ]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config",
    os.path.join(ROOT, "experiments", "configs", "default.py"),
    flag_values=values,
    lock_config=True,
    sys_argv=argv,
  )
  values(argv)
  assert values.config.is_locked
  averager = config_lib.make_averager(config_lib.parse(values.config))
  assert isinstance(averager, qs.parallel.GlobalQSGD)
  assert (averager.wire, averager.bucket_size) == ("int16", 256)
  # Unset fields keep the strategy's defaults.
  config = default_config.get_config()
  config.compress = "gqsgd"
  default = qs.parallel.GlobalQSGD()
  built = config_lib.make_averager(config_lib.parse(config))
  assert (built.wire, built.bucket_size) == (default.wire, default.bucket_size)


def test_compress_kwargs_the_strategy_lacks_is_an_error(tmp_path):
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={tmp_path}/o",
      "--cluster=v100:1",
      "--compress=qsgd",
      "--config.compress_kwargs.wire=int16",
    )
  )
  assert (
    "config.compress_kwargs ['seed', 'wire'] do not fit compress='qsgd'" in last
  ), last


def test_diverged_run_fails_and_writes_no_summary(tmp_path, user_models):
  out = tmp_path / "out"
  out.mkdir()
  (out / "summary.json").write_text('{"final_eval_accuracy": 0.99}')
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={out}",
      "--cluster=v100:1",
      "--config.model=user_models:nan_cnn",
      "--config.steps=1",
      "--config.batch_size=8",
      "--config.eval_every=0",
      "--config.checkpoint_every=0",
      path=user_models,
    )
  )
  # Stopped at the step's check, the model named, not the learning rate.
  assert last.startswith(
    "error: training stopped at step 1: the training loss is nan"
  ), last
  assert "likely cause: the model or the loss: the loss was nan at step 1" in (
    last
  )
  assert not (out / "summary.json").exists()


_TINY_RUN = (
  "--cluster=v100:1,t4:1",
  "--plan=auto",
  "--config.steps=2",
  "--config.batch_size=8",
  "--config.eval_every=2",
  "--config.checkpoint_every=2",
)


def _files(root):
  """{path: (bytes, mtime_ns)} of every file under ``root``."""
  out = {}
  for dirpath, _, names in os.walk(root):
    for name in names:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[path] = (f.read(), os.stat(path).st_mtime_ns)
  return out


def test_train_refusals_leave_a_finished_run_unchanged(tmp_path):
  out = tmp_path / "out"
  first = _run("experiments.train", f"--out_dir={out}", *_TINY_RUN)
  assert first.returncode == 0, first.stderr[-3000:]
  assert (out / "allocation" / "summary.json").exists()
  before = _files(out)
  last = _error_line(_run("experiments.train", f"--out_dir={out}", *_TINY_RUN))
  assert last == (
    f"error: {out} already holds checkpoints; pass --resume to continue "
    "that run or use a new --out_dir"
  ), last
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={out}",
      *_TINY_RUN,
      "--resume",
      "--config.lr_schedule=step",
      "--config.lr_decay_steps=0",
    )
  )
  assert "lr_schedule=step needs lr_decay_steps" in last, last
  assert _files(out) == before


def test_train_out_dir_in_use_by_another_run(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  lock = out / rundir.directory.LOCK_FILE
  with open(lock, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    f.flush()
    last = _error_line(
      _run("experiments.train", f"--out_dir={out}", *_TINY_RUN)
    )
  assert last == (
    f"error: --out_dir {out} is in use by another run "
    f"(pid {os.getpid()} on {socket.gethostname()})"
  ), last
  assert sorted(os.listdir(out)) == [rundir.directory.LOCK_FILE]


def test_train_stale_lock_file_does_not_block(tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  # A killed run's lock file: its record stays, its lock went with it.
  (out / rundir.directory.LOCK_FILE).write_text(
    '{"pid": 1, "host": "elsewhere"}\n'
  )
  result = _run("experiments.train", f"--out_dir={out}", *_TINY_RUN)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (out / "summary.json").exists()
  # Released and cleared at exit: the next run (here resuming) may start.
  assert (out / rundir.directory.LOCK_FILE).read_text() == ""
  with rundir.OutDirLock(str(out)):
    pass


# --------------------------------------------------------------------------
# experiments.allocate
# --------------------------------------------------------------------------


def _allocate(tmp_path, *args, path=None):
  return _run(
    "experiments.allocate",
    "--model=cnn",
    "--cluster=v100:1,t4:1",
    "--num_batches=1",
    f"--out={tmp_path}/plans",
    *args,
    path=path,
  )


@pytest.mark.parametrize(
  "scores, message",
  [
    ([1, 2], "holds a list; expected {layer: {precision: number}}"),
    ({}, "has no layers"),
    (
      {"values": {"conv1": 3}},
      "layer 'conv1' maps to a int, not {precision: number}",
    ),
    ({"conv1": {"int3": 1.0}}, "layer 'conv1': "),
    (
      {"conv1": {"int8": float("nan")}},
      "the score of layer 'conv1' at int8 is nan, not a finite number",
    ),
    ({"conv1": {"int8": "high"}}, "is 'high', not a finite number"),
    (
      {"values": {"conv1": {"int8": 1.0}}, "method": 3},
      "its method is a int, not a name",
    ),
    (
      {"conv1": {"int8": 1.0}},
      "the indicator scores and the timing model have different layers",
    ),
  ],
)
def test_allocate_scores_of_the_wrong_shape(tmp_path, scores, message):
  path = tmp_path / "scores.json"
  path.write_text(json.dumps(scores))
  last = _error_line(_allocate(tmp_path, f"--scores={path}"))
  assert message in last, last


def test_allocate_unreadable_scores_files(tmp_path):
  last = _error_line(_allocate(tmp_path, f"--scores={tmp_path}"))
  assert last == (
    f"error: --scores file '{tmp_path}' is a directory, not a JSON file"
  ), last
  path = tmp_path / "deep.json"
  path.write_text(_DEEP)
  last = _error_line(_allocate(tmp_path, f"--scores={path}"))
  assert last == f"error: --scores file '{path}' is nested too deeply", last


@pytest.mark.parametrize(
  "arg, message",
  [
    ("--batch_size=0", "--batch_size must be >= 1, got 0"),
    ("--batch_size=-8", "--batch_size must be >= 1, got -8"),
    ("--score_batch_size=0", "--score_batch_size must be >= 1, got 0"),
    ("--num_batches=0", "--num_batches must be >= 1, got 0"),
    ("--compression=1.5", "--compression must be a fraction in [0, 1]"),
    ("--memory_limit=t4=-1", "the limit must be a positive number of GiB"),
    ("--model_kwargs=[1]", "--model_kwargs must be a JSON object"),
    (f"--model_kwargs={_DEEP}", "--model_kwargs is nested too deeply"),
    (f"--dataset_kwargs={_DEEP}", "--dataset_kwargs is nested too deeply"),
  ],
)
def test_allocate_bad_flags(tmp_path, arg, message):
  last = _error_line(_allocate(tmp_path, arg))
  assert message in last, last
  assert not (tmp_path / "plans").exists()  # checked before anything ran


def test_allocate_existing_file_as_out_and_bad_factory(tmp_path, user_models):
  taken = tmp_path / "taken"
  taken.write_text("x")
  last = _error_line(
    _run("experiments.allocate", "--model=cnn", f"--out={taken}")
  )
  assert last == f"error: --out '{taken}' is an existing file, not a directory"
  last = _error_line(
    _allocate(tmp_path, "--model=user_models:returns_int", path=user_models)
  )
  assert "'user_models:returns_int' is not a model factory" in last, last
