"""Interception is scoped to the planned model's call, as qwix scopes it.

jax's contraction ops are replaced only while a listed or planned model runs
(per thread, nested, undone on exit and on a failed patch); a module with no
site never computes under ``jax.disable_jit``; and site numbers come from a
per-call stack that nothing clears while a call is under way.
"""

from __future__ import annotations

import os
import pickle
import threading
import types

from flax import nnx
import flax.linen as nn
import jax
from jax._src.lax import lax as lax_internal
from jax._src.numpy import tensor_contractions
import jax.numpy as jnp
from jaxpr_utils import contractions
import pytest

import qsync_jax as qs
from qsync_jax.plan import policy

_JAX_DIR = os.path.dirname(jax.__file__)
# Every function interception replaces, by module.
_PATCHED = {
  jax.lax: (
    "dot_general",
    "conv_general_dilated",
    "dot",
    "batch_matmul",
    "conv",
    "conv_with_general_padding",
    "conv_transpose",
  ),
  jnp: (
    "einsum",
    "matmul",
    "dot",
    "tensordot",
    "inner",
    "vdot",
    "matvec",
    "vecmat",
    "vecdot",
  ),
  jax.nn: ("dot_product_attention",),
}
X = jax.ShapeDtypeStruct((2, 4), jnp.float32)
INT8 = qs.PrecisionPlan([(".*", "int8")])


def _not_jax_own() -> list[str]:
  """The replaced functions that are not jax's own code right now."""
  changed = []
  for module, names in _PATCHED.items():
    for name in names:
      fn = getattr(module, name)
      code = getattr(fn, "__code__", None)  # a jitted function has none
      if code is not None and not code.co_filename.startswith(_JAX_DIR):
        changed.append(f"{module.__name__}.{name}")
  if tensor_contractions.matmul is not jnp.matmul:
    changed.append("the matmul of @")
  return changed


def _int8_dots(jaxpr) -> int:
  return sum(
    1
    for primitive, operands, _ in contractions(jaxpr)
    if primitive == "dot_general" and operands == ("int8", "int8")
  )


class Leaf(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.full((4, 4), 0.5))

  def __call__(self, x):
    return jnp.einsum("bi,ij->bj", x, self.w[...])


class Block(nnx.Module):
  """A raw einsum, a child's einsum, another raw einsum."""

  def __init__(self):
    self.w = nnx.Param(jnp.full((4, 4), 0.25))
    self.child = Leaf()

  def mix(self, x):
    return jnp.einsum("bi,ij->bj", x, self.w[...])

  def __call__(self, x):
    return self.mix(self.child(self.mix(x)))


class Deep(nnx.Module):
  """``n`` blocks between two contractions of the root's own."""

  def __init__(self, n: int):
    self.w = nnx.Param(jnp.full((4, 4), 0.5))
    self.blocks = nnx.List([Block() for _ in range(n)])

  def __call__(self, x):
    x = jnp.einsum("bi,ij->bj", x, self.w[...])
    for block in self.blocks:
      x = block(x)
    return jnp.einsum("bi,ij->bj", x, self.w[...])


def test_jax_is_itself_again_after_listing_planning_and_running():
  model = Deep(1)
  assert "blocks/0/child/einsum_0" in qs.layer_paths(model, X)
  assert not _not_jax_own()
  qs.apply_plan(model, INT8, X, device_kind="t4")
  assert not _not_jax_own()
  x = jnp.ones((2, 4))
  eager = model(x)
  assert not _not_jax_own()
  jitted = jax.jit(lambda m, a: m(a))(model, x)
  assert not _not_jax_own()
  graphdef, state = nnx.split(model)
  merged = jax.jit(lambda s, a: nnx.merge(graphdef, s)(a))(state, x)
  assert not _not_jax_own()
  assert jnp.allclose(eager, jitted) and jnp.allclose(eager, merged)
  # Every contraction is a site of an int8 plan (the head named by ".*").
  assert _int8_dots(jax.make_jaxpr(model)(x)) == 5
  assert _int8_dots(jax.make_jaxpr(nnx.clone(model))(x)) == 5
  copied = pickle.loads(pickle.dumps(model))
  assert type(copied) is type(model) and type(model).__name__ == "Deep"
  assert _int8_dots(jax.make_jaxpr(copied)(x)) == 5
  traced = jax.make_jaxpr(lambda s, a: nnx.merge(graphdef, s)(a))(state, x)
  assert _int8_dots(traced) == 5
  assert not _not_jax_own()


def test_site_numbers_hold_through_hundreds_of_module_calls():
  # 300 module calls in one call of the root, which contracts before and
  # after them: every call keeps its own count throughout.
  n = 150
  model = nnx.eval_shape(lambda: Deep(n))
  expected = ["einsum_0"]
  for i in range(n):
    expected += [
      f"blocks/{i}/einsum_0",
      f"blocks/{i}/child/einsum_0",
      f"blocks/{i}/einsum_1",
    ]
  layers = qs.model_layers(model, X)
  assert [layer.path for layer in layers] == [*expected, "einsum_1"]
  plan = qs.PrecisionPlan([(".*/einsum_1", "int8")])
  policy.set_precisions(layers, policy.resolve_layers(layers, plan), plan.quant)
  graphdef, state = nnx.split(model)
  traced = jax.make_jaxpr(lambda s, a: nnx.merge(graphdef, s)(a))(state, X)
  assert _int8_dots(traced) == n
  assert len(contractions(traced)) == 3 * n + 2


