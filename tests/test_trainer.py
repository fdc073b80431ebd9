"""Tests for HybridTrainer, cluster specs, dynamic batching and loss scaling,
BatchNorm statistics at evaluation and optimizer state at syncs."""

import inspect
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
from qsync_jax.train import saved_state
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


def _steps(trainer, batches, state=None):
  """``state`` (default: the trainer's initial state) after one step on each
  of ``batches``."""
  state = trainer.init() if state is None else state
  for b in batches:
    state, _ = trainer.train_step(state, b)
  return state


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
  state = trainer.init()
  for step in range(3):
    x, y = _batch(32, seed=step)
    state, _ = trainer.train_step(state, _split(x, y, sizes))
    opt.update(ref, _grad(ref, x, y))
  want = _flat(nnx.state(ref, nnx.Param))
  for i in range(4):
    np.testing.assert_allclose(
      _flat(trainer.worker_params(state, i)), want, rtol=1e-5, atol=1e-5
    )


def test_dynamic_batch_weighted_gradient_equals_the_full_batch_gradient():
  sizes = [3, 5, 8, 16]
  model = _cnn()
  before = _flat(nnx.state(model, nnx.Param))
  x, y = _batch(sum(sizes))
  full_grad = _flat(_grad(model, x, y))
  trainer = HybridTrainer(model, _workers(sizes), optax.sgd(1.0))
  np.testing.assert_allclose(trainer.grad_weights, np.array(sizes) / 32)
  state = _steps(trainer, [_split(x, y, sizes)])
  step = before - _flat(trainer.worker_params(state, 0))
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
  state = _steps(
    trainer, [_split(*_batch(32, seed=step), sizes) for step in range(3)]
  )
  rows = [np.asarray(r) for r in _rows(state.params).values()]
  for r in rows[1:]:
    np.testing.assert_array_equal(r, rows[0])
  assert state.sync_rounds == 3
  assert state.comm_bytes == pytest.approx(3 * 1.5 * 4 * trainer.num_params)


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
  state = _steps(trainer, [_split(*_batch(32), sizes)])
  before = {d: np.asarray(r) for d, r in _rows(state.params).items()}
  opt_before = [np.asarray(a) for a in jax.tree.leaves(state.opt_state)]
  scale = state.current_loss_scale
  assert state.skipped_steps == 0
  x, y = _batch(32, seed=1)
  x[20, 3, 3, 0] = np.inf  # one example on worker 2 (an INT8/FP16 worker)
  state, _ = trainer.train_step(state, _split(x, y, sizes))
  assert state.skipped_steps == 1  # it grew: the step was skipped
  assert state.current_loss_scale == scale / 2
  for d, r in _rows(state.params).items():
    np.testing.assert_array_equal(np.asarray(r), before[d])
  for a, b in zip(jax.tree.leaves(state.opt_state), opt_before):
    np.testing.assert_array_equal(np.asarray(a), b)
  state, _ = trainer.train_step(state, _split(*_batch(32, seed=2), sizes))
  assert state.skipped_steps == 1  # it did not grow: the step was taken
  assert not np.array_equal(
    np.asarray(next(iter(_rows(state.params).values()))),
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
    sync=qs.SyncSettings(schedule=schedule, opt_fields_to_average=("mu", "nu")),
  )
  pytree, flat = make(optax.adam(1e-2)), make(qs.elementwise(optax.adam(1e-2)))
  batches = [_split(*_batch(16, seed=step), sizes) for step in range(4)]
  pytree_state, flat_state = _steps(pytree, batches), _steps(flat, batches)
  for i in range(2):
    # Float32 rounding (XLA fuses the two layouts differently), which
    # Adam's m / sqrt(v) amplifies on near-zero gradients.
    np.testing.assert_allclose(
      _flat(flat.worker_params(flat_state, i)),
      _flat(pytree.worker_params(pytree_state, i)),
      rtol=1e-5,
      atol=1e-5,
    )
  float_shapes = lambda t: {
    a.shape for a in jax.tree.leaves(t) if np.issubdtype(a.dtype, np.floating)
  }
  assert float_shapes(flat_state.opt_state) == {(2, flat.num_params)}
  assert (2, flat.num_params) not in float_shapes(pytree_state.opt_state)


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
    sync=qs.SyncSettings(
      schedule=qs.make_schedule(sync, total_steps=4, h_base=2)
    ),
  )
  _steps(
    trainer,
    [_split(*_batch(sum(sizes), seed=step), sizes) for step in range(4)],
  )
  # The workers share one gradient function, compiled once per device.
  (grad_fn,) = set(trainer._grad_fns.values())
  assert grad_fn._cache_size() == num_workers
  assert trainer.programs.update._cache_size() == int(sync == "dp")
  assert trainer.programs.local_update._cache_size() == int(sync == "local")


