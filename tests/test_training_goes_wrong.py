"""Training that goes wrong stops the main job with the step and the cause.

A loss that is not finite, or more steps skipped for a non-finite gradient
than a small share, stops the run at the first checked step
(experiments.train_health): one message naming the step, what was observed
and the likely cause (inputs, labels, FP16 overflow, the learning rate, the
model), the last finite checkpoint kept and no ``summary.json``. The runs
are in-process and tiny (a linear model on 8 features, two fake CPU
workers, a few steps); the binary's ``error:`` line and exit status are
tests/test_bad_input.py::test_diverged_run_fails_and_writes_no_summary.
"""

import math
import os
import types

from flax import nnx
import jax
import ml_collections
import numpy as np
import optax
import pytest

from experiments import config_lib
from experiments import train_health
from experiments import train_lib
from experiments import train_loop
from experiments.configs import default as default_config
from qsync_jax import models
from qsync_jax.plan.precision import Precision
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker


def _config(**fields):
  config = default_config.get_config()
  config.cluster = "cpu:2"
  config.plan_mode = "manual"
  config.model = "user_models:bare_linear"
  config.model_kwargs = ml_collections.ConfigDict({"num_classes": 3})
  config.dataset = "failing_training:arrays"
  config.batch_size = 8
  config.steps = 8
  config.log_every = 2
  config.eval_every = 0
  config.checkpoint_every = 2
  for name, value in fields.items():
    config[name] = value
  return config


def _fail(tmp_path, **fields):
  """Runs the job; returns the failure's message and the run directory."""
  out = tmp_path / "run"
  out.mkdir()
  # An earlier run's summary must not pass for this one's.
  (out / "summary.json").write_text('{"final_eval_accuracy": 0.99}')
  with pytest.raises(train_health.TrainingFailed) as failed:
    train_lib.train_and_evaluate(config_lib.parse(_config(**fields)), str(out))
  assert not (out / "summary.json").exists()
  return str(failed.value), out


def _checkpoints(out):
  path = out / "checkpoints"
  return sorted(int(n) for n in os.listdir(path) if n.isdigit())


def test_nan_targets_stop_at_the_logged_step_naming_the_batch(tmp_path):
  message, out = _fail(
    tmp_path,
    dataset="failing_training:nan_targets",
    loss_fn="failing_training:target_loss",
  )
  assert message.startswith(
    "training stopped at step 4: the training loss is nan (checked every "
    "log_every=2 steps); likely cause: worker 0's batch at step 4 has "
    "non-finite labels (NaN or inf)"
  ), message
  assert "the checkpoint of step 2, the last finite one, is kept" in message
  assert _checkpoints(out) == [2]


def test_nan_in_a_streamed_first_batch_is_named_not_the_model(tmp_path):
  # A stream is not read twice: the first step's batches are checked while
  # the loop holds them.
  message, _ = _fail(
    tmp_path,
    dataset="failing_training:nan_target_stream",
    loss_fn="failing_training:target_loss",
  )
  assert "likely cause: worker 0's batch at step 1 has non-finite labels" in (
    message
  ), message
  assert "the model or the loss" not in message


def test_non_finite_inputs_are_named_from_the_batches():
  x = np.ones((4, 2, 3), np.float32)
  x[2, 1, 0] = np.inf
  found = train_health.scan([(7, {0: (x, np.zeros(4, np.int32))})], 3)
  assert found == {
    "inputs": "worker 0's batch at step 7 has 1 of 4 examples with "
    "non-finite inputs (NaN or inf): clean or filter the dataset"
  }


def test_learning_rate_too_large_is_said_with_the_growing_loss(tmp_path):
  message, out = _fail(
    tmp_path,
    loss_fn="failing_training:mse_loss",
    optimizer="sgd",
    learning_rate=30.0,
    steps=16,
    log_every=4,
    checkpoint_every=4,
  )
  assert message.startswith("training stopped at step 12: the training "), (
    message
  )
  assert (
    "likely cause: a learning rate too large (config.learning_rate=30): the "
    "loss grew from " in message
  ), message
  # Steps 4 and 8 were finite (if huge); step 12 is not, and is not saved.
  assert _checkpoints(out) == [4, 8]


