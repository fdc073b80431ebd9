"""Tests for qsync_jax.models: shapes, training steps, registry, loading."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import optax
import pytest

from qsync_jax import models
from qsync_jax.plan.layers import MatMul

# Tiny variants of every built-in model: CPU compile time dominates, so keep
# them shallow and narrow.
TINY = {
  "cnn": dict(),
  "resnet18": dict(width=4, image_size=8, stage_sizes=(1, 1, 1, 1)),
  "resnet50": dict(width=4, image_size=16),
  "vgg16_bn": dict(width_multiplier=1 / 16, classifier_hidden=16),
  "bert": dict(
    vocab_size=64,
    max_len=8,
    num_layers=2,
    num_heads=2,
    hidden=16,
    mlp_dim=32,
    num_classes=3,
  ),
  "lm": dict(max_len=8, num_layers=2, num_heads=2, hidden=16, mlp_dim=32),
  "vit_tiny": dict(
    image_size=8, patch_size=4, hidden=16, num_layers=2, num_heads=2, mlp_dim=32
  ),
}
BATCH = 4


def _tiny(name: str, seed: int = 0) -> nnx.Module:
  # An RBG key: its initialisers compile several times faster than threefry's
  # on CPU, and every parameter shape compiles its own initialiser eagerly.
  key = jax.random.key(seed, impl="unsafe_rbg")
  return models.create_model(name, rngs=nnx.Rngs(key), **TINY[name])


def _batch(model: nnx.Module, seed: int = 0):
  """Returns a fixed (inputs, labels) batch matching the model's input_spec."""
  spec = model.input_spec(BATCH)
  k_in, k_lab = jax.random.split(jax.random.key(seed))
  if jnp.issubdtype(spec.dtype, jnp.integer):
    x = jax.random.randint(
      k_in, spec.shape, 0, model.config.vocab_size, spec.dtype
    )
  else:
    x = jax.random.normal(k_in, spec.shape, spec.dtype)
  if model.task == "lm":
    return x, x
  y = jax.random.randint(k_lab, (BATCH,), 0, model.config.num_classes)
  return x, y


def _loss(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
  logits = model(x)
  if model.task == "lm":  # Next-token prediction.
    logits, y = logits[:, :-1], y[:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def _train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(_loss)(model, x, y)
  optimizer.update(model, grads)
  return loss


def test_registry_names():
  assert set(models.MODELS) == set(TINY)
  for cls in models.MODELS.values():
    assert cls.task in ("classification", "lm")


@pytest.mark.parametrize("name", sorted(TINY))
def test_forward_shape(name):
  # Abstract evaluation: checks shapes and dtypes without compiling anything.
  model = nnx.eval_shape(lambda: _tiny(name))
  model.eval()
  logits = nnx.eval_shape(lambda m, x: m(x), model, model.input_spec(BATCH))
  if model.task == "lm":
    assert logits.shape == (
      BATCH,
      model.config.max_len,
      model.config.vocab_size,
    )
  else:
    assert logits.shape == (BATCH, model.config.num_classes)
  assert logits.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(TINY))
def test_train_step_lowers_loss(name):
  model = _tiny(name)
  model.train()
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  x, y = _batch(model)
  before = jax.tree.leaves(nnx.state(model, nnx.Param))

  first = float(_train_step(model, optimizer, x, y))
  assert np.isfinite(first)
  after = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))

  for _ in range(5):
    last = float(_train_step(model, optimizer, x, y))
  assert np.isfinite(last)
  assert last < first


def _bf16(op):
  """Wraps a contraction so it computes and returns bfloat16, like a plan."""

  def lowered(*args, **kwargs):
    args = [
      a.astype(jnp.bfloat16)
      if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)
      else a
      for a in args
    ]
    kwargs.pop("preferred_element_type", None)
    return op(*args, **kwargs)

  return lowered


