"""Tests for the precision-aware contractions in qsync_jax.numerics.ops."""

import jax
from jax import lax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import pytest

from qsync_jax.numerics import ops
from qsync_jax.numerics import quant
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig

DN = (((1,), (0,)), ((), ()))
CONV_DN = ("NHWC", "HWIO", "NHWC")
LOW = ["int8", "fp16", "bf16", "fp8"]


def _data(*shapes, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def _cos(a, b):
  a, b = np.ravel(a), np.ravel(b)
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _dot(compute, **kw):
  return ops.DotGeneral(Precision(compute), QuantConfig(**kw))


def _conv(compute, **kw):
  op = ops.ConvGeneralDilated(Precision(compute), QuantConfig(**kw))
  return lambda x, w: op(x, w, (1, 1), "SAME", dimension_numbers=CONV_DN)


def test_int8_forward_is_int8_times_int8_to_int32():
  x, w = _data((8, 16), (16, 4))
  found = contractions_of(lambda x, w: _dot("int8")(x, w, DN), x, w)
  assert found == [("dot_general", ("int8", "int8"), "int32")]
  xc, wc = _data((2, 6, 6, 3), (3, 3, 3, 5))
  found = contractions_of(_conv("int8"), xc, wc)
  assert found == [("conv_general_dilated", ("int8", "int8"), "int32")]


def test_int8_backward_runs_in_fp16_with_fp32_weight_gradient():
  x, w = _data((8, 16), (16, 4))
  op = _dot("int8")
  grad_fn = jax.grad(lambda x, w: jnp.sum(op(x, w, DN) ** 2), (0, 1))
  found = contractions_of(grad_fn, x, w)
  assert ("dot_general", ("int8", "int8"), "int32") in found
  assert ("dot_general", ("float16", "float16"), "float16") in found
  assert ("dot_general", ("float32", "float32"), "float32") in found
  dx, dw = grad_fn(x, w)
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32


def test_int8_backward_uses_the_saved_int8_operands():
  x, w = _data((8, 16), (16, 4))
  g = _data((8, 4), seed=1)[0]
  _, vjp = jax.vjp(lambda x, w: _dot("int8")(x, w, DN), x, w)
  dx, dw = vjp(g)
  qx, sx = quant.quantize(x)
  qw, sw = quant.quantize(w)
  g16 = g.astype(jnp.float16)
  want_dx = g16 @ quant.dequantize(qw, sw, jnp.float16).T
  want_dw = quant.dequantize(qx, sx, jnp.float16).astype(
    jnp.float32
  ).T @ g16.astype(jnp.float32)
  np.testing.assert_array_equal(dx, want_dx.astype(jnp.float32))
  np.testing.assert_allclose(dw, want_dw, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "compute, dtype", [("fp16", "float16"), ("bf16", "bfloat16")]
)
def test_half_precision_layers_compute_in_that_dtype(compute, dtype):
  x, w = _data((8, 16), (16, 4))
  y = _dot(compute)(x, w, DN)
  assert y.dtype == jnp.dtype(dtype)
  found = contractions_of(lambda x, w: _dot(compute)(x, w, DN), x, w)
  assert found == [("dot_general", (dtype, dtype), dtype)]
  xc, wc = _data((2, 6, 6, 3), (3, 3, 3, 5))
  found = contractions_of(_conv(compute), xc, wc)
  assert found == [("conv_general_dilated", (dtype, dtype), dtype)]


def test_fp8_forward_is_e4m3_with_fp32_accumulation():
  x, w = _data((8, 16), (16, 4))
  found = contractions_of(lambda x, w: _dot("fp8")(x, w, DN), x, w)
  assert found == [
    ("dot_general", ("float8_e4m3fn", "float8_e4m3fn"), "float32")
  ]


@pytest.mark.parametrize(
  "compute, lax_precision",
  [("fp32", lax.Precision.HIGHEST), ("tf32", lax.Precision.DEFAULT)],
)
def test_fp32_and_tf32_are_plain_lax_ops(compute, lax_precision):
  x, w = _data((8, 16), (16, 4))
  jaxpr = jax.make_jaxpr(lambda x, w: _dot(compute)(x, w, DN))(x, w)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert lax_precision in tuple(eqn.params["precision"] or ())
  np.testing.assert_allclose(_dot(compute)(x, w, DN), x @ w, rtol=1e-5)


@pytest.mark.parametrize("compute", LOW)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_gradients_stay_close_to_fp32(compute, granularity):
  x, w = _data((32, 64), (64, 16))
  loss = lambda op: lambda x, w: jnp.sum(jnp.tanh(0.1 * op(x, w, DN)))
  ref = jax.grad(loss(lax.dot_general), (0, 1))(x, w)
  got = jax.grad(loss(_dot(compute, granularity=granularity)), (0, 1))(x, w)
  floor = 0.97 if compute == "fp8" else 0.995
  for r, g in zip(ref, got):
    assert g.dtype == jnp.float32
    assert _cos(r, g) > floor
  xc, wc = _data((2, 8, 8, 3), (3, 3, 3, 8))
  conv_loss = lambda f: lambda x, w: jnp.sum(jnp.tanh(0.2 * f(x, w)))
  ref = jax.grad(conv_loss(_conv("fp32")), (0, 1))(xc, wc)
  got = jax.grad(conv_loss(_conv(compute, granularity=granularity)), (0, 1))(
    xc, wc
  )
  for r, g in zip(ref, got):
    assert _cos(r, g) > floor


@pytest.mark.parametrize(
  "lhs_shape, rhs_shape, dn",
  [
    ((4, 6, 8), (4, 8, 5), (((2,), (1,)), ((0,), (0,)))),  # batched matmul
    ((8, 3, 6), (5, 8), (((0,), (1,)), ((), ()))),  # odd layouts
    ((6, 4, 8), (8, 4, 5), (((2,), (0,)), ((1,), (1,)))),  # batch not first
  ],
)
def test_per_channel_scales_map_onto_the_output(lhs_shape, rhs_shape, dn):
  x, w = _data(lhs_shape, rhs_shape)
  y = _dot("int8", granularity="channel")(x, w, dn)
  (lc, rc), _ = dn
  qx, sx = quant.quantize(x, lc)
  qw, sw = quant.quantize(w, rc)
  want = lax.dot_general(
    quant.dequantize(qx, sx),
    quant.dequantize(qw, sw),
    dn,
    precision=lax.Precision.HIGHEST,
  )
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_per_channel_conv_scales_per_example_and_output_channel():
  x, w = _data((3, 6, 6, 4), (3, 3, 4, 5))
  x = x * jnp.array([1.0, 10.0, 0.1])[:, None, None, None]
  y = _conv("int8", granularity="channel")(x, w)
  qx, sx = quant.quantize(x, (1, 2, 3))
  qw, sw = quant.quantize(w, (0, 1, 2))
  want = lax.conv_general_dilated(
    quant.dequantize(qx, sx),
    quant.dequantize(qw, sw),
    (1, 1),
    "SAME",
    dimension_numbers=CONV_DN,
    precision=lax.Precision.HIGHEST,
  )
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  # Per-example scales help the small example a lot.
  exact = lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=CONV_DN
  )
  per_tensor = _conv("int8")(x, w)
  err = lambda a: float(jnp.abs(a[2] - exact[2]).max())
  assert err(y) < err(per_tensor) / 5


