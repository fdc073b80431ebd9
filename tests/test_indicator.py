"""Tests for the sensitivity indicators and their measured ground truth."""

import inspect

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from jaxpr_utils import primitive_counts
import numpy as np
import pytest
from toy_models import NoLayers

from experiments.studies import indicator as indicator_study
from qsync_jax import models
from qsync_jax import sensitivity
from qsync_jax.allocation import pipeline
from qsync_jax.plan import policy
from qsync_jax.sensitivity import depth as sensitivity_depth
from qsync_jax.task import losses


def _cnn():
  return models.create_model("cnn", rngs=nnx.Rngs(0), widths=(4, 8), hidden=16)


def _batches(n=2, size=8):
  rng = np.random.default_rng(0)
  return [
    (
      rng.uniform(size=(size, 8, 8, 1)).astype(np.float32),
      rng.integers(0, 10, size).astype(np.int32),
    )
    for _ in range(n)
  ]


@pytest.mark.parametrize("method", sensitivity.METHODS)
def test_every_method_scores_every_layer(method):
  scores = sensitivity.compute(
    _cnn(), losses.cross_entropy, _batches(), method=method
  )
  assert scores.layers == ["conv1", "conv2", "fc", "head"]
  for _layer, row in scores.values.items():
    assert row["fp32"] == 0.0 and row["tf32"] == 0.0
    assert set(row) == {"int8", "fp16", "bf16", "fp32", "tf32"}
    assert all(np.isfinite(v) and v >= 0 for v in row.values())
  back = sensitivity.Scores.from_dict(scores.to_dict())
  assert back.values == scores.values


@pytest.mark.parametrize("method", ["qsync", "qsync_var", "wvar", "hessian"])
def test_int8_is_at_least_as_sensitive_as_fp16(method):
  scores = sensitivity.compute(
    _cnn(), losses.cross_entropy, _batches(), method=method
  )
  for layer, row in scores.values.items():
    assert row["int8"] >= row["fp16"] > 0, (layer, row)


def test_measured_ground_truth_orders_int8_above_fp16():
  truth = sensitivity.measure(
    _cnn(), losses.cross_entropy, _batches(), precisions=["int8", "fp16"]
  )
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
  model = models.create_model(
    "bert",
    rngs=nnx.Rngs(0),
    vocab_size=32,
    max_len=8,
    num_layers=1,
    num_heads=2,
    hidden=16,
    mlp_dim=16,
  )
  rng = np.random.default_rng(0)
  batches = [
    (
      rng.integers(0, 32, (4, 8)).astype(np.int32),
      rng.integers(0, 2, 4).astype(np.int32),
    )
  ]
  scores = sensitivity.compute(
    model, losses.cross_entropy, batches, method="qsync_var"
  )
  assert "int8" not in scores["token_embed"]
  assert "int8" not in scores["layers/0/attention/scores"]
  assert scores["layers/0/attention/query"]["int8"] > 0


def test_bad_input_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown indicator method 'gvar'"):
    sensitivity.compute(_cnn(), losses.cross_entropy, _batches(), "gvar")
  with pytest.raises(ValueError, match="at least one batch"):
    sensitivity.compute(_cnn(), losses.cross_entropy, [], "qsync")
  # The model is traced on the batch: one it cannot run fails, naming its
  # input_spec; one it runs (9 x 9 pools to the same 4 x 4) is scored.
  wrong = [(np.zeros((4, 12, 12, 1), np.float32), np.zeros(4, np.int32))]
  with pytest.raises(ValueError, match="does not match the model's input"):
    sensitivity.compute(_cnn(), losses.cross_entropy, wrong, "qsync")
  other = [(np.zeros((4, 9, 9, 1), np.float32), np.zeros(4, np.int32))]
  assert sensitivity.compute(_cnn(), None, other, "random").layers == [
    "conv1",
    "conv2",
    "fc",
    "head",
  ]

  with pytest.raises(ValueError, match="no layer a precision plan can"):
    sensitivity.compute(
      NoLayers(),
      losses.cross_entropy,
      [(np.zeros((2, 4), np.float32), np.zeros(2, np.int32))],
      "qsync",
    )


def _resnet():
  """ResNet-18 with one block per stage: 13 layers, enough to rank."""
  return models.create_model(
    "resnet18",
    rngs=nnx.Rngs(0),
    width=2,
    in_channels=1,
    image_size=8,
    num_classes=10,
    stage_sizes=(1, 1, 1, 1),
  )