def test_loss_scaling_is_off_without_fp16_layers():
  plans = [qs.PrecisionPlan([(r"conv\d", "int8")])] * 2
  trainer = HybridTrainer(_cnn(), _workers([4, 4], plans), optax.sgd(0.1))
  assert not trainer.loss_scaling and trainer.init().current_loss_scale == 1.0


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
  straight_state = _steps(straight, batches)
  first = make()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first, _steps(first, batches[:3]))
  resumed = make()
  restored = ckpt.restore_latest(resumed, resumed.init())
  assert restored.meta["step"] == 3 and restored.state.step == 3
  state = _steps(resumed, batches[3:], restored.state)
  assert resumed.params_digest(state) == straight.params_digest(straight_state)
  # The same workers with other plans: refused (other kinds reshard).
  other = HybridTrainer(_cnn(), _workers(sizes, kinds=kinds), optax.adam(1e-2))
  with pytest.raises(ValueError, match="other workers or plans"):
    ckpt.restore_latest(other, other.init())
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
    sync=qs.SyncSettings(schedule=qs.parallel.schedules.ConstantLocalSGD(1)),
  )
  batches = [_split(*_batch(32, seed=step), sizes) for step in range(4)]
  dp_state, local_state = _steps(dp, batches), _steps(local, batches)
  np.testing.assert_allclose(
    np.asarray(local_state.params),
    np.asarray(dp_state.params),
    rtol=0,
    atol=2e-6,
  )
  assert local_state.sync_rounds == dp_state.sync_rounds == 4
  assert local_state.comm_bytes == dp_state.comm_bytes


def test_local_sgd_rounds_keep_workers_apart_until_the_average():
  sizes = [8, 8, 8, 8]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(
      schedule=qs.parallel.schedules.ConstantLocalSGD(3, total_steps=7)
    ),
  )
  state = trainer.init()
  start = np.asarray(state.params)[0]
  local_rows = []
  for step in range(1, 8):
    state, _ = trainer.train_step(state, _split(*_batch(32, seed=step), sizes))
    rows = np.asarray(state.params)
    identical = all(np.array_equal(r, rows[0]) for r in rows[1:])
    assert identical == (step in (3, 6, 7)) == state.in_sync, step
    if step == 2:
      local_rows = rows
  # Step 3 ends the round: the average of the workers' local progress from
  # the shared start, with the step-3 updates in it.
  assert state.sync_rounds == 3
  assert state.comm_bytes == pytest.approx(3 * 1.5 * 4 * trainer.num_params)
  assert not np.allclose(local_rows[0], start)
  # Adam's moments stay local: each worker saw its own gradients.
  mu = np.asarray(jax.tree.leaves(state.opt_state)[1])
  assert mu.shape[0] == 4 and not np.allclose(mu[0], mu[1])


def test_evaluation_in_the_middle_of_a_round_uses_the_mean_model():
  sizes = [8, 8, 8, 8]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(schedule=qs.parallel.schedules.ConstantLocalSGD(4)),
  )
  state = _steps(
    trainer, [_split(*_batch(32, seed=step), sizes) for step in range(2)]
  )
  assert not state.in_sync
  x, y = _batch(64, seed=9)
  got = trainer.evaluate(state, (x, y))
  ref = _cnn()
  mean = np.asarray(state.params).mean(0)
  nnx.update(ref, trainer.unravel(mean))
  ref.eval()
  logits = ref(x)
  assert got["loss"] == pytest.approx(
    float(losses.cross_entropy(logits, y)), rel=1e-5
  )
  assert state.sync_rounds == 0 and not state.in_sync  # untouched


