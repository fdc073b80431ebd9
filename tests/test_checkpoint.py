"""Tests for checkpoint integrity: checksums at save, verified at restore."""

import asyncio
import errno
import gc
import json
import logging
import os
import re
import shutil
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_trainer import _batch
from test_trainer import _cnn
from test_trainer import _split
from test_trainer import _workers

import qsync_jax as qs
from qsync_jax.train import integrity
from qsync_jax.train import saved_state
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer

SIZES = [4, 4]


def _trainer():
  return HybridTrainer(_cnn(), _workers(SIZES), optax.adam(1e-2))


def _train(trainer, state, steps):
  for _ in range(steps):
    state, _ = trainer.train_step(
      state, _split(*_batch(8, seed=state.step), SIZES)
    )
  return state


def _arrays(trainer, state):
  return [
    np.asarray(a)
    for a in jax.tree.leaves(saved_state.state_tree(trainer, state))
  ]


def _assert_same(trainer, state, arrays):
  got = _arrays(trainer, state)
  assert len(got) == len(arrays)
  for a, b in zip(got, arrays):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Checkpoints at steps 1 and 2, and the state each one holds."""
  directory = str(tmp_path_factory.mktemp("template") / "ckpt")
  trainer, ckpt, states = _trainer(), Checkpointer(directory), {}
  state = trainer.init()
  for step in (1, 2):
    state = _train(trainer, state, 1)
    ckpt.save(trainer, state)
    states[step] = _arrays(trainer, state)
  ckpt.close()
  return directory, states


@pytest.fixture
def ckpt_dir(saved, tmp_path):
  directory = str(tmp_path / "ckpt")
  shutil.copytree(saved[0], directory)
  return directory


def _data_files(step_dir):
  # Orbax's array data: the ocdbt data files under state/.
  return [
    os.path.join(root, f)
    for root, _, files in os.walk(os.path.join(step_dir, "state"))
    if os.path.basename(root) == "d" and "ocdbt" in root
    for f in files
  ]


def _largest(step_dir):
  files = _data_files(step_dir)
  assert files, f"no ocdbt data files under {step_dir}"
  return max(files, key=os.path.getsize)


def _flip(step_dir):
  path = _largest(step_dir)
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    f.seek(0)
    f.write(data)


def _older_arrays(step_dir):
  # Well-formed arrays with other values (step 1's) under step 2's metadata:
  # only the checksum can tell.
  state = os.path.join(step_dir, "state")
  shutil.rmtree(state)
  shutil.copytree(os.path.join(os.path.dirname(step_dir), "1", "state"), state)


def _truncate(step_dir):
  path = _largest(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)


def _empty(step_dir):
  for name in os.listdir(step_dir):
    path = os.path.join(step_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _no_meta(step_dir):
  shutil.rmtree(os.path.join(step_dir, "meta"))


def _edit_meta(step_dir):
  path = os.path.join(step_dir, "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  meta["comm_bytes"] += 1.0
  with open(path, "w") as f:
    json.dump(meta, f)


def test_intact_checkpoint_restores_bit_identically(ckpt_dir, saved, capsys):
  trainer = _trainer()
  restored = Checkpointer(ckpt_dir).restore_latest(trainer, trainer.init())
  assert restored.meta["step"] == 2 and restored.state.step == 2
  _assert_same(trainer, restored.state, saved[1][2])
  assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
  "corrupt, why",
  [
    # Flipped bytes land in raw values (caught by the checksum) or in an
    # encoded block (unreadable), depending on the file's layout.
    (_flip, r"checksum mismatch in \['|arrays are unreadable"),
    (_older_arrays, r"checksum mismatch in \['"),
    (_truncate, r"arrays are unreadable"),
    (_empty, r"metadata is unreadable|no metadata"),
    (_no_meta, r"metadata is unreadable|no metadata"),
    (_edit_meta, r"checksum mismatch in its metadata"),
  ],
)
def test_corrupt_newest_falls_back_to_the_older_one(
  ckpt_dir, saved, capsys, corrupt, why
):
  corrupt(os.path.join(ckpt_dir, "2"))
  trainer = _trainer()
  ckpt = Checkpointer(ckpt_dir)
  restored = ckpt.restore_latest(trainer, trainer.init())
  assert restored.meta["step"] == 1 and restored.state.step == 1
  _assert_same(trainer, restored.state, saved[1][1])
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("warning: ")
  assert "step 2: " in err[0] and "restored step 1" in err[0]
  assert re.search(why, err[0]), err[0]
  # The bad one is set aside, so the resumed run can save step 2 again.
  assert os.path.isdir(os.path.join(ckpt_dir, "corrupt-2"))
  state = _train(trainer, restored.state, 1)
  ckpt.save(trainer, state)
  again = _trainer()
  restored = Checkpointer(ckpt_dir).restore_latest(again, again.init())
  assert restored.meta["step"] == 2
  _assert_same(again, restored.state, _arrays(trainer, state))


def test_flipped_array_bytes_are_a_checksum_mismatch(saved):
  # Whatever orbax's files do with flipped bytes, a changed value is caught.
  trainer = _trainer()
  state = Checkpointer(saved[0]).restore_latest(trainer, trainer.init()).state
  tree = saved_state.state_tree(trainer, state)
  meta = {integrity.INTEGRITY: {"arrays": {"0": integrity.array_digests(tree)}}}
  assert integrity.array_problem(meta, tree) is None
  tree["params"] = jax.tree.map(
    lambda a: a.at[(0,) * a.ndim].add(1.0), tree["params"]
  )
  assert "checksum mismatch in ['params']" in integrity.array_problem(
    meta, tree
  )


def test_all_corrupt_is_a_clear_error(ckpt_dir):
  _flip(os.path.join(ckpt_dir, "2"))
  _empty(os.path.join(ckpt_dir, "1"))
  trainer = _trainer()
  state = trainer.init()
  before = _arrays(trainer, state)
  with pytest.raises(
    ValueError,
    match=r"no intact checkpoint in .*ckpt: "
    r"step 2: .*; step 1: ",
  ):
    Checkpointer(ckpt_dir).restore_latest(trainer, state)
  assert state.step == 0
  _assert_same(trainer, state, before)  # nothing corrupt was loaded


def test_checkpoint_without_checksums_restores_with_a_warning(tmp_path, capsys):
  trainer = _trainer()
  state = _train(trainer, trainer.init(), 1)
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  # The format before checksums: the same items, no integrity record.
  ckpt._manager.save(
    1,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(saved_state.state_tree(trainer, state)),
      meta=ocp.args.JsonSave(saved_state.state_meta(trainer, state)),
    ),
  )
  ckpt._manager.wait_until_finished()
  resumed = _trainer()
  restored = ckpt.restore_latest(resumed, resumed.init())
  assert restored.meta["step"] == 1
  _assert_same(resumed, restored.state, _arrays(trainer, state))
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "cannot be verified" in err[0]
  assert "step 1" in err[0]


def test_an_optimizer_declared_otherwise_is_refused_and_not_set_aside(
  ckpt_dir, saved
):
  # The saving run's Adam kept a pytree state; one declared elementwise
  # keeps a flat one. Refused before any array is read, the checkpoint is
  # not taken for a corrupt one.
  resumed = HybridTrainer(
    _cnn(), _workers(SIZES), qs.elementwise(optax.adam(1e-2))
  )
  with pytest.raises(
    ValueError,
    match="holds a pytree optimizer state and "
    "this run's optimizer keeps a flat one",
  ):
    Checkpointer(ckpt_dir).restore_latest(resumed, resumed.init())
  assert sorted(os.listdir(ckpt_dir)) == sorted(os.listdir(saved[0]))
  trainer = _trainer()
  restored = Checkpointer(ckpt_dir).restore_latest(trainer, trainer.init())
  assert restored.meta["step"] == 2


def test_a_checkpointer_leaves_the_unraisable_hook_alone(tmp_path, monkeypatch):
  # Only a failing save filters what orbax's abandoned writes print; an
  # unrelated unraisable error, even one that reads like theirs, still
  # reaches the hook that was there before.
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  hook = sys.unraisablehook
  asyncio_filters = list(logging.getLogger("asyncio").filters)
  trainer = _trainer()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  assert sys.unraisablehook is hook
  ckpt.save(trainer, _train(trainer, trainer.init(), 1))
  assert ckpt.latest_step() == 1
  ckpt.close()
  assert sys.unraisablehook is hook
  assert logging.getLogger("asyncio").filters == asyncio_filters

  class _ClosedLoop:
    def __del__(self):
      raise RuntimeError("Event loop is closed")

  cycle = _ClosedLoop()
  cycle.self = cycle  # collected by gc.collect(), not at the del
  del cycle
  gc.collect()
  ours = [u for u in seen if u.object is _ClosedLoop.__del__]
  assert [(type(u.exc_value), str(u.exc_value)) for u in ours] == [
    (RuntimeError, "Event loop is closed")
  ]


def test_a_failed_save_drops_the_closed_loop_callbacks_that_come_first(
  tmp_path, monkeypatch
):
  # A full disk: orbax closes its event loop and tensorstore's callbacks of
  # the other writes fail on it, most of them before the save raises.
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  closed = asyncio.new_event_loop()
  closed.close()

  class _WriteCallback:  # run as tensorstore runs it: errors unraisable
    def __del__(self):
      closed.call_soon_threadsafe(print)

  def full_disk(*args, **kwargs):
    _WriteCallback()
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  trainer = _trainer()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  monkeypatch.setattr(ckpt._manager, "save", full_disk)
  with pytest.raises(OSError) as raised:
    ckpt.save(trainer, trainer.init())
  assert raised.value.errno == errno.ENOSPC
  assert seen == []
  _WriteCallback()  # the late ones, after the failure, too
  assert seen == []

  class _Other:
    def __del__(self):
      raise RuntimeError("Event loop is closed")

  _Other()  # not asyncio's: passed on
  assert [str(u.exc_value) for u in seen] == ["Event loop is closed"]