def _rotated(values):
  """The same scores given to other layers: each layer takes the row of the
  layer half the network away (a fixed shuffle of the layer order)."""
  layers = list(values)
  half = len(layers) // 2
  return {
    l: values[layers[(i + half) % len(layers)]] for i, l in enumerate(layers)
  }


def test_study_ranks_layers_within_each_precision():
  result = indicator_study.study(
    _resnet(),
    losses.cross_entropy,
    _batches(),
    precisions=["int8", "fp16"],
    methods=["qsync_var", "random"],
  )
  layers = result["layers"]
  assert len(layers) == 13 and result["precisions"] == ["int8", "fp16"]
  assert result["train_step_s"] > 0
  for name in ("qsync_var", "random"):
    r = result["methods"][name]
    assert -1 <= r["spearman_vs_measured"] <= 1
    assert -1 <= r["spearman_vs_measured_loss"] <= 1
    assert r["time_s"] >= 0 and set(r["scores"]) == set(layers)
    assert list(r["within_precision"]) == ["int8", "fp16"]
    for w in r["within_precision"].values():
      assert w["num_layers"] == 13 and w["null_reasons"] == {}
      assert -1 <= w["spearman_vs_measured_loss"] <= 1
    assert r["mean_within_vs_measured"] == pytest.approx(
      np.mean(
        [w["spearman_vs_measured"] for w in r["within_precision"].values()]
      )
    )
  # The allocator picks which layers go to a precision: the default method
  # must order the layers of one precision as the measured gradient error
  # does (the overall figure would also reward scores that only put INT8
  # above FP16).
  best = result["methods"][sensitivity.DEFAULT_METHOD]["within_precision"]
  assert best["int8"]["spearman_vs_measured"] > 0.75, best
  assert best["fp16"]["spearman_vs_measured"] > 0.5, best
  # The threshold tells orders apart: the same scores on shuffled layers
  # keep INT8 above FP16 and fall below it.
  truth = {
    k: sensitivity.Scores.from_dict(v) for k, v in result["measured"].items()
  }
  scores = result["methods"][sensitivity.DEFAULT_METHOD]["scores"]
  shuffled = sensitivity.Scores(_rotated(scores), "shuffled")
  within = indicator_study.within_precision(
    shuffled, truth, truth["grad"].pairs()
  )
  assert within["int8"]["spearman_vs_measured"] < 0.75, within


def test_one_default_method_for_the_indicator_and_the_allocator():
  from experiments import allocate
  from experiments.configs import default

  assert sensitivity.DEFAULT_METHOD == "qsync_var"
  assert sensitivity.DEFAULT_METHOD in sensitivity.METHODS
  for fn, name in (
    (sensitivity.compute, "method"),
    (pipeline.compute_scores, "method"),
    (pipeline.plan_cluster, "indicator_name"),
  ):
    default_value = inspect.signature(fn).parameters[name].default
    assert default_value == sensitivity.DEFAULT_METHOD, fn
  assert default.get_config().allocator.indicator == sensitivity.DEFAULT_METHOD
  assert allocate.FLAGS["indicator"].default == sensitivity.DEFAULT_METHOD


def test_within_precision_is_null_with_a_reason_where_undefined():
  def table(rows):
    return sensitivity.Scores(rows, "m")

  truth = table(
    {
      "a": {"int8": 3.0, "fp16": 1.0, "bf16": 1.0},
      "b": {"int8": 2.0, "fp16": 2.0, "bf16": 1.0},
      "c": {"int8": 1.0, "fp16": 3.0},
    }
  )
  scores = table(
    {
      "a": {"int8": 9.0, "fp16": 5.0, "bf16": 1.0},
      "b": {"int8": 8.0, "fp16": 5.0, "bf16": 2.0},
      "c": {"int8": 7.0, "fp16": 5.0},
    }
  )
  within = indicator_study.within_precision(
    scores, {"grad": truth, "loss": truth}, truth.pairs()
  )
  assert within["int8"]["spearman_vs_measured"] == pytest.approx(1.0)
  assert within["int8"]["null_reasons"] == {}
  assert within["fp16"]["spearman_vs_measured"] is None
  assert within["fp16"]["null_reasons"] == {
    "spearman_vs_measured": "constant scores",
    "spearman_vs_measured_loss": "constant scores",
  }
  assert within["bf16"]["num_layers"] == 2
  assert within["bf16"]["spearman_vs_measured_loss"] is None
  assert (
    "fewer than 3" in within["bf16"]["null_reasons"]["spearman_vs_measured"]
  )
  flat = table({l: {"int8": 1.0} for l in "abc"})
  rho, reason = indicator_study.spearman(
    scores.vector(flat.pairs()), flat.vector(flat.pairs())
  )
  assert rho is None and reason == "constant measured values"
  assert indicator_study.mean_within(within, "spearman_vs_measured") == 1.0


