"""Models written the usual way, end to end: plan, train binary, resume.

The models (tests/user_models.py) have no qsync_jax methods: an NNX CNN with
BatchNorm and its own Dropout stream, a Linen ResNet-style module with a
``train`` flag, a bare ``nnx.Linear`` and a two-input model. The indicator
and the predictor on them are tested in test_user_models_indicator.py.
"""

import json
import os
import shutil

import binaries
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import user_models

from experiments.configs import default as default_config
import qsync_jax as qs
from qsync_jax import models
from qsync_jax import task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

# name: (factory, dataset, loss_fn spec, the int8 rule of a plan)
CASES = {
  "nnx_cnn": ("user_models:nnx_cnn", "digits", "", "conv1"),
  "linen_resnet": (
    "user_models:linen_resnet",
    "digits",
    "",
    "ResidualBlock_0/Conv_0",
  ),
  "bare_linear": ("user_models:bare_linear", "mnist1d", "", "Linear"),
  "two_input": (
    "user_models:two_input",
    "mnist1d",
    "user_models:two_input_loss",
    "a",
  ),
}


def _build(name):
  spec, dataset_name, _, _ = CASES[name]
  dataset = qs.data.load_dataset(dataset_name)
  model = models.build_model(
    spec,
    rngs=nnx.Rngs(0),
    data_kwargs=dataset.model_kwargs(),
    sample_input=dataset.x_train[:2],
  )
  x = dataset.x_train[:4]
  inputs = user_models.split_inputs(x) if name == "two_input" else x
  return model, inputs


