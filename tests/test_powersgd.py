"""Tests for PowerSGD (qsync_jax.parallel.powersgd) on the 4 fake CPU devices,
in shard_map as the trainer runs it, and through HybridTrainer."""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

from qsync_jax.parallel import averagers
from qsync_jax.parallel.powersgd import PowerSGD
from qsync_jax.train.trainer import HybridTrainer
from test_trainer import _batch, _cnn, _split, _workers

AXIS = "workers"
N = 4


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), (AXIS,))


def _run(averager, x, w, key=jax.random.key(3)):
  """One ``reduce`` per worker; returns (mean, sent), each (N, d)."""

  def fn(xi, wi):
    mean, sent = averager.reduce(xi[0], wi[0], AXIS, key)
    return mean[None], sent[None]

  mesh = _mesh()
  sharding = NamedSharding(mesh, P(AXIS))
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                            out_specs=(P(AXIS), P(AXIS))))
  return tuple(map(np.asarray, f(jax.device_put(x, sharding),
                                 jax.device_put(w, sharding))))


def _low_rank(rows, cols, rank, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(rows, rank)) @ rng.normal(size=(rank, cols))
          ).astype(np.float32)


@pytest.mark.parametrize("shape, averager", [
    ((24, 24), PowerSGD(rank=3)),           # nearly square by default
    ((40, 20), PowerSGD(rank=2, cols=20)),  # fixed width
    ((40, 20), PowerSGD(rank=4, cols=20)),  # rank above the input's
])
def test_identical_low_rank_inputs_average_exactly(shape, averager):
  m = _low_rank(*shape, rank=2 if shape == (40, 20) else 3).reshape(-1)
  x = np.stack([m] * N)
  w = np.full(N, 1 / N, np.float32)
  mean, sent = _run(averager, x, w)
  assert (mean == mean[:1]).all()  # every worker holds the same mean
  np.testing.assert_allclose(mean[0], m, atol=1e-5 * np.abs(m).max())
  # The shares sum to the mean (what error feedback relies on).
  np.testing.assert_allclose(sent.sum(0), mean[0], atol=1e-5)


def test_weighted_inputs_in_one_column_space_average_exactly():
  # Rank-2 inputs sharing one column space: their weighted sum is rank 2.
  rng = np.random.default_rng(1)
  u = rng.normal(size=(30, 2))
  x = np.stack([(u @ rng.normal(size=(2, 20))).reshape(-1)
                for _ in range(N)]).astype(np.float32)
  w = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
  mean, _ = _run(PowerSGD(rank=2, cols=20), x, w)
  exact = (x.astype(np.float64) * w[:, None]).sum(0)
  np.testing.assert_allclose(mean[0], exact, atol=1e-5 * np.abs(exact).max())


def test_full_rank_input_is_projected_onto_a_rank_r_subspace():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(N, 16 * 16)).astype(np.float32)
  w = np.full(N, 1 / N, np.float32)
  mean, sent = _run(PowerSGD(rank=2), x, w)
  exact = (x * w[:, None]).sum(0)
  a, m = exact.reshape(16, 16), mean[0].reshape(16, 16)
  assert np.linalg.matrix_rank(m, tol=1e-4) == 2
  # P P^T A: the error is orthogonal to the approximation, and smaller
  # than the input.
  assert abs(np.sum((a - m) * m)) < 1e-4 * np.sum(a * a)
  assert 0 < np.sum(m * m) < np.sum(a * a)
  np.testing.assert_allclose(sent.sum(0), mean[0], atol=1e-5)


