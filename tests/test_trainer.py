"""Tests for HybridTrainer, cluster specs, dynamic batching and loss scaling,
BatchNorm statistics at evaluation and optimizer state at syncs."""

import itertools
import logging

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import numpy as np
import optax
import pytest

import qsync_jax as qs
from qsync_jax import models
from qsync_jax.parallel import cluster
from qsync_jax.task import losses
from qsync_jax.train import evaluation
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.layout import rows as _rows
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

INT8_FP16 = qs.PrecisionPlan([(r"conv\d", "int8"), ("fc", "fp16")])


def _cnn(seed=0):
  return models.create_model("cnn", rngs=nnx.Rngs(seed))


def _batch(n, seed=0):
  rng = np.random.default_rng(seed)
  return (
    rng.uniform(size=(n, 8, 8, 1)).astype(np.float32),
    rng.integers(0, 10, size=n).astype(np.int32),
  )


def _workers(sizes, plans=None, kinds=None):
  plans = plans or [qs.PrecisionPlan()] * len(sizes)
  kinds = kinds or ["cpu"] * len(sizes)
  return [
    Worker(d, k, p, b) for d, k, p, b in zip(jax.devices(), kinds, plans, sizes)
  ]


def _split(x, y, sizes):
  bounds = np.cumsum([0, *sizes])
  return {
    i: (x[a:b], y[a:b]) for i, (a, b) in enumerate(itertools.pairwise(bounds))
  }


def _flat(tree):
  return np.asarray(ravel_pytree(tree)[0])


@nnx.jit
def _grad(model, x, y):
  return nnx.grad(lambda m: losses.cross_entropy(m(x), y))(model)


@pytest.mark.parametrize(
  "declared", [False, True], ids=["pytree_update", "elementwise_update"]
)
def test_four_fp32_workers_match_one_device_on_the_concatenated_batch(declared):
  # SGD with momentum: Adam's m / sqrt(v) turns float32 rounding noise on
  # near-zero gradients into +-lr steps, which says nothing about the trainer.
  sizes = [8, 8, 8, 8]
  tx = optax.sgd(0.1, momentum=0.9)
  trainer = HybridTrainer(
    _cnn(), _workers(sizes), qs.elementwise(tx) if declared else tx
  )
  ref = _cnn()
  opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
  for step in range(3):
    x, y = _batch(32, seed=step)
    trainer.train_step(_split(x, y, sizes))
    opt.update(ref, _grad(ref, x, y))
  want = _flat(nnx.state(ref, nnx.Param))
  for i in range(4):
    np.testing.assert_allclose(
      _flat(trainer.worker_params(i)), want, rtol=1e-5, atol=1e-5
    )


def test_dynamic_batch_weighted_gradient_equals_the_full_batch_gradient():
  sizes = [3, 5, 8, 16]
  model = _cnn()
  before = _flat(nnx.state(model, nnx.Param))
  x, y = _batch(sum(sizes))
  full_grad = _flat(_grad(model, x, y))
  trainer = HybridTrainer(model, _workers(sizes), optax.sgd(1.0))
  np.testing.assert_allclose(trainer.grad_weights, np.array(sizes) / 32)
  trainer.train_step(_split(x, y, sizes))
  step = before - _flat(trainer.worker_params(0))
  np.testing.assert_allclose(step, full_grad, rtol=1e-5, atol=1e-6)
  # An unweighted mean of the per-worker means would be a different step.
  per_worker = [
    _flat(_grad(model, xb, yb)) for xb, yb in _split(x, y, sizes).values()
  ]
  assert not np.allclose(np.mean(per_worker, 0), full_grad, rtol=1e-3)


def test_mixed_plans_keep_every_worker_identical():
  sizes = [8, 8, 8, 8]
  plans = [qs.PrecisionPlan()] * 2 + [INT8_FP16] * 2
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes, plans, ["v100", "v100", "t4", "t4"]),
    optax.adam(1e-2),
  )
  assert trainer.loss_scaling  # an FP16 layer turns it on
  for step in range(3):
    trainer.train_step(_split(*_batch(32, seed=step), sizes))
  rows = [np.asarray(r) for r in _rows(trainer.params).values()]
  for r in rows[1:]:
    np.testing.assert_array_equal(r, rows[0])
  assert trainer.sync_rounds == 3
  assert trainer.comm_bytes == pytest.approx(3 * 1.5 * 4 * trainer.num_params)


