"""Every contracting flax layer type, NNX and Linen, through every stage.

The zoo models (tests/zoo_models.py) call each layer type once: Conv in 1D,
2D and 3D (strided, dilated, grouped, depthwise, padding modes),
ConvTranspose, Embed with ``attend`` as a tied head, multi-head attention
(projections and the two attention matmuls), LinearGeneral / DenseGeneral
over several axes, Einsum, Linear / Dense, and a user's layer of raw
``jnp.einsum`` and ``@`` contractions. Each model is listed, planned,
scored by every indicator method and measured, traced, profiled,
predicted, allocated, trained by the trainer, checkpointed and resumed.
"""

from flax import nnx
import jax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import optax
import pytest
from test_trainer import _split
from test_trainer import _workers
import zoo_models

import qsync_jax as qs
from qsync_jax import predictor
from qsync_jax import sensitivity
from qsync_jax.plan import intercept
from qsync_jax.plan.precision import PlanError
from qsync_jax.train import saved_state

NNX_PATHS = [
  "conv2d",
  "dilated",
  "grouped",
  "depthwise",
  "transpose",
  "conv3d",
  "conv1d",
  "embed",
  "attention/query",
  "attention/key",
  "attention/value",
  "attention/attention_0",
  "attention/attention_1",
  "attention/out",
  "split_heads",
  "merge_heads",
  "einsum",
  "raw/einsum_0",
  "raw/matmul_1",
  "raw/einsum_2",
  "raw/matmul_3",
  "raw/matmul_4",
  "linear",
  "embed/dot_0",
]
_MHA = "MultiHeadDotProductAttention_0"
LINEN_PATHS = [
  "Conv_0",
  "Conv_1",
  "Conv_2",
  "ConvTranspose_0",
  "Conv_3",
  "Conv_4",
  "Embed_0",
  f"{_MHA}/query",
  f"{_MHA}/key",
  f"{_MHA}/value",
  f"{_MHA}/einsum_0",
  f"{_MHA}/einsum_1",
  f"{_MHA}/out",
  "DenseGeneral_0",
  "DenseGeneral_1",
  "Einsum_0",
  "LinenRaw_0/einsum_0",
  "LinenRaw_0/einsum_1",
  "LinenRaw_0/matmul_2",
  "LinenRaw_0/matmul_3",
  "Dense_0",
  "Embed_0/dot_0",
]
# Contractions of two activations, and the embeddings: 16 bits at least.
NNX_FLOORED = {
  "embed",
  "attention/attention_0",
  "attention/attention_1",
  "raw/einsum_2",
  "raw/matmul_3",
  "embed/dot_0",
}
LINEN_FLOORED = {
  "Embed_0",
  f"{_MHA}/einsum_0",
  f"{_MHA}/einsum_1",
  "LinenRaw_0/einsum_1",
  "LinenRaw_0/matmul_2",
  "Embed_0/dot_0",
}
CASES = {
  "nnx": (NNX_PATHS, NNX_FLOORED),
  "linen": (LINEN_PATHS, LINEN_FLOORED),
}


def _images(n, seed=0):
  rng = np.random.default_rng(seed)
  return (
    rng.uniform(size=(n, 8, 8, 1)).astype(np.float32),
    rng.integers(0, 10, size=n).astype(np.int32),
  )