@pytest.mark.parametrize("compress", ["gqsgd", "gqsgd_exp", "qsgd", "fp16"])
def test_compressed_averages_keep_workers_identical_and_count_their_bytes(
  compress,
):
  sizes = [8, 8, 8, 8]
  averager = qs.parallel.averagers.make_averager(compress)
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(averager=averager),
  )
  state = _steps(
    trainer, [_split(*_batch(32, seed=step), sizes) for step in range(3)]
  )
  rows = np.asarray(state.params)
  for r in rows[1:]:
    np.testing.assert_array_equal(r, rows[0])
  assert state.comm_bytes == pytest.approx(
    3 * averager.wire_bytes(trainer.num_params, 4)
  )
  assert state.comm_bytes < 3 * 1.5 * 4 * trainer.num_params


def test_gqsgd_noise_changes_from_step_to_step():
  # The trainer keys every average afresh: the same change averaged at the
  # next count rounds differently (a fixed key would repeat the error).
  sizes = [8, 8, 8, 8]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(averager=qs.parallel.averagers.make_averager("gqsgd")),
  )
  state = _steps(trainer, [_split(*_batch(32), sizes)])
  assert np.asarray(state.counter).tolist() == [1, 1, 1, 1]
  rng = np.random.default_rng(0)
  delta = jax.device_put(
    rng.normal(size=state.params.shape).astype(np.float32), trainer.sharding
  )
  moved = jax.jit(lambda a, b: a + b)(state.params, delta)
  a, b = (
    np.asarray(
      trainer.programs.average_params(
        moved, state.params, trainer._weights, counter, None
      )[0]
    )
    for counter in (state.counter, state.counter + 1)
  )
  assert not np.array_equal(a, b)
  exact = np.asarray(state.params)[0] + np.asarray(delta).mean(0)
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
      sync=qs.SyncSettings(
        schedule=schedule,
        error_feedback=True,
        averager=qs.parallel.averagers.make_averager("gqsgd"),
      ),
    )

  batches = [_split(*_batch(32, seed=s), sizes) for s in range(12)]
  straight = make()
  straight_state = _steps(straight, batches)
  assert straight_state.in_sync  # QSR ends with an average
  first = make()
  first_state = _steps(first, batches[:5])
  assert not first_state.in_sync  # rounds of 2 and 2, then a longer one
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first, first_state)
  resumed = make()
  state = ckpt.restore_latest(resumed, resumed.init()).state
  assert not state.in_sync and state.step == 5
  state = _steps(resumed, batches[5:], state)
  assert resumed.params_digest(state) == straight.params_digest(straight_state)
  assert state.sync_rounds == straight_state.sync_rounds
  assert state.sync_rounds == len(straight.sync.schedule.sync_steps(12))
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
  sync = qs.SyncSettings(
    schedule=qs.parallel.schedules.ConstantLocalSGD(4)
    if local
    else qs.parallel.schedules.EveryStep()
  )
  return HybridTrainer(
    _TinyBN(),
    _workers([4, 6]),
    optax.sgd(0.1),
    sync=sync,
    bn_stats=bn_stats,
    sample=qs.task.input_probe(np.zeros((2, 4), np.float32)),
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
  state = _steps(trainer, _bn_batches(2, seed=1))
  assert not state.in_sync  # the evaluated parameters are the mean
  rows = np.asarray(state.params)
  mean = (rows * trainer.grad_weights[:, None]).sum(0)
  p = trainer.unravel(mean)
  w, c = np.asarray(p["fc1"]["kernel"][...]), np.asarray(p["fc1"]["bias"][...])
  steps = _bn_batches(3, seed=2)
  # QSR: momentum 1 / (1 + idx) per worker, a cumulative mean of the
  # batches' statistics (NNX's biased variance), then the workers' mean.
  h = [[s[i][0] @ w + c for s in steps] for i in range(2)]
  want_mean = np.mean([np.mean([a.mean(0) for a in hi], 0) for hi in h], 0)
  want_var = np.mean([np.mean([a.var(0) for a in hi], 0) for hi in h], 0)
  params = trainer.programs.mean_params(state.params, trainer._weights)
  got = evaluation.reestimate(
    trainer._bn_fn, params, state.rest, trainer.local_devices, steps
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
  assert trainer.evaluate(state, (x, y), train_batches=steps)["loss"] == (
    pytest.approx(want, rel=1e-5)
  )
  averaged = _bn_trainer("average")
  averaged_state = _steps(averaged, _bn_batches(2, seed=1))
  assert averaged.evaluate(averaged_state, (x, y))["loss"] != pytest.approx(
    want, rel=1e-3
  )


def test_bn_reestimation_leaves_training_state_and_resume_bit_identical(
  tmp_path,
):
  batches = _bn_batches(8, seed=4)
  bn_data = _bn_batches(2, seed=5)
  x, y = bn_data[0][0]
  plain = _bn_trainer()
  plain_state = _steps(plain, batches)
  straight = _bn_trainer()
  state = straight.init()
  evals = []
  for step, b in enumerate(batches, 1):
    state, _ = straight.train_step(state, b)
    if step in (2, 4, 8):  # mid-round and after a sync
      before = [
        np.asarray(v) for v in jax.tree.leaves((state.rest, state.opt_state))
      ]
      evals.append(straight.evaluate(state, (x, y), train_batches=bn_data))
      after = jax.tree.leaves((state.rest, state.opt_state))
      for a, b2 in zip(before, after):
        np.testing.assert_array_equal(a, np.asarray(b2))
  assert straight.params_digest(state) == plain.params_digest(plain_state)
  first = _bn_trainer()
  first_state = _steps(first, batches[:2])
  first.evaluate(first_state, (x, y), train_batches=bn_data)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first, first_state)
  resumed = _bn_trainer()
  resumed_state = ckpt.restore_latest(resumed, resumed.init()).state
  resumed_state = _steps(resumed, batches[2:], resumed_state)
  assert resumed.params_digest(resumed_state) == straight.params_digest(state)
  assert (
    resumed.evaluate(resumed_state, (x, y), train_batches=bn_data) == evals[-1]
  )
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
    state = _steps(trainer, batches)
    results.append(trainer.evaluate(state, _batch(32, seed=9)))  # no batches
  assert results[0] == results[1]


def test_bn_settings_errors():
  with pytest.raises(ValueError, match="unknown bn_stats 'mean'"):
    _bn_trainer("mean")
  trainer = _bn_trainer()
  with pytest.raises(ValueError, match="needs training batches"):
    trainer.evaluate(trainer.init(), _bn_batches(1)[0][0])
  with pytest.raises(ValueError, match=r"no batch for local workers \[1\]"):
    trainer.evaluate(
      trainer.init(),
      _bn_batches(1)[0][0],
      train_batches=[{0: _bn_batches(1)[0][0]}],
    )
  with pytest.raises(
    ValueError, match="no field.s. mux to average; its fields: count, mu, nu"
  ):
    HybridTrainer(
      _cnn(),
      _workers([4, 4]),
      optax.adam(1e-2),
      sync=qs.SyncSettings(
        schedule=qs.parallel.schedules.ConstantLocalSGD(2),
        opt_fields_to_average=["mux"],
      ),
    )


def test_averaging_mu_at_a_sync_makes_every_worker_hold_the_mean():
  sizes = [8, 8, 8, 8]

  def make(fields):
    return HybridTrainer(
      _cnn(),
      _workers(sizes),
      optax.adam(1e-2),
      sync=qs.SyncSettings(
        schedule=qs.parallel.schedules.ConstantLocalSGD(2),
        opt_fields_to_average=fields,
      ),
    )

  with_mu, without = make(["mu"]), make([])
  # Step 2 ends the first round.
  batches = [_split(*_batch(32, seed=step), sizes) for step in range(2)]
  with_mu_state = _steps(with_mu, batches)
  without_state = _steps(without, batches)

  def rows(tree):  # (workers, all entries)
    return np.concatenate(
      [np.asarray(x).reshape(4, -1) for x in jax.tree.leaves(tree)], 1
    )

  mu = rows(with_mu_state.opt_state[0].mu)
  local_mu = rows(without_state.opt_state[0].mu)
  assert not np.allclose(local_mu[0], local_mu[1])
  for row in mu:
    np.testing.assert_array_equal(row, mu[0])
  np.testing.assert_allclose(mu[0], local_mu.mean(0), rtol=1e-5, atol=1e-9)
  np.testing.assert_array_equal(
    rows(with_mu_state.opt_state[0].nu), rows(without_state.opt_state[0].nu)
  )
  assert with_mu_state.comm_bytes - without_state.comm_bytes == pytest.approx(
    qs.parallel.averagers.MeanAverager().wire_bytes(with_mu.num_params, 4)
  )


def test_config_checks_bn_and_optimizer_fields():
  from experiments import config_lib
  from experiments.configs import default

  config = default.get_config()
  config.opt_fields_to_average = ("mu,nu",)  # as the command line gives it
  # Averaged at a local schedule's parameter averages: dp makes none.
  with pytest.raises(ValueError, match="which the schedule 'dp'"):
    config_lib.parse(config)
  config.sync = "local"
  assert config_lib.opt_fields(config_lib.parse(config)) == ("mu", "nu")
  for field, value, message in [
    ("bn_batches", 0, "config.bn_batches must be an integer >= 1"),
    ("bn_stats", "mean", "config.bn_stats must be one of average, reestimate"),
    ("opt_fields_to_average", ("trace",), "no field.s. trace"),
  ]:
    bad = default.get_config()
    bad[field] = value
    with pytest.raises(ValueError, match=message):
      config_lib.parse(bad)


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
    sync=qs.SyncSettings(
      schedule=qs.make_schedule(sync, total_steps=4, h_base=2, switch_step=1)
    ),
  )
  compiling = lambda: {
    m.split("jit(")[1].split(")")[0]
    for m in caplog.messages
    if m.startswith("Compiling")
  }
  with jax.log_compiles(True):
    caplog.set_level(logging.WARNING)
    state = trainer.init()
    trainer.compile(state, 4)
    assert compiled <= compiling()
    caplog.clear()
    for step in range(4):
      state, _ = trainer.train_step(
        state, _split(*_batch(sum(sizes), seed=step), sizes)
      )
  assert compiling() <= {"grad_fn"}, caplog.messages


