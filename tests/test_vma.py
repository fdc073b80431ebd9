"""Planned layers inside a user's ``jax.shard_map`` with ``check_vma=True``.

Every precision's custom VJP (``qsync_jax.numerics.ops``) must give each
operand's gradient that operand's varying-manual-axes type: a per-worker
(stacked, ``P(AXIS)``) weight gets its worker's own gradient, a replicated
(``P()``) one the sum over workers, as jax's autodiff does for ``lax`` ops.
Each case differentiates the loss with respect to the parameters and the
input, under ``shard_map`` and, as the reference, per shard without it.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import qsync_jax as qs
from qsync_jax.numerics import ops
from qsync_jax.plan.layers import MatMul

AXIS = "x"
N = 4
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "fp8")
# Relative error (Frobenius norm) of a planned layer's gradients against the
# plain FP32 layer's under the same shard_map: the precision's own error.
VS_FP32 = {
  "fp32": 1e-5,
  "bf16": 3e-2,
  "fp16": 4e-3,
  "int8": 6e-2,
  "fp8": 1.5e-1,
}
# Modes: (parameter spec, data spec). "replicated": one weight, data sharded;
# "per_worker": stacked weights (local SGD), data sharded; "shared_data":
# stacked weights, one replicated batch (the input's gradient is then summed).
MODES = {
  "replicated": (P(), P(AXIS)),
  "per_worker": (P(AXIS), P(AXIS)),
  "shared_data": (P(AXIS), P()),
}


class _Wrap(nnx.Module):
  """One planned layer at path ``layer`` (a rule names it, so it is not
  forced to FP32 as the head)."""

  def __init__(self, layer):
    self.layer = layer

  def __call__(self, x):
    return self.layer(x)


def _layer(kind: str):
  """(layer, one shard's input shape) for an op kind."""
  rngs = nnx.Rngs(0)
  if kind == "linear":
    return nnx.Linear(8, 6, rngs=rngs), (4, 8)
  if kind == "conv":
    return nnx.Conv(3, 4, kernel_size=(3, 3), rngs=rngs), (2, 5, 5, 3)
  if kind == "einsum":
    return nnx.Einsum("bi,hio->bho", (2, 8, 5), (2, 5), rngs=rngs), (4, 8)
  raise ValueError(kind)


def _loss(graphdef, state, x, t):
  y = nnx.merge(graphdef, state)(x).astype(jnp.float32)
  return jnp.sum((y - t) ** 2)


def _grads(graphdef, state, x, t):
  """(loss, d_state, d_x) of one worker."""
  loss, (ds, dx) = jax.value_and_grad(
    functools.partial(_loss, graphdef), argnums=(0, 1)
  )(state, x, t)
  return loss, ds, dx


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), (AXIS,))


def _under_shard_map(graphdef, mode):
  """The gradients of ``graphdef``'s loss in a checked shard_map program."""
  pspec, dspec = MODES[mode]
  per_worker = pspec == P(AXIS)

  def body(state, x, t):
    if per_worker:
      state = jax.tree.map(lambda v: v[0], state)
    loss, ds, dx = _grads(graphdef, state, x, t)
    if per_worker:
      ds = jax.tree.map(lambda v: v[None], ds)
    return loss[None], ds, dx

  return jax.jit(
    jax.shard_map(
      body,
      mesh=_mesh(),
      in_specs=(pspec, dspec, dspec),
      out_specs=(P(AXIS), pspec, dspec),
      check_vma=True,
    )
  )


def _per_shard(graphdef, mode, state, x, t):
  """The reference: each worker's gradients computed without shard_map,
  combined as the shard_map outputs are (summed where replicated)."""
  pspec, dspec = MODES[mode]
  grads = jax.jit(functools.partial(_grads, graphdef))
  shard = lambda a, i: a if dspec == P() else np.split(a, N)[i]
  row = lambda s, i: s if pspec == P() else jax.tree.map(lambda v: v[i], s)
  outs = [grads(row(state, i), shard(x, i), shard(t, i)) for i in range(N)]
  loss = np.stack([o[0] for o in outs])
  ds = [o[1] for o in outs]
  dx = [np.asarray(o[2]) for o in outs]
  if pspec == P():
    ds = jax.tree.map(lambda *v: np.sum(v, axis=0), *ds)
  else:
    ds = jax.tree.map(lambda *v: np.stack(v), *ds)
  dx = np.sum(dx, axis=0) if dspec == P() else np.concatenate(dx)
  return loss, ds, dx


def _case(kind, precision, mode, quant=None):
  """(plain graphdef, planned graphdef, state, x, t) of one case."""
  layer, shard_shape = _layer(kind)
  model = _Wrap(layer)
  plain, state = nnx.split(model)
  plan = qs.PrecisionPlan([("layer", precision)], quant=quant)
  sample = jax.ShapeDtypeStruct(shard_shape, jnp.float32)
  planned, _ = nnx.split(qs.apply_plan(model, plan, sample))
  pspec, dspec = MODES[mode]
  rng = np.random.default_rng(1)
  if pspec == P(AXIS):  # every worker's weights differ (local SGD)
    state = jax.tree.map(
      lambda v: np.stack(
        [np.asarray(v) + 0.1 * rng.normal(size=v.shape) for _ in range(N)]
      ).astype(np.float32),
      state,
    )
  batch = (
    shard_shape if dspec == P() else (N * shard_shape[0], *shard_shape[1:])
  )
  x = rng.normal(size=batch).astype(np.float32)
  y = jax.eval_shape(
    nnx.merge(
      plain, jax.tree.map(lambda v: v[0], state) if pspec == P(AXIS) else state
    ),
    x[:1],
  )
  t = rng.normal(size=(batch[0], *y.shape[1:])).astype(np.float32)
  return plain, planned, state, x, t


