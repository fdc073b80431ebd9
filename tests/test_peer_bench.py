"""Tests for experiments.peer_bench: the torch CNN, the checks, a short run.

The model tests and the end-to-end run need torch (the ``peers`` extra)
and skip without it; the end-to-end run uses no links (``--nolinks``), two
processes, a small CNN and a few steps.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.benches.peers import bench

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TORCH = 'the peers extra is not installed: pip install -e ".[peers]"'
SMALL = {"widths": [8, 16], "hidden": 64}


def _flax_params(model_kwargs, seed=0):
  from flax import nnx

  from qsync_jax.models.cnn import SmallCNN
  from qsync_jax.models.cnn import SmallCNNConfig

  model = SmallCNN(SmallCNNConfig(**model_kwargs), rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return model, {
    layer: {k: np.asarray(v) for k, v in p.items()}
    for layer, p in params.items()
  }


def test_torch_cnn_matches_the_flax_cnn():
  pytest.importorskip("torch", reason=NO_TORCH)
  import torch

  from experiments.benches.peers import torch_model

  flax_model, params = _flax_params(SMALL)
  model = torch_model.build(SMALL, 0)
  shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
  flax_sizes = {
    f"{layer}.{'weight' if k == 'kernel' else 'bias'}": v.size
    for layer, p in params.items()
    for k, v in p.items()
  }
  assert {n: math.prod(s) for n, s in shapes.items()} == flax_sizes
  assert shapes["fc.weight"] == (64, 4 * 4 * 16)
  # The same layers in the same order: flax's parameters give its logits.
  torch_model.load_flax_params(model, params)
  x = np.random.default_rng(0).random((5, 8, 8, 1), np.float32)
  np.testing.assert_allclose(
    model(torch.from_numpy(x)).detach().numpy(),
    np.asarray(flax_model(x)),
    atol=1e-5,
  )


def test_torch_init_has_flax_init_std():
  pytest.importorskip("torch", reason=NO_TORCH)
  from experiments.benches.peers import torch_model

  kwargs = {"widths": [32, 64], "hidden": 1024}
  _, params = _flax_params(kwargs)
  model = torch_model.build(kwargs, 0)
  for layer in torch_model.LAYERS:
    weight = getattr(model, layer).weight.detach().numpy()
    kernel = params[layer]["kernel"]
    fan_in = math.prod(kernel.shape[:-1])
    # Both within sampling error of lecun_normal's 1/sqrt(fan_in).
    want = 1 / math.sqrt(fan_in)
    tol = 4 * want / math.sqrt(2 * kernel.size) + 1e-3 * want
    for got in (weight.std(), kernel.std()):
      assert abs(got - want) < max(tol, 0.2 * want), (layer, got, want)
    # Truncated at two standard deviations of the untruncated normal.
    limit = 2 * torch_model.lecun_std(fan_in)
    assert np.abs(weight).max() <= limit + 1e-6
    assert not getattr(model, layer).bias.detach().numpy().any()


def test_missing_extra_is_one_line(monkeypatch, tmp_path):
  monkeypatch.setattr(bench, "_find", lambda module: None)
  out = tmp_path / "out"
  with pytest.raises(
    bench.MissingExtraError, match=r'pip install -e "\.\[peers\]"'
  ):
    bench.run(str(out), names=["ddp_fp32"], link=None, recovery_repeats=0)
  assert not out.exists()


def test_bad_arguments_write_nothing(tmp_path):
  out = tmp_path / "out"
  with pytest.raises(ValueError, match="unknown configuration"):
    bench.run(str(out), names=["ddp_fp64"], link=None)
  with pytest.raises(ValueError, match="--seeds must be >= 1"):
    bench.run(str(out), names=["dp"], seeds=0, link=None)
  assert not out.exists()


def test_short_run_writes_both_frameworks(tmp_path):
  pytest.importorskip("torch", reason=NO_TORCH)
  pytest.importorskip("torchft", reason=NO_TORCH)
  out = tmp_path / "bench"
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
  )
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # tiny programs: fast compiles
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.peer_bench",
      f"--out={out}",
      "--configs=ddp_fp32,dp",
      "--seeds=1",
      "--steps=6",
      "--num_processes=2",
      "--nolinks",
      "--nofloors",
      "--recovery_repeats=0",
      f"--model_kwargs={json.dumps(SMALL)}",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  for key in (
    "best_qsync_vs_best_peer",
    "best_qsync_vs_own_floor",
    "date",
    "link",
    "host_cores",
    "recovery",
  ):
    assert key in summary
  assert summary["link"] is None and summary["recovery"] is None
  configs = summary["configs"]
  assert configs["ddp_fp32"]["framework"] == "torch"
  assert configs["dp"]["framework"] == "qsync_jax"
  for c in configs.values():
    assert c["mb_sent_per_worker"] is None  # no links, no bytes
    assert 0 <= c["final_accuracy_mean"] <= 1
    assert c["step_time_mean_s"] > 0
    assert len(c["time_to_target_s"]) == 1
  rows = [
    json.loads(line)
    for line in (out / "ddp_fp32" / "seed0" / "metrics.jsonl")
    .read_text()
    .splitlines()
  ]
  assert [r["step"] for r in rows] == [5, 6]
  for r in rows:
    assert {"train_time_s", "eval_accuracy", "eval_loss"} <= set(r)
  assert rows[1]["train_time_s"] >= rows[0]["train_time_s"] > 0
  torch_summary = json.loads(
    (out / "ddp_fp32" / "seed0" / "summary.json").read_text()
  )
  assert torch_summary["steps"] == 6
  assert torch_summary["final_eval_accuracy"] == rows[-1]["eval_accuracy"]
  assert (out / "time_to_accuracy.png").exists()
  assert "ddp_fp32" in p.stdout and "dp" in p.stdout


def test_torchft_recovery_counts_the_steps_the_newcomer_healed_to():
  from experiments.benches.peers import recovery

  rows = []
  for replica, pid in ((0, 100), (1, 101)):
    for step in range(1, 51):
      rows.append(
        {
          "t": step * 0.1,
          "step": step,
          "committed": step // 5,
          "replica": replica,
          "pid": pid,
        }
      )
  # Replica 0 goes on after the kill (t 5.0), stalled once by the quorum.
  for step in range(51, 61):
    t = 5.0 + 2.0 + (step - 51) * 0.1
    rows.append(
      {"t": t, "step": step, "committed": step // 5, "replica": 0, "pid": 100}
    )
  # The newcomer trains alone from nothing, then heals to step 60.
  rows += [
    {"t": 6.0, "step": 1, "committed": 0, "replica": 1, "pid": 102},
    {"t": 6.1, "step": 2, "committed": 0, "replica": 1, "pid": 102},
    {"t": 8.0, "step": 61, "committed": 12, "replica": 1, "pid": 102},
  ]
  out = recovery.torchft_measures(rows, 101, 102, 5.0, 5.5)
  assert out["steps_lost"] == 0
  assert out["newcomer_s"] == pytest.approx(2.5)
  assert out["stall_s"] == pytest.approx(1.9)  # less its usual 0.1 s step
  assert out["seconds_lost"] == pytest.approx(4.4)
  assert out["newcomer_finished"]
  # Healed to a step before the killed replica's last: those steps are lost.
  rows[-1] = {**rows[-1], "step": 41}
  assert recovery.torchft_measures(rows, 101, 102, 5.0, 5.5)["steps_lost"] == 10