# ----------------------------------------------------------------------
# The state as a value: a pure step, a pytree, the settings it refuses.
# ----------------------------------------------------------------------


def _host_state(state):
  """Copies of ``state``'s arrays on the host, and its host fields."""
  arrays = [np.array(a) for a in jax.tree.leaves(state)]
  fields = (
    state.step,
    state.sync_rounds,
    state.comm_bytes,
    state.in_sync,
    state.data,
  )
  return arrays, fields


def _assert_same_host_state(got, want):
  (got_arrays, got_fields), (want_arrays, want_fields) = got, want
  assert got_fields == want_fields
  assert len(got_arrays) == len(want_arrays)
  for a, b in zip(got_arrays, want_arrays):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("local", [False, True], ids=["dp", "local"])
def test_train_step_is_pure(local):
  # Every field a step can change is in play: BatchNorm statistics, the
  # error-feedback residual and the averaging counter; under local SGD also
  # the anchor apart from the parameters and the outer optimizer's state.
  schedule = (
    qs.parallel.schedules.ConstantLocalSGD(2)
    if local
    else qs.parallel.schedules.EveryStep()
  )
  trainer = HybridTrainer(
    _TinyBN(),
    _workers([4, 6]),
    optax.adam(1e-2),
    sync=qs.SyncSettings(
      schedule=schedule,
      averager=qs.make_averager("gqsgd"),
      error_feedback=True,
      outer_tx=optax.sgd(0.7, momentum=0.9) if local else None,
    ),
    sample=qs.task.input_probe(np.zeros((2, 4), np.float32)),
  )
  attributes = dict(vars(trainer))
  state = trainer.init().replace(data={"position": 3})
  # Step 1 is local and step 2 averages under local SGD; both average
  # gradients under data parallelism.
  for batches in _bn_batches(2, seed=6):
    before = _host_state(state)
    first, first_metrics = trainer.train_step(state, batches)
    second, second_metrics = trainer.train_step(state, batches)
    # The input state is left as it was (not donated, not mutated) ...
    _assert_same_host_state(_host_state(state), before)
    # ... and stepping it again gives the same state and metrics, bit for
    # bit.
    _assert_same_host_state(_host_state(second), _host_state(first))
    assert jax.tree.structure(second) == jax.tree.structure(first)
    assert [
      np.asarray(m).tobytes() for m in jax.tree.leaves(second_metrics)
    ] == [np.asarray(m).tobytes() for m in jax.tree.leaves(first_metrics)]
    assert jax.tree.structure(second_metrics) == jax.tree.structure(
      first_metrics
    )
    assert first.step == state.step + 1 and first.data == {"position": 3}
    state = first
  assert state.in_sync and state.sync_rounds == (1 if local else 2)
  if local:
    assert state.outer_state is not None
  # No attribute of the trainer was set, added or removed by the steps.
  assert vars(trainer).keys() == attributes.keys()
  for name, value in vars(trainer).items():
    assert value is attributes[name], name


