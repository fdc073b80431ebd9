"""Tests for PowerSGD (qsync_jax.parallel.powersgd) on the 4 fake CPU devices,
in shard_map as the trainer runs it, through the optax transformation and
through HybridTrainer (warm start included, and its checkpoint)."""

import os

from absl import flags
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags
import numpy as np
import optax
import pytest
from test_trainer import _batch
from test_trainer import _cnn
from test_trainer import _split
from test_trainer import _steps
from test_trainer import _workers

from experiments import config_lib
import qsync_jax as qs
from qsync_jax import parallel
from qsync_jax.parallel import averagers
from qsync_jax.parallel.powersgd import PowerSGD
from qsync_jax.train import saved_state
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer

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
  f = jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS))
    )
  )
  return tuple(
    map(np.asarray, f(jax.device_put(x, sharding), jax.device_put(w, sharding)))
  )


def _low_rank(rows, cols, rank, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(rows, rank)) @ rng.normal(size=(rank, cols))).astype(
    np.float32
  )


@pytest.mark.parametrize(
  "shape, averager",
  [
    ((24, 24), PowerSGD(rank=3)),  # nearly square by default
    ((40, 20), PowerSGD(rank=2, cols=20)),  # fixed width
    ((40, 20), PowerSGD(rank=4, cols=20)),  # rank above the input's
  ],
)
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
  x = np.stack(
    [(u @ rng.normal(size=(2, 20))).reshape(-1) for _ in range(N)]
  ).astype(np.float32)
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
        averager, xi[0], residual, wi[0], AXIS, key
      )
      return residual, mean

    keys = jax.random.split(jax.random.key(0), steps)
    residual, means = lax.scan(step, jnp.zeros_like(xi[0]), keys)
    return residual[None], jnp.cumsum(means, axis=0)[None]

  mesh = _mesh()
  sharding = NamedSharding(mesh, P(AXIS))
  f = jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS))
    )
  )
  residual, cumulative = map(
    np.asarray, f(jax.device_put(x, sharding), jax.device_put(w, sharding))
  )
  np.testing.assert_allclose(
    cumulative[0, -1] + residual.sum(0), steps * exact, atol=1e-3
  )
  err = [
    np.linalg.norm(cumulative[0, t - 1] / t - exact) / np.linalg.norm(exact)
    for t in (1, steps // 2, steps)
  ]
  assert err[0] > 0.5  # one rank-1 call misses most of a random matrix
  assert err[2] < 0.1 and err[2] < 0.6 * err[1]  # about 1 / T
  # Without feedback the running average keeps the rank-1 bias.
  plain = np.mean(
    [_run(averager, x, w, jax.random.key(k))[0][0] for k in range(8)], axis=0
  )
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
    2 * 4 / 4096
  )
  # Not a perfect square: padded up; fixed width; rank clamped.
  assert PowerSGD(rank=2).matrix_shape(17) == (4, 5, 2)
  assert PowerSGD(rank=2, cols=256).matrix_shape(1000) == (4, 256, 2)
  assert PowerSGD(rank=8).matrix_shape(10) == (3, 4, 3)
  assert PowerSGD(rank=8).wire_bytes(10, 2) == pytest.approx(4 * 7 * 3)
  assert a.wire_bytes(d, 1) == 0 and a.wire_bytes(0, 4) == 0


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(rank=0), "rank must be an integer >= 1"),
    (dict(rank=1.5), "rank must be an integer >= 1"),
    (dict(cols=0), "cols must be None or an integer >= 1"),
    (dict(warm_start=1), "warm_start must be a bool"),
  ],
)
def test_bad_settings_are_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    averagers.make_averager("powersgd", **kwargs)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_trains_through_the_hybrid_trainer(error_feedback):
  sizes = [8] * N
  averager = averagers.make_averager("powersgd", rank=2)
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(averager=averager, error_feedback=error_feedback),
  )
  x, y = _batch(32, seed=0)
  state = trainer.init()
  first = trainer.evaluate(state, (x, y))["loss"]
  state = _steps(
    trainer,
    [_split(*_batch(32, seed=step % 2), sizes) for step in range(6)],
    state,
  )
  rows = np.asarray(state.params)
  for r in rows[1:]:
    np.testing.assert_array_equal(r, rows[0])
  assert state.comm_bytes == pytest.approx(
    6 * averager.wire_bytes(trainer.num_params, N)
  )
  assert state.comm_bytes < 0.1 * 6 * 1.5 * 4 * trainer.num_params
  assert (state.residual is not None) == error_feedback
  assert trainer.evaluate(state, (x, y))["loss"] < first


