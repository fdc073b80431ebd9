"""The main job's check that training is going right, and the stop if not.

This module owns :func:`check`, which the loop
(:func:`experiments.train_loop.train_loop`) calls where it already reads
values on the host (a logged step, an evaluation, a checkpoint, the last
step), so that it costs nothing between them: a training loss or an eval
loss that is not finite, parameters that are not (at checkpoints, before
the save), or more steps skipped for a non-finite gradient than
:data:`MAX_SKIPPED_SHARE` allows, stop the run with a
:class:`TrainingFailed` naming the step, what was observed and the likely
cause (:func:`likely_cause`: non-finite inputs or labels out of range in
the batches since the last check, FP16 layers with loss scaling off, a loss
that was finite at the first step and grew, or a model that is not finite
before any update). The first step the loop can tell is therefore the first
checked step at or after the failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import math
from typing import Any

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from qsync_jax import data as data_lib
from qsync_jax.plan.precision import Precision

#: The share of the steps so far that may be skipped for a non-finite
#: gradient before training stops (beyond :data:`SCALE_SEARCH_SKIPS`).
MAX_SKIPPED_SHARE = 0.1

#: Skips a dynamic loss scale may take while it halves from its initial
#: 2**15 to its minimum, 1 (:meth:`qsync_jax.train.loss_scale.LossScale
#: .create`): the scale finding its level, not training going wrong.
SCALE_SEARCH_SKIPS = 15

#: At most this many steps' batches are read again to find bad inputs.
_MAX_STEPS_SCANNED = 1000


class TrainingFailed(FloatingPointError):
  """Training went wrong: a loss or the parameters are not finite, or too
  many steps were skipped; the message names the step and the likely
  cause."""


@dataclasses.dataclass
class History:
  """What the checks saw so far in this run.

  Attributes:
    start_step: the step the run started from (0, or a resumed one).
    first_loss: the first step's mean training loss, or None.
    losses: ``(step, loss)`` of every passed check.
    checked_step: the last step a check passed (the run's start before).
    first_findings: what :func:`scan` found in the first step's batches,
      read while the loop still holds them when the first loss is not
      finite; None where they were not scanned.
  """

  start_step: int
  first_loss: float | None = None
  first_findings: dict[str, str] | None = None
  losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  checked_step: int = 0

  def __post_init__(self):
    self.checked_step = self.start_step


def mean_loss(out: Mapping[int, Mapping[str, Any]]) -> float:
  """The local workers' mean training loss of a step (a host read)."""
  return float(np.mean([float(m["loss"]) for m in out.values()]))


def _local_max(x: jax.Array) -> int:
  """The largest value of a stacked per-worker scalar on this process."""
  return max(int(np.asarray(s.data).max()) for s in x.addressable_shards)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
  leaves = [
    jnp.isfinite(x).all()
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jnp.stack(leaves).all() if leaves else jnp.bool_(True)


def _params_finite(state: Any) -> bool:
  """Whether this process's rows of the parameters and optimizer state are
  finite (one reduction on each device; a scalar read)."""
  return all(
    bool(_all_finite(s.data))
    for x in jax.tree.leaves((state.params, state.opt_state))
    if hasattr(x, "addressable_shards")
    for s in x.addressable_shards
  )


def skipped_allowed(done: int, loss_scaling: bool) -> float:
  """The skipped steps allowed after ``done`` steps."""
  return MAX_SKIPPED_SHARE * done + (SCALE_SEARCH_SKIPS if loss_scaling else 0)


def check(
  run: Any,
  history: History,
  state: Any,
  out: Mapping[int, Mapping[str, Any]],
  *,
  train_loss: float | None = None,
  eval_loss: float | None = None,
  params: bool = False,
) -> None:
  """Checks the step ``state`` is at; raises if training went wrong.

  Every process calls it at the same steps; in a multi-process run the
  processes combine what they saw, so that all stop or none.

  Args:
    run: the :class:`experiments.train_loop.Run`.
    history: this run's :class:`History`, updated where the check passes.
    state: the state after the step.
    out: the step's metrics (device scalars).
    train_loss: the step's mean training loss, when already read.
    eval_loss: the step's eval loss, where it was evaluated.
    params: also check the parameters and optimizer state (before a
      checkpoint: a non-finite state is never saved).

  Raises:
    TrainingFailed: naming the step, what is not finite or how many steps
      were skipped, the likely cause and the last checkpoint kept.
  """
  done, trainer = state.step, run.trainer
  loss = mean_loss(out) if train_loss is None else train_loss
  seen = np.array(
    [
      not math.isfinite(loss),
      eval_loss is not None and not math.isfinite(eval_loss),
      params and not _params_finite(state),
      _local_max(state.loss_scale.skipped),
    ],
    np.int64,
  )
  if jax.process_count() > 1:
    seen = np.asarray(multihost_utils.process_allgather(seen)).max(axis=0)
  bad_loss, bad_eval, bad_params, skipped = (int(v) for v in seen)
  too_many_skipped = skipped > skipped_allowed(done, trainer.loss_scaling)
  if not (bad_loss or bad_eval or bad_params or too_many_skipped):
    history.losses.append((done, loss))
    history.checked_step = done
    return
  if bad_loss:
    problem = f"the training loss is {loss}"
  elif bad_eval:
    problem = f"the eval loss is {eval_loss}"
  elif bad_params:
    problem = "the parameters are not all finite"
  else:
    problem = (
      f"{skipped} of {done} steps were skipped for a non-finite gradient"
    )
  findings = bad_batches(run, history.checked_step, done)
  for key, value in (history.first_findings or {}).items():
    findings.setdefault(key, value)
  cause = likely_cause(
    bad_batches=findings,
    first_scanned=history.first_findings is not None,
    fp16_kinds=fp16_kinds(trainer),
    loss_scaling=bool(trainer.loss_scaling),
    scale_at_floor=state.current_loss_scale <= 1.0,
    losses=history.losses,
    first_loss=history.first_loss if history.start_step == 0 else None,
    loss_finite=not (bad_loss or bad_eval or bad_params),
    learning_rate=run.job.learning_rate,
  )
  raise TrainingFailed(
    f"training stopped at step {done}: {problem} (checked every "
    f"log_every={run.job.log_every} steps); likely cause: {cause}; "
    f"{kept_checkpoint(run)}; no summary.json written"
  )


def kept_checkpoint(run: Any) -> str:
  """Where the last good checkpoint is, said for the message."""
  step = run.checkpointer.latest_step()
  if step is None:
    return "no checkpoint was saved"
  return (
    f"the checkpoint of step {step}, the last finite one, is kept in "
    f"{run.checkpointer.directory}"
  )


def fp16_kinds(trainer: Any) -> list[str]:
  """The device kinds whose workers compute some layer in FP16."""
  return sorted(
    {
      w.kind
      for w, eff in zip(trainer.workers, trainer.precisions)
      if Precision.FP16 in eff.values()
    }
  )


def _window_batches(
  run: Any, start: int, stop: int
) -> Iterable[tuple[int, Mapping[int, Any]]]:
  """``(step, {worker: (x, y)})`` of the steps ``start + 1..stop`` that can
  be read again (a batcher whose batches are a function of the step; a
  streamed one only gives the last step's, which the loop kept)."""
  workers = run.trainer.local_workers
  if isinstance(run.batcher, data_lib.WorkerBatcher):
    first = max(start, stop - _MAX_STEPS_SCANNED)
    for index in range(first, stop):  # step t trains on the batch of t - 1
      yield index + 1, run.batcher.worker_batches(index, workers)
  elif run.last_batches is not None:
    yield stop, run.last_batches


def _leaves(tree: Any) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def bad_batches(run: Any, start: int, stop: int) -> dict[str, str]:
  """What is wrong with the batches of steps ``start + 1..stop``.

  Returns:
    :func:`scan`'s findings; with a streamed dataset, whose earlier
    batches cannot be read again, ``"unread"`` says which were not.
  """
  found = scan(_window_batches(run, start, stop), run.num_classes)
  if not isinstance(run.batcher, data_lib.WorkerBatcher) and stop - start > 1:
    found["unread"] = (
      f"the batches of steps {start + 1}..{stop - 1} were not checked (a "
      "streamed dataset is not read twice)"
    )
  return found


def scan(
  steps: Iterable[tuple[int, Mapping[int, Any]]], classes: int | None
) -> dict[str, str]:
  """What is wrong with some steps' batches.

  Args:
    steps: ``(step, {worker: (x, y)})`` pairs.
    classes: the model's classes, which integer labels must index; None:
      labels are not class indices.

  Returns:
    ``{"inputs": ..., "labels": ...}``, each the first bad batch said in
    words, where found.
  """
  found: dict[str, str] = {}
  for step, batches in steps:
    for worker, (x, y) in batches.items():
      where = f"worker {worker}'s batch at step {step}"
      if "inputs" not in found:
        for a in _leaves(x):
          if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
            rows = (~np.isfinite(a.reshape(len(a), -1))).any(axis=1).sum()
            found["inputs"] = (
              f"{where} has {rows} of {len(a)} examples with non-finite "
              "inputs (NaN or inf): clean or filter the dataset"
            )
            break
      if "labels" not in found:
        found.update(_bad_labels(y, classes, where))
      if len(found) == 2:
        return found
  return found


def _bad_labels(y: Any, classes: int | None, where: str) -> dict[str, str]:
  for a in _leaves(y):
    if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
      return {"labels": f"{where} has non-finite labels (NaN or inf)"}
    if classes and np.issubdtype(a.dtype, np.integer) and a.size:
      low, high = int(a.min()), int(a.max())
      if low < 0 or high >= classes:
        bad = low if low < 0 else high
        return {
          "labels": f"{where} has label {bad}, out of range for the "
          f"model's {classes} classes (0..{classes - 1}): fix the labels, "
          "or give the model more classes (num_classes)"
        }
  return {}


def likely_cause(
  *,
  bad_batches: Mapping[str, str],
  first_scanned: bool,
  fp16_kinds: Sequence[str],
  loss_scaling: bool,
  scale_at_floor: bool,
  losses: Sequence[tuple[int, float]],
  first_loss: float | None,
  loss_finite: bool,
  learning_rate: float,
) -> str:
  """The likely cause of a failure, from what was observed, in words.

  In this order: bad inputs or labels in the failing steps' batches; FP16
  layers trained without loss scaling, or with a loss scale that fell to
  1 (their gradients overflow); a loss
  that was finite at the first step and then grew or went non-finite (the
  learning rate); a loss that was not finite at the first step, before any
  update (the model or the loss, whatever the learning rate); else a
  gradient that is not finite while the loss is.

  Args:
    bad_batches: :func:`bad_batches`' findings.
    first_scanned: whether the first step's batches were scanned (and
      found clean, unless ``bad_batches`` says otherwise).
    fp16_kinds: :func:`fp16_kinds`.
    loss_scaling: whether dynamic loss scaling is on.
    scale_at_floor: whether the loss scale is at its minimum, 1.
    losses: ``(step, loss)`` of the checks that passed.
    first_loss: the loss of step 1 (before any update), or None (not seen,
      or a resumed run).
    loss_finite: whether the losses and parameters were finite (only steps
      were skipped).
    learning_rate: the configured (peak) learning rate.

  Returns:
    The cause, said as likely, with what to do.
  """
  found = [bad_batches[k] for k in ("inputs", "labels") if k in bad_batches]
  if found:
    return "; ".join(found)
  unread = f" ({bad_batches['unread']})" if "unread" in bad_batches else ""
  kinds = ", ".join(fp16_kinds)
  if fp16_kinds and not loss_scaling:
    return (
      f"FP16 overflow: {kinds} compute layers in fp16 with loss scaling "
      "off (turn it on: HybridTrainer(loss_scaling='auto'), or plan those "
      "layers in bf16 or fp32)"
    )
  if fp16_kinds and scale_at_floor and loss_finite:
    return (
      f"FP16 overflow: the loss scale fell to 1 and the gradients of "
      f"{kinds}'s fp16 layers still overflow (plan those layers in bf16 "
      "or fp32)"
    )
  if first_scanned and first_loss is not None and not math.isfinite(first_loss):
    return (
      f"the model or the loss: the loss was {first_loss} at step 1, before "
      "any update, on finite inputs, so not the learning rate (check the "
      "model's forward pass and the loss for log, division or sqrt at 0)"
    )
  grew = ""
  finite = [(s, v) for s, v in losses if math.isfinite(v)]
  if first_loss is not None and math.isfinite(first_loss):
    finite.insert(0, (1, first_loss))
  if len(finite) >= 2 and finite[-1][1] > 1.5 * min(v for _, v in finite):
    (s0, v0), (s1, v1) = min(finite, key=lambda p: p[1]), finite[-1]
    grew = f"the loss grew from {v0:.4g} at step {s0} to {v1:.4g} at step {s1}"
  if grew or not loss_finite:
    said = grew or "the loss and inputs were finite before"
    return (
      f"a learning rate too large (config.learning_rate={learning_rate:g}): "
      f"{said}; lower it{unread}"
    )
  return (
    "a gradient that is not finite while the loss is (a layer or loss with "
    "an infinite derivative, such as sqrt or log at 0), or a learning "
    f"rate too large (config.learning_rate={learning_rate:g}){unread}"
  )
