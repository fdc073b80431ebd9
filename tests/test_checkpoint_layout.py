"""A checkpoint written by qsync_jax 0.1.0 restores into today's trainer.

``tests/data/checkpoint_0_1_0`` holds step 2 of the two-worker CNN of
``test_checkpoint`` (Adam, learning rate 1e-2), written by qsync_jax 0.1.0
before its training state became one pytree (the trainer kept the state as
attributes then), on the suite's four fake CPU devices. The digest is that
of the arrays the old trainer held at the save (each array's dtype, shape
and bytes, in checkpoint order), so a change of the on-disk layout, of the
state's order or of what a restore fills in fails here rather than in a
user's resumed run.
"""

import hashlib
import shutil

import jax
import numpy as np
from test_checkpoint import _arrays
from test_checkpoint import _train
from test_checkpoint import _trainer

from qsync_jax.train.checkpoint import Checkpointer

CHECKPOINT = "checkpoint_0_1_0"
ARRAYS = 23
DIGEST = "07e352d205aca670b69939b92c76d20d0d5eddfa75f7270dc2b30483fca36ea0"


def _digest(arrays):
  h = hashlib.sha256()
  for a in arrays:
    h.update(str(a.dtype).encode())
    h.update(str(a.shape).encode())
    h.update(a.tobytes())
  return h.hexdigest()


def test_a_checkpoint_of_release_0_1_0_restores_and_trains_on(
  tmp_path, request
):
  source = request.path.parent / "data" / CHECKPOINT
  directory = tmp_path / "ckpt"
  shutil.copytree(source, directory)
  trainer = _trainer()
  restored = Checkpointer(str(directory)).restore_latest(
    trainer, trainer.init()
  )
  assert restored is not None
  assert int(restored.state.step) == 2
  arrays = _arrays(trainer, restored.state)
  assert len(arrays) == ARRAYS
  assert _digest(arrays) == DIGEST
  state = _train(trainer, restored.state, 1)
  assert int(state.step) == 3
  leaves = jax.tree.leaves(state.params)
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