@pytest.mark.parametrize(
  "declared", [False, True], ids=["pytree_update", "elementwise_update"]
)
def test_non_finite_gradient_skips_the_step_on_all_workers(declared):
  sizes = [8, 8, 8, 8]
  plans = [qs.PrecisionPlan()] * 2 + [INT8_FP16] * 2
  tx = optax.adam(1e-2)
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes, plans, ["v100", "v100", "t4", "t4"]),
    qs.elementwise(tx) if declared else tx,
  )
  trainer.train_step(_split(*_batch(32), sizes))
  before = {d: np.asarray(r) for d, r in _rows(trainer.params).items()}
  opt_before = [np.asarray(a) for a in jax.tree.leaves(trainer.opt_state)]
  scale = trainer.current_loss_scale
  x, y = _batch(32, seed=1)
  x[20, 3, 3, 0] = np.inf  # one example on worker 2 (an INT8/FP16 worker)
  trainer.train_step(_split(x, y, sizes))
  assert not trainer.last_step_finite()
  assert trainer.skipped_steps == 1
  assert trainer.current_loss_scale == scale / 2
  for d, r in _rows(trainer.params).items():
    np.testing.assert_array_equal(np.asarray(r), before[d])
  for a, b in zip(jax.tree.leaves(trainer.opt_state), opt_before):
    np.testing.assert_array_equal(np.asarray(a), b)
  trainer.train_step(_split(*_batch(32, seed=2), sizes))
  assert trainer.last_step_finite() and trainer.skipped_steps == 1
  assert not np.array_equal(
    np.asarray(next(iter(_rows(trainer.params).values()))),
    next(iter(before.values())),
  )


def test_an_elementwise_optimizer_keeps_flat_state_and_steps_as_on_the_pytree():
  # Local SGD: each worker's own update (no averaging) and, every second
  # step, the parameter average with Adam's moments averaged too.
  sizes = [8, 8]
  schedule = qs.make_schedule("local", total_steps=4, h_base=2)
  make = lambda tx: HybridTrainer(
    _cnn(),
    _workers(sizes),
    tx,
    schedule=schedule,
    opt_fields_to_average=("mu", "nu"),
  )
  pytree, flat = make(optax.adam(1e-2)), make(qs.elementwise(optax.adam(1e-2)))
  for step in range(4):
    batches = _split(*_batch(16, seed=step), sizes)
    pytree.train_step(batches)
    flat.train_step(batches)
  for i in range(2):
    # Float32 rounding (XLA fuses the two layouts differently), which
    # Adam's m / sqrt(v) amplifies on near-zero gradients.
    np.testing.assert_allclose(
      _flat(flat.worker_params(i)),
      _flat(pytree.worker_params(i)),
      rtol=1e-5,
      atol=1e-5,
    )
  float_shapes = lambda t: {
    a.shape for a in jax.tree.leaves(t) if np.issubdtype(a.dtype, np.floating)
  }
  assert float_shapes(flat.opt_state) == {(2, flat.num_params)}
  assert (2, flat.num_params) not in float_shapes(pytree.opt_state)