def test_error_feedback_makes_the_cumulative_mean_converge():
  # Fixed worker inputs, a fresh Q per call: sum of T means + the final
  # residuals = T * exact, and the residuals stay bounded (rank 1 of a
  # 12 x 12 matrix: after ~20 calls), so the running average of the means
  # converges to the exact mean like 1 / T.
  steps, rng = 120, np.random.default_rng(3)
  x = rng.normal(size=(N, 12 * 12)).astype(np.float32)
  w = np.full(N, 1 / N, np.float32)
  exact = (x.astype(np.float64) * w[:, None]).sum(0)
  averager = PowerSGD(rank=1)

  def fn(xi, wi):
    def step(residual, key):
      mean, residual = averagers.compress_with_feedback(
          averager, xi[0], residual, wi[0], AXIS, key)
      return residual, mean

    keys = jax.random.split(jax.random.key(0), steps)
    residual, means = lax.scan(step, jnp.zeros_like(xi[0]), keys)
    return residual[None], jnp.cumsum(means, axis=0)[None]

  mesh = _mesh()
  sharding = NamedSharding(mesh, P(AXIS))
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                            out_specs=(P(AXIS), P(AXIS))))
  residual, cumulative = map(np.asarray, f(jax.device_put(x, sharding),
                                           jax.device_put(w, sharding)))
  np.testing.assert_allclose(cumulative[0, -1] + residual.sum(0),
                             steps * exact, atol=1e-3)
  err = [np.linalg.norm(cumulative[0, t - 1] / t - exact)
         / np.linalg.norm(exact) for t in (1, steps // 2, steps)]
  assert err[0] > 0.5  # one rank-1 call misses most of a random matrix
  assert err[2] < 0.1 and err[2] < 0.6 * err[1]  # about 1 / T
  # Without feedback the running average keeps the rank-1 bias.
  plain = np.mean([_run(averager, x, w, jax.random.key(k))[0][0]
                   for k in range(8)], axis=0)
  assert np.linalg.norm(plain - exact) / np.linalg.norm(exact) > 0.3


def test_non_finite_input_gives_a_nan_mean_and_zeros_stay_zeros():
  w = np.full(N, 1 / N, np.float32)
  x = np.ones((N, 25), np.float32)
  x[2, 7] = np.inf
  assert np.isnan(_run(PowerSGD(rank=2), x, w)[0]).all()
  # A zero (rank-deficient) P still has an orthonormal basis: no NaN.
  mean, sent = _run(PowerSGD(rank=2), np.zeros((N, 25), np.float32), w)
  assert not mean.any() and not sent.any()


def test_without_a_key_q_comes_from_the_seed():
  x = np.random.default_rng(4).normal(size=(N, 100)).astype(np.float32)
  w = np.full(N, 1 / N, np.float32)
  a = _run(PowerSGD(rank=1, seed=1), x, w, None)[0]
  b = _run(PowerSGD(rank=1, seed=1), x, w, None)[0]
  c = _run(PowerSGD(rank=1, seed=2), x, w, None)[0]
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_wire_bytes_and_matrix_shape():
  fp32 = averagers.MeanAverager()
  d = 2**24
  a = averagers.make_averager("powersgd", rank=4)
  assert a.matrix_shape(d) == (4096, 4096, 4)
  assert a.wire_bytes(d, 4) == pytest.approx(2 * 3 / 4 * 4 * (2 * 4096) * 4)
  assert a.wire_bytes(d, 4) / fp32.wire_bytes(d, 4) == pytest.approx(
      2 * 4 / 4096)
  # Not a perfect square: padded up; fixed width; rank clamped.
  assert PowerSGD(rank=2).matrix_shape(17) == (4, 5, 2)
  assert PowerSGD(rank=2, cols=256).matrix_shape(1000) == (4, 256, 2)
  assert PowerSGD(rank=8).matrix_shape(10) == (3, 4, 3)
  assert PowerSGD(rank=8).wire_bytes(10, 2) == pytest.approx(4 * 7 * 3)
  assert a.wire_bytes(d, 1) == 0 and a.wire_bytes(0, 4) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "rank must be an integer >= 1"),
    (dict(rank=1.5), "rank must be an integer >= 1"),
    (dict(cols=0), "cols must be None or an integer >= 1"),
])
def test_bad_settings_are_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    averagers.make_averager("powersgd", **kwargs)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_trains_through_the_hybrid_trainer(error_feedback):
  sizes = [8] * N
  averager = averagers.make_averager("powersgd", rank=2)
  trainer = HybridTrainer(_cnn(), _workers(sizes), optax.adam(1e-2),
                          averager=averager, error_feedback=error_feedback)
  x, y = _batch(32, seed=0)
  first = trainer.evaluate((x, y))["loss"]
  for step in range(6):
    trainer.train_step(_split(*_batch(32, seed=step % 2), sizes))
  rows = np.asarray(trainer.params)
  for r in rows[1:]:
    np.testing.assert_array_equal(r, rows[0])
  assert trainer.comm_bytes == pytest.approx(
      6 * averager.wire_bytes(trainer.num_params, N))
  assert trainer.comm_bytes < 0.1 * 6 * 1.5 * 4 * trainer.num_params
  assert (trainer.residual is not None) == error_feedback
  assert trainer.evaluate((x, y))["loss"] < first
