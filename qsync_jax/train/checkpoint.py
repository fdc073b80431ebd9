"""Checkpoints of a HybridTrainer with orbax.

This module owns what a checkpoint holds (:func:`state_tree`,
:func:`state_meta`, and :func:`load_state` to put it back) and how it is
written and read (:class:`Checkpointer`). A checkpoint holds the trainer's
arrays (parameters, optimizer state, loss scale, BatchNorm statistics: global
arrays over the workers) and its host state as JSON (step, sync counters,
schedule state, the plans). Orbax writes a step to a temporary directory and
renames it when complete, so a run killed with SIGKILL mid-save leaves the
previous checkpoint intact; resuming restores the latest complete one and
continues bit-identically on CPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from absl import logging
import jax
import orbax.checkpoint as ocp

from qsync_jax.train import layout
from qsync_jax.train import loss_scale as ls
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


def state_tree(trainer: HybridTrainer) -> dict[str, Any]:
  """The arrays a checkpoint holds (global arrays over the workers)."""
  tree = {"params": trainer.params, "opt_state": trainer.opt_state,
          "loss_scale": trainer.loss_scale, "rest": trainer._stacked_rest(),
          "anchor": trainer._anchor, "counter": trainer._counter}
  if trainer.residual is not None:
    tree["residual"] = trainer.residual
  return tree


def state_meta(trainer: HybridTrainer) -> dict[str, Any]:
  """The host-side state a checkpoint holds (JSON)."""
  return {"step": trainer.step, "sync_rounds": trainer.sync_rounds,
          "comm_bytes": trainer.comm_bytes,
          "schedule": trainer.schedule.state_dict(),
          "in_sync": trainer.in_sync,
          "plans": [w.plan.to_dict() for w in trainer.workers],
          "kinds": [w.kind for w in trainer.workers]}


def load_state(trainer: HybridTrainer, tree: dict[str, Any],
               meta: dict[str, Any]) -> None:
  """Restores :func:`state_tree` and :func:`state_meta` output into
  ``trainer``.

  Raises:
    ValueError: the checkpoint was written for other workers or plans.
  """
  plans = [w.plan.to_dict() for w in trainer.workers]
  kinds = [w.kind for w in trainer.workers]
  if meta.get("plans") != plans or meta.get("kinds") != kinds:
    raise ValueError(
        "the checkpoint was written by a run with other workers or plans "
        f"(kinds {meta.get('kinds')} vs {kinds}); resume with the same "
        "cluster and plans, or start a new run directory")
  trainer.params = tree["params"]
  # A synced checkpoint's anchor is its params: keep them one array.
  trainer._anchor = (trainer.params if meta.get("in_sync", True)
                     else tree["anchor"])
  trainer._counter = tree["counter"]
  if trainer.residual is not None:
    trainer.residual = tree["residual"]
  trainer.opt_state = tree["opt_state"]
  trainer.loss_scale = ls.LossScale(*tree["loss_scale"])
  for i in trainer.local_workers:
    trainer.rest[i] = layout.unstack_tree(tree["rest"],
                                          trainer.workers[i].device)
  trainer.step = int(meta["step"])
  trainer.sync_rounds = int(meta["sync_rounds"])
  trainer.comm_bytes = float(meta["comm_bytes"])
  trainer.schedule.load_state_dict(meta.get("schedule", {}))


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
    meta = {**state_meta(trainer), **(extra_meta or {})}
    with _quiet():
      self._manager.save(trainer.step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state_tree(trainer)),
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
        state_tree(trainer))
    with _quiet():
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
    load_state(trainer, restored["state"], restored["meta"])
    return restored["meta"]

  def close(self) -> None:
    with _quiet():
      self._manager.close()
