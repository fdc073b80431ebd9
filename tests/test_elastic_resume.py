"""Tests for checkpoints resumed onto another set of workers: every new
worker starts from the saved workers' mean (qsync_jax/train/resharding.py).

The means below are computed here as the rule states it: the saved rows in
float64, ``np.mean`` over the workers axis, cast back to the leaf's dtype.
"""

import logging
import os
import re
import shutil

from absl import logging as absl_logging
from flax import nnx
import jax
import numpy as np
import optax
import pytest
from test_checkpoint import _edit_meta
from test_checkpoint import _older_arrays

import qsync_jax as qs
from qsync_jax.train import saved_state
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

FP16 = qs.PrecisionPlan([("fc2", "fp16")])


class _Tiny(nnx.Module):
  """Linear -> ReLU -> Linear, 4 features to 3 classes."""

  def __init__(self, hidden=8):
    rngs = nnx.Rngs(0)
    self.fc1 = nnx.Linear(4, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, 3, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.fc1(x)))


class _TinyBN(nnx.Module):
  """Linear -> BatchNorm -> Dropout (its own RNG stream) -> Linear."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.fc1 = nnx.Linear(4, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
    self.fc2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.fc2(self.drop(self.bn(self.fc1(x))))


def _workers(sizes, kinds=None, plans=None):
  kinds = kinds or ["cpu"] * len(sizes)
  plans = plans or [qs.PrecisionPlan()] * len(sizes)
  return [
    Worker(d, k, p, b) for d, k, p, b in zip(jax.devices(), kinds, plans, sizes)
  ]


def _trainer(sizes, model=None, tx=None, kinds=None, plans=None, **sync):
  """A trainer of ``sizes`` workers; ``sync``: its SyncSettings' fields."""
  return HybridTrainer(
    model or _Tiny(),
    _workers(sizes, kinds, plans),
    tx or optax.adam(1e-2),
    sample=qs.task.input_probe(np.zeros((2, 4), np.float32)),
    sync=qs.SyncSettings(**sync),
  )


def _local(h=4):
  return qs.make_schedule("local", total_steps=16, h_base=h)


def _train(trainer, state, steps):
  """``state`` after ``steps`` steps of ``trainer``."""
  for _ in range(steps):
    rng = np.random.default_rng(state.step)
    state, _ = trainer.train_step(
      state,
      {
        i: (
          rng.normal(size=(w.batch_size, 4)).astype(np.float32) + i,
          rng.integers(0, 3, size=w.batch_size).astype(np.int32),
        )
        for i, w in enumerate(trainer.workers)
      },
    )
  return state


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _mean(rows):
  rows = np.asarray(rows)
  return np.mean(rows.astype(np.float64), axis=0).astype(rows.dtype)


def _each_row_is(stacked, row):
  stacked = np.asarray(stacked)
  row = np.asarray(row)
  return all(
    r.dtype == row.dtype and r.tobytes() == row.tobytes() for r in stacked
  )


def _save(trainer, state, directory):
  ckpt = Checkpointer(str(directory))
  ckpt.save(trainer, state)
  ckpt.close()
  return str(directory)


def _restore(directory, trainer, state=None):
  """The newest checkpoint under ``directory`` restored into ``trainer``
  (onto ``state``, default its initial one): ``(state, meta)``."""
  state = trainer.init() if state is None else state
  return Checkpointer(str(directory)).restore_latest(trainer, state)


@pytest.fixture(scope="module")
def mid_round(tmp_path_factory):
  """Four local-SGD Adam workers saved at steps 1 and 2, mid-round (their
  parameters apart): the directory, ``{step: host arrays}`` and the
  state at step 2."""
  directory = tmp_path_factory.mktemp("mid_round") / "ckpt"
  trainer = _trainer([4, 4, 4, 4], schedule=_local())
  ckpt, states, state = Checkpointer(str(directory)), {}, trainer.init()
  for step in (1, 2):
    state = _train(trainer, state, 1)
    ckpt.save(trainer, state)
    states[step] = _host(saved_state.state_tree(trainer, state))
  ckpt.close()
  assert not state.in_sync
  return str(directory), states, state


@pytest.fixture
def mid_round_dir(mid_round, tmp_path):
  directory = str(tmp_path / "ckpt")
  shutil.copytree(mid_round[0], directory)
  return directory