def test_train_state_is_a_pytree_with_static_host_fields():
  sizes = [4, 4]
  trainer = HybridTrainer(
    _cnn(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(
      averager=qs.make_averager("gqsgd"), error_feedback=True
    ),
  )
  state = _steps(trainer, [_split(*_batch(8), sizes)])
  state = state.replace(data={"position": 8})
  assert isinstance(state, qs.TrainState)
  same = jax.tree.map(lambda x: x, state)
  assert isinstance(same, qs.TrainState)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state), strict=True):
    assert a is b
  assert (same.step, same.sync_rounds, same.comm_bytes) == (
    1,
    1,
    state.comm_bytes,
  )
  assert same.in_sync and same.data == {"position": 8}
  assert same.comm_bytes > 0
  # The host fields are static: no leaf is one of them, every leaf is an
  # array of an array field, and they live in the tree's structure.
  leaves = jax.tree.leaves(state)
  array_fields = (
    state.params,
    state.opt_state,
    state.loss_scale,
    state.rest,
    state.anchor,
    state.counter,
    state.residual,
    state.averager_state,
    state.outer_state,
  )
  assert len(leaves) == len(jax.tree.leaves(array_fields))
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)
  for field, value in [
    ("step", 2),
    ("sync_rounds", 5),
    ("comm_bytes", 1.0),
    ("in_sync", False),
    ("data", None),
  ]:
    other = state.replace(**{field: value})
    assert jax.tree.structure(other) != jax.tree.structure(state), field
    assert getattr(jax.tree.map(lambda x: x, other), field) == value
  leaves, treedef = jax.tree.flatten(state)
  assert jax.tree.unflatten(treedef, leaves).step == 1


