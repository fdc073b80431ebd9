"""Tests for the sensitivity indicators and their measured ground truth."""

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.studies import indicator as indicator_study
from qsync_jax import models
from qsync_jax import sensitivity
from qsync_jax.train import losses
from toy_models import NoLayers


def _cnn():
  return models.create_model("cnn", rngs=nnx.Rngs(0), widths=(4, 8),
                             hidden=16)


def _batches(n=2, size=8):
  rng = np.random.default_rng(0)
  return [(rng.uniform(size=(size, 8, 8, 1)).astype(np.float32),
           rng.integers(0, 10, size).astype(np.int32)) for _ in range(n)]


@pytest.mark.parametrize("method", sensitivity.METHODS)
def test_every_method_scores_every_layer(method):
  scores = sensitivity.compute(_cnn(), losses.cross_entropy, _batches(),
                               method=method)
  assert scores.layers == ["conv1", "conv2", "fc", "head"]
  for layer, row in scores.values.items():
    assert row["fp32"] == 0.0 and row["tf32"] == 0.0
    assert set(row) == {"int8", "fp16", "bf16", "fp32", "tf32"}
    assert all(np.isfinite(v) and v >= 0 for v in row.values())
  back = sensitivity.Scores.from_dict(scores.to_dict())
  assert back.values == scores.values


@pytest.mark.parametrize("method", ["qsync", "qsync_var", "wvar", "hessian"])
def test_int8_is_at_least_as_sensitive_as_fp16(method):
  scores = sensitivity.compute(_cnn(), losses.cross_entropy, _batches(),
                               method=method)
  for layer, row in scores.values.items():
    assert row["int8"] >= row["fp16"] > 0, (layer, row)


def test_measured_ground_truth_orders_int8_above_fp16():
  truth = sensitivity.measure(_cnn(), losses.cross_entropy, _batches(),
                              precisions=["int8", "fp16"])
  for kind in ("grad", "loss"):
    for layer, row in truth[kind].values.items():
      assert row["int8"] > row["fp16"] >= 0, (kind, layer, row)


def test_hutchinson_trace_matches_the_exact_hessian_trace():
  w = jax.random.normal(jax.random.key(0), (6, 4))
  x = jax.random.normal(jax.random.key(1), (16, 6))
  params = {"w": w, "b": jnp.zeros(4)}

  def loss(p):
    return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  flat, unravel = ravel_pytree(params)
  hess = np.asarray(jax.hessian(lambda f: loss(unravel(f)))(flat))
  probes = 4000
  est = sensitivity.hutchinson_traces(loss, params, jax.random.key(2), probes)
  # ravel_pytree orders the leaves by key: "b" (4) then "w" (24).
  for name, block in (("b", slice(0, 4)), ("w", slice(4, 28))):
    exact = float(np.trace(hess[block, block]))
    # Rademacher probes: the per-probe variance is the sum over unordered
    # pairs {i, j}, i != j, of (coefficient of v_i v_j)^2: 2 H_ij when both
    # are in the block, H_ij when one is.
    inside = np.zeros(len(flat), bool)
    inside[block] = True
    coef = hess * (inside[:, None].astype(float) + inside[None, :])
    var = np.sum(np.triu(coef, 1) ** 2)
    tol = 5 * np.sqrt(var / probes)
    print(name, float(est[name]), exact, tol)
    assert abs(float(est[name]) - exact) < tol


def test_floors_give_embeddings_and_attention_only_16_bit_scores():
  model = models.create_model("bert", rngs=nnx.Rngs(0), vocab_size=32,
                              max_len=8, num_layers=1, num_heads=2,
                              hidden=16, mlp_dim=16)
  rng = np.random.default_rng(0)
  batches = [(rng.integers(0, 32, (4, 8)).astype(np.int32),
              rng.integers(0, 2, 4).astype(np.int32))]
  scores = sensitivity.compute(model, losses.cross_entropy, batches,
                               method="qsync_var")
  assert "int8" not in scores["token_embed"]
  assert "int8" not in scores["layers/0/attention/scores"]
  assert scores["layers/0/attention/query"]["int8"] > 0


def test_bad_input_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown indicator method 'gvar'"):
    sensitivity.compute(_cnn(), losses.cross_entropy, _batches(), "gvar")
  with pytest.raises(ValueError, match="at least one batch"):
    sensitivity.compute(_cnn(), losses.cross_entropy, [], "qsync")
  wrong = [(np.zeros((4, 9, 9, 1), np.float32), np.zeros(4, np.int32))]
  with pytest.raises(ValueError, match="does not match the model's input"):
    sensitivity.compute(_cnn(), losses.cross_entropy, wrong, "qsync")

  with pytest.raises(ValueError, match="no layer a precision plan can"):
    sensitivity.compute(NoLayers(), losses.cross_entropy,
                        [(np.zeros((2, 4), np.float32),
                          np.zeros(2, np.int32))], "qsync")


def test_study_reports_spearman_time_and_scores_per_method():
  result = indicator_study.study(_cnn(), losses.cross_entropy, _batches(),
                                 precisions=["int8", "fp16"],
                                 methods=["qsync_var", "random"])
  assert result["layers"] == ["conv1", "conv2", "fc", "head"]
  assert result["precisions"] == ["int8", "fp16"]
  assert result["train_step_s"] > 0
  for name in ("qsync_var", "random"):
    r = result["methods"][name]
    assert -1 <= r["spearman_vs_measured"] <= 1
    assert r["time_s"] >= 0 and set(r["scores"]) == set(result["layers"])
  # On a tiny CNN the second-order variance already tracks the truth.
  assert result["methods"]["qsync_var"]["spearman_vs_measured"] > 0.5