def _noisy_low_rank(n=24, rank=3, seed=5):
  """Workers' inputs whose mean is a rank-3 signal (singular values 4, 3,
  2) plus a tail (1 down to 0.1): a gap of 2 at the rank. Returns ``(x,
  w, mean, best)``, ``best`` the mean's best rank-3 approximation."""
  rng = np.random.default_rng(seed)
  u, v = (np.linalg.qr(rng.normal(size=(n, n)))[0] for _ in range(2))
  a = (u * np.r_[4, 3, 2, np.linspace(1, 0.1, n - rank)]) @ v.T
  e = rng.normal(size=(N, n * n))
  x = (a.reshape(-1) + e - e.mean(0)).astype(np.float32)
  w = np.full(N, 1 / N, np.float32)
  mean = (x.astype(np.float64) * w[:, None]).sum(0).reshape(n, n)
  uu, ss, vv = np.linalg.svd(mean)
  return x, w, mean, (uu[:, :rank] * ss[:rank]) @ vv[:rank]


def _repeated(averager, x, w, steps):
  """``steps`` calls of :func:`averagers.average` on the same inputs with
  fresh keys, threading the averager's state; returns (state, means), each
  stacked per worker (None state for a stateless one)."""

  def fn(xi, wi):
    def step(state, key):
      mean, _, state = averagers.average(
        averager, xi[0], wi[0], AXIS, key, state=state
      )
      return state, mean

    keys = jax.random.split(jax.random.key(0), steps)
    state, means = lax.scan(
      step, averagers.init_state(averager, xi.shape[1]), keys
    )
    return jax.tree.map(lambda a: a[None], state), means[None]

  mesh = _mesh()
  sharding = NamedSharding(mesh, P(AXIS))
  f = jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS))
    )
  )
  return jax.tree.map(
    np.asarray, f(jax.device_put(x, sharding), jax.device_put(w, sharding))
  )


def test_warm_start_converges_to_the_best_rank_r_approximation():
  # Subspace iteration: each call is one power step from the last Q, so on
  # a fixed input the mean converges to the truncated SVD; a random start
  # every call stays well above the best rank-3 error.
  x, w, mean, best = _noisy_low_rank()
  best_err = np.linalg.norm(mean - best)
  warm_state, warm = _repeated(PowerSGD(rank=3), x, w, 12)
  _, cold = _repeated(PowerSGD(rank=3, warm_start=False), x, w, 12)

  def errs(means):
    return (
      np.array([np.linalg.norm(m.reshape(mean.shape) - mean) for m in means[0]])
      / best_err
    )

  assert errs(warm)[0] == errs(cold)[0] > 1.2  # the same first call
  np.testing.assert_allclose(warm[0, -1].reshape(mean.shape), best, atol=1e-5)
  assert errs(warm)[-1] < 1 + 1e-6
  assert errs(cold).min() > 1.1
  # Q is the all-reduced factor: the same on every worker, bit for bit.
  assert warm_state.shape == (N, 24, 3)
  assert (warm_state == warm_state[:1]).all() and warm_state.any()
  assert (warm == warm[:1]).all()


def test_state_is_only_for_warm_start_and_zeros_start_cold():
  a = PowerSGD(rank=2, cols=20)
  assert a.init_state(400).shape == (20, 2) and not a.init_state(400).any()
  assert PowerSGD(warm_start=False).init_state(400) is None
  assert a.init_state(0) is None
  for other in ("mean", "fp16", "gqsgd", "gqsgd_exp", "qsgd"):
    assert averagers.init_state(averagers.make_averager(other), 400) is None
  # A state of zeros draws Q from the key: the cold call, bit for bit.
  x = np.random.default_rng(6).normal(size=(N, 400)).astype(np.float32)
  w = np.full(N, 1 / N, np.float32)
  _, means = _repeated(a, x, w, 1)
  _, cold = _repeated(PowerSGD(rank=2, cols=20, warm_start=False), x, w, 1)
  np.testing.assert_array_equal(means, cold)
  with pytest.raises(ValueError, match="state of shape"):
    a.reduce_with_state(jnp.ones(400), 1.0, AXIS, None, jnp.zeros((19, 2)))