@pytest.mark.parametrize("sync", ["dp", "local"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_every_program_compiles_once(sync, num_workers):
  # The second step reads rows the first step's programs wrote; the first
  # reads the initial state, which must look the same to jit (it did not on
  # a one-device mesh).
  sizes = [4] * num_workers
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.sgd(0.1),
    schedule=qs.make_schedule(sync, total_steps=4, h_base=2),
  )
  for step in range(4):
    trainer.train_step(_split(*_batch(sum(sizes), seed=step), sizes))
  # The workers share one gradient function, compiled once per device.
  (grad_fn,) = set(trainer._grad_fns.values())
  assert grad_fn._cache_size() == num_workers
  assert trainer._update._cache_size() == int(sync == "dp")
  assert trainer._local_update._cache_size() == int(sync == "local")


def test_loss_scaling_is_off_without_fp16_layers():
  plans = [qs.PrecisionPlan([(r"conv\d", "int8")])] * 2
  trainer = HybridTrainer(_cnn(), _workers([4, 4], plans), optax.sgd(0.1))
  assert not trainer.loss_scaling and trainer.current_loss_scale == 1.0


def test_checkpoint_restore_continues_bit_identically(tmp_path):
  sizes = [8, 8, 8, 8]
  plans = [qs.PrecisionPlan()] * 2 + [INT8_FP16] * 2
  kinds = ["v100", "v100", "t4", "t4"]

  def make():
    return HybridTrainer(
      _cnn(), _workers(sizes, plans, kinds), optax.adam(1e-2)
    )

  batches = [_split(*_batch(32, seed=s), sizes) for s in range(6)]
  straight = make()
  for b in batches:
    straight.train_step(b)
  first = make()
  for b in batches[:3]:
    first.train_step(b)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first)
  resumed = make()
  meta = ckpt.restore_latest(resumed)
  assert meta["step"] == 3 and resumed.step == 3
  for b in batches[3:]:
    resumed.train_step(b)
  assert resumed.params_digest() == straight.params_digest()
  # The same workers with other plans: refused (other kinds reshard).
  other = HybridTrainer(_cnn(), _workers(sizes, kinds=kinds), optax.adam(1e-2))
  with pytest.raises(ValueError, match="other workers or plans"):
    ckpt.restore_latest(other)
  ckpt.close()


def test_bad_worker_sets_are_clear_errors():
  d = jax.devices()[0]
  with pytest.raises(ValueError, match="at least one worker"):
    HybridTrainer(_cnn(), [], optax.sgd(0.1))
  with pytest.raises(ValueError, match="distinct devices"):
    HybridTrainer(
      _cnn(), [Worker(d, "cpu", qs.PrecisionPlan(), 4)] * 2, optax.sgd(0.1)
    )
  with pytest.raises(qs.PlanError, match="'v100' does not support int8"):
    HybridTrainer(_cnn(), _workers([4], [INT8_FP16], ["v100"]), optax.sgd(0.1))


@pytest.mark.parametrize(
  "spec, message",
  [
    ("", "empty cluster spec"),
    ("v100", "malformed cluster group 'v100'"),
    ("v100:2,k80:1", "unknown device kind 'k80'"),
    ("v100:0", "count must be positive"),
    ("t4:-1", "count must be positive"),
    ("t4:two", "is not an integer"),
  ],
)
def test_cluster_spec_errors(spec, message):
  with pytest.raises(ValueError, match=message):
    cluster.parse_cluster(spec)


def test_cluster_spec_maps_onto_devices():
  spec = cluster.parse_cluster("v100:2, T4:2")
  assert spec.kinds == ("v100", "v100", "t4", "t4")
  assert str(spec) == "v100:2,t4:2"
  assert cluster.assign_devices(spec) == jax.devices()[:4]
  with pytest.raises(ValueError, match="needs 5 devices but only 4 exist"):
    cluster.assign_devices(cluster.parse_cluster("v100:3,t4:2"))


def test_dynamic_batch_sizes_follow_speed_and_keep_the_global_batch():
  assert cluster.dynamic_batch_sizes(256, [1.3, 1.3, 1.0, 1.0]) == [
    72,
    72,
    56,
    56,
  ]
  sizes = cluster.dynamic_batch_sizes(10, [100, 1, 1])
  assert sum(sizes) == 10 and min(sizes) == 1
  with pytest.raises(ValueError, match="positive"):
    cluster.dynamic_batch_sizes(8, [1, 0])
  with pytest.raises(ValueError, match="smaller than the 3 workers"):
    cluster.dynamic_batch_sizes(2, [1, 1, 1])
  assert cluster.parse_speeds("v100:1.3,t4:1") == {"v100": 1.3, "t4": 1.0}
  with pytest.raises(ValueError, match="must be positive"):
    cluster.parse_speeds("t4:-1")