def _build(name):
  x, _ = _images(2)
  if name == "nnx":
    return zoo_models.NNXZoo(10, rngs=nnx.Rngs(0))
  return qs.from_linen(zoo_models.LinenZoo(10), x, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_layer_and_contraction_is_listed_and_planned(name):
  paths, floored = CASES[name]
  model = _build(name)
  x, _ = _images(4)
  assert qs.layer_paths(model, x) == paths
  model.eval()
  reference = model(x)
  # INT8 wherever the floors allow: int8 operands for every such layer.
  plan = qs.PrecisionPlan([], default="int8")
  effective = qs.effective_precisions(model, plan, x, device_kind="t4")
  assert {p for p, prec in effective.items() if prec.bits >= 16} == floored
  qs.apply_plan(model, plan, x, device_kind="t4")
  found = contractions_of(lambda a: model(a), x)
  int8 = [c for c in found if c[1] == ("int8", "int8")]
  fp16 = [c for c in found if c[1] == ("float16", "float16")]
  # One int8 contraction per INT8 layer; the floored ones compute in FP16,
  # the tied head too: ``attend`` casts to its embedding's dtype.
  assert len(int8) == len(paths) - len(floored)
  assert len(fp16) == len(floored - {"embed", "Embed_0"})
  out = model(x)
  assert np.isfinite(np.asarray(out)).all()
  error = jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)
  assert 0 < float(error) < 0.25


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rule_naming_an_activation_contraction_lifts_its_floor(name):
  _, floored = CASES[name]
  model = _build(name)
  x, _ = _images(2)
  site = sorted(p for p in floored if "/" in p and "dot" not in p)[0]
  plan = qs.PrecisionPlan([(site, "int8")], default="fp16")
  assert qs.effective_precisions(model, plan, x)[site].value == "int8"
  # A pattern that only happens to match keeps the floor.
  wide = qs.PrecisionPlan([(".*", "int8")], default="fp16")
  embedding = "embed" if name == "nnx" else "Embed_0"
  with pytest.raises(PlanError, match=f"{embedding} \\(int8\\)"):
    qs.effective_precisions(model, wide, x)
  without_embedding = qs.PrecisionPlan(
    [(f"(?!{embedding}$).*", "int8")], default="fp16"
  )
  assert qs.effective_precisions(model, without_embedding, x)[site].bits == 16


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_indicator_method_and_the_measurement_score_every_layer(name):
  paths, floored = CASES[name]
  model = _build(name)
  batches = [_images(4, seed) for seed in range(2)]
  for method in sensitivity.METHODS:
    scores = sensitivity.compute(
      model, None, batches, method, ["int8", "fp16"], hessian_probes=1
    )
    assert scores.layers == paths, method
    for path in paths:
      row = scores.values[path]
      assert all(np.isfinite(v) and v >= 0 for v in row.values()), method
      assert ("int8" in row) == (path not in floored), (method, path)
  measured = sensitivity.measure(model, None, batches[:1], ["int8", "fp16"])
  grad = measured["grad"]
  assert grad.layers == paths
  int8 = [p for p in paths if p not in floored]
  assert all(grad.values[p]["int8"] > 0 for p in int8)


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_profile_prediction_and_allocation_cover_every_layer(name):
  paths, floored = CASES[name]
  model = _build(name)
  batch = _images(4)
  g = predictor.trace_graph(model, batch[0])
  assert g.paths == paths
  assert all(n.flops > 0 for n in g.nodes if n.kind != "Embed")
  assert {n.path for n in g.nodes if n.floored} == floored
  prof = predictor.profile(
    model, batch, precisions=["fp32"], tx=optax.sgd(0.1), repeats=1
  )
  assert set(prof.layers) == set(paths)
  profiles = {k: predictor.analytic_profile(g, k) for k in ("v100", "t4")}
  fp32 = predictor.predict(g, "v100:1,t4:1", {}, profiles)
  scores = sensitivity.compute(model, None, [batch], "random", ["int8", "fp16"])
  allocation = qs.allocate(g, "v100:1,t4:1", scores.values, profiles)
  assert set(allocation.precisions["t4"]) == set(paths)
  assert allocation.prediction.step_time_s <= fp32.step_time_s * (1 + 1e-9)
  assert all(allocation.precisions["t4"][p].bits >= 16 for p in floored)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_trainer_trains_int8_plans_and_resumes_from_a_checkpoint(
  name, tmp_path
):
  sizes = [4, 4]
  plans = [qs.PrecisionPlan(), qs.PrecisionPlan([], default="int8")]

  def trainer():
    return qs.HybridTrainer(
      _build(name),
      _workers(sizes, plans, ["v100", "t4"]),
      optax.adam(1e-3),
      sample=qs.task.input_probe(_images(2)[0]),
    )

  def batch(step):
    return _split(*_images(8, seed=step), sizes)

  first = trainer()
  state, metrics = first.init(), []
  for s in range(2):
    state, step_metrics = first.train_step(state, batch(s))
    metrics.append(step_metrics)
  losses = [float(m[w]["loss"]) for m in metrics for w in (0, 1)]
  assert all(np.isfinite(losses))
  # At the first step both workers hold the initial parameters: the FP32
  # worker's loss is the model's own, the INT8 worker's is near it.
  plain = _build(name)
  plain.eval()
  for w, tolerance in ((0, 1e-5), (1, 0.1)):
    x, y = batch(0)[w]
    own = float(
      optax.softmax_cross_entropy_with_integer_labels(plain(x), y).mean()
    )
    assert abs(losses[w] - own) <= tolerance * own
  assert losses[1] != pytest.approx(own, rel=1e-5)
  ckpt = qs.Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first, state)
  ckpt.close()
  state, _ = first.train_step(state, batch(2))
  resumed = trainer()
  restored = qs.Checkpointer(str(tmp_path / "ckpt")).restore_latest(
    resumed, resumed.init()
  )
  assert restored.meta["step"] == 2
  resumed_state, _ = resumed.train_step(restored.state, batch(2))
  for a, b in zip(
    jax.tree.leaves(saved_state.state_tree(first, state)),
    jax.tree.leaves(saved_state.state_tree(resumed, resumed_state)),
  ):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_stacked_layer_is_one_clear_error():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return Block(nnx.Rngs(key))

  class Stack(nnx.Module):
    def __init__(self):
      self.blocks = make(jax.random.split(jax.random.key(0), 3))

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(h, block):
        return block(h)

      return body(x, self.blocks)

  with pytest.raises(intercept.StackedLayerError, match="nnx.scan or nnx.vmap"):
    qs.layer_paths(Stack(), jnp.ones((2, 4)))


