"""Tests for applying precision plans to NNX models (qsync_jax.plan.policy)."""

import collections

from flax import nnx
import jax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import pytest
from toy_models import NoLayers

import qsync_jax as qs
from qsync_jax import models
from qsync_jax.numerics.precision import Precision


def _cnn():
  return models.create_model("cnn", rngs=nnx.Rngs(0))


def _encoder():
  return models.create_model(
    "bert",
    rngs=nnx.Rngs(0),
    vocab_size=64,
    max_len=16,
    num_layers=2,
    num_heads=2,
    hidden=32,
    mlp_dim=64,
    num_classes=3,
  )


def _params(model):
  return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def _grads(model, x, y):
  def loss(m):
    logits = m(x)
    return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

  return jax.tree.leaves(nnx.grad(loss)(model))


def _cos_tree(a, b):
  a = np.concatenate([np.ravel(v) for v in a])
  b = np.concatenate([np.ravel(v) for v in b])
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_layer_paths_are_in_forward_order():
  assert qs.layer_paths(_cnn()) == ["conv1", "conv2", "fc", "head"]
  paths = qs.layer_paths(_encoder())
  assert paths[:2] == ["token_embed", "position_embed"]
  assert paths[2:8] == [
    "layers/0/attention/query",
    "layers/0/attention/key",
    "layers/0/attention/value",
    "layers/0/attention/scores",
    "layers/0/attention/context",
    "layers/0/attention/out",
  ]
  assert paths[-1] == "head"
  # Sorting would put layers/10 before layers/2; forward order does not.
  deep = models.create_model(
    "bert",
    rngs=nnx.Rngs(0),
    vocab_size=8,
    max_len=4,
    num_layers=11,
    num_heads=1,
    hidden=4,
    mlp_dim=4,
  )
  layer_ids = [
    p.split("/")[1] for p in qs.layer_paths(deep) if p.startswith("layers/")
  ]
  assert layer_ids == sorted(layer_ids, key=int)


def test_int8_layer_jaxpr_has_int8_conv_and_dot():
  model = _cnn()
  qs.apply_plan(model, qs.PrecisionPlan([("conv1|fc", "int8")]))
  x = jnp.ones((2, 8, 8, 1))
  found = contractions_of(lambda x: model(x), x)
  assert found[0] == ("conv_general_dilated", ("int8", "int8"), "int32")
  assert found[1] == ("conv_general_dilated", ("float32", "float32"), "float32")
  assert found[2] == ("dot_general", ("int8", "int8"), "int32")
  assert found[3] == ("dot_general", ("float32", "float32"), "float32")


def test_fp16_layers_compute_in_f16():
  model = _cnn()
  qs.apply_plan(model, qs.PrecisionPlan([], default="fp16"))
  found = contractions_of(lambda x: model(x), jnp.ones((2, 8, 8, 1)))
  # The head keeps FP32: no rule names it.
  assert [f[1] for f in found] == [("float16", "float16")] * 3 + [
    ("float32", "float32")
  ]


