"""The main job: hybrid-cluster training from a config, with outputs on disk.

This module owns ``main(config, out_dir, overrides)``, everything the
``experiments/train.py`` binary does after reading its flags (the shortcut
flags applied, the config parsed once, the sizes checked, a multi-process
run joined, bad input as one ``error:`` line), and
``train_and_evaluate(job, out_dir)``, which it calls and library callers may
call directly. A run is split as MaxText splits one: :func:`setup` maps the
cluster spec onto the JAX devices present, builds one worker per device
with its kind's precision plan (and its batch size, equal or proportional
to device speed), a :class:`~qsync_jax.train.trainer.HybridTrainer` and its
state (restored where the run resumes); :func:`experiments.train_loop
.train_loop` runs the steps and :func:`experiments.train_loop.finalize`
writes ``summary.json`` and the curves. In a multi-process run
(``qsync_jax.process.initialize``) every process runs its own workers and
only process 0 writes the files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import contextlib
import math
import os
import sys
import types
from typing import Any, NamedTuple

from absl import logging
from flax import nnx
import jax
import ml_collections

from experiments import config_lib
from experiments import flag_aliases
from experiments import limits_lib
from experiments import plans_lib
from experiments import train_loop
from qsync_jax import cli
from qsync_jax import data as data_lib
from qsync_jax import files
from qsync_jax import models as models_lib
from qsync_jax import rundir
from qsync_jax.allocation import sharing
from qsync_jax.numerics import selfcheck
from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan import devices as devices_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import agreement
from qsync_jax.process import coordination
from qsync_jax.process import initialize
from qsync_jax.process import membership
from qsync_jax.process import membership_record
from qsync_jax.process import preemption
from qsync_jax.process import run_start
from qsync_jax.process.membership import ElasticWorld
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker


def world_job(
  job: config_lib.JobConfig, world: ElasticWorld | None
) -> config_lib.JobConfig:
  """``job`` with the cluster this process's world trains on.

  In an elastic world ``config.cluster`` names the pool, one worker per
  slot, and the world's workers are the kinds of its slots
  (:func:`qsync_jax.process.membership.world_kinds`); manual plans for
  kinds no slot of this world runs are dropped
  (:func:`~qsync_jax.process.membership.world_plans`): the command is the
  same in every world. ``--cluster=auto`` is left to
  :func:`resolve_cluster` (this world's devices).

  Raises:
    ValueError: ``config.cluster`` does not name one worker per slot.
  """
  auto = job.cluster.strip().lower() == cluster_lib.AUTO
  if world is not None and not auto:
    kinds = membership.world_kinds(
      cluster_lib.parse_cluster(job.cluster).kinds, world
    )
    spec = cluster_lib.ClusterSpec(tuple(kinds))
    job = job.replace(
      cluster=cluster_lib.cluster_string(spec),
      plans=types.MappingProxyType(membership.world_plans(job.plans, kinds)),
    )
  return job


def resolve_cluster(job: config_lib.JobConfig) -> config_lib.JobConfig:
  """``job`` whose ``--cluster=auto`` is one worker per device of
  ``jax.devices()`` (every process's); JAX starts here.

  Raises:
    ValueError: a manual plan names a kind the resolved cluster lacks.
  """
  if job.cluster.strip().lower() != cluster_lib.AUTO:
    return job
  spec = cluster_lib.resolve_cluster(cluster_lib.AUTO)
  if job.plan_mode == "manual":
    config_lib.check_plan_kinds(job.plans, spec)
  return job.replace(cluster=cluster_lib.cluster_string(spec))


def make_workers(
  job: config_lib.JobConfig,
  plans: Mapping[str, PrecisionPlan] | None = None,
  batch_sizes: Sequence[int] | None = None,
  devices: Sequence[Any] | None = None,
) -> list[Worker]:
  """Builds the workers of ``job.cluster`` with their plans and batches.

  ``plans`` (default ``job.plans``) maps a device kind to its plan; kinds it
  does not name train in FP32, and a kind the cluster does not have is an
  error. ``job.batch_mode`` is ``"equal"`` (``job.batch_size`` each) or
  ``"dynamic"`` (QSync's DB baseline: the global batch
  ``batch_size * num_workers`` split in proportion to ``job.speeds``);
  ``batch_sizes``, one per worker, are used instead where given (a resume
  keeps its checkpoint's global batch:
  :func:`qsync_jax.process.run_start.resume_batch_sizes`).

  Raises:
    ValueError: a bad cluster spec, too few devices, a plan for a kind not in
      the cluster, or a bad batch mode or speed.
  """
  spec = cluster_lib.parse_cluster(job.cluster)
  devices = cluster_lib.assign_devices(spec, devices)
  plans = job.plans if plans is None else plans
  config_lib.check_plan_kinds(plans, spec)
  sizes = list(batch_sizes or ()) or cluster_lib.split_batch(
    job.batch_size * spec.num_workers, spec.kinds, job.batch_mode, job.speeds
  )
  return [
    Worker(d, k, plans.get(k, PrecisionPlan()), b)
    for d, k, b in zip(devices, spec.kinds, sizes)
  ]


def check_agreement(job: config_lib.JobConfig, model: nnx.Module) -> None:
  """Checks that every process has the same run before any collective.

  Compares the library versions, ``XLA_FLAGS``, the config (less its
  ``distributed`` settings, which may differ per process, and its plans,
  which :func:`qsync_jax.allocation.sharing.check_plans` compares once
  planned, naming the kind and field), the initial parameters' count and
  digest and the data-order seed (:mod:`qsync_jax.process.agreement`); a
  no-op with one process.

  Raises:
    qsync_jax.process.agreement.AgreementError: naming the process and the
      field that differ, or a process that did not report in time.
  """
  if jax.process_count() == 1:
    return
  plain = {
    k: v for k, v in job.to_plain().items() if k not in ("distributed", "plans")
  }
  logging.info("checking that %d processes agree", jax.process_count())
  agreement.check(
    agreement.local_facts(
      config=plain, params=nnx.state(model, nnx.Param), data_seed=job.seed
    )
  )


def _check_resume_files(
  job: config_lib.JobConfig, out_dir: str, step: int | None
) -> tuple[bytes | None, dict[str, Any] | None]:
  """:func:`qsync_jax.rundir.metrics.check_resume` on process 0, for all.

  Process 0 alone writes (and may alone see) the run's files; its verdict,
  or its error, reaches every process, so that all refuse the run or all
  go on.

  Returns:
    ``(metrics, finished)``: the bytes to write back to ``metrics.jsonl``
    (process 0; None elsewhere), and the summary of a run already finished
    at ``job.steps`` (on every process), else None.

  Raises:
    ValueError: process 0's refusal (one process).
    qsync_jax.process.coordination.CoordinationError: the same, on every
      process of a multi-process run.
  """
  if jax.process_count() == 1:
    return rundir.metrics.check_resume(out_dir, step, job.steps)
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
    metrics, finished = rundir.metrics.check_resume(out_dir, step, job.steps)
  except ValueError as e:
    # Raises the error on process 0 too, once the others have it.
    coordination.share(store, key, source=0, process_index=0, error=str(e))
    raise
  coordination.share(store, key, finished, source=0, process_index=0)
  return metrics, finished


def _kind_precisions(job: config_lib.JobConfig, kind: str) -> set[Precision]:
  """The precisions ``kind``'s workers may compute: a manual plan's (FP16
  too where it goes below 16 bits: the floored layers'), else the
  allocator's candidates the kind supports."""
  supported = devices_lib.supported_precisions(kind)
  if job.plan_mode != "manual":
    return {Precision.parse(p) for p in job.allocator.candidates} & supported
  plan = job.plans.get(kind, PrecisionPlan())
  used = plan.precisions()
  return used | ({Precision.FP16} if min(p.bits for p in used) < 16 else set())


def numerics_check(job: config_lib.JobConfig) -> dict[str, Any]:
  """The numerics self-check of this process's kinds, before anything is
  planned or traced (:func:`qsync_jax.numerics.selfcheck.run`, mode
  ``job.numerics_check``): each low-precision contraction the kinds' plans
  may use, compiled on the first local device of each kind. A wrong one is
  switched to a safe path for this process (every step traced after it, the
  predictor's and the trainer's, takes that path), or stops the run.

  Returns:
    The check's record; in a multi-process run, every process's under
    ``"processes"`` (process order).

  Raises:
    qsync_jax.numerics.selfcheck.NumericsCheckError: mode ``"error"`` and
      a wrong contraction.
  """
  spec = cluster_lib.parse_cluster(job.cluster)
  local: dict[str, Any] = {}
  for device, kind in zip(cluster_lib.assign_devices(spec), spec.kinds):
    if device.process_index == jax.process_index():
      local.setdefault(kind, device)
  record = selfcheck.run(
    local,
    {k: selfcheck.signatures_for(_kind_precisions(job, k)) for k in local},
    mode=job.numerics_check,
    quant={k: p.quant for k, p in job.plans.items()},
  )
  logging.info(
    "numerics check: %d checks, %d switches in %.2f s",
    len(record["checks"]),
    len(record["switches"]),
    record["seconds"],
  )
  if jax.process_count() > 1:
    processes = coordination.gather(
      coordination.client(),
      record,
      jax.process_index(),
      jax.process_count(),
      prefix="qsync_numerics_check",
      timeout_s=job.distributed.planning_timeout_s,
      what="its numerics check",
    )
    record = {"mode": record["mode"], "processes": processes}
  return record


class _Plans(NamedTuple):
  """The workers a run trains, and how their plans came about."""

  workers: list[Worker]
  digest: str
  result: Any
  sources: Mapping[str, str] | None
  cache: Any


def _open_data(
  job: config_lib.JobConfig, batch_sizes: Sequence[int] | None
) -> tuple[Any, data_lib.Dataset]:
  """The dataset (a built-in name or a user's factory; a user's Grain
  dataset is read as training goes) and the examples the model and the
  planning are sized with, checked against this host's memory at the
  per-worker batch a resume's re-split batches need."""
  source = data_lib.open_dataset(
    job.dataset, integer_labels=not job.loss_fn, **job.dataset_kwargs
  )
  sized = job
  if batch_sizes:
    share = math.ceil(sum(batch_sizes) / len(batch_sizes))
    sized = job.replace(batch_size=max(job.batch_size, share))
  num_workers = cluster_lib.parse_cluster(job.cluster).num_workers
  dataset = data_lib.examples_in_memory(
    source, sized.batch_size * max(num_workers, job.allocator.num_batches)
  )
  # Before the model is built: its workers' steps fit where they run.
  limits_lib.check_model_memory(sized, dataset)
  return source, dataset


def _plan_workers(
  job: config_lib.JobConfig,
  model: nnx.Module,
  dataset: data_lib.Dataset,
  out_dir: str,
  batch_sizes: Sequence[int] | None,
) -> _Plans:
  """The workers with their plans (planned here with ``--plan=auto``),
  checked to be the same on every process."""
  cache = plans_lib.plan_cache(job, out_dir)
  plans, result, sources = plans_lib.job_plans(job, model, dataset, cache)
  workers = make_workers(job, plans=plans, batch_sizes=batch_sizes)
  digest = sharing.check_plans({w.kind: w.plan for w in workers})
  logging.info("plans %s on %d process(es)", digest[:12], jax.process_count())
  return _Plans(workers, digest, result, sources, cache)


def _restore(
  job: config_lib.JobConfig,
  out_dir: str,
  start: run_start.RunStart,
  trainer: HybridTrainer,
  batcher: Any,
  record: membership_record.MembershipRecord,
  placeholders: bool = False,
) -> tuple[Any, bytes | None, dict[str, Any] | None]:
  """The state the run starts from, restored where it resumes.

  ``placeholders``: the model's weights are placeholders
  (:func:`qsync_jax.models.placeholder_weights`), so a checkpoint must be
  restored.

  Returns:
    ``(state, kept_metrics, finished)``: the state; the bytes
    ``metrics.jsonl`` keeps (process 0 of a resume; else None); the summary
    of a run already finished at ``job.steps``, else None.

  Raises:
    ValueError: a checkpoint past ``job.steps``, or what the checkpoint
      and the run directory's files refuse.
  """
  state = trainer.init()
  if start.was_preempted or start.restarted:
    why = "was preempted" if start.was_preempted else "is a later elastic world"
    logging.info("%s %s: resuming from its checkpoint", out_dir, why)
  restored = None
  if start.resuming and start.checkpointer is not None:
    # Onto other workers than the checkpoint's: restored onto these.
    restored = start.checkpointer.restore_latest(trainer, state)
  if not start.resuming:
    return state, None, None
  if restored is None and placeholders:
    raise ValueError(
      f"the checkpoints in {os.path.join(out_dir, run_start.CHECKPOINTS_DIR)}"
      " were removed while the run started; start it again"
    )
  if restored is None:
    logging.info("no checkpoint in %s: starting from step 0", out_dir)
    resumed_step = None
  else:
    state, meta = restored
    # A streamed dataset reads on from the checkpoint's position.
    batcher.load_state_dict(state.data, state.step)
    logging.info("resumed from step %d", state.step)
    resumed_step = state.step
    record.resumed(meta, [w.kind for w in trainer.workers], start.previous)
    if resumed_step > job.steps:
      raise ValueError(
        f"--resume: the checkpoint in "
        f"{os.path.join(out_dir, run_start.CHECKPOINTS_DIR)} is at step "
        f"{resumed_step}, past config.steps={job.steps}; pass "
        f"--config.steps={resumed_step} or more to continue that run, or "
        "use a new --out_dir"
      )
  kept, finished = _check_resume_files(job, out_dir, resumed_step)
  return state, kept, finished


def _build_trainer(
  job: config_lib.JobConfig,
  model: nnx.Module,
  workers: list[Worker],
  dataset: data_lib.Dataset,
) -> HybridTrainer:
  """The trainer of ``workers``, traced with one worker's batch."""
  b = workers[0].batch_size
  return HybridTrainer(
    model,
    workers,
    config_lib.make_optimizer(job),
    objective=config_lib.make_loss_fn(job),
    sample=(dataset.x_train[:b], dataset.y_train[:b]),
    sync=config_lib.sync_settings(job),
    bn_stats=job.bn_stats,
    seed=job.seed,
  )


def _log_run(job: config_lib.JobConfig, trainer: HybridTrainer) -> None:
  for i, w in enumerate(trainer.workers):
    logging.info(
      "worker %d: %s on %s, batch %d, plan %s",
      i,
      w.kind,
      w.device,
      w.batch_size,
      w.plan,
    )
  schedule = trainer.sync.schedule
  logging.info("loss scaling: %s", trainer.loss_scaling)
  logging.info(
    "sync %s (%d sync rounds planned over %d steps), averaging %s",
    schedule.name,
    len(schedule.sync_steps(job.steps)),
    job.steps,
    trainer.sync.averager.name,
  )


def setup(
  job: config_lib.JobConfig,
  out_dir: str,
  watch: preemption.PreemptionWatch,
  lock: rundir.OutDirLock | None = None,
) -> train_loop.Run | dict[str, Any]:
  """Sets a run up: its workers, trainer and state, ready for the loop.

  Every check that can refuse the run comes before the first write into
  ``out_dir``; ``lock`` (process 0's) then records its holder.

  Returns:
    The :class:`experiments.train_loop.Run`; or, for a run directory that
    already holds this run finished at ``job.steps``, its summary.
  """
  world = membership.from_env()
  job = resolve_cluster(world_job(job, world))
  rundir.make_out_dir(out_dir)
  rundir.directory.check_layout(out_dir)
  start = run_start.RunStart.open(
    out_dir,
    world,
    resume=job.resume,
    kinds=cluster_lib.parse_cluster(job.cluster).kinds,
    batch_mode=job.batch_mode,
    speeds=job.speeds,
  )
  source, dataset = _open_data(job, start.batch_sizes)
  # The checkpoint's weights replace the initial ones: not initialized where
  # nothing reads them first (every initializer shape is an XLA compile).
  placeholders = start.restores_checkpoint and not plans_lib.reads_weights(job)
  if placeholders:
    logging.info("resuming: the model's weights come from the checkpoint")
    model = models_lib.placeholder_weights(
      lambda: config_lib.build_model(job, dataset)
    )
  else:
    model = config_lib.build_model(job, dataset)
  num_classes = config_lib.check_model_fits(job, model, dataset)
  check_agreement(job, model)
  # Before the predictor or the trainer traces a contraction.
  checked = numerics_check(job)
  record = membership_record.MembershipRecord(world)
  record.mark("plan")
  planned = _plan_workers(job, model, dataset, out_dir, start.batch_sizes)
  record.mark("restore")
  trainer = _build_trainer(job, model, planned.workers, dataset)
  batcher = data_lib.training_batcher(
    source, [w.batch_size for w in planned.workers], seed=job.seed
  )
  state, kept, finished = _restore(
    job, out_dir, start, trainer, batcher, record, placeholders
  )
  if finished is not None:
    if start.checkpointer is not None:
      start.checkpointer.close()
    logging.info(
      "%s already holds this run, finished at step %d: nothing to do",
      out_dir,
      state.step,
    )
    return finished
  # Past every check: the run's first writes into out_dir.
  if lock is not None:
    lock.record()
  checkpointer = start.checkpointer or Checkpointer(
    os.path.join(out_dir, run_start.CHECKPOINTS_DIR)
  )
  writes = jax.process_index() == 0
  if writes and planned.result is not None:
    planned.cache.save(planned.result)
  # Rows and TensorBoard events logged after the checkpoint go (a torn
  # last row too); a new run starts both anew. Process 0 writes them.
  metric_writer = rundir.MetricWriter(
    out_dir, start_step=state.step, kept_rows=kept
  )
  if writes:
    os.makedirs(os.path.join(out_dir, "plans"), exist_ok=True)
    for w in trainer.workers:
      files.write_text(
        os.path.join(out_dir, "plans", f"{w.kind}.json"), w.plan.to_json()
      )
  _log_run(job, trainer)
  return train_loop.Run(
    job,
    out_dir,
    trainer,
    state,
    source,
    batcher,
    checkpointer,
    metric_writer,
    record,
    watch,
    planned.digest,
    planned.sources,
    num_classes,
    numerics_check=checked,
  )


def run(
  job: config_lib.JobConfig, out_dir: str, watch: preemption.PreemptionWatch
) -> dict[str, Any]:
  """Setup, the loop and its end, under ``out_dir``'s lock (process 0)."""
  with contextlib.ExitStack() as stack:
    lock = None
    if jax.process_index() == 0:
      # One run at a time in out_dir: process 0 holds its lock.
      lock = stack.enter_context(rundir.OutDirLock(out_dir))
    ready = setup(job, out_dir, watch, lock)
    if not isinstance(ready, train_loop.Run):
      return ready
    loop = train_loop.train_loop(ready)
    if loop.preempted:
      return {"preempted": True, "steps": loop.state.step}
    return train_loop.finalize(ready, loop)


def train_and_evaluate(
  job: config_lib.JobConfig, out_dir: str
) -> dict[str, Any]:
  """Runs the main job; see ``experiments/configs/default.py`` for fields.

  Before training, every process checks that the others run the same job
  (:func:`check_agreement`). SIGTERM makes every process checkpoint the
  step they agree on and return early; the ``PREEMPTED`` file it leaves makes
  the next call with the same directory resume, as ``config.resume`` does.

  Elastic runs and resumes onto other workers: :func:`world_job` and
  :mod:`qsync_jax.process.run_start` (an elastic
  pool's ``config.cluster`` names one worker per slot; a later world
  resumes by itself; the global batch is kept;
  ``--plan=auto`` plans again, reusing :class:`qsync_jax.allocation
  .job_plans.PlanCache`; each change is recorded).

  Args:
    job: the job's config (:func:`experiments.config_lib.parse`).
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
    ValueError: a size this host cannot hold, or a bad output directory;
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
  limits_lib.check_sizes(job)
  rundir.make_out_dir(out_dir)
  with preemption.PreemptionWatch() as watch:
    return run(job, out_dir, watch)


def main(
  config: ml_collections.ConfigDict,
  out_dir: str,
  overrides: Mapping[str, Any] | None = None,
) -> None:
  """Runs the main job as ``python -m experiments.train`` does.

  Applies the shortcut flags' values to ``config``
  (:func:`experiments.flag_aliases.apply_overrides`), parses and checks it
  once (:func:`experiments.config_lib.parse`) and creates ``out_dir`` before
  anything starts, joins the multi-process run
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
    job = config_lib.parse(config)  # the one parse and check of the config
    limits_lib.check_sizes(job)
    rundir.make_out_dir(out_dir, "--out_dir")
    _join(job)
    if jax.process_index() == 0:  # once per run
      for line in config_lib.unused_settings(job):
        print(f"warning: {line}", file=sys.stderr, flush=True)
    try:
      with preemption.PreemptionWatch() as watch:
        result = run(job, out_dir, watch)
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


def _join(job: config_lib.JobConfig) -> None:
  """Joins the multi-process run the launcher or ``config.distributed``
  describes; a single process on CPU gets one fake CPU device per worker
  (before the backend starts; it does not affect GPU backends). JAX starts
  here, or this names what stops it."""
  # An elastic pool's --cluster names one worker per slot: checked now.
  world_cluster = world_job(job, membership.from_env()).cluster
  dist = job.distributed
  multi = initialize.initialize(
    timeout_s=dist.initialization_timeout_s,
    heartbeat_timeout_s=dist.heartbeat_timeout_s,
    shutdown_timeout_s=dist.shutdown_timeout_s,
    local_devices=dist.local_devices,
    coordinator_address=dist.coordinator_address,
    num_processes=dist.num_processes,
    process_id=dist.process_id,
  )
  if not multi and job.cluster.strip().lower() != cluster_lib.AUTO:
    limits_lib.check_fake_devices(job)
    jax.config.update(
      "jax_num_cpu_devices",
      cluster_lib.parse_cluster(world_cluster).num_workers,
    )
  cluster_lib.devices()
