"""The examples/ scripts run and do what their docstrings say."""

import json
import math
import os
import re

import binaries
from flax import nnx
import jax.numpy as jnp
import pytest

from examples import byo_model
from examples import gpt
from examples import unet
import qsync_jax as qs
from qsync_jax.predictor import casting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_byo_model_loop_learns_with_int8_qsr_and_gqsgd():
  # The user's own shard_map + optax loop: an INT8 convolution, QSR local
  # SGD (fewer syncs than steps) and Global-QSGD averages.
  accuracy, syncs = byo_model.main(steps=120, n=2)
  assert 0 < syncs < 120
  assert accuracy > 0.8


def _train(out, *flags):
  """The train binary with --plan=auto on a two-kind cluster, 2 steps."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  return binaries.run(
    "experiments.train",
    f"--out_dir={out}",
    "--plan=auto",
    "--cluster=v100:1,t4:1",
    "--config.steps=2",
    "--config.batch_size=4",
    "--config.allocator.num_batches=1",
    "--config.allocator.timing_batch_size=4",
    # Weight variance: the cheapest indicator (every method on every kind
    # of site is tested in test_layer_zoo.py).
    "--config.allocator.indicator=wvar",
    "--config.log_every=1",
    "--config.eval_every=2",
    *flags,
    env=env,
    timeout=600,
  )


def _finite_final_loss(out):
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 2
  assert math.isfinite(summary["final_train_loss"])
  assert math.isfinite(summary["final_eval_loss"])
  return summary


def test_gpt_lists_its_attention_sites_and_trains_with_an_auto_plan(tmp_path):
  model = gpt.make_gpt(
    rngs=nnx.Rngs(0), vocab_size=16, max_len=4, emb_dim=8, num_heads=2
  )
  paths = qs.layer_paths(model, jnp.zeros((1, 4), jnp.int32))
  for i in (0, 1):
    # The score and value matmuls of nnx.MultiHeadAttention, intercepted.
    assert f"blocks/{i}/attention/attention_0" in paths
    assert f"blocks/{i}/attention/attention_1" in paths
  assert paths[-1] == "token_embed/dot_0"  # the tied head, embed.attend
  out = tmp_path / "gpt"
  result = _train(
    out,
    "--config.model=examples.gpt:make_gpt",
    "--config.dataset=text",
    '--dataset_kwargs={"seq_len": 8, "max_bytes": 20000}',
    '--model_kwargs={"emb_dim": 8, "mlp_dim": 16, "num_heads": 2}',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  # The allocator's plan, a row per layer, attention sites included.
  assert "allocator (greedy" in result.stderr
  assert re.search(
    r"blocks/1/attention/attention_1 +- +\w+ +\w+", result.stderr
  )
  _finite_final_loss(out)


def test_unet_denoises_through_the_user_data_and_loss_hooks(tmp_path):
  noisy, clean = unet.noisy_digits("test", size=8)
  assert noisy.shape == clean.shape == (297, 8, 8, 1)
  out = tmp_path / "unet"
  result = _train(
    out,
    "--config.model=examples.unet:make_unet",
    "--config.dataset=examples.unet:noisy_digits",
    "--config.loss_fn=examples.unet:mse_loss",
    '--dataset_kwargs={"size": 8}',
    '--model_kwargs={"features": [4, 8]}',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "allocator (greedy" in result.stderr
  assert re.search(r"up/0/up +2x2x8x4 +\w+ +\w+", result.stderr)
  summary = _finite_final_loss(out)
  # The loss's own metric is reported: the MSE is the loss.
  assert summary["final_eval_mse"] == summary["final_eval_loss"]


def test_predictor_check_steps_the_unet_on_its_data_and_loss(monkeypatch):
  from experiments.studies import predictor_accuracy as accuracy

  # An FP32 plan casts nothing: the device's cast costs are not needed.
  monkeypatch.setattr(
    accuracy.casting, "fit_cast_model", lambda device: casting.CastModel({})
  )
  spec = "examples.unet:make_unet"
  result = accuracy.evaluate(
    [spec],
    model_kwargs={spec: {"features": [4]}},
    batch_sizes={spec: 4},
    datasets={spec: "examples.unet:noisy_digits"},
    dataset_kwargs={spec: {"size": 8}},
    loss_fns={spec: "examples.unet:mse_loss"},
    workers=(1,),
    rounds=1,
    burst=1,
    precisions=("fp32",),
    plan_names=("fp32",),
    log=lambda m: None,
  )
  (case,) = result["cases"]
  assert case["predicted_s"] > 0 and case["measured_s"] > 0
  # The U-Net's layers, sized for the data (1 channel in and out).
  layers = result["profiles"][spec]["1"]["layers"]
  assert sorted(layers) == ["down/0/conv_0", "down/0/conv_1", "out"]
  # The step's memory with the MSE loss on float targets, as compiled.
  assert abs(case["memory_rel_error"]) < 0.1


def test_predictor_check_asks_for_the_data_of_a_model_without_input_spec():
  from experiments.studies import predictor_accuracy as accuracy

  # Its factory takes the data's facts; a GPT sized by hand has no
  # input_spec. Either way the data are what is missing.
  with pytest.raises(ValueError, match="in_channels.*--datasets"):
    accuracy.model_and_batch("examples.unet:make_unet", {}, 4)
  with pytest.raises(ValueError, match="no input_spec.*--datasets"):
    accuracy.model_and_batch("examples.gpt:make_gpt", {"vocab_size": 16}, 4)
  with pytest.raises(ValueError, match=r"loss_fns names model\(s\) \['cnn'\]"):
    accuracy.evaluate(
      ["examples.unet:make_unet"],
      workers=(1,),
      loss_fns={"cnn": "examples.unet:mse_loss"},
    )
