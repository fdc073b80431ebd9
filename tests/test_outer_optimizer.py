"""Tests for the DiLoCo-style outer optimizer of local SGD (SyncSettings'
``outer_tx``, qsync_jax.train.programs.average_params_program) and its
config (experiments.config_lib)."""

import jax
import numpy as np
import optax
import pytest
from test_trainer import _batch
from test_trainer import _cnn
from test_trainer import _split
from test_trainer import _steps
from test_trainer import _workers

from experiments import config_lib
from experiments.configs import default as default_config
import qsync_jax as qs
from qsync_jax.train import saved_state
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer

SIZES = [8, 8, 8, 8]
H = 3


def _trainer(outer_tx=None, **sync):
  schedule = qs.parallel.schedules.ConstantLocalSGD(H)
  return HybridTrainer(
    _cnn(),
    _workers(SIZES),
    optax.sgd(0.05),
    sync=qs.SyncSettings(schedule=schedule, outer_tx=outer_tx, **sync),
  )


def _batches(steps):
  return [_split(*_batch(32, seed=s), SIZES) for s in range(steps)]


def _rows_identical(stacked):
  rows = np.asarray(stacked)
  return all(np.array_equal(r, rows[0]) for r in rows[1:])


def _nesterov():
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize("compress", ["none", "gqsgd"])
def test_outer_sgd_with_rate_one_is_plain_averaging_bit_for_bit(compress):
  def make(outer_tx):
    return _trainer(
      outer_tx,
      averager=qs.make_averager(compress),
      error_feedback=compress != "none",
    )

  plain, outer = make(None), make(optax.sgd(1.0))
  batches = _batches(2 * H)
  plain_run, outer_run = _steps(plain, batches), _steps(outer, batches)
  assert outer_run.sync_rounds == plain_run.sync_rounds == 2
  assert (
    np.asarray(outer_run.params).tobytes()
    == np.asarray(plain_run.params).tobytes()
  )
  assert outer_run.comm_bytes == plain_run.comm_bytes


def test_nesterov_momentum_is_the_hand_computed_outer_step():
  plain, outer = _trainer(), _trainer(_nesterov())
  plain_run, outer_run = plain.init(), outer.init()
  start = np.asarray(plain_run.params)[0]
  batches = _batches(2 * H)
  plain_run = _steps(plain, batches[:H], plain_run)
  outer_run = _steps(outer, batches[:H], outer_run)
  # First sync, zero momentum: the outer gradient is g = anchor - mean,
  # the trace becomes g and Nesterov steps by lr * (g + 0.9 g) = 1.33 g.
  g = start - np.asarray(plain_run.params)[0]
  np.testing.assert_allclose(
    np.asarray(outer_run.params)[0], start - 1.33 * g, rtol=0, atol=1e-6
  )

  def trace_rows(run):
    return np.concatenate(
      [np.asarray(l).reshape(4, -1) for l in jax.tree.leaves(run.outer_state)],
      axis=1,
    )

  trace = trace_rows(outer_run)
  assert _rows_identical(trace) and _rows_identical(outer_run.params)
  assert np.abs(trace[0]).max() > 0
  # The state advances: the second sync adds 0.9 * the old trace.
  before = trace
  outer_run = _steps(outer, batches[H:], outer_run)
  plain_run = _steps(plain, batches[H:], plain_run)
  after = trace_rows(outer_run)
  assert not np.allclose(after, before) and _rows_identical(after)
  assert not np.allclose(
    np.asarray(outer_run.params), np.asarray(plain_run.params)
  )
  assert outer_run.in_sync and outer_run.sync_rounds == 2


def test_checkpoint_mid_round_resumes_outer_state_bit_identically(tmp_path):
  def make():
    return _trainer(
      _nesterov(), averager=qs.make_averager("gqsgd"), error_feedback=True
    )

  batches = _batches(3 * H)
  straight = make()
  straight_run = _steps(straight, batches)
  first = make()
  first_run = _steps(first, batches[: H + 1])  # one sync, then mid-round
  assert not first_run.in_sync
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(first, first_run)
  assert "outer_state" in saved_state.state_tree(first, first_run)
  resumed = make()
  state = ckpt.restore_latest(resumed, resumed.init()).state
  for a, b in zip(
    jax.tree.leaves(state.outer_state), jax.tree.leaves(first_run.outer_state)
  ):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  state = _steps(resumed, batches[H + 1 :], state)
  assert resumed.params_digest(state) == straight.params_digest(straight_run)
  for a, b in zip(
    jax.tree.leaves(saved_state.state_tree(resumed, state)),
    jax.tree.leaves(saved_state.state_tree(straight, straight_run)),
  ):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  ckpt.close()


def test_outer_optimizer_needs_a_local_schedule():
  with pytest.raises(ValueError, match="never makes; use a local schedule"):
    HybridTrainer(
      _cnn(),
      _workers(SIZES),
      optax.sgd(0.05),
      sync=qs.SyncSettings(outer_tx=_nesterov()),
    )


def test_config_builds_the_outer_optimizer():
  config = default_config.get_config()
  assert config.outer_optimizer == "none"
  assert config_lib.make_outer_optimizer(config_lib.parse(config)) is None
  config.outer_optimizer = "diloco"
  config.sync = "local"
  tx = config_lib.make_outer_optimizer(config_lib.parse(config))
  # optax.sgd(0.7, momentum=0.9, nesterov=True) on a toy gradient.
  state = tx.init(np.zeros(2, np.float32))
  g = np.array([1.0, -2.0], np.float32)
  updates, state = tx.update(g, state)
  np.testing.assert_allclose(updates, -0.7 * 1.9 * g, rtol=1e-6)


@pytest.mark.parametrize(
  "changes, message",
  [
    (
      dict(outer_optimizer="adam", sync="local"),
      "outer_optimizer must be one of none, diloco",
    ),
    (
      dict(outer_optimizer="diloco", sync="dp"),
      "outer_optimizer=diloco needs a local sync",
    ),
    (
      dict(outer_optimizer="diloco", sync="local", outer_lr=0.0),
      r"config.outer_lr must be a finite number > 0",
    ),
    (
      dict(outer_optimizer="diloco", sync="local", outer_momentum=1.0),
      r"config.outer_momentum must be a finite number in \[0, 1\)",
    ),
  ],
)
def test_config_errors(changes, message):
  config = default_config.get_config()
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    config_lib.parse(config)
