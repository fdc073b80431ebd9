"""The main job's training loop and its end, once the run is set up.

This module owns the two parts of a run after its setup
(:func:`experiments.train_lib.setup`), as MaxText splits a training run:
:func:`train_loop` (the steps, with their metrics rows, evaluations,
checkpoints, the check that training is going right
(:mod:`experiments.train_health`) and the stop on a preemption notice) and
:func:`finalize` (the final evaluation, the check that the run did not
diverge, ``summary.json`` and the curves). A :class:`Run` is what setup
hands them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import dataclasses
import io
import json
import math
import os
import time
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from experiments import config_lib
from experiments import train_health
from qsync_jax import data as data_lib
from qsync_jax import files
from qsync_jax import host_malloc
from qsync_jax import rundir
from qsync_jax.launch import links
from qsync_jax.process import preemption
from qsync_jax.process import previous_run
from qsync_jax.process.membership_record import MembershipRecord
from qsync_jax.train import layout
from qsync_jax.train import trainer as trainer_lib
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.state import TrainState
from qsync_jax.train.trainer import HybridTrainer


@dataclasses.dataclass
class Run:
  """What the setup of a run hands its loop and its end.

  Attributes:
    job: the job's config (its cluster this world's, resolved).
    out_dir: the run directory.
    trainer: the trainer of this run's workers.
    state: the state the run starts from (step 0, or restored).
    source: the dataset (in memory or streamed).
    batcher: the workers' training batches.
    checkpointer: the run directory's checkpointer.
    metric_writer: ``metrics.jsonl`` and TensorBoard events.
    record: the run directory's membership changes.
    watch: the preemption notice, agreed on a step.
    plans_digest: the digest every process checked its plans against.
    profile_sources: where each kind's profile came from (auto plans), or
      None.
    num_classes: the model's classes, which labels must index (the
      built-in objective on class labels), or None.
    last_batches: the last step's batches, which the loop keeps (a
      reference) to say what was wrong with them if training fails.
    numerics_check: the numerics self-check's record (its checks and
      switches, :func:`qsync_jax.numerics.selfcheck.run`), or None.
  """

  job: config_lib.JobConfig
  out_dir: str
  trainer: HybridTrainer
  state: TrainState
  source: Any
  batcher: Any
  checkpointer: Checkpointer
  metric_writer: rundir.MetricWriter
  record: MembershipRecord
  watch: preemption.PreemptionWatch
  plans_digest: str
  profile_sources: Mapping[str, str] | None
  num_classes: int | None = None
  last_batches: Any = None
  numerics_check: Mapping[str, Any] | None = None

  @property
  def writes(self) -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


@dataclasses.dataclass
class Clock:
  """The loop's timing: training time leaves out evals and checkpoints.

  Attributes:
    start: when the loop started (``time.perf_counter()``).
    train_start: when the first step had run on every process (the
      training clock's start), or None before.
    excluded: seconds spent in evals and checkpoints since.
    window_start: the start of the current throughput window.
    window_step: the step it started at.
    wall_s: the loop's seconds, once it ended (:meth:`stop`).
    train_s: its training seconds, once it ended.
  """

  start: float
  train_start: float | None = None
  excluded: float = 0.0
  window_start: float = 0.0
  window_step: int = 0
  wall_s: float | None = None
  train_s: float | None = None

  def train_time(self) -> float:
    """Training seconds so far (0 before the first step)."""
    if self.train_start is None:
      return 0.0
    return time.perf_counter() - self.train_start - self.excluded

  def stop(self) -> None:
    """Records the loop's wall and training seconds at its end."""
    self.train_s = self.train_time()
    self.wall_s = time.perf_counter() - self.start


@dataclasses.dataclass
class Loop:
  """What the loop leaves: the state and what it logged.

  Attributes:
    state: the state after the last step.
    start_step: the step the loop started from.
    last_train: the last logged training metrics.
    last_eval: the last evaluation (``{"step", ...}``).
    clock: the loop's timing.
    preempted: the loop stopped on a notice, its step checkpointed.
  """

  state: TrainState
  start_step: int
  last_train: dict[str, float]
  last_eval: dict[str, Any]
  clock: Clock
  preempted: bool = False


def _metrics_text(metrics: Mapping[str, Any]) -> str:
  return " ".join(
    f"{k} {v:.4f}"
    for k, v in metrics.items()
    if k != "step" and isinstance(v, float)
  )


def _finish_step(state: TrainState, out: Any) -> None:
  """Waits for every program of the last step, not only its metrics.

  The metrics come from the gradient functions; the update, and a sync
  step's parameter average, run after them. Waiting for the metrics alone
  left those in flight when the clock stopped for an eval, so the eval's
  excluded time took in the float32 mean's all-reduce of a data-parallel
  step.
  """
  jax.block_until_ready((out, state.params, state.opt_state))


def _finish_step_everywhere(state: TrainState, out: Any, name: str) -> None:
  """:func:`_finish_step`, then waits until every process has finished its
  own (a barrier named ``name``): a clock read after it counts the slowest
  process's steps."""
  _finish_step(state, out)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def bn_batches(run: Run, step: int) -> Iterator[dict[int, Any]]:
  """The training batches evaluation re-estimates BatchNorm statistics on.

  The QSR code's ``bn_batches`` micro-batches split over the workers (at
  least one each): the batches of the training steps after ``step``, a
  function of the step, so a resumed run evaluates the same. A generator:
  a model without BatchNorm reads none.
  """
  trainer = run.trainer
  k = max(1, run.job.bn_batches // trainer.num_workers)
  yield from run.batcher.upcoming(step, k, trainer.local_workers)


def _evaluate(run: Run, state: TrainState) -> dict[str, float]:
  return run.trainer.evaluate(
    state,
    data_lib.eval_set(run.source),
    train_batches=bn_batches(run, state.step),
  )


def _save(run: Run, state: TrainState) -> None:
  """Checkpoints ``state`` with the data position and the record."""
  run.checkpointer.save(
    run.trainer,
    state.replace(data=run.batcher.state_dict()),
    run.record.checkpoint_meta(),
  )


def _train_row(
  run: Run, state: TrainState, out: Any, clock: Clock
) -> dict[str, Any]:
  """The metrics row of a logged step: every metric the objective reports,
  averaged over the local workers, and the step's throughput and sync."""
  done, now = state.step, time.perf_counter()
  global_batch = sum(w.batch_size for w in run.trainer.workers)
  rate = global_batch * (done - clock.window_step) / (now - clock.window_start)
  clock.window_start, clock.window_step = now, done
  train = {
    name: float(np.mean([float(m[name]) for m in out.values()]))
    for name in next(iter(out.values()))
  }
  logging.info(
    "step %d/%d %s %.0f examples/s",
    done,
    run.job.steps,
    _metrics_text(train),
    rate,
  )
  return {
    **train,
    "examples_per_s": rate,
    "loss_scale": state.current_loss_scale,
    "H": run.trainer.sync.schedule.round_length(done),
    "sync_rounds": state.sync_rounds,
    "comm_bytes": state.comm_bytes,
    "num_workers": run.trainer.num_workers,
  }


def _preempt(run: Run, state: TrainState, saved_step: int | None) -> None:
  """Checkpoints the agreed step (unless saved) and leaves ``PREEMPTED``."""
  done = state.step
  agreed, save_start = time.time(), time.perf_counter()
  if saved_step != done:
    _save(run, state)
  run.checkpointer.close()
  run.metric_writer.close()
  if run.writes:
    previous_run.write_preempted(
      os.path.join(run.out_dir, previous_run.PREEMPTED),
      done,
      agreed,
      time.perf_counter() - save_start,
    )
  logging.info(
    "preempted: checkpointed step %d; the same command resumes it", done
  )


def _first_step_done(run: Run, state: TrainState, out: Any, clock: Clock):
  """Starts the training clock once the first step (which compiles the
  gradient functions) has run on every process: a local step has no
  collective to wait at, and a process still compiling would share the
  cores with the others' clocked steps."""
  _finish_step_everywhere(state, out, "qsync training clock")
  clock.train_start = time.perf_counter()
  run.record.first_step_done()


def _stop(run: Run) -> None:
  """Closes the run's files after training failed; a stale
  ``summary.json`` goes (process 0), the checkpoints stay."""
  run.checkpointer.close()
  run.metric_writer.close()
  summary_path = os.path.join(run.out_dir, "summary.json")
  if run.writes and os.path.exists(summary_path):
    os.remove(summary_path)


def train_loop(run: Run) -> Loop:
  """Runs the steps from ``run.state`` to ``job.steps``.

  Every ``log_every`` steps a metrics row (the writer's), every
  ``eval_every`` an evaluation (not timed), every ``checkpoint_every`` a
  checkpoint (not timed); on a preemption notice every process checkpoints
  the step they agree on and the loop stops. At each of those steps, where
  the loop reads values anyway, :func:`experiments.train_health.check`
  checks that training is going right (before a checkpoint, that the state
  is finite, so none that is not is saved).

  Returns:
    The :class:`Loop`.

  Raises:
    experiments.train_health.TrainingFailed: a loss or the parameters are
      not finite, or too many steps were skipped, at a checked step; the
      run's files are closed, its checkpoints kept, no ``summary.json``.
  """
  job, trainer, state = run.job, run.trainer, run.state
  # Every update and averaging program compiles now, outside the training
  # clock; the first step (before the clock starts) compiles the rest.
  trainer.compile(state, job.steps)
  clock = Clock(time.perf_counter())
  clock.window_start, clock.window_step = clock.start, state.step
  loop = Loop(state, state.step, {}, {}, clock)
  history = train_health.History(state.step)
  saved_step = None
  while state.step < job.steps:
    batches = run.batcher.worker_batches(state.step, trainer.local_workers)
    run.last_batches = batches
    state, out = trainer.train_step(state, batches)
    loop.state, done = state, state.step
    if done == loop.start_step + 1:
      _first_step_done(run, state, out, clock)
      history.first_loss = train_health.mean_loss(out)
      if not math.isfinite(history.first_loss):
        # Read now: a streamed dataset's batches cannot be read again.
        history.first_findings = train_health.scan(
          [(done, batches)], run.num_classes
        )
    row: dict[str, Any] = {}
    if done % job.log_every == 0 or done == job.steps:
      row = _train_row(run, state, out, clock)
      loop.last_train = {
        k: v for k, v in row.items() if k in next(iter(out.values()))
      }
    if job.eval_every and (done % job.eval_every == 0 or done == job.steps):
      # The step's queued work finishes before the clock stops for the eval,
      # on every process: a process that waits here for the slowest counts
      # the wait as training, as it would at a synchronizing step, so that
      # runs that meet only at evals are not timed by their fastest process.
      _finish_step_everywhere(state, out, "qsync evaluation clock")
      eval_start = time.perf_counter()
      row["train_time_s"] = clock.train_time()
      ev = _evaluate(run, state)
      loop.last_eval = {"step": done, **ev}
      clock.excluded += time.perf_counter() - eval_start
      row.update({f"eval_{name}": value for name, value in ev.items()})
      logging.info("step %d eval %s", done, _metrics_text(ev))
    if row:
      run.metric_writer.write(done, row)
    checkpoint = job.checkpoint_every and (
      done % job.checkpoint_every == 0 or done == job.steps
    )
    if row or checkpoint:
      check_start = time.perf_counter()
      try:
        train_health.check(
          run,
          history,
          state,
          out,
          train_loss=row.get("loss"),
          eval_loss=row.get("eval_loss"),
          params=bool(checkpoint),
        )
      except train_health.TrainingFailed:
        _stop(run)
        raise
      if checkpoint:  # the state's check belongs to the checkpoint's time
        clock.excluded += time.perf_counter() - check_start
    if checkpoint:
      _finish_step(state, out)
      save_start = time.perf_counter()
      _save(run, state)
      clock.excluded += time.perf_counter() - save_start
      saved_step = done
    if run.watch.reached(done):
      # Every process reaches this at the same step (PreemptionWatch).
      _preempt(run, state, saved_step)
      loop.preempted = True
      return loop
    if "eval_loss" in row or (
      job.checkpoint_every and done % job.checkpoint_every == 0
    ):
      # Throughput windows count training only, not evals or checkpoints.
      clock.window_start, clock.window_step = time.perf_counter(), done
  if state.step > loop.start_step:
    _finish_step(state, out)
  clock.stop()
  return loop


def check_finite_result(
  trainer: HybridTrainer,
  state: TrainState,
  eval_loss: float,
  train_loss: float | None,
  summary_path: str | None,
) -> None:
  """Raises if the run ends with non-finite parameters or losses.

  A diverged run must not look like a result: any ``summary.json`` at
  ``summary_path`` (an earlier run's, or an earlier segment's of a resumed
  run) is removed. The last training loss counts too: a step whose gradient
  was not finite is skipped, so the parameters can stay finite while the
  model has diverged.

  Args:
    trainer: the trainer.
    state: the state after the last step.
    eval_loss: the final eval loss.
    train_loss: the last logged training loss (None: none this run).
    summary_path: the summary to remove; None on a process that writes
      nothing.

  Raises:
    FloatingPointError: naming what is not finite.
  """
  # The local workers' flat parameter rows, read as they are: unravelling
  # them into the model's tree would dispatch a slice per leaf.
  rows = layout.rows(state.params)
  if not math.isfinite(eval_loss):
    problem = f"the final eval loss is {eval_loss}"
  elif train_loss is not None and not math.isfinite(train_loss):
    problem = f"the final training loss is {train_loss}"
  elif not all(
    np.isfinite(np.asarray(rows[d])).all()
    for d in trainer.local_devices.values()
  ):
    problem = "the final parameters are not all finite"
  else:
    return
  if summary_path is not None and os.path.exists(summary_path):
    os.remove(summary_path)
  # The loop's checks (train_health) saw the training losses finite; what
  # is left is the final evaluation.
  raise FloatingPointError(
    f"training diverged: {problem} at step {state.step} (the training "
    "loss was finite at the last check: check the eval data and the "
    "model's eval mode); no summary.json written"
  )


def summary(run: Run, loop: Loop, final: Mapping[str, Any]) -> dict[str, Any]:
  """The run's ``summary.json`` (its fields: :func:`experiments.train_lib
  .train_and_evaluate`)."""
  job, trainer, state, clock = run.job, run.trainer, loop.state, loop.clock
  wall = clock.wall_s or 0.0
  steps_this_run = state.step - loop.start_step
  global_batch = sum(w.batch_size for w in trainer.workers)
  return {
    **{f"final_eval_{k}": v for k, v in final.items() if k != "step"},
    "final_train_loss": loop.last_train.get("loss"),
    "steps": state.step,
    "steps_this_run": steps_this_run,
    "sync": trainer.sync.schedule.name,
    "compress": trainer.sync.averager.name,
    "error_feedback": trainer.sync.error_feedback,
    "outer_optimizer": job.outer_optimizer,
    "sync_rounds": state.sync_rounds,
    "comm_bytes": state.comm_bytes,
    "wall_time_s": wall,
    # From the end of this run's first step (compilation), less evals
    # and checkpoints.
    "train_time_s": clock.train_s or 0.0,
    "examples_per_s": global_batch * steps_this_run / wall if wall else None,
    "loss_scaling": trainer.loss_scaling,
    "skipped_steps": state.skipped_steps,
    "params_sha256": trainer.params_digest(state),
    "cluster": job.cluster,
    "num_processes": jax.process_count(),
    "plans_sha256": run.plans_digest,
    # Where each kind's profile came from (auto plans), or None.
    "profiles": run.profile_sources,
    # The launcher's emulated link and its measured rate, or None.
    "link": links.link_info_from_env(),
    # The host allocator's mode (qsync_jax.host_malloc).
    "host_malloc": host_malloc.mode_from_env(),
    "workers": trainer_lib.describe_workers(trainer.workers),
    "precisions": [
      {k: v.value for k, v in eff.items()} for eff in trainer.precisions
    ],
    # One entry per membership change (membership_record.MembershipRecord).
    "membership": run.record.entries,
    # Each low-precision contraction checked on its device before
    # training, and each switched to a safe path (numerics.selfcheck).
    "numerics_check": run.numerics_check,
  }


def finalize(run: Run, loop: Loop) -> dict[str, Any]:
  """Ends a run that reached its last step: the final evaluation (the
  loop's last, when it was of the last step), the divergence check, and
  the run's files (process 0).

  Returns:
    The summary written to ``summary.json``.

  Raises:
    FloatingPointError: the final parameters or losses are not finite (no
      summary is written; a stale one is removed).
  """
  state = loop.state
  final = (
    loop.last_eval
    if loop.last_eval.get("step") == state.step
    else {"step": state.step, **_evaluate(run, state)}
  )
  run.checkpointer.close()
  summary_path = os.path.join(run.out_dir, "summary.json")
  check_finite_result(
    run.trainer,
    state,
    final["loss"],
    loop.last_train.get("loss"),
    summary_path if run.writes else None,
  )
  result = summary(run, loop, final)
  if result["skipped_steps"]:
    # Within the share train_health allows, but not silent either.
    logging.warning(
      "%d of %d steps were skipped for a non-finite gradient",
      result["skipped_steps"],
      state.step,
    )
  run.metric_writer.close()
  if run.writes:
    files.write_json(summary_path, result, indent=2)
    preempted_path = os.path.join(run.out_dir, previous_run.PREEMPTED)
    if os.path.exists(preempted_path):
      os.remove(preempted_path)
    metrics_path = os.path.join(run.out_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
      plot_curves(metrics_path, os.path.join(run.out_dir, "curves.png"))
  logging.info("final eval %s; wrote %s", _metrics_text(final), run.out_dir)
  return result


def plot_curves(metrics_path: str, png_path: str) -> None:
  """Writes a PNG of training loss and, where logged, accuracy (train and
  eval)."""
  import matplotlib  # local: only the plot needs it

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with open(metrics_path) as f:
    rows = [json.loads(line) for line in f]
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_accuracy" in r]
  with_accuracy = any("accuracy" in r for r in train) or evals
  fig, axes = plt.subplots(
    1,
    2 if with_accuracy else 1,
    figsize=(10 if with_accuracy else 5, 4),
    squeeze=False,
  )
  ax_loss = axes[0][0]
  ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train])
  ax_loss.set(xlabel="step", ylabel="train loss", yscale="log")
  if with_accuracy:
    ax_acc = axes[0][1]
    acc = [r for r in train if "accuracy" in r]
    ax_acc.plot(
      [r["step"] for r in acc], [r["accuracy"] for r in acc], label="train"
    )
    ax_acc.plot(
      [r["step"] for r in evals],
      [r["eval_accuracy"] for r in evals],
      "o-",
      label="eval",
    )
    ax_acc.set(xlabel="step", ylabel="accuracy")
    ax_acc.legend()
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=100)
  plt.close(fig)
  files.write_bytes(png_path, png.getvalue())