def test_trainer_overhead_benchmark_reports_both_step_times():
  from experiments.benches import trainer_overhead

  r = trainer_overhead.trainer_overhead(
    "cnn", 4, num_workers=2, rounds=1, steps_per_round=2
  )
  assert r["hybrid_step_s"] > 0 and r["spmd_step_s"] > 0
  assert r["ratio"] == pytest.approx(r["hybrid_step_s"] / r["spmd_step_s"])


def test_trainer_overhead_benchmark_times_a_factory_model_from_its_example():
  # A user's factory has no input_spec: the example's shape stands for it.
  from experiments.benches import trainer_overhead

  r = trainer_overhead.trainer_overhead(
    "user_models:bare_linear",
    4,
    num_workers=2,
    rounds=1,
    steps_per_round=2,
    model_kwargs={"input_shape": (8,), "num_classes": 3},
    example_spec=jax.ShapeDtypeStruct((8,), np.float32),
  )
  assert r["model"] == "user_models:bare_linear"
  assert r["hybrid_step_s"] > 0 and r["spmd_step_s"] > 0


# ----------------------------------------------------------------------
# Synchronization schedules and averagers inside the trainer.
# ----------------------------------------------------------------------


def test_local_sgd_with_h1_and_plain_sgd_equals_data_parallel():
  # x0 + mean_i(-lr g_i) == x0 - lr mean_i(g_i): equal up to float32
  # rounding, and never bit-identical by construction (the sums differ).
  sizes = [8, 8, 8, 8]
  dp = HybridTrainer(_cnn(), _workers(sizes), optax.sgd(0.1))
  local = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.sgd(0.1),
    schedule=qs.parallel.schedules.ConstantLocalSGD(1),
  )
  for step in range(4):
    batches = _split(*_batch(32, seed=step), sizes)
    dp.train_step(batches)
    local.train_step(batches)
  np.testing.assert_allclose(
    np.asarray(local.params), np.asarray(dp.params), rtol=0, atol=2e-6
  )
  assert local.sync_rounds == dp.sync_rounds == 4
  assert local.comm_bytes == dp.comm_bytes


def test_local_sgd_rounds_keep_workers_apart_until_the_average():
  sizes = [8, 8, 8, 8]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    schedule=qs.parallel.schedules.ConstantLocalSGD(3, total_steps=7),
  )
  start = np.asarray(trainer.params)[0]
  local_rows = []
  for step in range(1, 8):
    trainer.train_step(_split(*_batch(32, seed=step), sizes))
    rows = np.asarray(trainer.params)
    identical = all(np.array_equal(r, rows[0]) for r in rows[1:])
    assert identical == (step in (3, 6, 7)) == trainer.in_sync, step
    if step == 2:
      local_rows = rows
  # Step 3 ends the round: the average of the workers' local progress from
  # the shared start, with the step-3 updates in it.
  assert trainer.sync_rounds == 3
  assert trainer.comm_bytes == pytest.approx(3 * 1.5 * 4 * trainer.num_params)
  assert not np.allclose(local_rows[0], start)
  # Adam's moments stay local: each worker saw its own gradients.
  mu = np.asarray(jax.tree.leaves(trainer.opt_state)[1])
  assert mu.shape[0] == 4 and not np.allclose(mu[0], mu[1])


def test_evaluation_in_the_middle_of_a_round_uses_the_mean_model():
  sizes = [8, 8, 8, 8]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    schedule=qs.parallel.schedules.ConstantLocalSGD(4),
  )
  for step in range(2):
    trainer.train_step(_split(*_batch(32, seed=step), sizes))
  assert not trainer.in_sync
  x, y = _batch(64, seed=9)
  got = trainer.evaluate((x, y))
  ref = _cnn()
  mean = np.asarray(trainer.params).mean(0)
  nnx.update(ref, trainer._unravel(mean))
  ref.eval()
  logits = ref(x)
  assert got["loss"] == pytest.approx(
    float(losses.cross_entropy(logits, y)), rel=1e-5
  )
  assert trainer.sync_rounds == 0 and not trainer.in_sync  # untouched