class Unplanned(nnx.Module):
  """Two matmuls of one shape: a jitted matmul is traced once for both."""

  def __init__(self, n: int):
    self.w = nnx.Param(jnp.ones((n, 7)))

  def __call__(self, x):
    return jnp.matmul(x, self.w[...]) + jnp.matmul(x, self.w[...])


_AFTER = [lambda x: x]


class Calling(nnx.Module):
  """A planned model that calls whatever ``_AFTER`` holds."""

  def __init__(self):
    self.w = nnx.Param(jnp.ones((4, 4)))

  def __call__(self, x):
    return _AFTER[0](jnp.einsum("bi,ij->bj", x, self.w[...]))


def _matmul_traces(monkeypatch, fn, *args) -> int:
  """How often ``jnp.matmul``'s body runs while ``fn`` is traced in a jit."""
  calls = [0]
  own = lax_internal.dot_general

  def counting(*a, **k):
    calls[0] += 1
    return own(*a, **k)

  with monkeypatch.context() as patch:
    patch.setattr(lax_internal, "dot_general", counting)
    jax.jit(fn).trace(*args)
  return calls[0]


def test_a_module_without_sites_keeps_jit(monkeypatch):
  # Another model has been planned; this one never was.
  qs.apply_plan(Deep(1), INT8, X, device_kind="t4")
  alone = Unplanned(5)
  assert _matmul_traces(monkeypatch, alone, jnp.ones((3, 5))) <= 1
  # Called from inside a planned model: the planned model's contraction is
  # a site, the other module's matmuls compute as written.
  model = Calling()
  qs.apply_plan(model, INT8, X, device_kind="t4")
  _AFTER[0] = Unplanned(4)
  try:
    assert _matmul_traces(monkeypatch, model, jnp.ones((3, 4))) <= 1
    assert _int8_dots(jax.make_jaxpr(model)(jnp.ones((3, 4)))) == 1
    # A planned model calling another planned model: both plans hold.
    other = Deep(1)
    qs.apply_plan(other, INT8, X, device_kind="t4")
    _AFTER[0] = other
    assert _int8_dots(jax.make_jaxpr(model)(X)) == 1 + 5
  finally:
    _AFTER[0] = lambda x: x
  assert not _not_jax_own()


_PAUSE = [lambda: None]


class Pausing(nnx.Module):
  """A planned model whose call can be held open."""

  def __init__(self):
    self.block = Block()

  def __call__(self, x):
    _PAUSE[0]()
    return self.block(x)


def test_interception_in_one_thread_leaves_the_others_alone():
  model = Pausing()
  qs.apply_plan(model, INT8, X, device_kind="t4")
  inside, leave = threading.Event(), threading.Event()

  def pause():
    inside.set()
    assert leave.wait(60)

  _PAUSE[0] = pause
  errors = []

  def run():
    try:
      jax.make_jaxpr(model)(X)
    except BaseException as e:  # reported in the test's thread
      errors.append(e)
    finally:
      inside.set()

  thread = threading.Thread(target=run)
  thread.start()
  try:
    assert inside.wait(60)
    # The planned model is running in the other thread: jax is patched ...
    assert "jax.lax.dot_general" in _not_jax_own()
    # ... but here its contractions compute as written, those of a module
    # with sites included.
    assert _int8_dots(jax.make_jaxpr(model.block.mix)(X)) == 0
    assert _int8_dots(jax.make_jaxpr(model.block)(X)) == 3
  finally:
    _PAUSE[0] = lambda: None
    leave.set()
    thread.join(60)
  assert not errors
  assert not _not_jax_own()
  assert _int8_dots(jax.make_jaxpr(model)(X)) == 3


class _Refusing(types.ModuleType):
  """A module whose ``dot`` cannot be replaced."""

  def __setattr__(self, name, value):
    if name == "dot":
      raise RuntimeError("dot cannot be replaced")
    super().__setattr__(name, value)


def test_a_failed_patch_leaves_jax_as_it_was(monkeypatch):
  model = Deep(1)
  before = {
    (module.__name__, name): getattr(module, name)
    for module, names in _PATCHED.items()
    for name in names
  }
  codes = {k: getattr(f, "__code__", None) for k, f in before.items()}
  with monkeypatch.context() as patch:
    patch.setattr(jnp, "__class__", _Refusing)
    with pytest.raises(RuntimeError, match="dot cannot be replaced"):
      qs.layer_paths(model, X)
    for (module_name, name), fn in before.items():
      module = {m.__name__: m for m in _PATCHED}[module_name]
      assert getattr(module, name) is fn, name
      assert getattr(fn, "__code__", None) is codes[module_name, name], name
    assert not _not_jax_own()
  # Nothing is left half-done: the next listing patches and restores.
  assert "blocks/0/child/einsum_0" in qs.layer_paths(model, X)
  assert not _not_jax_own()


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones, (4, 4))
    return nn.Dense(4)(jnp.einsum("bi,ij->bj", x, w))


def test_linen_models_activate_through_their_call():
  x = jnp.ones((2, 4))
  model = qs.from_linen(LinenBlock(), X, rngs=0)
  qs.apply_plan(model, INT8, X, device_kind="t4")
  assert not _not_jax_own()
  traced = jax.make_jaxpr(lambda a: model(a, train=False))(x)
  assert _int8_dots(traced) == 2
  assert jnp.isfinite(model(x)).all()
  assert not _not_jax_own()
  planned = qs.linen.apply_plan(LinenBlock(), INT8, device_kind="t4")
  variables = planned.init(jax.random.key(0), x)
  assert not _not_jax_own()
  assert _int8_dots(jax.make_jaxpr(planned.apply)(variables, x)) == 2
  assert not _not_jax_own()