def test_a_model_that_is_nan_from_the_start_is_not_told_the_learning_rate(
  tmp_path,
):
  message, out = _fail(tmp_path, model="failing_training:nan_linear")
  assert message.startswith(
    "training stopped at step 2: the training loss is nan"
  ), message
  assert "likely cause: the model or the loss: the loss was nan at step 1" in (
    message
  )
  assert "learning rate too large" not in message
  assert "no checkpoint was saved" in message
  assert _checkpoints(out) == []


def test_every_step_skipped_stops_instead_of_reporting_the_untrained_model(
  tmp_path,
):
  # The loss is finite, its gradient is not: every step is skipped.
  message, _ = _fail(tmp_path, loss_fn="failing_training:sqrt_loss")
  assert message.startswith(
    "training stopped at step 2: 2 of 2 steps were skipped for a non-finite "
    "gradient"
  ), message
  assert "a gradient that is not finite while the loss is" in message


def test_labels_out_of_range_are_named_from_the_batches():
  x, y = np.zeros((4, 8), np.float32), np.array([0, 2, 7, 1], np.int32)
  found = train_health.scan([(3, {1: (x, y)})], classes=3)
  assert found == {
    "labels": "worker 1's batch at step 3 has label 7, out of range for the "
    "model's 3 classes (0..2): fix the labels, or give the model more "
    "classes (num_classes)"
  }
  assert train_health.scan([(3, {1: (x, y)})], classes=None) == {}


def test_skipped_share_allows_a_loss_scale_finding_its_level():
  assert train_health.skipped_allowed(100, loss_scaling=False) == 10
  assert train_health.skipped_allowed(100, loss_scaling=True) == 25


def _cause(**observed):
  seen = dict(
    bad_batches={},
    first_scanned=True,
    fp16_kinds=[],
    loss_scaling=True,
    scale_at_floor=False,
    losses=[(2, 2.3), (4, 2.1)],
    first_loss=2.4,
    loss_finite=True,
    learning_rate=0.003,
  )
  return train_health.likely_cause(**{**seen, **observed})


def test_fp16_overflow_is_named_with_loss_scaling_off_or_at_its_floor():
  assert _cause(fp16_kinds=["t4"], loss_scaling=False).startswith(
    "FP16 overflow: t4 compute layers in fp16 with loss scaling off"
  )
  assert _cause(fp16_kinds=["t4"], scale_at_floor=True).startswith(
    "FP16 overflow: the loss scale fell to 1"
  )
  # Bad inputs come first: they explain an overflow too.
  assert (
    _cause(fp16_kinds=["t4"], loss_scaling=False, bad_batches={"inputs": "x"})
    == "x"
  )
  # Without FP16 layers, a loss finite at step 1 that went non-finite: the
  # learning rate.
  assert _cause(loss_finite=False).startswith(
    "a learning rate too large (config.learning_rate=0.003): the loss and "
    "inputs were finite before"
  )
  # A loss not finite at step 1, its inputs unread: not said to be the
  # model.
  assert not _cause(first_loss=math.nan, first_scanned=False).startswith(
    "the model"
  )


def test_fp16_kinds_are_those_with_fp16_layers():
  trainer = types.SimpleNamespace(
    workers=[types.SimpleNamespace(kind=k) for k in ("v100", "t4", "t4")],
    precisions=[{"fc": Precision.FP32}, {"fc": Precision.FP16}] * 2,
  )
  assert train_health.fp16_kinds(trainer) == ["t4"]


def test_final_parameters_not_finite_fail_the_run_and_remove_its_summary(
  tmp_path,
):
  workers = [Worker(d, "cpu", PrecisionPlan(), 4) for d in jax.devices()[:2]]
  trainer = HybridTrainer(
    models.create_model("cnn", rngs=nnx.Rngs(0)), workers, optax.sgd(0.1)
  )
  state = trainer.init()
  summary = tmp_path / "summary.json"
  summary.write_text("{}")
  # Finite: nothing happens.
  train_loop.check_finite_result(trainer, state, 0.5, 0.5, str(summary))
  assert summary.exists()
  # One worker's row with a NaN, the losses finite: the parameters are named.
  bad = state.replace(params=state.params.at[1, 3].set(np.nan))
  with pytest.raises(FloatingPointError, match="final parameters are not all"):
    train_loop.check_finite_result(trainer, bad, 0.5, 0.5, str(summary))
  assert not summary.exists()