@pytest.mark.parametrize("compress", ["gqsgd", "gqsgd_exp", "qsgd", "fp16"])
def test_compressed_averages_keep_workers_identical_and_count_their_bytes(
  compress,
):
  sizes = [8, 8, 8, 8]
  averager = qs.parallel.averagers.make_averager(compress)
  trainer = HybridTrainer(
    _cnn(), _workers(sizes), optax.adam(1e-2), averager=averager
  )
  for step in range(3):
    trainer.train_step(_split(*_batch(32, seed=step), sizes))
  rows = np.asarray(trainer.params)
  for r in rows[1:]:
    np.testing.assert_array_equal(r, rows[0])
  assert trainer.comm_bytes == pytest.approx(
    3 * averager.wire_bytes(trainer.num_params, 4)
  )
  assert trainer.comm_bytes < 3 * 1.5 * 4 * trainer.num_params


def test_gqsgd_noise_changes_from_step_to_step():
  # The trainer keys every average afresh: the same change averaged at the
  # next count rounds differently (a fixed key would repeat the error).
  sizes = [8, 8, 8, 8]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    averager=qs.parallel.averagers.make_averager("gqsgd"),
  )
  trainer.train_step(_split(*_batch(32), sizes))
  assert np.asarray(trainer._counter).tolist() == [1, 1, 1, 1]
  rng = np.random.default_rng(0)
  delta = jax.device_put(
    rng.normal(size=trainer.params.shape).astype(np.float32), trainer.sharding
  )
  moved = jax.jit(lambda a, b: a + b)(trainer.params, delta)
  a, b = (
    np.asarray(
      trainer._average_params(
        moved, trainer.params, trainer._weights, counter, None
      )[0]
    )
    for counter in (trainer._counter, trainer._counter + 1)
  )
  assert not np.array_equal(a, b)
  exact = np.asarray(trainer.params)[0] + np.asarray(delta).mean(0)
  for got in (a, b):
    assert np.abs(got[0] - exact).max() < 4 * np.abs(np.asarray(delta)).max()


def test_qsr_checkpoint_mid_round_resumes_bit_identically(tmp_path):
  sizes = [8, 8, 8, 8]
  lr = optax.cosine_decay_schedule(1e-2, 12)

  def make():
    schedule = qs.parallel.schedules.QSR(
      lr, total_steps=12, alpha=2e-2, h_base=2
    )
    return HybridTrainer(
      _cnn(),
      _workers(sizes),
      optax.adam(lr),
      schedule=schedule,
      error_feedback=True,
      averager=qs.parallel.averagers.make_averager("gqsgd"),
    )

  batches = [_split(*_batch(32, seed=s), sizes) for s in range(12)]
  straight = make()
  for b in batches:
    straight.train_step(b)
  assert straight.in_sync  # QSR ends with an average
  first = make()
  for b in batches[:5]:
    first.train_step(b)
  assert not first.in_sync  # rounds of 2 and 2, then a longer one
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first)
  resumed = make()
  ckpt.restore_latest(resumed)
  assert not resumed.in_sync and resumed.step == 5
  for b in batches[5:]:
    resumed.train_step(b)
  assert resumed.params_digest() == straight.params_digest()
  assert resumed.sync_rounds == straight.sync_rounds
  assert resumed.sync_rounds == len(straight.schedule.sync_steps(12))
  ckpt.close()


# ----------------------------------------------------------------------
# BatchNorm statistics at evaluation, optimizer state at syncs.
# ----------------------------------------------------------------------


class _TinyBN(nnx.Module):
  """Linear -> BatchNorm -> Linear on 4 features."""

  def __init__(self, seed=0):
    rngs = nnx.Rngs(seed)
    self.fc1 = nnx.Linear(4, 3, rngs=rngs)
    self.bn = nnx.BatchNorm(3, momentum=0.9, rngs=rngs)
    self.fc2 = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.bn(self.fc1(x)))


def _bn_trainer(bn_stats="reestimate", local=True):
  schedule = qs.parallel.schedules.ConstantLocalSGD(4) if local else None
  return HybridTrainer(
    _TinyBN(),
    _workers([4, 6]),
    optax.sgd(0.1),
    schedule=schedule,
    bn_stats=bn_stats,
    sample_input=np.zeros((2, 4), np.float32),
  )


