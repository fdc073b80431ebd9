"""The training state: everything a step changes, as one pytree.

This module owns :class:`TrainState`, the value a
:class:`~qsync_jax.train.trainer.HybridTrainer` step takes and returns
(``state, metrics = trainer.train_step(state, batches)``), which
:class:`~qsync_jax.train.checkpoint.Checkpointer` saves and restores. It is
listed here once; the programs of :mod:`.programs` read and write its array
fields, the trainer its host fields.

Array fields are stacked over the workers (:mod:`.layout`): a global
``(num_workers, ...)`` array sharded over the ``workers`` mesh axis, one row
per worker on its device. The host fields (the step, sync counters, bytes
on the wire, the data position) are Python values, static in the pytree:
the step decides which program runs, so it is read on the host every step.
"""

from __future__ import annotations

from typing import Any

from flax import struct
import jax

from qsync_jax.train import layout
from qsync_jax.train import loss_scale as ls


class TrainState(struct.PyTreeNode):
  """Everything a training step changes.

  Attributes:
    params: ``(n, P)`` each worker's parameters as one flat float32 vector.
    opt_state: the optimizer state, each leaf stacked.
    loss_scale: the :class:`~qsync_jax.train.loss_scale.LossScale`, stacked.
    rest: ``{worker index: non-parameter model state}`` (BatchNorm
      statistics, a layer's RNG state) of this process's workers, each on
      its worker's device.
    anchor: ``(n, P)`` the parameters at the last synchronization (local
      SGD's common starting point); the same array as ``params`` when in
      sync, so data parallelism pays nothing for it.
    counter: ``(n,)`` averages so far (keys each one's rounding noise).
    residual: ``(n, P)`` error-feedback residuals, or None without feedback.
    averager_state: the averager's state carried between averages
      (PowerSGD's warm-start ``Q``), each leaf stacked; None for a
      stateless averager.
    outer_state: the outer optimizer's state (DiLoCo), each leaf stacked;
      None without one.
    step: steps taken.
    sync_rounds: synchronizations so far.
    comm_bytes: bytes each worker has sent on the wire so far (the
      averagers' ring counts).
    in_sync: every worker holds the same parameters (after a sync).
    data: the data position, JSON (a streamed dataset's iterator state) or
      None where the batches are a function of the step; saved with the
      state.
  """

  params: jax.Array
  opt_state: Any
  loss_scale: ls.LossScale
  rest: dict[int, Any]
  anchor: jax.Array
  counter: jax.Array
  residual: jax.Array | None = None
  averager_state: Any = None
  outer_state: Any = None
  step: int = struct.field(pytree_node=False, default=0)
  sync_rounds: int = struct.field(pytree_node=False, default=0)
  comm_bytes: float = struct.field(pytree_node=False, default=0.0)
  in_sync: bool = struct.field(pytree_node=False, default=True)
  data: Any = struct.field(pytree_node=False, default=None)

  @property
  def skipped_steps(self) -> int:
    """Steps skipped so far because a gradient was not finite (the first
    local worker's count)."""
    return int(layout.local_scalar(self.loss_scale.skipped))

  @property
  def current_loss_scale(self) -> float:
    """The loss scale the next step uses (1 when scaling is off; the first
    local worker's)."""
    return float(layout.local_scalar(self.loss_scale.scale))