def _lower_everything(model: nnx.Module) -> None:
  """Lowers every contraction and embedding to bfloat16 (no FP32 head)."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.Linear):
      module.dot_general = _bf16(jax.lax.dot_general)
    elif isinstance(module, nnx.Conv):
      module.conv_general_dilated = _bf16(jax.lax.conv_general_dilated)
    elif isinstance(module, MatMul):
      module.einsum_op = _bf16(jnp.einsum)
    elif isinstance(module, nnx.Embed):
      module.dtype = jnp.bfloat16


@pytest.mark.parametrize("name", ["cnn", "lm", "vit_tiny"])
def test_low_precision_layers_give_float32_logits(name):
  model = _tiny(name)
  model.eval()
  x, _ = _batch(model)
  _lower_everything(model)
  # Every contraction runs and returns bfloat16 ...
  graphdef, state = nnx.split(model)
  found = contractions_of(lambda s: nnx.merge(graphdef, s)(x), state)
  assert found and {f[1:] for f in found} == {
    (("bfloat16", "bfloat16"), "bfloat16")
  }, found
  # ... and the logits are float32.
  logits = nnx.jit(lambda m, x: m(x))(model, x)
  assert logits.dtype == jnp.float32
  assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("name", ["lm", "vgg16_bn"])
def test_dropout_traces_in_train_mode(name):
  model = nnx.eval_shape(
    lambda: models.create_model(
      name, rngs=nnx.Rngs(0), dropout_rate=0.1, **TINY[name]
    )
  )
  model.train()
  logits = nnx.eval_shape(lambda m, x: m(x), model, model.input_spec(BATCH))
  assert logits.dtype == jnp.float32


def test_default_sizes_are_realistic():
  counts = {}
  for name in ("resnet18", "resnet50", "vit_tiny"):
    model = nnx.eval_shape(
      lambda name=name: models.create_model(name, rngs=nnx.Rngs(0))
    )
    counts[name] = sum(
      p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param))
    )
  assert 11.0e6 < counts["resnet18"] < 11.3e6
  assert 23.4e6 < counts["resnet50"] < 23.6e6
  assert 5.3e6 < counts["vit_tiny"] < 5.8e6


def test_resnet_imagenet_stem_shape():
  model = nnx.eval_shape(
    lambda: models.create_model(
      "resnet50", rngs=nnx.Rngs(0), width=4, image_size=32, cifar_stem=False
    )
  )
  model.eval()
  logits = nnx.eval_shape(lambda m, x: m(x), model, model.input_spec(2))
  assert logits.shape == (2, 10) and logits.dtype == jnp.float32


def test_create_model_unknown_name():
  with pytest.raises(ValueError, match="unknown model 'nope'.*resnet50"):
    models.create_model("nope", rngs=nnx.Rngs(0))


def test_create_model_unknown_override():
  with pytest.raises(ValueError, match="'depth'.*valid fields:.*width"):
    models.create_model("resnet18", rngs=nnx.Rngs(0), depth=3)


def test_create_model_list_override_stays_hashable():
  model = nnx.eval_shape(
    lambda: models.create_model(
      "resnet18", rngs=nnx.Rngs(0), width=4, stage_sizes=[1, 1]
    )
  )
  assert model.config.stage_sizes == (1, 1)
  hash(nnx.graphdef(model))


def tiny_cnn_factory(*, rngs: nnx.Rngs) -> nnx.Module:
  """A user factory, loaded below through its ``module:factory`` spec."""
  return models.SmallCNN(
    models.SmallCNNConfig(widths=(2, 2), hidden=4), rngs=rngs
  )


def test_load_model_factory_builtin():
  factory = models.load_model_factory("cnn")
  model = nnx.eval_shape(lambda: factory(rngs=nnx.Rngs(0), hidden=8))
  assert isinstance(model, models.SmallCNN)
  assert model.config.hidden == 8


def test_load_model_factory_module_spec():
  factory = models.load_model_factory(f"{__name__}:tiny_cnn_factory")
  assert factory is tiny_cnn_factory
  model = nnx.eval_shape(lambda: factory(rngs=nnx.Rngs(0)))
  assert model.config.widths == (2, 2)
  cls = models.load_model_factory("qsync_jax.models.vit:ViTTiny")
  assert cls is models.ViTTiny


@pytest.mark.parametrize(
  "spec, problem",
  [
    ("nope", "invalid model spec"),
    ("a.b:", "invalid model spec"),
    (":factory", "invalid model spec"),
    ("no_such_module_xyz:factory", "cannot import module"),
    ("qsync_jax.models.cnn:missing", "has no attribute"),
    ("qsync_jax.models:MODELS", "not callable"),
  ],
)
def test_load_model_factory_errors(spec, problem):
  with pytest.raises(ValueError, match=problem) as info:
    models.load_model_factory(spec)
  assert "vit_tiny" in str(info.value)  # Lists the built-in names.


@pytest.mark.parametrize(
  "name, kwargs", [("resnet18", {}), ("lm", {"dropout_rate": 0.1})]
)
def test_placeholder_weights_skip_the_initializers_and_keep_the_rest(
  name, kwargs, caplog
):
  def build():
    key = jax.random.key(0, impl="unsafe_rbg")
    return models.create_model(name, rngs=nnx.Rngs(key), **TINY[name], **kwargs)

  with jax.log_compiles(), caplog.at_level("WARNING"):
    model = models.placeholder_weights(build)
  compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.msg]
  # One program, the traced build: no initializer compiled on its own.
  assert len(compiled) == 1 and "zeroed" in compiled[0], compiled
  placeholders = nnx.to_flat_state(nnx.state(model))
  real = nnx.to_flat_state(nnx.state(build()))
  assert [path for path, _ in placeholders] == [path for path, _ in real]
  kinds = set()
  for (path, var), (_, want) in zip(placeholders, real):
    assert type(var) is type(want), path
    value, expected = var[...], want[...]
    assert value.shape == expected.shape and value.dtype == expected.dtype
    if isinstance(want, nnx.Param):
      assert not np.any(np.asarray(value)), path
    else:  # BatchNorm statistics, dropout's RNG stream: as built
      if jax.dtypes.issubdtype(expected.dtype, jax.dtypes.prng_key):
        value, expected = (
          jax.random.key_data(value),
          jax.random.key_data(expected),
        )
      np.testing.assert_array_equal(value, expected, err_msg=str(path))
      kinds.add(type(want).__name__)
  assert kinds, "the model has no state besides its parameters"