def test_the_linen_api_plans_every_contraction_of_a_linen_module():
  module = zoo_models.LinenZoo(10)
  x, _ = _images(4)
  assert qs.linen.layer_paths(module, jax.random.key(0), x) == LINEN_PATHS
  variables = module.init(jax.random.key(0), x)
  planned = qs.linen.apply_plan(
    module, qs.PrecisionPlan([], default="int8"), device_kind="t4"
  )
  found = contractions_of(lambda a: planned.apply(variables, a), x)
  int8 = [c for c in found if c[1] == ("int8", "int8")]
  assert len(int8) == len(LINEN_PATHS) - len(LINEN_FLOORED)
  precisions = planned.precisions()
  assert {p for p, prec in precisions.items() if prec.bits >= 16} == (
    LINEN_FLOORED
  )
  reference = module.apply(variables, x)
  error = jnp.linalg.norm(planned.apply(variables, x) - reference)
  assert 0 < float(error / jnp.linalg.norm(reference)) < 0.25


def test_contractions_no_precision_applies_to_are_not_layers():
  class Mixed(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))

    def __call__(self, x):
      counts = jnp.dot(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4), jnp.int32))
      phase = jnp.einsum("bi,ij->bj", x.astype(jnp.complex64), self.w[...])
      return x @ self.w + counts.sum() + phase.real

  model, x = Mixed(), jnp.ones((2, 4))
  assert qs.layer_paths(model, x) == ["matmul_0"]
  with pytest.raises(PlanError, match="integer or complex operands"):
    qs.apply_plan(model, qs.PrecisionPlan([("einsum_1", "int8")]), x)
