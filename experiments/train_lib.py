"""The main job: hybrid-cluster training from a config, with outputs on disk.

This module owns ``main(config, out_dir, overrides)``, everything the
``experiments/train.py`` binary does after reading its flags (applying the
shortcut flags, the checks, joining a multi-process run, bad input as one
``error:`` line), and ``train_and_evaluate(config, out_dir)``, which it
calls and library callers may call directly: it maps the cluster spec onto
the JAX devices present, builds one worker per device with its kind's
precision plan (and its batch size, equal or proportional to device speed),
trains a :class:`~qsync_jax.train.trainer.HybridTrainer`, checkpoints and
resumes it, and writes ``summary.json``, ``metrics.jsonl``, the plans and a
PNG of the curves.
In a multi-process run (``qsync_jax.process.initialize``) every process runs
its own workers and only process 0 writes the files. The config's checks and
the objects it names are in :mod:`experiments.config_lib`; a run ending in
non-finite parameters or losses fails (``FloatingPointError``) instead of
writing a summary, and ``qsync_jax.rundir.make_out_dir`` refuses an output path
that is a file.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import contextlib
import io
import json
import math
import os
import sys
import time
from typing import Any

from absl import logging
from flax import nnx
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from experiments import config_lib
from experiments import flag_aliases
from experiments import limits_lib
from experiments import membership_lib
from experiments import plans_lib
from qsync_jax import cli
from qsync_jax import data as data_lib
from qsync_jax import files
from qsync_jax import host_malloc
from qsync_jax import rundir
from qsync_jax.allocation import sharing
from qsync_jax.launch import links
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import agreement
from qsync_jax.process import coordination
from qsync_jax.process import initialize
from qsync_jax.process import membership
from qsync_jax.process import membership_record
from qsync_jax.process import preemption
from qsync_jax.process import previous_run
from qsync_jax.process import run_start
from qsync_jax.train import trainer as trainer_lib
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.state import TrainState
from qsync_jax.train.sync import SyncSettings
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

#: The file a preempted run leaves in its directory: the same command then
#: resumes from the checkpoint it wrote, without --resume.
PREEMPTED = previous_run.PREEMPTED


def make_workers(
  config: ml_collections.ConfigDict,
  devices=None,
  plans: Mapping[str, Any] | None = None,
  batch_sizes: list[int] | None = None,
) -> list[Worker]:
  """Builds the workers of ``config.cluster`` with their plans and batches.

  ``plans`` (default ``config.plans``) maps a device kind to a plan (a
  mapping, JSON text or a file path); kinds it does not name train in FP32,
  and a kind the cluster does not have is an error. ``config.batch_mode``
  is ``"equal"`` (``config.batch_size`` each) or ``"dynamic"`` (QSync's DB
  baseline: the global batch ``batch_size * num_workers`` split in
  proportion to ``config.speeds``); ``batch_sizes``, one per worker, are
  used instead where given (a resume keeps its checkpoint's global batch:
  :func:`qsync_jax.process.run_start.resume_batch_sizes`).

  Raises:
    ValueError: a bad cluster spec, too few devices, a plan for a kind not in
      the cluster, or a bad batch mode or speed.
  """
  spec = cluster_lib.parse_cluster(config.cluster)
  devices = cluster_lib.assign_devices(spec, devices)
  if plans is None:
    plans = config_lib.to_plain(config.get("plans", {})) or {}
  config_lib.check_plan_kinds(plans, spec)
  plan_of = {
    kind: config_lib.load_plan(plans[kind])
    if kind in plans
    else PrecisionPlan()
    for kind in spec.groups()
  }
  sizes = batch_sizes or cluster_lib.split_batch(
    config.batch_size * spec.num_workers,
    spec.kinds,
    config.batch_mode,
    config.speeds,
  )
  return [
    Worker(d, k, plan_of[k], b) for d, k, b in zip(devices, spec.kinds, sizes)
  ]


def batcher_sample(
  dataset: data_lib.Dataset, workers: list[Worker]
) -> tuple[np.ndarray, np.ndarray]:
  """One worker's batch of the training set, to trace the model with."""
  b = workers[0].batch_size
  return dataset.x_train[:b], dataset.y_train[:b]


