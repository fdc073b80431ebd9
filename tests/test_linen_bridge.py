"""Tests for Linen models as NNX modules (qsync_jax.plan.bridge): a ResNet
written the usual Linen way goes through layer listing, apply_plan, gradients,
BatchNorm updates and the trainer."""

import functools

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import optax
import pytest

import qsync_jax as qs
from qsync_jax.numerics.precision import Precision
from qsync_jax.plan import bridge
from qsync_jax.plan import policy
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

X = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
Y = jnp.arange(4, dtype=jnp.int32) % 10


class ResNetBlock(nn.Module):
  """flax's ImageNet example block, small."""

  filters: int
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(
      nn.BatchNorm, use_running_average=not train, momentum=0.9
    )
    residual = x
    y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides)(x)))
    y = norm()(nn.Conv(self.filters, (3, 3))(y))
    if residual.shape != y.shape:
      residual = norm()(
        nn.Conv(self.filters, (1, 1), self.strides, name="proj")(residual)
      )
    return nn.relu(residual + y)


class ResNet(nn.Module):
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), name="conv_init")(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = ResNetBlock(8, name="block1")(x, train)
    x = ResNetBlock(16, (2, 2), name="block2")(x, train)
    x = nn.Dropout(0.2, deterministic=not train)(x.mean((1, 2)))
    return nn.Dense(self.num_classes, name="head")(x)


PATHS = [
  "conv_init",
  "block1/Conv_0",
  "block1/Conv_1",
  "block2/Conv_0",
  "block2/Conv_1",
  "block2/proj",
  "head",
]


def _model(seed=0):
  return bridge.from_linen(ResNet(), X, rngs=nnx.Rngs(seed))


def _eval_out(model):
  graphdef, state = nnx.split(model)
  return graphdef, state, lambda s: nnx.merge(graphdef, s)(X, train=False)


def test_layer_paths_match_the_linen_api_and_keep_the_mode():
  model = _model()
  want = qs.linen.layer_paths(
    ResNet(), {"params": jax.random.key(0), "dropout": jax.random.key(1)}, X
  )
  assert want == PATHS
  model.eval()
  assert qs.layer_paths(model, X) == PATHS
  assert model.deterministic  # tracing ran train mode, then restored eval
  model.train()
  layers = policy.model_layers(model, X)
  assert [l.kind for l in layers] == ["Conv"] * 6 + ["Linear"]
  assert not model.deterministic
  # Proxies share the Linen variables: state paths stay the Linen ones.
  paths = policy.weight_paths(model, layers)
  assert paths["block2/proj"] == (
    "linen_variables",
    "params",
    "block2",
    "proj",
    "kernel",
  )
  kernel = nnx.state(model)["linen_variables"]["params"]["head"]["kernel"]
  np.testing.assert_array_equal(kernel[...], layers[-1].module.kernel[...])


def test_nested_linen_model_paths_are_prefixed():
  class Outer(nnx.Module):
    def __init__(self):
      self.backbone = _model()

    def __call__(self, x):
      return self.backbone(x)

  assert qs.layer_paths(Outer(), X) == [f"backbone/{p}" for p in PATHS]


def test_apply_plan_puts_int8_operands_in_the_jaxpr_and_stays_close():
  model = _model()
  _, state, run = _eval_out(model)
  ref = run(state)
  plan = qs.PrecisionPlan([(r"block1/Conv_\d", "int8"), ("conv_init", "bf16")])
  assert qs.effective_precisions(model, plan, X) == {
    "conv_init": Precision.BF16,
    "block1/Conv_0": Precision.INT8,
    "block1/Conv_1": Precision.INT8,
    "block2/Conv_0": Precision.FP32,
    "block2/Conv_1": Precision.FP32,
    "block2/proj": Precision.FP32,
    "head": Precision.FP32,
  }
  qs.apply_plan(model, plan, X)
  _, state, run = _eval_out(model)
  operands = [f[1] for f in contractions_of(run, state)]
  assert operands[:3] == [
    ("bfloat16", "bfloat16"),
    ("int8", "int8"),
    ("int8", "int8"),
  ]
  assert operands[3:] == [("float32", "float32")] * 4
  out = run(state)
  assert 0 < float(jnp.abs(out - ref).max()) < 0.05 * float(jnp.abs(ref).max())
  # The parameters stay FP32 master weights.
  assert {
    str(p.dtype) for p in jax.tree.leaves(nnx.state(model, nnx.Param))
  } == {"float32"}


def test_grads_flow_and_batch_stats_update_only_in_train_mode():
  model = _model()
  qs.apply_plan(model, qs.PrecisionPlan([(r"block2/Conv_\d", "int8")]), X)
  stats = lambda: jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
  before = stats()

  def loss(m):
    return optax.softmax_cross_entropy_with_integer_labels(
      m(X, train=True), Y
    ).mean()

  grads = nnx.jit(nnx.grad(loss))(model)
  params = grads["linen_variables"]["params"]
  for path in PATHS:
    node = params
    for part in path.split("/"):
      node = node[part]
    assert float(jnp.abs(node["kernel"][...]).sum()) > 0, path
  after_train = stats()
  changed = jax.tree.map(
    lambda a, b: not np.allclose(a, b), before, after_train
  )
  assert all(jax.tree.leaves(changed))
  forward = nnx.jit(lambda m: m(X))
  nnx.jit(lambda m: m(X, train=False))(model)
  model.eval()
  forward(model)
  jax.tree.map(np.testing.assert_array_equal, after_train, stats())


def test_an_init_apply_pair_works_like_the_module():
  module = ResNet()

  def init(rngs, x, train=True):
    return module.init(rngs, x, train=train)

  def apply(variables, x, *, train, rngs=None, mutable=False):
    return module.apply(variables, x, train=train, rngs=rngs, mutable=mutable)

  pair = bridge.from_linen((init, apply), X, rngs=nnx.Rngs(0))
  model = _model()
  assert qs.layer_paths(pair, X) == PATHS
  np.testing.assert_allclose(
    pair(X, train=False), model(X, train=False), rtol=1e-6
  )
  qs.apply_plan(pair, qs.PrecisionPlan([("block1/Conv_0", "int8")]), X)
  ops = contractions_of(
    lambda s: nnx.merge(nnx.graphdef(pair), s)(X, train=False), nnx.state(pair)
  )
  assert ops[1][1] == ("int8", "int8")
  with pytest.raises(ValueError, match="flax.linen.Module or an"):
    bridge.from_linen(lambda x: x, X, rngs=nnx.Rngs(0))


def test_embeddings_are_floored_at_sixteen_bits():
  class Text(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      return nn.Dense(5)(nn.Embed(20, 8)(tokens).mean(1))

  tokens = jnp.zeros((2, 6), jnp.int32)
  model = bridge.from_linen(Text(), tokens, rngs=nnx.Rngs(0))
  layers = policy.model_layers(model, tokens)
  assert [(l.path, l.kind) for l in layers] == [
    ("Embed_0", "Embed"),
    ("Dense_0", "Linear"),
  ]
  assert policy.is_embedding(layers[0].module)
  plan = qs.PrecisionPlan(default="int8")
  assert qs.effective_precisions(model, plan, tokens)["Embed_0"] is (
    Precision.FP16
  )
  qs.apply_plan(model, plan, tokens)
  assert model(tokens).dtype == jnp.float32
  jaxpr = str(
    jax.make_jaxpr(
      lambda s: nnx.merge(nnx.graphdef(model), s)(tokens, train=False)
    )(nnx.state(model))
  )
  assert "f16[20,8]" in jaxpr


def test_hybrid_trainer_trains_and_evaluates_a_linen_resnet():
  model = _model()
  devices = jax.devices()[:2]
  plans = [qs.PrecisionPlan([(r"block1/Conv_\d", "int8")]), qs.PrecisionPlan()]
  workers = [Worker(d, "cpu", p, 4) for d, p in zip(devices, plans)]
  trainer = HybridTrainer(
    model, workers, optax.sgd(0.1), bn_stats="average", sample=(X, Y)
  )
  state = trainer.init()
  untrained = trainer.evaluate(state, (X, Y))
  initial = jax.tree.map(np.asarray, trainer.worker_params(state))
  # Both workers fit the same batch: five steps move the model towards it.
  losses = []
  for _ in range(5):
    state, metrics = trainer.train_step(state, dict.fromkeys(range(2), (X, Y)))
    losses.append(float(metrics[0]["loss"]))
  assert all(np.isfinite(losses))
  # Every layer's kernel moved (the biases before a BatchNorm get no
  # gradient).
  trained = trainer.worker_params(state)
  for path in PATHS:
    before, after = initial, trained
    for part in ["linen_variables", "params", *path.split("/"), "kernel"]:
      before, after = before[part], after[part]
    assert not np.allclose(before[...], after[...]), path
  result = trainer.evaluate(state, (X, Y))
  assert result["loss"] < untrained["loss"] - 0.2, (untrained, result)
  assert result["accuracy"] > untrained["accuracy"], (untrained, result)


def test_batch_norm_momentum_override_takes_the_batch_statistics():
  model = _model()
  model.batch_norm_momentum = 0.0
  nnx.jit(lambda m: m(X, train=True))(model)
  mean = nnx.state(model, nnx.BatchStat)["linen_variables"]["batch_stats"][
    "BatchNorm_0"
  ]["mean"][...]
  # conv_init's batch mean, which momentum 0 copies into the statistics.
  conv = nn.Conv(8, (3, 3)).apply(
    {"params": model.linen_vars()["params"]["conv_init"]}, X
  )
  np.testing.assert_allclose(mean, conv.mean((0, 1, 2)), rtol=1e-5, atol=1e-6)


def test_a_negated_mode_keyword_is_found_and_passed():
  class Drop(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = False):
      return nn.Dropout(0.5, deterministic=deterministic)(nn.Dense(16)(x))

  x = jnp.ones((2, 4))
  model = bridge.from_linen(Drop(), x, rngs=3)  # a seed works too
  assert model.train_kwarg == ("deterministic", True)
  np.testing.assert_array_equal(model(x, train=False), model(x, train=False))
  # Train mode draws dropout masks from the model's own streams: they
  # differ from call to call and zero some units.
  first, second = model(x), model(x)
  assert not np.array_equal(first, second)
  assert float((first == 0).mean()) > 0.2
  model.eval()  # NNX's mode switch reaches the Linen flag
  np.testing.assert_array_equal(model(x), model(x, train=False))
  with pytest.raises(ValueError, match="unknown train_kwarg 'mode'"):
    bridge.from_linen(Drop(), x, rngs=0, train_kwarg="mode")