class _Skip(nnx.Module):
  """h = relu(d1(x)); out = head(d2(relu(d3(h))) + h): a skip around d3,
  d2, so the head is shallower than d2 though it runs after it."""

  def __init__(self, rngs):
    self.d1 = nnx.Linear(6, 8, rngs=rngs)
    self.d3 = nnx.Linear(8, 8, rngs=rngs)
    self.d2 = nnx.Linear(8, 8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.d1(x))
    return self.head(self.d2(nnx.relu(self.d3(h))) + h)


def _skip_batches(n=2):
  rng = np.random.default_rng(1)
  return [
    (
      rng.normal(size=(5, 6)).astype(np.float32),
      rng.integers(0, 3, 5).astype(np.int32),
    )
    for _ in range(n)
  ]


def test_qsync_depth_is_the_bfs_depth_not_the_forward_index():
  model = _Skip(nnx.Rngs(0))
  x = jnp.asarray(_skip_batches()[0][0])
  layers = policy.model_layers(model, x)
  assert [l.path for l in layers] == ["d1", "d3", "d2", "head"]
  depths, lookup = sensitivity_depth.forward_structure(model, layers, x)
  # Nodes: d1's dot 0, bias 1, relu 2, d3's dot 3, bias 4, relu 5, d2's dot
  # 6; the skip sum reads relu (2) and d2's bias (7): 3; the head's dot 4.
  assert depths == [0, 3, 6, 4]
  assert lookup == [None] * 4
  # The score follows: the head (depth 4 of L = 6) weighs its forward term
  # by gamma (6 - 4) = 8, where forward order (last layer) would give 0.
  scores = sensitivity.compute(
    model, losses.cross_entropy, _skip_batches(), "qsync", ["int8"]
  )
  stats = _hand_stats(model, _skip_batches(), "head")
  fwd = (
    stats["w_norm"] * stats["sv"] ** 2 * stats["dv"]
    + stats["x_norm"] * stats["sw"] ** 2 * stats["dw"]
  ) / 6
  bwd = (
    stats["gw_norm"] * stats["sv"] ** 2 * stats["dv"]
    + stats["x_norm"] * 2.0 ** (2 * stats["e_x"]) * 2.0**-18 * stats["dvv"]
  ) / 6
  np.testing.assert_allclose(
    scores["head"]["int8"], 4 * 2 * fwd + 4 * bwd, rtol=1e-4
  )


def _exp(v):
  """|binary exponent| of float16(v), capped at 5 (QSync's e_x)."""
  return min(abs(int(np.frexp(np.float16(v))[1])), 5)


def _hand_stats(model, batches, path):
  """The head's QSync statistics of the _Skip model, by hand in numpy."""

  def head_input(m, x):
    h = nnx.relu(m.d1(x))
    return m.d2(nnx.relu(m.d3(h))) + h

  def loss(m, x, y):
    return losses.cross_entropy(m(x), y)

  grads = [
    nnx.grad(loss)(model, jnp.asarray(x), jnp.asarray(y)) for x, y in batches
  ]
  gw = np.mean([np.asarray(g[path]["kernel"][...]) for g in grads], axis=0)
  xs = [np.asarray(head_input(model, jnp.asarray(x))) for x, _ in batches]
  w = np.asarray(getattr(model, path).kernel[...])
  x_norm = float(np.mean([np.linalg.norm(v) for v in xs]))
  dv = xs[0].size
  return {
    "sv": float(np.mean([np.abs(v).max() for v in xs])) / 127,
    "sw": np.abs(w).max() / 127,
    "dv": dv,
    "dw": w.size,
    "dvv": xs[0].shape[0] * w.shape[1],
    "x_norm": x_norm,
    "w_norm": np.linalg.norm(w),
    "gw": gw,
    "gw_norm": np.linalg.norm(gw),
    "per_batch_gw_norm": float(
      np.mean(
        [np.linalg.norm(np.asarray(g[path]["kernel"][...])) for g in grads]
      )
    ),
    "e_x": _exp(np.sqrt(x_norm / dv)),
  }