def test_shrink_and_grow_keep_the_data_parallel_state(tmp_path):
  # Data parallelism keeps every row equal: their mean is each of them,
  # bit for bit, on however many workers resume.
  four = _trainer([2, 2, 2, 2])
  four_state = _train(four, four.init(), 2)
  saved = _host(saved_state.state_tree(four, four_state))
  two = _trainer([4, 4])
  two_state, meta = _restore(_save(four, four_state, tmp_path / "a"), two)
  assert meta["kinds"] == ["cpu"] * 4 and meta["batch_sizes"] == [2] * 4
  assert (
    two_state.step,
    two_state.sync_rounds,
    two_state.comm_bytes,
    two_state.in_sync,
  ) == (2, 2, four_state.comm_bytes, True)
  got = _host(saved_state.state_tree(two, two_state))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved)):
    assert a.shape == (2, *b.shape[1:]) and _each_row_is(a, b[0])
  two_state = _train(two, two_state, 1)
  three = _trainer([3, 3, 2])
  three_state = _restore(_save(two, two_state, tmp_path / "b"), three).state
  assert three_state.step == 3 and three.num_workers == 3
  assert _each_row_is(three_state.params, np.asarray(two_state.params)[0])
  three_state = _train(three, three_state, 1)
  assert three_state.step == 4 and three_state.sync_rounds == 4


def test_local_sgd_mid_round_every_worker_starts_from_the_mean(
  mid_round_dir, mid_round, caplog
):
  rows = mid_round[1][2]["params"]
  assert not (rows == rows[:1]).all()  # the workers' parameters are apart
  # A gradient-averaging schedule: its parameters are averaged, so the
  # mid-round refusal of a same-workers resume does not apply.
  resumed = _trainer([8, 8])
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    with caplog.at_level(logging.INFO):
      state, meta = _restore(mid_round_dir, resumed)
  finally:
    absl_logging.set_verbosity(verbosity)
  assert meta["step"] == 2 and not meta["in_sync"]
  assert state.in_sync and state.anchor is state.params
  assert _each_row_is(state.params, _mean(rows))
  lines = [
    r.getMessage() for r in caplog.records if "from 4 workers" in r.message
  ]
  assert len(lines) == 1 and "\n" not in lines[0]
  assert re.search(
    r"resumed checkpoint step 2 from 4 workers \(cpu, cpu, cpu, cpu\) onto 2 "
    r"workers \(cpu, cpu\): every worker starts from the saved workers' "
    r"float64 mean of loss_scale, opt_state, params; integer leaves of "
    r"counter, loss_scale, opt_state carried from saved worker 0",
    lines[0],
  ), lines[0]
  state = _train(resumed, state, 1)
  assert state.step == 3 and state.sync_rounds == mid_round[2].sync_rounds + 1


def test_adam_state_is_averaged_and_its_count_carried(mid_round_dir, mid_round):
  saved = mid_round[1][2]["opt_state"][0]
  mu = np.asarray(saved.mu["fc1"]["kernel"][...])
  assert not (mu == mu[:1]).all()  # each worker's own moments
  resumed = _trainer([4, 4, 4], schedule=_local())
  got = _restore(mid_round_dir, resumed).state.opt_state[0]
  for field in ("mu", "nu"):
    for a, b in zip(
      jax.tree.leaves(getattr(got, field)),
      jax.tree.leaves(getattr(saved, field)),
    ):
      assert a.shape[0] == 3 and _each_row_is(a, _mean(b))
  assert np.asarray(got.count).tolist() == [2, 2, 2]


