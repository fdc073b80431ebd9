"""User mistakes end with one line naming the file, flag or value.

Where the check is a library function, it is called in-process; the
binaries run as subprocesses only where their behaviour is the point: the
exit status, the last line, no traceback and nothing left in ``--out_dir``.
"""

import json
import os
import subprocess

import binaries
from flax import nnx
import numpy as np
import optax
import pytest

from experiments import config_fields
from experiments import config_lib
from experiments import flag_aliases
from experiments.configs import default as default_config
from qsync_jax import cli
from qsync_jax import data as data_lib
from qsync_jax import models
from qsync_jax import rundir
from qsync_jax import task
from qsync_jax.allocation import sharing
from qsync_jax.data import cache as data_cache
from qsync_jax.launch import links
from qsync_jax.launch import local
from qsync_jax.numerics import ops
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import agreement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# User code, importable by the binaries as ``mistakes``.
_USER_CODE = """
import optax
from qsync_jax import models


def per_example_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def three_classes(*, rngs):
  return models.SmallCNN(
    models.SmallCNNConfig(widths=(2, 2), hidden=4, num_classes=3), rngs=rngs
  )


def sized(*, rngs, hidden=4, offset=0):
  return models.SmallCNN(models.SmallCNNConfig(hidden=hidden), rngs=rngs)


def buggy(*, rngs, offset=0):
  return 1 / offset
"""


@pytest.fixture(name="user_code")
def _user_code(tmp_path, monkeypatch):
  path = tmp_path / "user_code"
  path.mkdir()
  (path / "mistakes.py").write_text(_USER_CODE)
  monkeypatch.syspath_prepend(str(path))
  return str(path)


def _run(module, *args, path=None, env=None):
  full = dict(os.environ)
  full["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
  full["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *([path] if path else []), full.get("PYTHONPATH", "")]
  )
  full.update(env or {})
  return binaries.run(module, *args, env=full, timeout=300)


def _error_line(result):
  """The last line of a run that failed as bad input should: exit 1."""
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return result.stderr.strip().splitlines()[-1]


_TINY = (
  "--config.steps=1",
  "--config.batch_size=8",
  "--config.eval_every=0",
  "--config.checkpoint_every=0",
)


# --------------------------------------------------------------------------
# Plan files
# --------------------------------------------------------------------------


def test_plan_path_that_is_a_directory_or_binary(tmp_path):
  binary = tmp_path / "plan.json"
  binary.write_bytes(b"\xff\x00plan")
  with pytest.raises(ValueError) as info:
    config_fields.load_plan(str(tmp_path))
  assert str(info.value) == (
    f"plan file '{tmp_path}' is a directory, not a JSON file"
  )
  with pytest.raises(ValueError) as info:
    config_fields.load_plan(str(binary))
  assert str(info.value) == (
    f"plan file '{binary}' is not UTF-8 text (byte 0 is b'\\xff'); "
    "expected a JSON file"
  )
  # Read by the config's check, before a run writes anything.
  config = default_config.get_config()
  config.cluster, config.plan_mode = "v100:1,t4:1", "manual"
  config.plans = {"t4": str(tmp_path)}
  with pytest.raises(ValueError, match="is a directory, not a JSON file"):
    config_lib.parse(config)


def test_plan_file_with_wrong_contents_names_the_file(tmp_path):
  plan = tmp_path / "t4.json"
  plan.write_text("[1, 2]")
  with pytest.raises(ValueError) as info:
    config_fields.load_plan(str(plan))
  assert str(info.value) == (
    f"plan file '{plan}': a plan must be a JSON object, got list"
  )
  plan.write_text('{"rules": [["conv1", "int3"]]}')
  with pytest.raises(ValueError, match=f"plan file '{plan}': invalid plan"):
    config_fields.load_plan(str(plan))


def test_plan_flag_given_twice_or_without_a_kind():
  config = default_config.get_config()
  with pytest.raises(ValueError) as info:
    flag_aliases.apply_overrides(config, {"plan": ["t4=a.json", "T4=b.json"]})
  assert str(info.value) == (
    "--plan gives two plans for t4: 'a.json' and 'b.json'"
  )
  with pytest.raises(ValueError) as info:
    flag_aliases.apply_overrides(config, {"plan": ["plans/t4.json"]})
  assert str(info.value) == (
    "--plan='plans/t4.json': expected KIND=PLAN.json, the device kind the "
    "plan is for and the plan, e.g. --plan=t4=plans/t4.json"
  )


# --------------------------------------------------------------------------
# The output directory
# --------------------------------------------------------------------------


@pytest.fixture(name="read_only_dir")
def _read_only_dir(tmp_path):
  if os.geteuid() != 0:
    pytest.skip("mounting a read-only tmpfs needs root")
  where = tmp_path / "ro"
  where.mkdir()
  mount = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)],
    capture_output=True,
    text=True,
  )
  if mount.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
  try:
    yield where
  finally:
    subprocess.run(["umount", str(where)], check=True)