def test_a_non_finite_call_resets_the_state():
  x = np.ones((N, 25), np.float32)
  x[1, 3] = np.nan
  state, means = _repeated(PowerSGD(rank=2), x, np.full(N, 0.25, np.float32), 2)
  assert np.isnan(means).all() and not state.any()


def test_the_transformation_keeps_the_warm_start_state():
  x, _w, mean, best = _noisy_low_rank()
  tx = parallel.averaged(PowerSGD(rank=3), AXIS)
  state = tx.init(jnp.zeros(mean.size))
  assert state.averager_state.shape == (24, 3)

  def body(g, s):
    out, s = tx.update(g[0], jax.tree.map(lambda a: a[0], s))
    return out[None], jax.tree.map(lambda a: a[None], s)

  f = jax.jit(
    jax.shard_map(
      body,
      mesh=_mesh(),
      in_specs=(P(AXIS), P(AXIS)),
      out_specs=(P(AXIS), P(AXIS)),
    )
  )
  stacked = jax.tree.map(lambda a: jnp.stack([a] * N), state)
  for _ in range(12):
    out, stacked = f(x, stacked)
  np.testing.assert_allclose(
    np.asarray(out)[0].reshape(mean.shape), best, atol=1e-5
  )
  q = np.asarray(stacked.averager_state)
  assert (q == q[:1]).all() and q.any()
  assert stacked.residual is None


def _powersgd_trainer(warm_start=True):
  return HybridTrainer(
    _cnn(),
    _workers([8] * N),
    optax.sgd(0.05, momentum=0.9),
    sync=qs.SyncSettings(
      averager=averagers.make_averager(
        "powersgd", rank=2, warm_start=warm_start
      ),
      error_feedback=True,
    ),
  )


def test_trainer_carries_q_and_a_checkpoint_resumes_bit_identically(tmp_path):
  batches = [_split(*_batch(32, seed=s), [8] * N) for s in range(6)]
  straight = _powersgd_trainer()
  straight_state = _steps(straight, batches)
  q = np.asarray(straight_state.averager_state)
  assert (
    q.shape
    == (N, *straight.sync.averager.matrix_shape(straight.num_params)[1:])
    and q.any()
    and (q == q[:1]).all()
  )
  # A skipped (non-finite) step leaves Q and the residual as they were.
  nan = jax.jit(lambda p: p * jnp.nan)(straight_state.params)
  out = straight.programs.update(
    straight_state.params,
    straight_state.opt_state,
    straight_state.loss_scale,
    nan,
    straight._weights,
    straight_state.counter,
    straight_state.residual,
    straight_state.averager_state,
  )
  assert not np.asarray(out[3]).any()
  np.testing.assert_array_equal(out[5], straight_state.residual)
  np.testing.assert_array_equal(out[6], q)
  first = _powersgd_trainer()
  first_state = _steps(first, batches[:3])
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first, first_state)
  assert "averager_state" in saved_state.state_tree(first, first_state)
  resumed = _powersgd_trainer()
  state = ckpt.restore_latest(resumed, resumed.init()).state
  ckpt.close()
  assert (
    np.asarray(state.averager_state).tobytes()
    == np.asarray(first_state.averager_state).tobytes()
  )
  state = _steps(resumed, batches[3:], state)
  assert resumed.params_digest(state) == straight.params_digest(straight_state)
  for a, b in zip(
    jax.tree.leaves(saved_state.state_tree(resumed, state)),
    jax.tree.leaves(saved_state.state_tree(straight, straight_state)),
  ):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  # Without warm start there is no state, and the run differs.
  cold = _powersgd_trainer(warm_start=False)
  cold_state = _steps(cold, batches)
  assert cold_state.averager_state is None
  assert "averager_state" not in saved_state.state_tree(cold, cold_state)
  assert cold.params_digest(cold_state) != straight.params_digest(
    straight_state
  )


@pytest.mark.parametrize("arg, warm", [(None, True), ("false", False)])
def test_the_config_sets_warm_start(arg, warm):
  argv = [
    "train",
    "--config.compress=powersgd",
    "--config.compress_kwargs.rank=16",
  ]
  if arg is not None:
    argv.append(f"--config.compress_kwargs.warm_start={arg}")
  values = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config",
    os.path.join(
      os.path.dirname(os.path.dirname(__file__)),
      "experiments",
      "configs",
      "default.py",
    ),
    flag_values=values,
    lock_config=True,
    sys_argv=argv,
  )
  values(argv)
  averager = config_lib.make_averager(config_lib.parse(values.config))
  assert (averager.rank, averager.warm_start) == (16, warm)