def test_kinds_change_and_the_loss_scale_follows_the_new_plans(tmp_path):
  kinds = ["v100", "v100", "t4", "t4"]
  plans = [qs.PrecisionPlan()] * 2 + [FP16] * 2
  saving = _trainer([2] * 4, kinds=kinds, plans=plans, schedule=_local(2))
  saving_state = _train(saving, saving.init(), 3)
  assert saving.loss_scaling and not saving_state.in_sync
  saved = _host(saved_state.state_tree(saving, saving_state))
  directory = _save(saving, saving_state, tmp_path / "ckpt")
  # The same kinds with other plans is still refused.
  with pytest.raises(ValueError, match="other workers or plans"):
    _restore(directory, _trainer([2] * 4, kinds=kinds, schedule=_local(2)))
  mixed = _trainer(
    [4, 4], kinds=["v100", "t4"], plans=[qs.PrecisionPlan(), FP16]
  )
  mixed_state, meta = _restore(directory, mixed)
  assert meta["kinds"] == kinds and mixed.loss_scaling
  assert _each_row_is(mixed_state.params, _mean(saved["params"]))
  scale = saved["loss_scale"]
  assert _each_row_is(mixed_state.loss_scale.scale, _mean(scale.scale))
  assert _each_row_is(mixed_state.loss_scale.good_steps, scale.good_steps[0])
  assert mixed_state.current_loss_scale == 2.0**15
  # FP32 plans only: this run does not scale, so neither does its scale.
  fp32 = _trainer([4, 4], kinds=["v100", "v100"])
  fp32_state = _restore(directory, fp32).state
  assert not fp32.loss_scaling and fp32_state.current_loss_scale == 1.0
  assert _each_row_is(fp32_state.loss_scale.good_steps, np.int32(-1))
  assert _each_row_is(fp32_state.params, _mean(saved["params"]))
  _train(mixed, mixed_state, 1)
  _train(fp32, fp32_state, 1)


def test_powersgd_shares_q_and_the_residuals_are_averaged(tmp_path):
  def make(n):
    return _trainer(
      [4] * n,
      tx=optax.sgd(0.05, momentum=0.9),
      averager=qs.make_averager("powersgd", rank=2, warm_start=True),
      error_feedback=True,
    )

  four = make(4)
  four_state = _train(four, four.init(), 2)
  saved = _host(saved_state.state_tree(four, four_state))
  q, residual = saved["averager_state"], saved["residual"]
  assert q.any() and (q == q[:1]).all()
  assert not (residual == residual[:1]).all()  # each worker's own error
  resumed = make(2)
  state = _restore(_save(four, four_state, tmp_path / "ckpt"), resumed).state
  assert _each_row_is(state.averager_state, q[0])  # exact: equal rows
  assert _each_row_is(state.residual, _mean(residual))
  _train(resumed, state, 1)


def test_diloco_outer_state_comes_back_exactly(tmp_path):
  def make(n):
    return _trainer(
      [4] * n,
      tx=optax.sgd(0.05),
      schedule=_local(2),
      outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True),
    )

  four = make(4)
  four_state = _train(four, four.init(), 3)  # one outer step, then mid-round
  saved = _host(saved_state.state_tree(four, four_state))
  trace = jax.tree.leaves(saved["outer_state"])
  assert any(t.any() for t in trace)
  resumed = make(3)
  state = _restore(_save(four, four_state, tmp_path / "ckpt"), resumed).state
  for a, b in zip(jax.tree.leaves(state.outer_state), trace):
    assert (b == b[:1]).all() and _each_row_is(a, b[0])
  assert _each_row_is(state.params, _mean(saved["params"]))
  state = _train(resumed, state, 1)  # step 4 ends the round: the outer step
  assert state.in_sync and state.sync_rounds == 2
  after = jax.tree.leaves(_host(state.outer_state))
  assert any((a[0] != b[0]).any() for a, b in zip(after, trace))


def test_batchnorm_statistics_are_averaged_and_dropout_keys_stay_own(tmp_path):
  def make(n):
    return _trainer([4] * n, model=_TinyBN(), schedule=_local())

  four = make(4)
  four_state = _train(four, four.init(), 2)
  saved = _host(saved_state.state_tree(four, four_state))["rest"]
  mean = saved["bn"]["mean"][...]
  assert not (mean == mean[:1]).all()  # each worker's own batches
  resumed = make(3)
  initial = resumed.init()
  fresh = _host(resumed.stacked_rest(initial.rest))
  directory = _save(four, four_state, tmp_path / "ckpt")
  state = _restore(directory, resumed, initial).state
  got = _host(resumed.stacked_rest(state.rest))
  for name in ("mean", "var"):
    assert _each_row_is(got["bn"][name][...], _mean(saved["bn"][name][...]))
  count = got["drop"]["rngs"]["count"][...]
  assert _each_row_is(count, saved["drop"]["rngs"]["count"][...][0])
  assert count[0] == 2  # one mask per step so far
  # A worker's key is its index's fold of the layer's stream, as built: the
  # key the saved worker of that index had.
  key = got["drop"]["rngs"]["key"][...]
  assert key.tobytes() == fresh["drop"]["rngs"]["key"][...].tobytes()
  assert key.tobytes() == saved["drop"]["rngs"]["key"][...][:3].tobytes()
  assert not (key == key[:1]).all()
  _train(resumed, state, 1)