def test_out_dir_on_a_read_only_file_system(read_only_dir):
  with pytest.raises(ValueError) as info:
    rundir.make_out_dir(str(read_only_dir), "--out_dir")
  assert str(info.value) == (
    f"--out_dir '{read_only_dir}' is not writable: a read-only file system"
  )
  out = read_only_dir / "run"
  last = _error_line(_run("experiments.train", f"--out_dir={out}", *_TINY))
  assert last == (
    f"error: --out_dir '{out}' cannot be created: Read-only file system"
  )
  assert os.listdir(read_only_dir) == []


# --------------------------------------------------------------------------
# Model sizes, the loss, the classes
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "spec, kwargs, named, raised",
  [
    ("cnn", {"hidden": 0}, "hidden=0", "ZeroDivisionError"),
    ("cnn", {"widths": [4, 0]}, "widths=[4, 0]", "ZeroDivisionError"),
    ("cnn", {"hidden": -2}, "hidden=-2", "TypeError"),
    ("lm", {"num_heads": 0}, "num_heads=0", "ZeroDivisionError"),
  ],
)
def test_a_size_below_one_names_the_kwarg(spec, kwargs, named, raised):
  def build():
    return models.build_model(spec, rngs=nnx.Rngs(0), **kwargs)

  for abstract in (False, True):  # built, and under nnx.eval_shape
    with pytest.raises(ValueError) as info:
      models.without_weights(build) if abstract else build()
    assert str(info.value).startswith(
      f"model {spec!r} cannot be built with {named}: sizes must be >= 1 "
      f"({raised}: "
    ), info.value


def test_a_size_below_one_in_a_users_factory(user_code):
  del user_code
  with pytest.raises(ValueError) as info:
    models.build_model("mistakes:sized", rngs=nnx.Rngs(0), hidden=0)
  assert str(info.value) == (
    "model 'mistakes:sized' cannot be built with hidden=0: sizes must be "
    ">= 1 (ZeroDivisionError: float division by zero)"
  )
  # An error the factory's own code raises is the user's: named as the
  # factory's, with the user's exception (and its traceback) as the cause.
  with pytest.raises(models.FactoryError) as info:
    models.build_model("mistakes:buggy", rngs=nnx.Rngs(0), offset=0)
  assert str(info.value).startswith(
    "model 'mistakes:buggy' raised ZeroDivisionError: division by zero"
  )
  assert isinstance(info.value.__cause__, ZeroDivisionError)


def _vector_loss(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def _integer_loss(logits, labels):
  del logits, labels
  return np.int32(3)


def _loss_only(model, batch, rngs):
  del rngs
  return task.losses.cross_entropy(model(batch[0]), batch[1])


def _aux_list(model, batch, rngs):
  return _loss_only(model, batch, rngs), [1.0]


def _per_example_with_aux(model, batch, rngs):
  del rngs
  return _vector_loss(model(batch[0]), batch[1]), {}


@pytest.fixture(name="tiny")
def _tiny():
  model = models.SmallCNN(
    models.SmallCNNConfig(widths=(2, 2), hidden=4), rngs=nnx.Rngs(0)
  )
  x = np.zeros((4, 8, 8, 1), np.float32)
  return model, (x, np.zeros(4, np.int32))


@pytest.mark.parametrize(
  "fn, message",
  [
    (
      _vector_loss,
      "returned a loss of shape (4,), not a scalar: reduce it over the "
      "batch (e.g. its .mean())",
    ),
    (
      _per_example_with_aux,
      "returned a loss of shape (4,), not a scalar: reduce it over the "
      "batch (e.g. its .mean())",
    ),
    (
      _integer_loss,
      "returned a loss of type int32, not a float: an integer has no "
      "gradient, so training would not move",
    ),
    (
      _loss_only,
      "must return (loss, aux) or (logits, labels), got an array of shape ()",
    ),
    (
      _aux_list,
      "must return (loss, aux) with aux a dict of scalar metrics or None, "
      "got aux of type list",
    ),
  ],
)
def test_a_loss_of_the_wrong_form_names_the_loss(tiny, fn, message):
  model, batch = tiny
  objective = task.as_objective(fn)
  name = f"'{fn.__module__}:{fn.__qualname__}'"
  with pytest.raises(ValueError) as info:
    objective(model, batch)
  assert str(info.value) == f"loss_fn {name} {message}"


def test_model_with_fewer_classes_than_the_labels(tiny):
  model, _ = tiny
  dataset = data_lib.load_dataset("digits")
  job = config_lib.parse(default_config.get_config())
  config_lib.check_model_fits(job, model, dataset)  # 10 classes: fits
  few = models.SmallCNN(
    models.SmallCNNConfig(widths=(2, 2), hidden=4, num_classes=3),
    rngs=nnx.Rngs(0),
  )
  with pytest.raises(ValueError) as info:
    config_lib.check_model_fits(job, few, dataset)
  assert str(info.value) == (
    "model 'cnn' outputs 3 classes but dataset 'digits' has 10 (labels "
    "0..9): give the model a head of 10 (num_classes)"
  )


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ("--config.loss_fn=mistakes:per_example_loss",),
      "error: loss_fn 'mistakes:per_example_loss' returned a loss of shape "
      "(8,), not a scalar: reduce it over the batch (e.g. its .mean())",
    ),
    (
      ("--model=mistakes:three_classes",),
      "error: model 'mistakes:three_classes' outputs 3 classes but dataset "
      "'digits' has 10 (labels 0..9): give the model a head of 10 "
      "(num_classes)",
    ),
  ],
)
def test_train_refuses_before_writing_into_out_dir(
  tmp_path, user_code, args, message
):
  out = tmp_path / "out"
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={out}",
      "--cluster=v100:1",
      *_TINY,
      *args,
      path=user_code,
    )
  )
  assert last == message
  assert not out.exists()  # made for the lock, and removed again