def test_qsync_takes_the_norm_of_the_accumulated_weight_gradient():
  model, batches = _Skip(nnx.Rngs(0)), _skip_batches(3)
  stats = _hand_stats(model, batches, "head")
  # The batches disagree, so the per-batch norms' mean is clearly larger.
  assert stats["per_batch_gw_norm"] > 1.2 * stats["gw_norm"]
  # FP16 at the head: depth 4, L = 6; only ||grad W|| and e_g differ between
  # the accumulated and the per-batch reading.
  e_w = _exp(np.sqrt(stats["w_norm"] / stats["dw"]))

  def fp16(gw_norm, e_g):
    c = 2.0**-18 / 6
    fwd = c * (
      stats["w_norm"] * stats["dv"] * stats["e_x"]
      + stats["x_norm"] * stats["dw"] * e_w
    )
    bwd = c * (
      gw_norm * stats["dv"] * stats["e_x"]
      + stats["x_norm"] * stats["dvv"] * e_g
    )
    return 4 * 2 * fwd + 4 * bwd

  e_g = _exp(np.abs(stats["gw"]).max())
  got = sensitivity.compute(
    model, losses.cross_entropy, batches, "qsync", ["fp16"]
  )["head"]["fp16"]
  np.testing.assert_allclose(got, fp16(stats["gw_norm"], e_g), rtol=1e-4)
  assert not np.isclose(got, fp16(stats["per_batch_gw_norm"], e_g), rtol=1e-3)


def test_qsync_scores_an_embedding_table_as_its_input():
  model = models.create_model(
    "bert",
    rngs=nnx.Rngs(0),
    vocab_size=32,
    max_len=8,
    num_layers=1,
    num_heads=2,
    hidden=16,
    mlp_dim=16,
  )
  rng = np.random.default_rng(0)
  batches = [
    (
      rng.integers(0, 32, (4, 8)).astype(np.int32),
      rng.integers(0, 2, 4).astype(np.int32),
    )
    for _ in range(2)
  ]
  scores = sensitivity.compute(
    model, losses.cross_entropy, batches, "qsync", ["int8", "fp16"]
  )
  layers = policy.model_layers(model, jnp.asarray(batches[0][0]))
  depths, lookup = sensitivity_depth.forward_structure(
    model, layers, jnp.asarray(batches[0][0])
  )
  i = [l.path for l in layers].index("token_embed")
  assert depths[i] == 0 and lookup[i] == 4 * 8 * 16
  # Depth 0: only gamma L times the forward term, with Sw = Dw = ||W|| = 1
  # and the table as x (QSync's profile_stas_emb): FP16's
  # 2^-18 / 6 (||W|| Dv e_x + ||x|| Dw e_w), e_w = |exp(float16(1))| = 1.
  table = np.asarray(model.token_embed.embedding[...])
  t_norm = np.linalg.norm(table)
  e_x = _exp(np.sqrt(t_norm / table.size))
  want = 4 * max(depths) * 2.0**-18 / 6 * (table.size * e_x + t_norm)
  assert scores["token_embed"]["fp16"] > 0
  np.testing.assert_allclose(scores["token_embed"]["fp16"], want, rtol=1e-5)


def test_the_hutchinson_probe_is_one_draw_shaped_like_every_leaf():
  from qsync_jax.sensitivity import methods

  tree = {
    "conv": jnp.zeros((3, 3, 1, 4)),
    "placeholder": jnp.zeros(()),
    "rows": [jnp.zeros((5,)), jnp.zeros((2, 7))],
  }
  probe = methods.rademacher_probe(jax.random.key(0), tree)
  assert jax.tree.structure(probe) == jax.tree.structure(tree)
  for got, like in zip(jax.tree.leaves(probe), jax.tree.leaves(tree)):
    assert got.shape == like.shape and got.dtype == jnp.float32
    if like.ndim:
      assert set(np.unique(np.asarray(got))) <= {-1.0, 1.0}
  assert float(probe["placeholder"]) == 0.0  # scalars stay as they were
  # Both signs appear (one stream split over the leaves, not one sign each).
  flat = np.concatenate(
    [np.ravel(x) for x in jax.tree.leaves(probe) if np.ndim(x)]
  )
  assert 0.2 < np.mean(flat > 0) < 0.8
  # One random-bits draw for all leaves: XLA's CPU compile time grows with
  # every draw in the capture pass.
  jaxpr = jax.make_jaxpr(lambda k: methods.rademacher_probe(k, tree))(
    jax.random.key(0)
  )
  assert primitive_counts(jaxpr).get("random_bits") == 1