def test_einsum_runs_its_contraction_in_int8():
  a, b = _data((2, 3, 5, 4), (2, 3, 6, 4))
  op = ops.Einsum(Precision.INT8)
  found = contractions_of(lambda a, b: op("bhqd,bhkd->bhqk", a, b), a, b)
  assert found == [("dot_general", ("int8", "int8"), "int32")]
  np.testing.assert_allclose(
    op("bhqd,bhkd->bhqk", a, b), jnp.einsum("bhqd,bhkd->bhqk", a, b), atol=0.1
  )
  with pytest.raises(ValueError, match="takes two operands"):
    op("a->a", a)


def test_ops_accept_and_ignore_nnx_keyword_arguments():
  x, w = _data((4, 8), (8, 2))
  xc, wc = _data((2, 6, 6, 3), (3, 3, 3, 5))
  nnx_kwargs = dict(precision=None, preferred_element_type=None)
  for compute in ["int8", "fp32"]:
    y = _dot(compute)(x, w, DN, **nnx_kwargs, out_sharding=None)
    assert y.shape == (4, 2) and y.dtype == jnp.float32
    np.testing.assert_array_equal(y, _dot(compute)(x, w, DN))
    op = ops.ConvGeneralDilated(Precision(compute))
    y = op(xc, wc, (1, 1), "SAME", dimension_numbers=CONV_DN, **nnx_kwargs)
    np.testing.assert_array_equal(y, _conv(compute)(xc, wc))


def test_stochastic_rounding_option_reaches_the_operands():
  x, w = _data((64, 64), (64, 64))
  nearest = _dot("int8")(x, w, DN)
  sr = _dot("int8", rounding="stochastic")(x, w, DN)
  trunc = _dot("int8", rounding="truncate")(x, w, DN)
  assert not np.allclose(nearest, sr) and not np.allclose(nearest, trunc)
  exact = x @ w
  # Truncation is the least accurate of the three.
  err = lambda y: float(jnp.abs(y - exact).mean())
  assert err(trunc) > err(nearest)


def test_functional_forms_match_the_op_classes():
  x, w = _data((4, 8), (8, 2))
  np.testing.assert_array_equal(
    ops.dot_general(x, w, DN, compute="int8"), _dot("int8")(x, w, DN)
  )
  a, b = _data((2, 3, 4), (2, 4, 5))
  np.testing.assert_array_equal(
    ops.einsum("bij,bjk->bik", a, b, compute="fp16"),
    ops.Einsum(Precision.FP16)("bij,bjk->bik", a, b),
  )
