"""Tests of qsync_jax.numerics.cpu_gemm: weight gradients as GEMMs on XLA:CPU."""

import re

from flax import nnx
import jax
from jax import lax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import pytest

from qsync_jax import models
from qsync_jax.numerics import cpu_gemm
from qsync_jax.numerics import ops
from qsync_jax.numerics.precision import Precision
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.train import step as step_lib

FP32 = ops.DotGeneral(Precision.FP32)
# (lhs shape, rhs shape, dimension numbers): x @ w, a 3-D x @ w, x @ w.T.
FORMS = [
  ((32, 64), (64, 16), (((1,), (0,)), ((), ()))),
  ((4, 8, 64), (64, 16), (((2,), (0,)), ((), ()))),
  ((32, 64), (16, 64), (((1,), (1,)), ((), ()))),
]


def _data(lhs_shape, rhs_shape):
  k1, k2 = jax.random.split(jax.random.key(0))
  return jax.random.normal(k1, lhs_shape), jax.random.normal(k2, rhs_shape)


def _loss(op, dn):
  return lambda x, w: jnp.sum(jnp.tanh(0.1 * op(x, w, dn)))


def _transposed_lhs_dots(compiled_text: str) -> list[str]:
  """The compiled program's dots whose first operand contracts its first
  dimension (what XLA:CPU leaves to Eigen)."""
  return [
    line
    for line in compiled_text.splitlines()
    if " dot(" in line and "lhs_contracting_dims={0}" in line
  ]


def _gemm_grad(fn):
  def traced(*args):
    with cpu_gemm.gemm_gradients():
      return fn(*args)

  return traced


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn", FORMS)
def test_weight_gradient_contracts_the_last_dimension_of_a_copy(
  lhs_shape, rhs_shape, dn
):
  x, w = _data(lhs_shape, rhs_shape)
  grad = jax.grad(_loss(FP32, dn), argnums=1)
  plain = jax.jit(grad).lower(x, w).compile().as_text()
  assert _transposed_lhs_dots(plain)  # what the switch is for
  gemm = jax.jit(_gemm_grad(grad)).lower(x, w).compile().as_text()
  assert not _transposed_lhs_dots(gemm)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn", FORMS)
def test_values_are_lax_dot_generals_and_its_gradients(
  lhs_shape, rhs_shape, dn
):
  x, w = _data(lhs_shape, rhs_shape)
  lax_op = lambda a, b, d: lax.dot_general(
    a, b, d, precision=lax.Precision.HIGHEST
  )
  forward = jax.jit(_gemm_grad(lambda a, b: FP32(a, b, dn)))
  np.testing.assert_array_equal(
    forward(x, w), jax.jit(lambda a, b: lax_op(a, b, dn))(x, w)
  )
  grads = jax.jit(_gemm_grad(jax.grad(_loss(FP32, dn), argnums=(0, 1))))(x, w)
  want = jax.jit(jax.grad(_loss(lax_op, dn), argnums=(0, 1)))(x, w)
  np.testing.assert_array_equal(grads[0], want[0])  # the input gradient
  np.testing.assert_allclose(grads[1], want[1], rtol=1e-5, atol=1e-6)
  # Forward mode and second derivatives (a Hessian-vector product) too.
  v = jnp.ones_like(w)
  jvp = _gemm_grad(lambda b: jax.jvp(lambda c: FP32(x, c, dn), (b,), (v,)))
  np.testing.assert_allclose(
    jax.jit(jvp)(w)[1], lax_op(x, v, dn), rtol=1e-5, atol=1e-5
  )
  hvp = lambda op: (
    lambda b: jax.jvp(jax.grad(lambda c: _loss(op, dn)(x, c)), (b,), (v,))[1]
  )
  np.testing.assert_allclose(
    jax.jit(_gemm_grad(hvp(FP32)))(w),
    jax.jit(hvp(lax_op))(w),
    rtol=1e-4,
    atol=1e-6,
  )


def test_contractions_of_another_form_or_outside_the_switch_are_plain():
  # Batched (attention-like) and out of the switch: lax.dot_general as is.
  a, b = _data((2, 4, 8, 16), (2, 4, 8, 16))
  batched = (((3,), (3,)), ((0, 1), (0, 1)))
  x, w = _data(*FORMS[0][:2])
  for fn, args in [
    (_gemm_grad(lambda a, b: FP32(a, b, batched)), (a, b)),
    (lambda x, w: FP32(x, w, FORMS[0][2]), (x, w)),
  ]:
    jaxpr = jax.make_jaxpr(fn)(*args)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general"]


def test_the_trainers_gradient_function_runs_its_weight_gradients_as_gemms():
  model = models.create_model("cnn", rngs=nnx.Rngs(0), widths=(4, 8), hidden=16)
  split = step_lib.plan_graphdefs(model, [(PrecisionPlan(), "cpu")])
  flat, unravel = ravel_pytree(split.params)
  grad_fn = step_lib.grad_function(split.graphdefs[0], unravel)
  batch = (jnp.ones((8, 8, 8, 1)), jnp.zeros((8,), jnp.int32))
  text = (
    grad_fn.lower(
      flat[None], split.rest, jnp.ones((1,)), batch, np.zeros(2, np.uint32)
    )
    .compile()
    .as_text()
  )
  assert re.search(r" dot\(", text)  # the dense layers' products
  assert not _transposed_lhs_dots(text)