def _metrics_text(metrics: Mapping[str, Any]) -> str:
  return " ".join(
    f"{k} {v:.4f}"
    for k, v in metrics.items()
    if k != "step" and isinstance(v, float)
  )


def check_agreement(
  config: ml_collections.ConfigDict, model: nnx.Module
) -> None:
  """Checks that every process has the same run before any collective.

  Compares the library versions, ``XLA_FLAGS``, the config (less its
  ``distributed`` settings, which may differ per process), the initial
  parameters' count and digest and the data-order seed
  (:mod:`qsync_jax.process.agreement`); a no-op with one process.

  Raises:
    qsync_jax.process.agreement.AgreementError: naming the process and the
      field that differ, or a process that did not report in time.
  """
  if jax.process_count() == 1:
    return
  plain = {
    k: v for k, v in config_lib.to_plain(config).items() if k != "distributed"
  }
  logging.info("checking that %d processes agree", jax.process_count())
  agreement.check(
    agreement.local_facts(
      config=plain, params=nnx.state(model, nnx.Param), data_seed=config.seed
    )
  )


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


def bn_batches(
  config: ml_collections.ConfigDict,
  batcher: data_lib.WorkerBatcher | data_lib.StreamBatcher,
  trainer: HybridTrainer,
  step: int,
) -> Iterator[dict[int, Any]]:
  """The training batches evaluation re-estimates BatchNorm statistics on.

  The QSR code's ``bn_batches`` micro-batches split over the workers (at
  least one each): the batches of the training steps after the current
  one, a function of the step, so a resumed run evaluates the same. A
  generator: a model without BatchNorm reads none.
  """
  k = max(1, config.get("bn_batches", 128) // trainer.num_workers)
  yield from batcher.upcoming(step, k, trainer.local_workers)


def _check_finite_result(
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
  params = [
    x
    for i in trainer.local_workers
    for x in jax.tree.leaves(trainer.worker_params(state, i))
  ]
  if not math.isfinite(eval_loss):
    problem = f"the final eval loss is {eval_loss}"
  elif train_loss is not None and not math.isfinite(train_loss):
    problem = f"the final training loss is {train_loss}"
  elif not all(np.isfinite(np.asarray(x)).all() for x in params):
    problem = "the final parameters are not all finite"
  else:
    return
  if summary_path is not None and os.path.exists(summary_path):
    os.remove(summary_path)
  raise FloatingPointError(
    f"training diverged: {problem} at step {state.step} (try a lower "
    "learning rate); no summary.json written"
  )


def _check_resume_files(
  config: ml_collections.ConfigDict, out_dir: str, step: int | None
) -> tuple[bytes | None, dict[str, Any] | None]:
  """:func:`qsync_jax.rundir.metrics.check_resume` on process 0, for all.

  Process 0 alone writes (and may alone see) the run's files; its verdict,
  or its error, reaches every process, so that all refuse the run or all
  go on.

  Returns:
    ``(metrics, finished)``: the bytes to write back to ``metrics.jsonl``
    (process 0; None elsewhere), and the summary of a run already finished
    at ``config.steps`` (on every process), else None.

  Raises:
    ValueError: process 0's refusal (one process).
    qsync_jax.process.coordination.CoordinationError: the same, on every
      process of a multi-process run.
  """
  if jax.process_count() == 1:
    return rundir.metrics.check_resume(out_dir, step, config.steps)
  store, key = coordination.client(), "qsync_resume_files"
  if jax.process_index() != 0:
    finished = coordination.share(
      store,
      key,
      source=0,
      process_index=jax.process_index(),
      what="its check of the run directory",
    )
    return None, finished
  try:
    metrics, finished = rundir.metrics.check_resume(out_dir, step, config.steps)
  except ValueError as e:
    # Raises the error on process 0 too, once the others have it.
    coordination.share(store, key, source=0, process_index=0, error=str(e))
    raise
  coordination.share(store, key, finished, source=0, process_index=0)
  return metrics, finished


def _finish_step(state: TrainState, out: Any) -> None:
  """Waits for every program of the last step, not only its metrics.

  The metrics come from the gradient functions; the update, and a sync
  step's parameter average, run after them. Waiting for the metrics alone
  left those in flight when the clock stopped for an eval, so the eval's
  excluded time took in the float32 mean's all-reduce of a data-parallel
  step.
  """
  jax.block_until_ready((out, state.params, state.opt_state))


def train_and_evaluate(
  config: ml_collections.ConfigDict, out_dir: str
) -> dict[str, Any]:
  """Runs the main job; see ``experiments/configs/default.py`` for fields.

  Before training, every process checks that the others run the same job
  (:func:`check_agreement`). SIGTERM makes every process checkpoint the
  step they agree on and return early; the ``PREEMPTED`` file it leaves makes
  the next call with the same directory resume, as ``config.resume`` does.

  Elastic runs and resumes onto other workers: :mod:`experiments
  .membership_lib` and :mod:`qsync_jax.process.run_start` (an elastic
  pool's ``config.cluster`` names one worker per slot; a later world
  resumes by itself; the global batch is kept;
  ``--plan=auto`` plans again, reusing :class:`qsync_jax.allocation
  .job_plans.PlanCache`; each change is recorded).

  Args:
    config: the job's config.
    out_dir: the run directory. With ``config.resume``, after a
      preemption, or in an elastic world after the first, a run continues
      from the newest checkpoint in ``out_dir/checkpoints``.

  Writes to ``out_dir`` (process 0 only):

  - ``summary.json``: final_eval_accuracy, final_eval_loss,
    final_train_loss, steps, steps_this_run, sync, compress,
    error_feedback, outer_optimizer, sync_rounds, comm_bytes (bytes each
    worker sent, ring all-reduce model), wall_time_s, train_time_s,
    examples_per_s, loss_scaling, skipped_steps, params_sha256, cluster,
    num_processes, plans_sha256, profiles (where each kind's profile came
    from, with auto plans), link (the launcher's --link and its measured
    rate, or null), host_malloc, workers [{kind, device, batch_size,
    plan}], precisions (per worker: {layer: precision}), membership (one
    entry per membership change of the run directory, see
    :class:`~qsync_jax.process.membership_record.MembershipRecord`).
  - ``metrics.jsonl``: one row per log/eval step (step, loss, accuracy,
    examples_per_s, loss_scale, H (the period of the step's round),
    sync_rounds, comm_bytes, num_workers, eval_loss, eval_accuracy), and
    the same numbers as TensorBoard scalars in ``tensorboard/``
    (:class:`qsync_jax.rundir.MetricWriter`).
  - ``plans/<kind>.json``: each device kind's PrecisionPlan.
  - ``allocation/``: with ``config.plan_mode="auto"`` (``--plan=auto``),
    the allocator's summary, scores (and their inputs' digest) and plans;
    ``profiles/<kind>.json``: each measured profile, with its inputs'
    digest.
  - ``curves.png``: training loss and accuracy, eval accuracy.
  - ``checkpoints/``: orbax checkpoints; ``config.resume`` (``--resume``)
    continues the newest one.
  - ``PREEMPTED``: after a preemption, until a run finishes: the agreed
    step, when it was agreed and its checkpoint's seconds.
  - ``.lock``: the :class:`~qsync_jax.rundir.OutDirLock` process 0 holds
    while it runs; a
    second run into ``out_dir`` meanwhile is refused (``ValueError``).

  Returns:
    The summary written to ``summary.json``; after a preemption
    ``{"preempted": True, "steps": step}`` (no summary is written;
    :func:`main` exits with
    :data:`~qsync_jax.process.membership.MEMBERSHIP_CHANGED_EXIT_CODE`).

  Raises:
    ValueError: a bad config (see ``validate_config``) or output directory;
      malformed ``QSYNC_ELASTIC_*`` variables, or a ``config.cluster``
      that does not name one worker per slot of the elastic pool; with
      ``config.resume``, a checkpoint of another model, optimizer or plans,
      one past ``config.steps``, one whose global batch has fewer examples
      than this run has workers, a damaged ``metrics.jsonl`` line other
      than its last, or a finished run without checkpoints. Each comes
      before the run writes into ``out_dir``. A run already finished at
      ``config.steps`` returns its ``summary.json`` and writes nothing.
    OSError: the file system refused a write (no space, read-only), naming
      the file; a failed checkpoint save leaves the earlier ones intact.
    FloatingPointError: the final parameters or eval loss are not finite;
      no ``summary.json`` is written (a stale one is removed).
    qsync_jax.process.agreement.AgreementError: the processes disagree.
  """
  # Before anything is written into out_dir (the lock file aside).
  config_lib.validate_config(config)
  limits_lib.check_sizes(config)
  rundir.make_out_dir(out_dir)
  # One run at a time in out_dir: process 0 holds its lock.
  with contextlib.ExitStack() as stack:
    lock = None
    if jax.process_index() == 0:
      lock = stack.enter_context(rundir.OutDirLock(out_dir))
    watch = stack.enter_context(preemption.PreemptionWatch())
    return _train_and_evaluate(config, out_dir, watch, lock)


def main(
  config: ml_collections.ConfigDict,
  out_dir: str,
  overrides: Mapping[str, Any] | None = None,
) -> None:
  """Runs the main job as ``python -m experiments.train`` does.

  Applies the shortcut flags' values to ``config``
  (:func:`experiments.flag_aliases.apply_overrides`), checks the config and
  creates ``out_dir`` before anything starts, joins the multi-process run
  the launcher or ``config.distributed`` describes
  (:func:`qsync_jax.process.initialize.initialize`; a single process on
  CPU gets one fake CPU device per worker), then runs
  :func:`train_and_evaluate`.

  Multi-process: started by srun, mpirun (Open MPI 4 or 5) or a Kubernetes
  indexed Job/JobSet, the same command needs no extra variables
  (jax.distributed detects the launcher; qsync_jax.process.detection fills
  in what it cannot); ``config.distributed.coordinator_address``,
  ``num_processes`` and ``process_id`` override what is detected. On one
  host, for development (one device per process; the launcher SIGKILLs
  every worker if one dies)::

    python -m qsync_jax.distributed --num_processes=4 -- \\
        python -m experiments.train --out_dir=runs/mp

  Before training the processes check that they agree (versions,
  XLA_FLAGS, config, initial parameters, data seed). SIGTERM makes every
  process checkpoint the step they agree on and exit with status
  :data:`~qsync_jax.process.membership.MEMBERSHIP_CHANGED_EXIT_CODE` (75,
  "start again": an elastic launcher starts the next world), leaving
  ``<out_dir>/PREEMPTED``; the same command then resumes from it. Under an
  elastic launcher (``QSYNC_ELASTIC_*``) ``--cluster`` names its pool, one
  worker per slot (or ``auto``), and each world trains on its slots' kinds.

  Bad input (a bad config value, a plan for a kind not in the cluster, an
  existing file as ``out_dir``, an ``out_dir`` another run holds or one
  with checkpoints but no ``--resume``, a ``--cluster`` that does not name
  one worker per slot of an elastic pool, ...) ends the program before
  training with one line ``error: ...`` on stderr and exit status 1. So do
  a run whose final parameters or eval loss are not finite (it writes no
  ``summary.json``) and processes that disagree or fail while planning
  (``error: process K disagrees with process 0 on FIELD: ...``, the same
  line on every process). A resume that does not fit ``out_dir`` (another
  model or optimizer, fewer steps than its checkpoint, a damaged
  ``metrics.jsonl``: :func:`train_and_evaluate`) is such a line too, and a
  full or read-only disk while the run writes is one line naming the path
  (:func:`qsync_jax.cli.disk_errors_exit`).

  Args:
    config: the job's config; ``overrides`` are applied to it in place.
    out_dir: the run directory (``--out_dir``).
    overrides: ``{flag: value}`` of the shortcut flags
      (:data:`experiments.flag_aliases.FLAG_ALIASES`); None values leave
      their fields alone.

  Raises:
    SystemExit: status 1 after the ``error:`` line; status 75 after a
      preemption.
  """
  cli.start_binary()
  # A full or read-only disk under out_dir: one line, naming the path.
  with (
    rundir.directory.refusal_leaves_no_dir(out_dir),
    cli.bad_input_exits(),
    cli.disk_errors_exit(out_dir),
  ):
    flag_aliases.apply_overrides(config, overrides or {})
    # Before anything starts (train_and_evaluate checks it again, for
    # library callers).
    config_lib.validate_config(config)
    limits_lib.check_sizes(config)
    rundir.make_out_dir(out_dir, "--out_dir")
    auto = config.cluster.strip().lower() == cluster_lib.AUTO
    # An elastic pool's --cluster names one worker per slot: checked now.
    world_cluster = membership_lib.world_config(
      config, membership.from_env()
    ).cluster
    dist = config.get("distributed", {})
    multi = initialize.initialize(
      timeout_s=dist.get("initialization_timeout_s", 300),
      heartbeat_timeout_s=dist.get("heartbeat_timeout_s", 100),
      shutdown_timeout_s=dist.get("shutdown_timeout_s", 300),
      local_devices=dist.get("local_devices", "auto"),
      coordinator_address=dist.get("coordinator_address"),
      num_processes=dist.get("num_processes"),
      process_id=dist.get("process_id"),
    )
    if not multi and not auto:
      # Single process: one fake CPU device per worker when running on CPU
      # (before the backend starts; it does not affect GPU backends).
      workers = cluster_lib.parse_cluster(world_cluster).num_workers
      limits_lib.check_fake_devices(config)
      jax.config.update("jax_num_cpu_devices", workers)
    cluster_lib.devices()  # JAX starts here, or names what stops it
    if jax.process_index() == 0:  # once per run
      for line in config_lib.unused_settings(config):
        print(f"warning: {line}", file=sys.stderr, flush=True)
    try:
      result = train_and_evaluate(config, out_dir)
    except FloatingPointError as e:  # diverged: not bad input, still a fail
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(1) from None
    except coordination.CoordinationError as e:
      # The processes disagree, or another failed while planning: the same
      # line on every process.
      print(f"error: {e}", file=sys.stderr, flush=True)
      raise SystemExit(1) from None
  if result.get("preempted"):
    # Checkpointed on a notice: "start again", not done.
    raise SystemExit(membership.MEMBERSHIP_CHANGED_EXIT_CODE)


def _train_and_evaluate(
  config: ml_collections.ConfigDict,
  out_dir: str,
  watch: preemption.PreemptionWatch,
  lock: rundir.OutDirLock | None = None,
) -> dict[str, Any]:
  """:func:`train_and_evaluate` with the preemption watch ``watch``.

  Every check that can refuse the run comes before the first write into
  ``out_dir``; ``lock`` (process 0's) then records its holder.
  """
  world = membership.from_env()
  config = membership_lib.world_config(config, world)
  if str(config.get("cluster", "")).strip().lower() == cluster_lib.AUTO:
    # One worker per device of jax.devices() (every process's), on a copy:
    # the caller's config keeps "auto".
    config = config.copy_and_resolve_references()
    with config.unlocked():
      config.cluster = cluster_lib.cluster_string(
        cluster_lib.resolve_cluster(cluster_lib.AUTO)
      )
  config_lib.validate_config(config)
  writer = jax.process_index() == 0
  rundir.make_out_dir(out_dir)
  rundir.directory.check_layout(out_dir)
  checkpoints_dir = os.path.join(out_dir, "checkpoints")
  preempted_path = os.path.join(out_dir, PREEMPTED)
  start = run_start.RunStart.open(
    out_dir,
    world,
    resume=config.resume,
    kinds=cluster_lib.parse_cluster(config.cluster).kinds,
    batch_mode=config.batch_mode,
    speeds=config.speeds,
  )
  checkpointer, resuming = start.checkpointer, start.resuming
  batch_sizes = start.batch_sizes
  schedule = config_lib.make_schedule(config)
  optimizer = config_lib.make_optimizer(config)
  loss_fn = config_lib.make_loss_fn(config)
  averager = config_lib.make_averager(config)
  outer_tx = config_lib.make_outer_optimizer(config)
  # A built-in name or a user's factory; a user's Grain dataset is read as
  # training goes, and its first examples size and plan the model.
  source = data_lib.open_dataset(
    config.dataset,
    integer_labels=not config.get("loss_fn"),
    **config_lib.to_plain(config.get("dataset_kwargs", {})),
  )
  # The data and memory a resume's (re-split) batches need.
  sized = membership_lib.sized_for(config, batch_sizes)
  dataset = data_lib.examples_in_memory(
    source,
    sized.batch_size
    * max(
      cluster_lib.parse_cluster(config.cluster).num_workers,
      config.allocator.num_batches,
    ),
  )
  # Before the model is built: its workers' steps fit where they run.
  limits_lib.check_model_memory(sized, dataset)
  model = config_lib.build_model(config, dataset)
  config_lib.check_model_fits(config, model, dataset)
  check_agreement(config, model)
  record = membership_record.MembershipRecord(world)
  record.mark("plan")
  plan_cache = plans_lib.plan_cache(config, out_dir)
  plans, result, profile_sources = plans_lib.job_plans(
    config, model, dataset, plan_cache
  )
  workers = make_workers(config, plans=plans, batch_sizes=batch_sizes)
  digest = sharing.check_plans({w.kind: w.plan for w in workers})
  logging.info("plans %s on %d process(es)", digest[:12], jax.process_count())
  record.mark("restore")
  sample = batcher_sample(dataset, workers)
  trainer = HybridTrainer(
    model,
    workers,
    optimizer,
    objective=loss_fn,
    sample=sample,
    sync=SyncSettings(
      schedule=schedule,
      averager=averager,
      error_feedback=config.get("error_feedback", False)
      and averager.name != "mean",
      outer_tx=outer_tx,
      opt_fields_to_average=config_lib.opt_fields(config),
    ),
    bn_stats=config.get("bn_stats", "reestimate"),
    seed=config.seed,
  )
  state = trainer.init()
  batcher = data_lib.training_batcher(
    source, [w.batch_size for w in workers], seed=config.seed
  )
  metrics_path = os.path.join(out_dir, "metrics.jsonl")
  if start.was_preempted or start.restarted:
    why = "was preempted" if start.was_preempted else "is a later elastic world"
    logging.info("%s %s: resuming from its checkpoint", out_dir, why)
  resumed_step = None
  if resuming and checkpointer is not None:
    # Onto other workers than the checkpoint's: restored onto these.
    restored = checkpointer.restore_latest(trainer, state)
    if restored is None:
      logging.info("no checkpoint in %s: starting from step 0", out_dir)
    else:
      state, meta = restored
      # A streamed dataset reads on from the checkpoint's position.
      batcher.load_state_dict(state.data, state.step)
      logging.info("resumed from step %d", state.step)
      resumed_step = state.step
      record.resumed(meta, [w.kind for w in workers], start.previous)
  elif resuming:
    logging.info("no checkpoint in %s: starting from step 0", out_dir)
  kept_metrics = None
  if resuming:
    if resumed_step is not None and resumed_step > config.steps:
      raise ValueError(
        f"--resume: the checkpoint in {checkpoints_dir} is at step "
        f"{resumed_step}, past config.steps={config.steps}; pass "
        f"--config.steps={resumed_step} or more to continue that run, or "
        "use a new --out_dir"
      )
    kept_metrics, finished = _check_resume_files(config, out_dir, resumed_step)
    if finished is not None:
      if checkpointer is not None:
        checkpointer.close()
      logging.info(
        "%s already holds this run, finished at step %d: nothing to do",
        out_dir,
        resumed_step,
      )
      return finished

  # Past every check: the run's first writes into out_dir.
  if lock is not None:
    lock.record()
  if checkpointer is None:
    checkpointer = Checkpointer(checkpoints_dir)
  if writer and result is not None:
    plan_cache.save(result)
  # Rows and TensorBoard events logged after the checkpoint go (a torn
  # last row too); a new run starts both anew. Process 0 writes them.
  metric_writer = rundir.MetricWriter(
    out_dir, start_step=state.step, kept_rows=kept_metrics
  )

  if writer:
    os.makedirs(os.path.join(out_dir, "plans"), exist_ok=True)
    for w in workers:
      files.write_text(
        os.path.join(out_dir, "plans", f"{w.kind}.json"), w.plan.to_json()
      )
  for i, w in enumerate(workers):
    logging.info(
      "worker %d: %s on %s, batch %d, plan %s",
      i,
      w.kind,
      w.device,
      w.batch_size,
      w.plan,
    )
  logging.info("loss scaling: %s", trainer.loss_scaling)
  logging.info(
    "sync %s (%d sync rounds planned over %d steps), averaging %s",
    schedule.name,
    len(schedule.sync_steps(config.steps)),
    config.steps,
    averager.name,
  )

  # Every update and averaging program compiles now, outside the training
  # clock; the first step (before the clock starts) compiles the rest.
  trainer.compile(state, config.steps)
  global_batch = sum(w.batch_size for w in workers)
  start = time.perf_counter()
  start_step = state.step
  window_start, window_step = start, state.step
  last_train, last_eval = {}, {}
  saved_step = None
  # Seconds spent in evals and checkpoints, left out of train_time_s.
  excluded = 0.0
  while state.step < config.steps:
    step = state.step
    state, out = trainer.train_step(
      state, batcher.worker_batches(step, trainer.local_workers)
    )
    done = state.step
    if done == start_step + 1:
      # The training clock starts once the first step (which compiles the
      # gradient functions) has run on every process: a local step has no
      # collective to wait at, and a process still compiling would share
      # the cores with the others' clocked steps.
      _finish_step(state, out)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("qsync training clock")
      train_start = time.perf_counter()
      record.first_step_done()
    row = None
    if done % config.log_every == 0 or done == config.steps:
      now = time.perf_counter()
      # Every metric the objective reports, averaged over local workers.
      last_train = {
        name: float(np.mean([float(m[name]) for m in out.values()]))
        for name in next(iter(out.values()))
      }
      rate = global_batch * (done - window_step) / (now - window_start)
      window_start, window_step = now, done
      row = {
        "step": done,
        **last_train,
        "examples_per_s": rate,
        "loss_scale": state.current_loss_scale,
        "H": schedule.round_length(done),
        "sync_rounds": state.sync_rounds,
        "comm_bytes": state.comm_bytes,
        "num_workers": trainer.num_workers,
      }
      logging.info(
        "step %d/%d %s %.0f examples/s",
        done,
        config.steps,
        _metrics_text(last_train),
        rate,
      )
    if config.eval_every and (
      done % config.eval_every == 0 or done == config.steps
    ):
      # The step's queued work finishes before the clock stops for the eval.
      _finish_step(state, out)
      eval_start = time.perf_counter()
      train_time = eval_start - train_start - excluded
      ev = trainer.evaluate(
        state,
        data_lib.eval_set(source),
        train_batches=bn_batches(config, batcher, trainer, state.step),
      )
      last_eval = {"step": done, **ev}
      excluded += time.perf_counter() - eval_start
      row = {
        **(row or {"step": done}),
        "train_time_s": train_time,
        **{f"eval_{name}": value for name, value in ev.items()},
      }
      logging.info("step %d eval %s", done, _metrics_text(ev))
    if row is not None:
      metric_writer.write(done, {k: v for k, v in row.items() if k != "step"})
    if config.checkpoint_every and (
      done % config.checkpoint_every == 0 or done == config.steps
    ):
      _finish_step(state, out)
      save_start = time.perf_counter()
      checkpointer.save(
        trainer,
        state.replace(data=batcher.state_dict()),
        record.checkpoint_meta(),
      )
      excluded += time.perf_counter() - save_start
      saved_step = done
    if watch.reached(done):
      # Every process reaches this at the same step (PreemptionWatch).
      agreed, save_start = time.time(), time.perf_counter()
      if saved_step != done:
        checkpointer.save(
          trainer,
          state.replace(data=batcher.state_dict()),
          record.checkpoint_meta(),
        )
      checkpointer.close()
      metric_writer.close()
      if writer:
        previous_run.write_preempted(
          preempted_path, done, agreed, time.perf_counter() - save_start
        )
      logging.info(
        "preempted: checkpointed step %d; the same command resumes it", done
      )
      return {"preempted": True, "steps": done}
    if "eval_loss" in (row or {}) or (
      config.checkpoint_every and done % config.checkpoint_every == 0
    ):
      # Throughput windows count training only, not evals or checkpoints.
      window_start, window_step = time.perf_counter(), done
  if state.step > start_step:
    _finish_step(state, out)
  wall = time.perf_counter() - start
  train_time = (
    time.perf_counter() - train_start - excluded
    if state.step > start_step
    else 0.0
  )
  final = (
    last_eval
    if last_eval.get("step") == state.step
    else {
      "step": state.step,
      **trainer.evaluate(
        state,
        data_lib.eval_set(source),
        train_batches=bn_batches(config, batcher, trainer, state.step),
      ),
    }
  )
  checkpointer.close()
  _check_finite_result(
    trainer,
    state,
    final["loss"],
    last_train.get("loss"),
    os.path.join(out_dir, "summary.json") if writer else None,
  )
  summary = {
    **{
      f"final_eval_{name}": value
      for name, value in final.items()
      if name != "step"
    },
    "final_train_loss": last_train.get("loss"),
    "steps": state.step,
    "steps_this_run": state.step - start_step,
    "sync": schedule.name,
    "compress": averager.name,
    "error_feedback": trainer.sync.error_feedback,
    "outer_optimizer": config.get("outer_optimizer", "none"),
    "sync_rounds": state.sync_rounds,
    "comm_bytes": state.comm_bytes,
    "wall_time_s": wall,
    # From the end of this run's first step (compilation), less evals
    # and checkpoints.
    "train_time_s": train_time,
    "examples_per_s": (
      global_batch * (state.step - start_step) / wall if wall > 0 else None
    ),
    "loss_scaling": trainer.loss_scaling,
    "skipped_steps": state.skipped_steps,
    "params_sha256": trainer.params_digest(state),
    "cluster": config.cluster,
    "num_processes": jax.process_count(),
    "plans_sha256": digest,
    # Where each kind's profile came from (auto plans), or None.
    "profiles": profile_sources,
    # The launcher's emulated link and its measured rate, or None.
    "link": links.link_info_from_env(),
    # The host allocator's mode (qsync_jax.host_malloc).
    "host_malloc": host_malloc.mode_from_env(),
    "workers": trainer_lib.describe_workers(trainer.workers),
    "precisions": [
      {k: v.value for k, v in eff.items()} for eff in trainer.precisions
    ],
    # One entry per membership change (membership_record.MembershipRecord).
    "membership": record.entries,
  }
  metric_writer.close()
  if writer:
    files.write_json(os.path.join(out_dir, "summary.json"), summary, indent=2)
    if os.path.exists(preempted_path):
      os.remove(preempted_path)
    if os.path.exists(metrics_path):
      plot_curves(metrics_path, os.path.join(out_dir, "curves.png"))
  logging.info("final eval %s; wrote %s", _metrics_text(final), out_dir)
  return summary