@pytest.mark.parametrize(
  "settings, names",
  [
    (dict(outer_tx=optax.sgd(0.7)), ("outer_tx", "schedule 'dp'")),
    (
      dict(
        schedule=qs.make_schedule("dp", total_steps=4), outer_tx=optax.sgd(0.7)
      ),
      ("outer_tx", "schedule 'dp'"),
    ),
    (dict(opt_fields_to_average=("mu",)), ("opt_fields_to_average", "'dp'")),
    (dict(error_feedback=True), ("error_feedback", "averager 'mean'")),
    (
      dict(error_feedback=True, averager=qs.make_averager("mean")),
      ("error_feedback", "averager 'mean'"),
    ),
  ],
  ids=["outer_tx", "outer_tx_dp", "opt_fields", "feedback", "feedback_mean"],
)
def test_sync_settings_refuse_a_setting_the_others_would_ignore(
  settings, names
):
  with pytest.raises(ValueError, match="^SyncSettings: ") as error:
    qs.SyncSettings(**settings)
  for name in names:
    assert name in str(error.value), (name, str(error.value))


def test_sync_settings_take_each_setting_with_a_partner_that_uses_it():
  local = qs.make_schedule("local", total_steps=8, h_base=2)
  settings = qs.SyncSettings(
    schedule=local,
    averager=qs.make_averager("gqsgd"),
    error_feedback=True,
    outer_tx=optax.sgd(0.7),
    opt_fields_to_average=["mu"],
    grad_weights=[0.25, 0.75],
  )
  assert settings.opt_fields_to_average == ("mu",)
  assert settings.grad_weights == (0.25, 0.75)
  with pytest.raises(ValueError, match="must be a sequence of field names"):
    qs.SyncSettings(schedule=local, opt_fields_to_average="mu")


def test_hybrid_trainer_refuses_sync_that_is_not_sync_settings():
  with pytest.raises(TypeError, match="sync must be a qsync_jax.SyncSettings"):
    HybridTrainer(
      _cnn(),
      _workers([4, 4]),
      optax.sgd(0.1),
      sync={"schedule": qs.make_schedule("dp", total_steps=4)},
    )


def test_hybrid_trainer_has_at_most_nine_parameters():
  parameters = inspect.signature(HybridTrainer).parameters
  assert len(parameters) <= 9, list(parameters)


