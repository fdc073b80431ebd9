"""Pieces for a user's own loop: tree averaging, the optax transformation,
and sync tables a jitted step can index."""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from qsync_jax import parallel
from qsync_jax.parallel import averagers

AXIS = "data"
N = 4


def mesh():
  return Mesh(np.array(jax.devices()[:N]), (AXIS,))


def worker_trees(seed=0):
  """Four workers' trees: mixed float dtypes, nested, stacked on axis 0."""
  rng = np.random.default_rng(seed)
  return {
    "w": rng.normal(size=(N, 3, 5)).astype(np.float32),
    "b": rng.normal(size=(N, 7)).astype(np.float32),
    "h": [rng.normal(size=(N, 4)).astype(jnp.bfloat16)],
  }


def row(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


def per_worker(fn, num_in, num_out):
  """``fn`` on each worker's row under shard_map with check_vma=True."""

  def body(*args):
    args = [jax.tree.map(lambda x: x[0], a) for a in args]
    out = fn(*args)
    return jax.tree.map(lambda x: x[None], out)

  specs = tuple([P(AXIS)] * num_in)
  out_specs = tuple([P(AXIS)] * num_out) if num_out > 1 else P(AXIS)
  return jax.jit(
    jax.shard_map(
      body, mesh=mesh(), in_specs=specs, out_specs=out_specs, check_vma=True
    )
  )


def exact_mean(trees):
  return jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), 0), trees)


def test_average_tree_mean_is_the_mean_of_the_workers_trees():
  trees = worker_trees()
  f = per_worker(
    lambda t: averagers.average_tree(
      averagers.MeanAverager(), t, jnp.float32(1 / N), AXIS
    ),
    1,
    1,
  )
  out = f(trees)
  want = exact_mean(trees)
  for i in range(N):
    got = row(out, i)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert got["h"][0].dtype == jnp.bfloat16 and got["w"].dtype == np.float32
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["b"], want["b"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
      np.asarray(got["h"][0], np.float32), want["h"][0], rtol=1e-2, atol=1e-2
    )


def test_average_tree_gqsgd_is_within_its_error_bound():
  trees = worker_trees(1)
  trees["h"] = [x.astype(np.float32) for x in trees["h"]]  # exact compare
  averager = parallel.make_averager("gqsgd")
  key = jax.random.key(3)
  f = per_worker(
    lambda t: averager.reduce(
      averagers.ravel_floats(t)[0], jnp.float32(1 / N), AXIS, key
    )[0],
    1,
    1,
  )
  g = per_worker(
    lambda t: averagers.average_tree(
      averager, t, jnp.float32(1 / N), AXIS, key
    ),
    1,
    1,
  )
  out = g(trees)
  # Each worker's stochastic rounding moves w_i x_i by less than one step
  # M / s (one bucket here): |mean - exact| <= n M / s (arXiv 2305.18627).
  flat_workers = np.stack(
    [np.asarray(averagers.ravel_floats(row(trees, i))[0]) for i in range(N)]
  )
  bound = N * np.max(np.abs(flat_workers / N)) / averager.levels(N)
  want = exact_mean(trees)
  errors = []
  for i in range(N):
    for a, b in zip(jax.tree.leaves(row(out, i)), jax.tree.leaves(want)):
      errors.append(np.max(np.abs(np.asarray(a, np.float64) - b)))
  assert max(errors) <= bound
  assert max(errors) > 0  # really quantized
  # The tree path is the flat averager on the raveled tree, unraveled.
  flat_out = np.asarray(f(trees))
  np.testing.assert_array_equal(
    np.asarray(averagers.ravel_floats(row(out, 0))[0]), flat_out[0]
  )


def test_non_float_leaves_are_refused_by_path():
  tree = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(ValueError, match=r"int32 at \['step'\]"):
    averagers.ravel_floats(tree)
  with pytest.raises(ValueError, match="floating-point"):
    parallel.averaged(averagers.MeanAverager(), AXIS, error_feedback=True).init(
      tree
    )