# --------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------


def test_zero_cpu_devices_with_cluster_auto(tmp_path):
  out = tmp_path / "out"
  last = _error_line(
    _run(
      "experiments.train",
      f"--out_dir={out}",
      "--cluster=auto",
      *_TINY,
      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=0"},
    )
  )
  assert last == (
    "error: XLA_FLAGS sets --xla_force_host_platform_device_count=0: JAX's "
    "CPU backend needs at least 1 device"
  )
  assert not out.exists()


def test_library_variables_are_checked_at_start(monkeypatch, capsys):
  assert ops.kernel_backend_from_env({}) == "auto"
  monkeypatch.setattr(cli.host_malloc, "configure_from_env", lambda: None)
  cases = [
    (
      {"QSYNC_KERNELS": "triton"},
      "error: QSYNC_KERNELS must be one of auto, pallas, xla, got 'triton'",
    ),
    (
      {"QSYNC_LINK": "1gbit", "QSYNC_LINK_RATE_BPS": "fast"},
      "error: QSYNC_LINK_RATE_BPS must be a number, got 'fast'",
    ),
    (
      {"QSYNC_CPU_QUOTA": "1,1"},
      "error: QSYNC_CPU_QUOTA set without QSYNC_LINK: the launcher sets "
      "them together (python -m qsync_jax.distributed --link=...); unset "
      "them",
    ),
  ]
  for env, line in cases:
    with monkeypatch.context() as m:
      for name in ("QSYNC_KERNELS", *links._LINK_DETAILS, links.ENV_LINK):
        m.delenv(name, raising=False)
      for name, value in env.items():
        m.setenv(name, value)
      with pytest.raises(SystemExit) as info:
        cli.start_binary()
    assert info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == line


def test_dataset_cache_variable_naming_a_file(tmp_path, monkeypatch):
  taken = tmp_path / "cache"
  taken.write_text("")
  monkeypatch.setenv(data_cache.CACHE_ENV_VAR, str(taken / "sub"))
  with pytest.raises(ValueError) as info:
    data_cache.default_cache_dir()
  assert str(info.value) == (
    f"QSYNC_JAX_CACHE='{taken}/sub' cannot be the dataset cache directory: "
    f"'{taken}' is a file"
  )


# --------------------------------------------------------------------------
# Settings the run would not read
# --------------------------------------------------------------------------


def test_unused_settings_are_one_warning_line_each():
  config = default_config.get_config()
  assert config_lib.unused_settings(config_lib.parse(config)) == []
  config.steps = 400
  config.lr_schedule = "step"
  config.lr_decay_steps = (300, 400, 500)
  config.momentum = 0.9  # Adam has none
  config.alpha = 0.5  # QSR's, and sync is dp
  config.plan_mode = "manual"
  config.allocator.method = "ilp"  # the allocator does not run
  assert config_lib.unused_settings(config_lib.parse(config)) == [
    "config.momentum=0.9 is not used with optimizer='adam' (only with 'sgd')",
    "config.alpha=0.5 is not used with sync='dp' (only with 'qsr')",
    "config.allocator.method=ilp is not used with plan_mode='manual' (only "
    "with 'auto')",
    "config.lr_decay_steps 400, 500 are at or past the last step "
    "(config.steps=400): the learning rate never decays there",
  ]
  config = default_config.get_config()
  config.warmup_steps = 10
  assert config_lib.unused_settings(config_lib.parse(config)) == [
    "config.warmup_steps=10 is not used with lr_schedule='constant' (no "
    "warmup; only sync='qsr' reads it, for its period)"
  ]