def test_resumes_onto_the_same_new_workers_are_bit_identical(
  mid_round_dir,
):
  digests = []
  for _ in range(2):
    resumed = _trainer([4, 6, 2], schedule=_local(2))
    state = _train(resumed, _restore(mid_round_dir, resumed).state, 3)
    digests.append(
      [resumed.params_digest(state)]
      + [
        np.asarray(a).tobytes()
        for a in jax.tree.leaves(saved_state.state_tree(resumed, state))
      ]
    )
  assert digests[0] == digests[1]


@pytest.mark.parametrize(
  "other, message",
  [
    (
      {"model": _Tiny(hidden=16)},
      r"checkpoint step 2 in .*ckpt is of another model: parameter "
      r"fc1\.bias is \(8,\) float32 in the checkpoint and \(16,\) float32 "
      r"in this run; resume with the model it was saved with, or start a "
      r"new run directory",
    ),
    (
      {"tx": optax.sgd(0.1)},
      r"checkpoint step 2 in .*ckpt is of another optimizer: "
      r"opt_state\.0\.count is \(4,\) int32 in the checkpoint and absent in "
      r"this run; resume with the optimizer it was saved with, or start a new "
      r"run directory",
    ),
  ],
  ids=["model", "optimizer"],
)
def test_another_model_on_other_workers_is_refused_in_one_line(
  mid_round_dir, other, message
):
  before = sorted(os.listdir(mid_round_dir))
  with pytest.raises(ValueError) as error:
    _restore(mid_round_dir, _trainer([8, 8], **other))
  text = str(error.value)
  assert "\n" not in text and re.fullmatch(message, text), text
  assert sorted(os.listdir(mid_round_dir)) == before  # not set aside


def _flip_every_file(step_dir):
  # A tiny model's arrays lie inline in OCDBT's b-tree nodes (state/d/), not
  # only in the processes' data files: damage every one of them.
  for path in [
    os.path.join(root, f)
    for root, _, files in os.walk(os.path.join(step_dir, "state"))
    if os.path.basename(root) == "d"
    for f in files
  ]:
    with open(path, "r+b") as f:
      data = bytearray(f.read())
      mid = len(data) // 2
      data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
      f.seek(0)
      f.write(data)


@pytest.mark.parametrize(
  "corrupt, why",
  [
    # Well-formed arrays of step 1 under step 2's metadata: only the
    # checksums of the rows tell.
    (_older_arrays, r"checksum mismatch in \['"),
    (_flip_every_file, r"checksum mismatch in \['|unreadable"),
  ],
  ids=["other_values", "flipped_bytes"],
)
def test_a_corrupt_array_file_is_detected_on_a_reshard(
  mid_round_dir, mid_round, capsys, corrupt, why
):
  corrupt(os.path.join(mid_round_dir, "2"))
  ckpt = Checkpointer(mid_round_dir)
  resumed = _trainer([8, 8])
  state, meta = ckpt.restore_latest(resumed, resumed.init())
  assert meta["step"] == 1 and state.step == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "step 2: " in err[0], err
  assert re.search(why, err[0]), err[0]
  assert os.path.isdir(os.path.join(mid_round_dir, "corrupt-2"))
  assert _each_row_is(state.params, _mean(mid_round[1][1]["params"]))


def test_latest_meta_reads_the_newest_intact_metadata_alone(
  mid_round_dir, tmp_path
):
  assert Checkpointer(str(tmp_path / "none")).latest_meta() is None
  meta = Checkpointer(mid_round_dir).latest_meta()
  assert meta["step"] == 2 and meta["batch_sizes"] == [4, 4, 4, 4]
  assert meta["kinds"] == ["cpu"] * 4
  _edit_meta(os.path.join(mid_round_dir, "2"))
  before = sorted(os.listdir(mid_round_dir))
  assert Checkpointer(mid_round_dir).latest_meta()["step"] == 1
  assert sorted(os.listdir(mid_round_dir)) == before  # nothing moved