def _bn_batches(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      i: (
        rng.normal(size=(b, 4)).astype(np.float32) + i,
        rng.integers(0, 2, size=b).astype(np.int32),
      )
      for i, b in enumerate([4, 6])
    }
    for _ in range(steps)
  ]


def test_bn_reestimation_equals_a_hand_computation():
  trainer = _bn_trainer()
  for b in _bn_batches(2, seed=1):
    trainer.train_step(b)
  assert not trainer.in_sync  # the evaluated parameters are the mean
  rows = np.asarray(trainer.params)
  mean = (rows * trainer.grad_weights[:, None]).sum(0)
  p = trainer._unravel(mean)
  w, c = np.asarray(p["fc1"]["kernel"][...]), np.asarray(p["fc1"]["bias"][...])
  steps = _bn_batches(3, seed=2)
  # QSR: momentum 1 / (1 + idx) per worker, a cumulative mean of the
  # batches' statistics (NNX's biased variance), then the workers' mean.
  h = [[s[i][0] @ w + c for s in steps] for i in range(2)]
  want_mean = np.mean([np.mean([a.mean(0) for a in hi], 0) for hi in h], 0)
  want_var = np.mean([np.mean([a.var(0) for a in hi], 0) for hi in h], 0)
  params = trainer._mean_params(trainer.params, trainer._weights)
  got = evaluation.reestimate(
    trainer._bn_fn, params, trainer.rest, trainer._devices, steps
  )
  np.testing.assert_allclose(
    np.mean([np.asarray(got[i]["bn"]["mean"][...]) for i in got], 0),
    want_mean,
    rtol=1e-5,
    atol=1e-6,
  )
  np.testing.assert_allclose(
    np.mean([np.asarray(got[i]["bn"]["var"][...]) for i in got], 0),
    want_var,
    rtol=1e-5,
    atol=1e-6,
  )
  # evaluate() uses them: the reference model with those statistics.
  x, y = _bn_batches(1, seed=3)[0][1]
  ref = _TinyBN()
  nnx.update(ref, p)
  ref.bn.mean[...] = want_mean
  ref.bn.var[...] = want_var
  ref.eval()
  want = float(losses.cross_entropy(ref(x), y))
  assert trainer.evaluate((x, y), train_batches=steps)["loss"] == (
    pytest.approx(want, rel=1e-5)
  )
  averaged = _bn_trainer("average")
  for b in _bn_batches(2, seed=1):
    averaged.train_step(b)
  assert averaged.evaluate((x, y))["loss"] != pytest.approx(want, rel=1e-3)


def test_bn_reestimation_leaves_training_state_and_resume_bit_identical(
  tmp_path,
):
  batches = _bn_batches(8, seed=4)
  bn_data = _bn_batches(2, seed=5)
  x, y = bn_data[0][0]
  plain = _bn_trainer()
  for b in batches:
    plain.train_step(b)
  straight = _bn_trainer()
  evals = []
  for step, b in enumerate(batches, 1):
    straight.train_step(b)
    if step in (2, 4, 8):  # mid-round and after a sync
      before = [
        np.asarray(v)
        for v in jax.tree.leaves((straight.rest, straight.opt_state))
      ]
      evals.append(straight.evaluate((x, y), train_batches=bn_data))
      after = jax.tree.leaves((straight.rest, straight.opt_state))
      for a, b2 in zip(before, after):
        np.testing.assert_array_equal(a, np.asarray(b2))
  assert straight.params_digest() == plain.params_digest()
  first = _bn_trainer()
  for b in batches[:2]:
    first.train_step(b)
  first.evaluate((x, y), train_batches=bn_data)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first)
  resumed = _bn_trainer()
  ckpt.restore_latest(resumed)
  for b in batches[2:]:
    resumed.train_step(b)
  assert resumed.params_digest() == straight.params_digest()
  assert resumed.evaluate((x, y), train_batches=bn_data) == evals[-1]
  ckpt.close()


def test_models_without_batchnorm_evaluate_the_same_either_way():
  sizes = [8, 8]
  batches = [_split(*_batch(16, seed=s), sizes) for s in range(2)]
  results = []
  for bn_stats in ("reestimate", "average"):
    trainer = HybridTrainer(
      _cnn(), _workers(sizes), optax.adam(1e-2), bn_stats=bn_stats
    )
    assert trainer._bn_fn is None
    for b in batches:
      trainer.train_step(b)
    results.append(trainer.evaluate(_batch(32, seed=9)))  # no batches
  assert results[0] == results[1]