def _modes(model):
  return [
    (p, getattr(n, a))
    for p, n in nnx.iter_graph(model)
    for a in ("deterministic", "use_running_average")
    if isinstance(n, nnx.Module) and a in vars(n)
  ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_puts_int8_on_the_named_layer_and_keeps_the_mode(name):
  model, inputs = _build(name)
  model.eval()
  modes = _modes(model)
  paths = qs.layer_paths(model, inputs)
  rule = CASES[name][3]
  assert rule in paths
  want = task.call_model(model, inputs, train=False)
  qs.apply_plan(model, qs.PrecisionPlan([(rule, "int8")]), inputs)
  assert _modes(model) == modes  # tracing left eval mode alone
  jaxpr = str(
    jax.make_jaxpr(lambda: task.call_model(model, inputs, train=False))()
  )
  assert "i8[" in jaxpr  # real int8 operands
  got = task.call_model(model, inputs, train=False)
  np.testing.assert_allclose(got, want, atol=0.1 * float(jnp.abs(want).max()))


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # faster compiles
  return env


def _config(name, **overrides):
  spec, dataset_name, loss_fn, _ = CASES[name]
  config = default_config.get_config()
  config.model = spec
  config.dataset = dataset_name
  config.loss_fn = loss_fn
  config.cluster = "v100:1,t4:1"
  config.plan_mode = "auto"
  config.batch_size = 16
  config.allocator.num_batches = 1
  config.allocator.timing_batch_size = 16
  config.bn_batches = 2
  config.learning_rate = 1e-2  # a few steps learn something
  config.steps = 8
  config.eval_every = 2
  config.log_every = 2
  config.checkpoint_every = 4
  for key, value in overrides.items():
    setattr(config, key, value)
  return config


def _flags(config):
  keys = (
    "model",
    "dataset",
    "loss_fn",
    "cluster",
    "plan_mode",
    "batch_size",
    "bn_batches",
    "learning_rate",
    "steps",
    "eval_every",
    "log_every",
    "checkpoint_every",
  )
  flags = [f"--config.{k}={config[k]}" for k in keys]
  flags += [
    "--config.allocator.num_batches=1",
    "--config.allocator.timing_batch_size=16",
  ]
  return flags


def _train(out, config, *extra):
  return binaries.run(
    "experiments.train",
    f"--out_dir={out}",
    *_flags(config),
    *extra,
    env=_env(),
    timeout=900,
  )


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_train_binary_runs_a_user_factory_and_resumes_bit_identically(
  name, tmp_path
):
  config = _config(name)
  out = tmp_path / "run"
  result = _train(out, config)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 8
  rows = [
    json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()
  ]
  evals = [
    (r["step"], r["eval_loss"], r["eval_accuracy"])
    for r in rows
    if "eval_loss" in r
  ]
  assert [e[0] for e in evals] == [2, 4, 6, 8]
  assert evals[-1][1:] == (
    summary["final_eval_loss"],
    summary["final_eval_accuracy"],
  )
  # Training learns: from step 2 to step 8 the eval loss falls and the
  # accuracy rises, above chance (10 classes).
  first, last = evals[0], evals[-1]
  assert last[1] < first[1] - 0.05, evals
  assert last[2] > max(first[2], 0.15), evals
  # Resume from the step-4 checkpoint (the step-8 one removed): the same
  # parameters, optimizer state, BatchNorm statistics, dropout streams and
  # data order give the same run.
  shutil.rmtree(out / "checkpoints" / "8")
  result = _train(out, config, "--resume")
  assert result.returncode == 0, result.stderr[-3000:]
  resumed = json.loads((out / "summary.json").read_text())
  assert resumed["steps_this_run"] == 4
  assert resumed["params_sha256"] == summary["params_sha256"]
  assert resumed["final_eval_loss"] == summary["final_eval_loss"]
  assert resumed["final_eval_accuracy"] == summary["final_eval_accuracy"]


def test_a_tonnx_factory_is_wrapped_and_a_bare_tonnx_is_a_clear_error():
  dataset = qs.data.load_dataset("digits")
  model = models.build_model(
    "user_models:tonnx_resnet",
    rngs=nnx.Rngs(0),
    data_kwargs=dataset.model_kwargs(),
    sample_input=dataset.x_train[:2],
  )
  assert isinstance(model, qs.LinenModel)
  assert "Dense_0" in qs.layer_paths(model, dataset.x_train[:2])
  tonnx = user_models.tonnx_resnet(rngs=nnx.Rngs(0), num_classes=10)
  nnx.bridge.lazy_init(tonnx, dataset.x_train[:2], train=False)
  with pytest.raises(ValueError, match="from_linen"):
    qs.layer_paths(tonnx, dataset.x_train[:2])


def test_unknown_model_and_dataset_kwargs_name_the_accepted_ones():
  with pytest.raises(
    ValueError, match="accepts: in_channels, num_classes, width"
  ):
    models.build_model(
      "user_models:nnx_cnn",
      rngs=nnx.Rngs(0),
      data_kwargs={"in_channels": 1, "num_classes": 10},
      depth=3,
    )
  with pytest.raises(ValueError, match="accepts: .*image_size"):
    models.build_model("cnn", rngs=nnx.Rngs(0), depth=3)
  with pytest.raises(ValueError, match="accepts: test_fraction, seed"):
    qs.data.load_dataset("digits", input_shape=(8, 8, 1))
  # The factory gets only the dataset facts it names.
  assert models.model_arguments(
    "user_models:bare_linear",
    {"input_shape": (4,), "num_classes": 3, "image_size": 8},
    {},
  ) == {"input_shape": (4,), "num_classes": 3}


@pytest.mark.parametrize(
  "args, message",
  [
    (
      ["--config.model=user_models:nnx_cnn", '--model_kwargs={"depth": 3}'],
      "accepts: in_channels, num_classes, width",
    ),
    (['--dataset_kwargs={"input_shape": 3}'], "accepts: test_fraction, seed"),
    (
      ["--config.dataset_kwargs.input_shape=3"],
      "--config.dataset_kwargs.input_shape: the config has no field",
    ),
  ],
)
def test_the_binary_reports_unknown_kwargs_in_one_line(tmp_path, args, message):
  result = binaries.run(
    "experiments.train", f"--out_dir={tmp_path}", *args, env=_env(), timeout=300
  )
  assert result.returncode == 1
  errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
  assert "Traceback" not in result.stderr
