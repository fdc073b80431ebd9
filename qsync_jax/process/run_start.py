"""How a run starts in its directory: anew, or from its checkpoint.

This module owns the decision a training run takes before it builds its
workers (:class:`RunStart`): whether it continues the directory's newest
checkpoint (asked to, after a notice left the ``PREEMPTED`` file, or in an
elastic world after the first, which resumes by itself), and with which
per-worker batches. A resume keeps the global batch its checkpoint records
(:func:`resume_batch_sizes`), re-split over other workers where the workers
changed, so that the data goes on with no example repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import os
from typing import Any

from absl import logging

from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.process.membership import ElasticWorld
from qsync_jax.process.previous_run import PREEMPTED
from qsync_jax.process.previous_run import PreviousRun
from qsync_jax.train.checkpoint import Checkpointer

#: The directory of a run directory's checkpoints.
CHECKPOINTS_DIR = "checkpoints"


def _spec(kinds: Sequence[str]) -> str:
  return cluster_lib.cluster_string(cluster_lib.ClusterSpec(tuple(kinds)))


def resume_batch_sizes(
  meta: Mapping[str, Any] | None,
  kinds: Sequence[str],
  batch_mode: str = "equal",
  speeds: str | Mapping[str, float] | None = None,
) -> list[int] | None:
  """The per-worker batches of a run that resumes from ``meta``.

  A run directory keeps the global batch its checkpoint records
  (``meta["batch_sizes"]``), so that the data continues with no example
  repeated or skipped: the same workers keep their saved batches; other
  workers (other kinds, or another count) split the same global batch
  (:func:`qsync_jax.parallel.cluster.split_batch` in ``batch_mode``), and
  one line is logged.

  Args:
    meta: the newest checkpoint's metadata
      (:meth:`~qsync_jax.train.checkpoint.Checkpointer.latest_meta`), or
      None (no checkpoint).
    kinds: this run's workers' device kinds, in worker order.
    batch_mode: ``"equal"`` or ``"dynamic"``.
    speeds: each kind's relative speed (dynamic mode).

  Returns:
    The batch sizes, or None where the checkpoint records none (none, or
    one written before it recorded them): the run's own then.

  Raises:
    ValueError: the global batch has fewer examples than this run has
      workers, or the split fails (a kind without a speed).

  Example:
    >>> meta = {"step": 6, "kinds": ["v100", "t4"], "batch_sizes": [8, 8]}
    >>> resume_batch_sizes(meta, ["v100", "t4", "t4"])
    [6, 5, 5]
  """
  saved = (meta or {}).get("batch_sizes")
  if not meta or not saved:
    return None
  saved = [int(b) for b in saved]
  saved_kinds = [str(k) for k in meta.get("kinds") or []]
  kinds = [str(k) for k in kinds]
  total = sum(saved)
  if saved_kinds == kinds and len(saved) == len(kinds):
    return saved
  if total < len(kinds):
    raise ValueError(
      f"the checkpoint at step {meta.get('step')} was written with a global "
      f"batch of {total} examples, fewer than the {len(kinds)} workers of "
      f"this run ({_spec(kinds)}); resume on at most {total} workers, or "
      "start a new run directory"
    )
  sizes = cluster_lib.split_batch(total, kinds, batch_mode, speeds)
  logging.info(
    "the checkpoint's global batch of %d examples is kept: per-worker "
    "batches %s on %s (its own: %s on %s)",
    total,
    sizes,
    _spec(kinds),
    saved,
    _spec(saved_kinds) if saved_kinds else "unknown workers",
  )
  return sizes


@dataclasses.dataclass(frozen=True)
class RunStart:
  """How a run starts in its directory: anew, or from its checkpoint.

  Attributes:
    resuming: the run continues the directory's newest checkpoint: asked
      to, after a notice (:data:`~qsync_jax.process.previous_run.PREEMPTED`),
      or in an elastic world after the first (``world.restart > 0``).
    was_preempted: the ``PREEMPTED`` file is there.
    restarted: an elastic world after the first.
    previous: what the run before left (read before anything changes).
    checkpointer: the directory's checkpointer where ``checkpoints/``
      exists (opening one creates it), else None.
    batch_sizes: the per-worker batches a resume keeps
      (:func:`resume_batch_sizes`), or None (the run's own).
  """

  resuming: bool
  was_preempted: bool
  restarted: bool
  previous: PreviousRun
  checkpointer: Checkpointer | None
  batch_sizes: list[int] | None

  @property
  def restores_checkpoint(self) -> bool:
    """Whether the run resumes from a checkpoint its directory holds.

    Its state, the model's weights included, is then the checkpoint's.
    ``restore_latest`` restores it, or refuses the run if every
    checkpoint there is damaged.
    """
    return (
      self.resuming
      and self.checkpointer is not None
      and self.checkpointer.latest_step() is not None
    )

  @classmethod
  def open(
    cls,
    out_dir: str,
    world: ElasticWorld | None,
    *,
    resume: bool,
    kinds: Sequence[str],
    batch_mode: str = "equal",
    speeds: str | Mapping[str, float] | None = None,
  ) -> RunStart:
    """Reads how the run in ``out_dir`` starts; writes nothing.

    Args:
      out_dir: the run directory.
      world: the elastic world
        (:func:`qsync_jax.process.membership.from_env`), or None.
      resume: the run was asked to continue the directory's checkpoint.
      kinds: this run's workers' device kinds, in worker order.
      batch_mode: how a resume onto other workers splits the global batch
        (:func:`resume_batch_sizes`).
      speeds: each kind's relative speed (dynamic mode).

    Raises:
      ValueError: ``out_dir`` holds checkpoints and the run does not
        resume, or what :func:`resume_batch_sizes` raises.
    """
    was_preempted = os.path.exists(os.path.join(out_dir, PREEMPTED))
    restarted = world is not None and world.restart > 0
    resuming = bool(resume) or was_preempted or restarted
    checkpoints = os.path.join(out_dir, CHECKPOINTS_DIR)
    checkpointer = (
      Checkpointer(checkpoints) if os.path.isdir(checkpoints) else None
    )
    if (
      not resuming
      and checkpointer is not None
      and checkpointer.latest_step() is not None
    ):
      raise ValueError(
        f"{out_dir} already holds checkpoints; pass --resume to "
        "continue that run or use a new --out_dir"
      )
    # Before the workers are built: a resume keeps the global batch.
    meta = (
      checkpointer.latest_meta()
      if resuming and checkpointer is not None
      else None
    )
    return cls(
      resuming,
      was_preempted,
      restarted,
      PreviousRun.read(out_dir),
      checkpointer,
      resume_batch_sizes(meta, kinds, batch_mode, speeds),
    )