def test_plan_leaves_parameters_fp32_and_unchanged_and_can_be_reapplied():
  model = _cnn()
  before = _params(model)
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
  fp32_out = model(x)
  qs.apply_plan(model, qs.PrecisionPlan([], default="int8"))
  int8_out = model(x)
  after = _params(model)
  jax.tree.map(np.testing.assert_array_equal, before, after)
  assert all(v.dtype == np.float32 for v in jax.tree.leaves(after))
  assert not np.allclose(fp32_out, int8_out)
  qs.apply_plan(model, qs.PrecisionPlan([], default="fp32"))
  np.testing.assert_allclose(model(x), fp32_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "build, x, y",
  [
    (
      _cnn,
      jax.random.uniform(jax.random.key(0), (16, 8, 8, 1)),
      jnp.arange(16) % 10,
    ),
    (
      _encoder,
      jax.random.randint(jax.random.key(0), (8, 16), 0, 64),
      jnp.arange(8) % 3,
    ),
  ],
)
def test_int8_fp16_plan_gradients_stay_close_to_fp32(build, x, y):
  ref_model = build()
  ref = _grads(ref_model, x, y)
  model = build()
  paths = qs.layer_paths(model)
  # Alternate INT8 and FP16 over the layers (16-bit-floored ones get FP16).
  plan = qs.PrecisionPlan(
    [
      (p, "int8" if i % 2 == 0 else "fp16")
      for i, p in enumerate(paths[:-1])
      if not (p.endswith(("embed", "scores", "context")))
    ],
    default="fp16",
  )
  want = collections.Counter(qs.effective_precisions(model, plan).values())
  assert want[Precision.INT8] > 0 and want[Precision.FP16] > 0, want
  qs.apply_plan(model, plan)
  # The plan took effect: the INT8 layers contract int8 operands, the
  # others (but the FP32 head) float16 ones.
  operands = collections.Counter(
    f[1] for f in contractions_of(lambda x: model(x), x[:2])
  )
  assert operands[("int8", "int8")] == want[Precision.INT8], operands
  assert operands[("float16", "float16")] > 0, operands
  got = _grads(model, x, y)
  cos = _cos_tree(ref, got)
  print("gradient cosine", cos)
  assert cos > 0.98, cos
  # ... and changed the gradients (close, not equal).
  assert cos < 1 - 1e-6, cos
  assert not all(np.array_equal(a, b) for a, b in zip(ref, got))


def test_forced_precisions():
  model = _encoder()
  eff = qs.effective_precisions(model, qs.PrecisionPlan([], default="int8"))
  assert eff["token_embed"] is Precision.FP16  # floored, default only
  assert eff["layers/0/attention/scores"] is Precision.FP16
  assert eff["layers/0/attention/query"] is Precision.INT8
  assert eff["head"] is Precision.FP32  # head unless named
  eff = qs.effective_precisions(
    model, qs.PrecisionPlan([("head", "int8")], default="int8")
  )
  assert eff["head"] is Precision.INT8
  with pytest.raises(qs.PlanError, match="token_embed \\(int8\\)"):
    qs.apply_plan(model, qs.PrecisionPlan([("token_embed", "int8")]))


def test_embedding_lookup_runs_at_16_bits():
  model = _encoder()
  qs.apply_plan(model, qs.PrecisionPlan([(".*embed", "bf16")]))
  assert model.token_embed.dtype == jnp.bfloat16
  emb = model.token_embed(jnp.array([[1, 2]]))
  assert emb.dtype == jnp.bfloat16
  qs.apply_plan(model, qs.PrecisionPlan([]))
  assert model.token_embed(jnp.array([[1, 2]])).dtype == jnp.float32


def test_bad_input_errors():
  model = _cnn()
  with pytest.raises(qs.PlanError) as e:
    qs.apply_plan(model, qs.PrecisionPlan([("conv3", "int8")]))
  assert "conv1, conv2, fc, head" in str(e.value)
  with pytest.raises(qs.PlanError, match="'v100' does not support int8"):
    qs.apply_plan(
      model, qs.PrecisionPlan([("conv1", "int8")]), device_kind="v100"
    )
  with pytest.raises(qs.PlanError, match="'t4' does not support fp8"):
    qs.apply_plan(model, qs.PrecisionPlan([("conv1", "fp8")]), device_kind="t4")
  with pytest.raises(ValueError, match="unknown precision 'int4'"):
    qs.PrecisionPlan([("conv1", "int4")])

  with pytest.raises(ValueError, match="no layer a precision plan can"):
    qs.layer_paths(NoLayers(), jnp.ones((1, 4)))

  class NoSpec(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.fc(x)

  with pytest.raises(ValueError, match="no input_spec"):
    qs.layer_paths(NoSpec())
  assert qs.layer_paths(NoSpec(), jnp.ones((1, 4))) == ["fc"]


def test_describe_lists_every_layer():
  text = qs.describe(_cnn(), qs.PrecisionPlan([("conv.*", "int8")]))
  assert [line.split() for line in text.splitlines()] == [
    ["layer", "kind", "precision"],
    ["conv1", "Conv", "int8"],
    ["conv2", "Conv", "int8"],
    ["fc", "Linear", "fp32"],
    ["head", "Linear", "fp32"],
  ]