def test_bn_settings_errors():
  with pytest.raises(ValueError, match="unknown bn_stats 'mean'"):
    _bn_trainer("mean")
  with pytest.raises(ValueError, match="needs training batches"):
    _bn_trainer().evaluate(_bn_batches(1)[0][0])
  with pytest.raises(ValueError, match=r"no batch for local workers \[1\]"):
    _bn_trainer().evaluate(
      _bn_batches(1)[0][0], train_batches=[{0: _bn_batches(1)[0][0]}]
    )
  with pytest.raises(
    ValueError, match="no field.s. mux to average; its fields: count, mu, nu"
  ):
    HybridTrainer(
      _cnn(), _workers([4, 4]), optax.adam(1e-2), opt_fields_to_average=["mux"]
    )


def test_averaging_mu_at_a_sync_makes_every_worker_hold_the_mean():
  sizes = [8, 8, 8, 8]

  def make(fields):
    return HybridTrainer(
      _cnn(),
      _workers(sizes),
      optax.adam(1e-2),
      schedule=qs.parallel.schedules.ConstantLocalSGD(2),
      opt_fields_to_average=fields,
    )

  with_mu, without = make(["mu"]), make([])
  for step in range(2):  # step 2 ends the first round
    b = _split(*_batch(32, seed=step), sizes)
    with_mu.train_step(b)
    without.train_step(b)

  def rows(tree):  # (workers, all entries)
    return np.concatenate(
      [np.asarray(x).reshape(4, -1) for x in jax.tree.leaves(tree)], 1
    )

  mu, local_mu = rows(with_mu.opt_state[0].mu), rows(without.opt_state[0].mu)
  assert not np.allclose(local_mu[0], local_mu[1])
  for row in mu:
    np.testing.assert_array_equal(row, mu[0])
  np.testing.assert_allclose(mu[0], local_mu.mean(0), rtol=1e-5, atol=1e-9)
  np.testing.assert_array_equal(
    rows(with_mu.opt_state[0].nu), rows(without.opt_state[0].nu)
  )
  assert with_mu.comm_bytes - without.comm_bytes == pytest.approx(
    qs.parallel.averagers.MeanAverager().wire_bytes(with_mu.num_params, 4)
  )


def test_config_checks_bn_and_optimizer_fields():
  from experiments import config_lib
  from experiments.configs import default

  config = default.get_config()
  config.opt_fields_to_average = ("mu,nu",)  # as the command line gives it
  assert config_lib.opt_fields(config) == ("mu", "nu")
  config_lib.validate_config(config)
  for field, value, message in [
    ("bn_batches", 0, "config.bn_batches must be an integer >= 1"),
    ("bn_stats", "mean", "config.bn_stats must be one of average, reestimate"),
    ("opt_fields_to_average", ("trace",), "no field.s. trace"),
  ]:
    bad = default.get_config()
    bad[field] = value
    with pytest.raises(ValueError, match=message):
      config_lib.validate_config(bad)


@pytest.mark.parametrize(
  "sync,compiled",
  [
    ("dp", {"update"}),
    ("local", {"local_update", "average"}),
    ("postlocal", {"update", "local_update", "average"}),
  ],
)
def test_compile_leaves_the_steps_only_the_gradient_functions(
  sync, compiled, caplog
):
  sizes = [4, 4]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.sgd(0.1),
    schedule=qs.make_schedule(sync, total_steps=4, h_base=2, switch_step=1),
  )
  compiling = lambda: {
    m.split("jit(")[1].split(")")[0]
    for m in caplog.messages
    if m.startswith("Compiling")
  }
  with jax.log_compiles(True):
    caplog.set_level(logging.WARNING)
    trainer.compile(4)
    assert compiled <= compiling()
    caplog.clear()
    for step in range(4):
      trainer.train_step(_split(*_batch(sum(sizes), seed=step), sizes))
  assert compiling() <= {"grad_fn"}, caplog.messages
