"""Checkpoints of a HybridTrainer with orbax.

A checkpoint holds the trainer's arrays (parameters, optimizer state, loss
scale, BatchNorm statistics: global arrays over the workers) and its host state
as JSON (step, sync counters, schedule state, the plans). Orbax writes a step
to a temporary directory and renames it when complete, so a run killed with
SIGKILL mid-save leaves the previous checkpoint intact; resuming restores the
latest complete one and continues bit-identically on CPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from absl import logging
import jax
import orbax.checkpoint as ocp

from qsync_jax.train.trainer import HybridTrainer


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
  # Orbax logs a dozen INFO lines per save; keep the job's log readable.
  level = logging.get_verbosity()  # absl: larger means more verbose
  logging.set_verbosity(min(level, logging.WARNING))
  try:
    yield
  finally:
    logging.set_verbosity(level)


class Checkpointer:
  """Saves and restores a :class:`HybridTrainer` under ``directory``.

  Args:
    directory: where checkpoints live (one subdirectory per step).
    max_to_keep: how many recent checkpoints to keep.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    with _quiet():
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               create=True))

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, trainer: HybridTrainer, extra_meta: dict | None = None
           ) -> None:
    """Saves the trainer's state at its current step (blocks until done)."""
    meta = {**trainer.state_meta(), **(extra_meta or {})}
    with _quiet():
      self._manager.save(trainer.step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(trainer.state_tree()),
          meta=ocp.args.JsonSave(meta)))
      self._manager.wait_until_finished()

  def restore_latest(self, trainer: HybridTrainer) -> dict[str, Any] | None:
    """Restores the newest checkpoint into ``trainer``.

    Returns:
      The checkpoint's JSON metadata, or None when there is no checkpoint.

    Raises:
      ValueError: the checkpoint does not match the trainer's workers.
    """
    step = self.latest_step()
    if step is None:
      return None
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        trainer.state_tree())
    with _quiet():
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
    trainer.load_state(restored["state"], restored["meta"])
    return restored["meta"]

  def close(self) -> None:
    with _quiet():
      self._manager.close()