@pytest.mark.parametrize(
  "sample",
  [
    np.zeros((2, 8, 8, 1), np.float32),  # inputs alone, not a batch
    (np.zeros((2, 5), np.float32), np.zeros(2, np.int32)),  # wrong shape
    {"inputs": 1},  # not arrays
  ],
  ids=["inputs_alone", "wrong_shape", "not_arrays"],
)
def test_a_sample_the_objective_cannot_run_says_what_sample_must_be(sample):
  with pytest.raises(ValueError) as error:
    HybridTrainer(_cnn(), _workers([4, 4]), optax.sgd(0.1), sample=sample)
  text = str(error.value)
  assert text.startswith(
    "sample must be one worker's batch, as train_step takes it"
  ), text
  assert "qsync_jax.task.Probe" in text and "input_probe" in text
  assert "could not run SmallCNN on it" in text
  # The batch and the probe of its inputs are both taken.
  x, y = _batch(2)
  HybridTrainer(_cnn(), _workers([4, 4]), optax.sgd(0.1), sample=(x, y))
  HybridTrainer(
    _cnn(),
    _workers([4, 4]),
    optax.sgd(0.1),
    sample=qs.task.input_probe(x),
  )


def test_loss_scaling_must_be_auto_or_a_bool():
  with pytest.raises(
    ValueError, match="loss_scaling must be 'auto', True or False, got 'yes'"
  ):
    HybridTrainer(_cnn(), _workers([4]), optax.sgd(0.1), loss_scaling="yes")
  trainer = HybridTrainer(
    _cnn(), _workers([4]), optax.sgd(0.1), loss_scaling=True
  )
  assert trainer.loss_scaling and trainer.init().current_loss_scale > 1


#: The entries and metadata keys of a checkpoint written while the trainer
#: held its state (``Checkpointer.save(trainer)``), which restore unchanged.
OLD_TREE = {"params", "opt_state", "loss_scale", "rest", "anchor", "counter"}
OLD_OPTIONAL = {"residual", "averager_state", "outer_state"}
OLD_META = {
  "step",
  "sync_rounds",
  "comm_bytes",
  "schedule",
  "in_sync",
  "sync",
  "plans",
  "kinds",
  "batch_sizes",
  "optimizer_state",
  "param_shapes",
}


def test_the_checkpoint_layout_is_the_one_before_the_state_was_a_pytree():
  sizes = [4, 4]
  plain = HybridTrainer(_cnn(), _workers(sizes), optax.adam(1e-2))
  state = _steps(plain, [_split(*_batch(8), sizes)])
  tree = saved_state.state_tree(plain, state)
  assert set(tree) == OLD_TREE
  assert tree["params"] is state.params and tree["anchor"] is state.anchor
  assert tree["counter"] is state.counter
  assert tree["loss_scale"] is state.loss_scale
  assert tree["opt_state"] is state.opt_state
  full = HybridTrainer(
    _TinyBN(),
    _workers(sizes),
    optax.adam(1e-2),
    sync=qs.SyncSettings(
      schedule=qs.parallel.schedules.ConstantLocalSGD(2),
      averager=qs.make_averager("powersgd", rank=1, warm_start=True),
      error_feedback=True,
      outer_tx=optax.sgd(0.7),
    ),
    sample=qs.task.input_probe(np.zeros((2, 4), np.float32)),
  )
  full_state = full.init()
  tree = saved_state.state_tree(full, full_state)
  assert set(tree) == OLD_TREE | OLD_OPTIONAL
  # The non-parameter state is stacked over the workers, as it was.
  for leaf in jax.tree.leaves(tree["rest"]):
    assert leaf.shape[0] == 2 and leaf.sharding == full.sharding
  # The metadata: the old keys, and the data position the training binary
  # used to add beside them.
  meta = saved_state.state_meta(full, full_state.replace(data={"p": 1}))
  assert set(meta) == OLD_META | {"data"}
  assert meta["data"] == {"p": 1}
  assert (meta["step"], meta["sync_rounds"], meta["in_sync"]) == (0, 0, True)
  assert meta["sync"] == "local" and meta["kinds"] == ["cpu", "cpu"]
  assert meta["batch_sizes"] == sizes
  assert set(saved_state.state_meta(plain, state)) == OLD_META | {"data"}