# --------------------------------------------------------------------------
# Processes that disagree
# --------------------------------------------------------------------------


def _facts(config):
  return agreement.local_facts(
    config=config, params={"w": np.ones(2)}, data_seed=0, environ={}
  )


def test_disagreeing_processes_name_the_config_field_and_values():
  base = {"model": "cnn", "model_kwargs": {"widths": [8, 16]}, "lr": 0.1}
  other = {**base, "model_kwargs": {"widths": [8, 32]}}
  line = agreement.first_mismatch([_facts(base), _facts(other)])
  assert line == (
    "process 1 disagrees with process 0 on config.model_kwargs.widths[1]: "
    "32 vs 16"
  )
  # A field one process lacks, and a long value: cut, yet still told apart.
  line = agreement.first_mismatch([_facts(base), _facts({**base, "x": 1})])
  assert (
    line == "process 1 disagrees with process 0 on config.x: 1 vs <missing>"
  )
  long_a, long_b = {"path": "a" * 200}, {"path": "a" * 199 + "b"}
  line = agreement.first_mismatch([_facts(long_a), _facts(long_b)])
  assert line.startswith("process 1 disagrees with process 0 on config.path: ")
  assert len(line) < 200
  # Bounded in size, whatever the config holds.
  facts = _facts({"big": list(range(10_000))})
  assert len(json.dumps(facts)) < 40_000
  # The plans name the kind and the rule or default that differ.
  plans = {"t4": PrecisionPlan([("conv1", "int8")])}
  other_plans = {"t4": PrecisionPlan([("conv1", "fp16")])}
  line = agreement.first_mismatch(
    [sharing.plan_facts(plans), sharing.plan_facts(other_plans)]
  )
  assert line == (
    'process 1 disagrees with process 0 on plans.t4.rules[0][1]: "fp16" vs '
    '"int8"'
  )


# --------------------------------------------------------------------------
# The localhost launcher
# --------------------------------------------------------------------------


def test_launcher_command_that_cannot_run(tmp_path):
  script = tmp_path / "run.sh"
  script.write_text("#!/bin/sh\n")
  env = {"PATH": str(tmp_path)}
  not_executable = (
    f"the command to launch, '{script}', is not executable (chmod +x it, "
    "or run it through its interpreter, e.g. -- python script.py)"
  )
  with pytest.raises(ValueError) as info:
    local.check_program(str(script), env)
  assert str(info.value) == not_executable
  with pytest.raises(ValueError, match="is a directory"):
    local.check_program(str(tmp_path), env)
  with pytest.raises(FileNotFoundError, match="'pyhton', is not on PATH"):
    local.check_program("pyhton", env)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    local.check_program(str(tmp_path / "missing"), env)
  script.chmod(0o755)
  assert local.check_program("run.sh", env) == str(script)
  # Through the binary: one line, exit 1, no process started.
  script.chmod(0o644)
  last = _error_line(
    _run("qsync_jax.distributed", "--num_processes=2", "--", str(script))
  )
  assert last == f"error: {not_executable}"


def test_launcher_link_flags_out_of_range_or_without_a_link():
  with pytest.raises(ValueError) as info:
    links.parse_cpu_quota("inf,1", 2)
  assert str(info.value) == (
    "cpu quota values must be positive finite numbers of CPUs, got 'inf,1'"
  )
  last = _error_line(
    _run(
      "qsync_jax.distributed",
      "--num_processes=2",
      "--latency=5ms",
      "--timeout_s=60",
      "--",
      "true",
    )
  )
  assert last == (
    "error: --latency only shapes an emulated link: add --link=RATE (e.g. "
    "--link=1gbit), or leave it out"
  )


# --------------------------------------------------------------------------
# experiments.allocate
# --------------------------------------------------------------------------


def test_allocate_files_and_flags(tmp_path):
  scores = tmp_path / "scores.json"
  scores.write_bytes(b"\x89PNG\r\n")
  with pytest.raises(ValueError) as info:
    config_fields.read_file(str(scores), "--scores file")
  assert str(info.value) == (
    f"--scores file '{scores}' is not UTF-8 text (byte 0 is b'\\x89'); "
    "expected a JSON file"
  )
  out = tmp_path / "plans"
  last = _error_line(
    _run("experiments.allocate", "--model=cnn", f"--out={out}", "--latency=5ms")
  )
  assert (
    last == "error: --latency needs --link (it is the link's delay); add --link"
  )
  assert not out.exists()