@functools.cache
def _fp32_under_shard_map(kind, mode):
  """(d_state, d_x) of the plain FP32 layer (jax's autodiff), per case."""
  plain, _, state, x, t = _case(kind, "fp32", mode)
  return _under_shard_map(plain, mode)(state, x, t)[1:]


def _rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _check(kind, precision, mode, quant=None, same_tol=1e-5):
  _plain, planned, state, x, t = _case(kind, precision, mode, quant)
  loss, ds, dx = _under_shard_map(planned, mode)(state, x, t)
  # The planned op under shard_map equals the same op run shard by shard:
  # the same local arithmetic, so only the workers' sum may reorder.
  r_loss, r_ds, r_dx = _per_shard(planned, mode, state, x, t)
  np.testing.assert_allclose(loss, r_loss, rtol=same_tol)
  for got, want in zip(
    jax.tree.leaves(ds) + [dx], jax.tree.leaves(r_ds) + [r_dx]
  ):
    assert got.shape == want.shape and got.dtype == np.float32
    assert _rel_err(got, want) < same_tol, (precision, mode)
  # And it is close, to the precision's error, to jax's own autodiff of the
  # plain FP32 layer under the same shard_map (psum for a replicated weight).
  f_ds, f_dx = _fp32_under_shard_map(kind, mode)
  for got, want in zip(
    jax.tree.leaves(ds) + [dx], jax.tree.leaves(f_ds) + [f_dx]
  ):
    assert _rel_err(got, want) < VS_FP32[precision], (precision, mode)


@pytest.mark.parametrize("mode", ["replicated", "per_worker"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["linear", "conv", "einsum"])
def test_planned_layer_gradients_under_checked_shard_map(kind, precision, mode):
  _check(kind, precision, mode)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_replicated_input_gradient_is_summed_in_float32(precision):
  # One batch for all workers: the input's gradient is the sum of the
  # workers' (each in the layer's precision), summed in float32.
  _check("linear", precision, "shared_data")


@pytest.mark.parametrize("mode", ["replicated", "per_worker"])
def test_stochastic_per_channel_int8_under_checked_shard_map(mode):
  # The rounding hash reads each element's local index and the bits of
  # x / scale, which XLA computes as x * (1 / scale) in some programs and not
  # others, so the noise (not its distribution) differs from the per-shard
  # program's: the two agree to int8's error, not bit for bit.
  _check(
    "linear",
    "int8",
    mode,
    qs.QuantConfig(granularity="channel", rounding="stochastic"),
    same_tol=VS_FP32["int8"],
  )


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_pallas_kernel_under_checked_shard_map(precision):
  # The kernel (interpret mode on CPU) runs in a nested unchecked shard_map;
  # its output must come back typed as varying over the workers' axis.
  kind, mode = {
    "int8": ("linear", "per_worker"),
    "fp8": ("einsum", "replicated"),
  }[precision]
  with ops.kernel_backend("pallas"):
    _check(kind, precision, mode)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_matmul_of_two_activations_under_checked_shard_map(precision):
  # Attention's MatMul: both operands are activations, one per worker and
  # one replicated; the replicated one's gradient is summed over workers.
  op = ops.Einsum(qs.Precision.parse(precision))
  mm = MatMul(op)
  rng = np.random.default_rng(2)
  a = rng.normal(size=(N * 3, 4, 8)).astype(np.float32)
  b = rng.normal(size=(8, 5)).astype(np.float32)
  loss = lambda a, b: jnp.sum(mm("bsi,io->bso", a, b).astype(jnp.float32) ** 2)
  grads = jax.grad(loss, argnums=(0, 1))
  got_a, got_b = jax.jit(
    jax.shard_map(
      grads,
      mesh=_mesh(),
      in_specs=(P(AXIS), P()),
      out_specs=(P(AXIS), P()),
      check_vma=True,
    )
  )(a, b)
  per = [jax.jit(grads)(s, b) for s in np.split(a, N)]
  assert _rel_err(got_a, np.concatenate([p[0] for p in per])) < 1e-5
  assert _rel_err(got_b, np.sum([p[1] for p in per], axis=0)) < 1e-5
  f_a, f_b = jax.grad(
    lambda a, b: jnp.sum(jnp.einsum("bsi,io->bso", a, b) ** 2), argnums=(0, 1)
  )(a, b)
  assert _rel_err(got_a, f_a) < VS_FP32[precision]
  assert _rel_err(got_b, f_b) < VS_FP32[precision]


def test_varying_axes_reads_the_type_inside_and_outside_shard_map():
  seen = {}

  def body(w, x):
    seen["w"], seen["x"] = ops.varying_axes(w), ops.varying_axes(x)
    seen["cast"] = ops.varying_axes(ops.pvary_to(w, {AXIS}))
    return x

  jax.shard_map(
    body,
    mesh=_mesh(),
    in_specs=(P(), P(AXIS)),
    out_specs=P(AXIS),
    check_vma=True,
  )(np.ones(3), np.ones(N))
  assert seen == {"w": frozenset(), "x": {AXIS}, "cast": {AXIS}}
  assert ops.varying_axes(jnp.ones(3)) == frozenset()
