"""Tests for scales, rounding modes and int8 / fp8 quantization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from qsync_jax.numerics import ops
from qsync_jax.numerics import quant


def test_absmax_scale_per_tensor_and_per_channel():
  x = jnp.array([[1.0, -4.0], [0.5, 2.0], [0.0, 0.0]])
  assert float(quant.absmax_scale(x, 127)) == pytest.approx(4 / 127)
  per_row = quant.absmax_scale(x, 127, reduce_axes=(1,))
  np.testing.assert_allclose(per_row[:, 0], [4 / 127, 2 / 127, 1.0])
  assert per_row.shape == (3, 1)


def test_quantize_round_trip_error_is_at_most_half_a_step():
  x = jax.random.normal(jax.random.key(0), (64, 32)) * 3
  q, s = quant.quantize(x)
  assert q.dtype == jnp.int8 and int(jnp.abs(q).max()) == 127
  err = jnp.abs(quant.dequantize(q, s) - x)
  assert float(err.max()) <= float(s) / 2 + 1e-6


def test_truncate_rounds_toward_zero_like_the_reference_kernel():
  v = jnp.array([1.7, -1.7, 0.4, -0.4, 2.5])
  np.testing.assert_array_equal(
    quant.round_values(v, "truncate"), [1, -1, 0, 0, 2]
  )
  np.testing.assert_array_equal(
    quant.round_values(v, "nearest"), [2, -2, 0, 0, 2]
  )


# Stochastic rounding: each rounded value has variance p(1 - p) <= 1/4 around
# its input, so the mean error over N independent elements has standard
# deviation <= 0.5 / sqrt(N). We allow 5 of those (a false alarm ~ 6e-7).
N = 1 << 20
TOL = 5 * 0.5 / np.sqrt(N)


@pytest.mark.parametrize("use_key", [False, True])
def test_stochastic_rounding_is_unbiased(use_key):
  key = jax.random.key(1) if use_key else None
  v = jax.random.uniform(jax.random.key(2), (N,), minval=-50, maxval=50)
  err = quant.round_values(v, "stochastic", key=key) - v
  assert abs(float(err.mean())) < TOL
  # Also for one repeated value, where round-to-nearest is maximally biased.
  c = jnp.full((N,), 0.3)
  assert (
    abs(float(quant.round_values(c, "stochastic", key=key).mean()) - 0.3) < TOL
  )
  assert abs(float(quant.round_values(c, "nearest").mean()) - 0.3) > 0.29


def test_stochastic_int8_quantization_is_unbiased_through_the_scale():
  x = jnp.full((N,), 0.123)
  scale = jnp.float32(1 / 127)  # 0.123 / scale = 15.621 steps
  q = quant.quantize_int8(x, scale, "stochastic")
  assert set(np.unique(np.asarray(q))) == {15, 16}
  assert abs(float(quant.dequantize(q, scale).mean()) - 0.123) < TOL * scale


def test_hash_noise_is_uniform_and_salted():
  x = jnp.zeros((100_000,))
  u = np.asarray(quant.hash_uniform(x))
  assert 0 <= u.min() and u.max() < 1
  assert stats.kstest(u, "uniform").pvalue > 0.01
  u2 = np.asarray(quant.hash_uniform(x, salt=7))
  assert abs(np.corrcoef(u, u2)[0, 1]) < 0.02


def test_fp8_quantization_uses_the_full_range():
  x = jax.random.normal(jax.random.key(3), (256,)) * 1e-3
  q, s = quant.quantize_fp8(x)
  assert q.dtype == jnp.float8_e4m3fn
  assert float(jnp.abs(q.astype(jnp.float32)).max()) == 448.0
  rel = jnp.abs(quant.dequantize(q, s) - x) / jnp.abs(x).max()
  assert float(rel.max()) < 2**-4
  g, _sg = quant.quantize_fp8(x, quant.FP8_GRADIENT)
  assert g.dtype == jnp.float8_e5m2


def test_config_rejects_unknown_values():
  with pytest.raises(ValueError, match="unknown granularity 'row'"):
    quant.QuantConfig(granularity="row")
  assert quant.QuantConfig.from_dict({"rounding": "truncate"}).rounding is (
    quant.Rounding.TRUNCATE
  )


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value_makes_its_scale_and_the_int8_output_non_finite(bad):
  # Large rows: XLA:CPU's max-reduction drops NaN there (jax 0.10).
  x = np.random.default_rng(0).normal(size=(256, 4096)).astype(np.float32)
  x[100, 7] = bad
  assert not np.isfinite(float(quant.absmax_scale(x, 127.0)))
  per_row = np.asarray(quant.absmax_scale(x, 127.0, reduce_axes=(1,)))
  assert not np.isfinite(per_row[100, 0])
  assert np.isfinite(np.delete(per_row, 100, axis=0)).all()
  w = np.ones((4096, 8), np.float32)
  y = ops.dot_general(x, w, (((1,), (0,)), ((), ())), compute="int8")
  assert not np.isfinite(np.asarray(y)).all()