@pytest.mark.parametrize("name", ["mean", "gqsgd"])
def test_transformation_gives_every_worker_the_same_update(name):
  grads = worker_trees(2)
  grads["h"] = [x.astype(np.float32) for x in grads["h"]]
  params = row(grads, 0)
  tx = optax.chain(
    parallel.averaged(parallel.make_averager(name), AXIS), optax.sgd(0.1)
  )
  state = tx.init(params)

  def step(g, state):
    g = jax.tree.map(lambda x: x[0], g)
    return tx.update(g, state, params)

  # out_specs P() for the updates: check_vma=True proves them invariant.
  f = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh(),
      in_specs=(P(AXIS), P()),
      out_specs=(P(), P()),
      check_vma=True,
    )
  )
  updates, new_state = f(grads, state)
  rows = per_worker(lambda g: tx.update(g, state, params)[0], 1, 1)(grads)
  for i in range(N):
    for a, b in zip(jax.tree.leaves(row(rows, i)), jax.tree.leaves(updates)):
      np.testing.assert_array_equal(a, b)
  want = jax.tree.map(lambda m: -0.1 * m, exact_mean(grads))
  if name == "mean":
    tol = 1e-6
  else:
    # The Global-QSGD bound of the mean (see the test above), times the
    # learning rate; float32 rounding of the update on top.
    flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads)])
    levels = parallel.make_averager(name).levels(N)
    tol = 0.1 * np.max(np.abs(flat)) / levels + 1e-7
  errors = [
    np.max(np.abs(np.asarray(a, np.float64) - b))
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(want))
  ]
  assert max(errors) <= tol, (errors, tol)
  if name == "gqsgd":
    assert max(errors) > 0  # really quantized
  assert int(new_state[0].count) == 1


def two_calls(error_feedback, seed=0):
  """Two gqsgd calls of the transformation; returns states and updates."""
  rng = np.random.default_rng(seed)
  size = 4096
  grads = [rng.normal(size=(N, size)).astype(np.float32) for _ in range(2)]
  tx = parallel.averaged(
    parallel.make_averager("gqsgd", bucket_size=None),
    AXIS,
    error_feedback=error_feedback,
  )
  state0 = tx.init(jnp.zeros(size))
  stacked = jax.tree.map(lambda x: jnp.stack([x] * N), state0)
  f = per_worker(tx.update, 2, 2)
  u1, s1 = f(grads[0], stacked)
  u2, s2 = f(grads[1], s1)
  exact = sum(g.mean(0) for g in grads)
  return stacked, s1, s2, np.asarray(u1[0] + u2[0]) - exact


def test_error_feedback_carries_the_residual_in_the_state():
  s0, s1, s2, err_ef = two_calls(True)
  assert not np.any(s0.residual)
  assert np.any(s1.residual) and np.any(s1.residual != s2.residual)
  assert np.all(np.asarray(s2.count) == 2)
  # The residuals telescope: the summed error is the last residuals' mean.
  np.testing.assert_allclose(err_ef, -np.asarray(s2.residual).sum(0), atol=1e-5)
  _, _, s_plain, err_plain = two_calls(False)
  assert s_plain.residual is None
  assert np.linalg.norm(err_ef) < 0.85 * np.linalg.norm(err_plain)


def schedules():
  lr = optax.cosine_decay_schedule(0.5, 60)
  return [
    parallel.make_schedule("dp", total_steps=60),
    parallel.make_schedule("local", total_steps=60, h_base=7),
    parallel.make_schedule(
      "postlocal", total_steps=60, h_base=4, switch_step=10
    ),
    parallel.make_schedule(
      "qsr",
      total_steps=60,
      h_base=2,
      alpha=0.8,
      lr_schedule=lambda s: float(lr(s)),
    ),
  ]


@pytest.mark.parametrize("schedule", schedules(), ids=lambda s: s.name)
def test_sync_table_equals_is_sync_step(schedule):
  table = schedule.sync_table(60)
  assert table.dtype == np.bool_ and table.shape == (60,)
  assert list(np.flatnonzero(table) + 1) == schedule.sync_steps(60)
  assert [bool(b) for b in table] == [
    schedule.is_sync_step(t) for t in range(1, 61)
  ]


def test_sync_table_drives_one_jitted_step():
  schedule = parallel.make_schedule("local", total_steps=10, h_base=3)
  table = jnp.asarray(schedule.sync_table(10))

  @jax.jit
  def step(t, x):
    return lax.cond(table[t - 1], lambda v: v * 0, lambda v: v + 1, x)

  x, seen = jnp.int32(0), []
  for t in range(1, 11):
    x = step(t, x)
    seen.append(int(x) == 0)
  assert seen == [schedule.is_sync_step(t) for t in range(1, 11)]
  assert step._cache_size() == 1


def test_sync_table_refuses_a_bad_length():
  with pytest.raises(ValueError, match="total_steps"):
    parallel.make_schedule("dp", total_steps=5).sync_table(0)
