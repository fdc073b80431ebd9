"""The main job's side of elastic membership: its world and its records.

This module owns what :mod:`experiments.train_lib` does about the workers
of a run changing from one of its processes' lives to the next
(:mod:`qsync_jax.parallel.membership` has the vocabulary):

- :func:`world_config`: in a world an elastic launcher started,
  ``--cluster`` names the pool, one worker per slot, and this run's workers
  are the kinds of the slots running now (``--cluster=auto``: the devices
  of this world);
- :class:`RunStart`: whether a run resumes (``--resume``, a
  ``PREEMPTED`` file, or a later elastic world, which resumes by itself)
  and with which batches: :func:`resume_batch_sizes` keeps the global batch
  its checkpoint records, re-split over other workers;
- the ``PREEMPTED`` file a run leaves when it checkpointed a step on a
  notice (:func:`write_preempted`), and what the next run reads of the run
  before it (:class:`PreviousRun`);
- :class:`MembershipRecord`: one entry per membership change the run
  directory went through, with the steps and seconds it cost, carried from
  run to run in the checkpoints' metadata and written to
  ``summary.json["membership"]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import math
import os
import time
from typing import Any

from absl import logging
import ml_collections

from experiments import config_lib
from experiments import run_files
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel.membership import Change
from qsync_jax.parallel.membership import ElasticWorld
from qsync_jax.train.checkpoint import Checkpointer

#: The file a run that checkpointed on a notice (SIGTERM) leaves in its
#: directory: the same command then resumes from that checkpoint without
#: --resume. It records ``{"step", "time", "checkpoint_s"}``: the step the
#: processes agreed on, ``time.time()`` when they did, and the seconds from
#: then until the checkpoint of that step was complete.
PREEMPTED = "PREEMPTED"

#: The causes of :data:`qsync_jax.parallel.membership.CAUSES` whose world
#: ended on a notice: its processes checkpointed an agreed step.
NOTICE_CAUSES = ("reclaimed", "returned")
#: The cause of an entry for a resume onto other workers without an elastic
#: launcher (``--resume`` with another ``--cluster``).
RESUME_CAUSE = "resume"

#: The phases of the restart timeline :class:`MembershipRecord` measures,
#: each from its mark to the next.
PHASES = ("plan", "restore", "compile")


def world_config(
  config: ml_collections.ConfigDict, world: ElasticWorld | None
) -> ml_collections.ConfigDict:
  """``config`` with the cluster of this elastic world.

  ``config.cluster`` names the pool, one worker per slot; the world's
  cluster is the kinds of its slots, in process order
  (:meth:`~qsync_jax.parallel.membership.ElasticWorld.select`). Manual plans
  for kinds of the pool that no slot of this world runs are dropped: the
  command is the same in every world.

  Args:
    config: the job's config (left unchanged).
    world: the world, or None when the run is not elastic.

  Returns:
    ``config`` itself when there is no world or its cluster is ``auto``
    (resolved from this world's devices); otherwise a copy.

  Raises:
    ValueError: ``config.cluster`` does not name one worker per slot.
  """
  cluster = str(config.get("cluster", ""))
  if world is None or cluster.strip().lower() == cluster_lib.AUTO:
    return config
  kinds = world.select(cluster_lib.parse_cluster(cluster).kinds)
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.cluster = cluster_lib.cluster_string(
      cluster_lib.ClusterSpec(tuple(kinds))
    )
    plans = config_lib.to_plain(config.get("plans", {})) or {}
    if any(kind not in kinds for kind in plans):
      config.plans = ml_collections.ConfigDict(
        {k: v for k, v in plans.items() if k in kinds}
      )
  return config


def split_batch(
  global_batch: int,
  kinds: Sequence[str],
  batch_mode: str,
  speeds: str | Mapping[str, float] = "",
) -> list[int]:
  """Splits ``global_batch`` over workers of ``kinds``.

  Args:
    global_batch: the examples of one step, over all workers.
    kinds: the workers' device kinds, in worker order.
    batch_mode: ``"equal"`` (as equal as possible: the remainder one each
      to the first workers) or ``"dynamic"`` (in proportion to ``speeds``,
      :func:`qsync_jax.parallel.cluster.dynamic_batch_sizes`).
    speeds: ``config.speeds`` (dynamic mode).

  Returns:
    One batch size per worker, summing to ``global_batch``.

  Raises:
    ValueError: fewer examples than workers, an unknown mode, or a kind
      without a speed.
  """
  n = len(kinds)
  if global_batch < n:
    raise ValueError(
      f"a global batch of {global_batch} examples cannot be split over "
      f"{n} workers (each needs one)"
    )
  if batch_mode == "equal":
    each, extra = divmod(global_batch, n)
    return [each + 1] * extra + [each] * (n - extra)
  if batch_mode == "dynamic":
    rates = cluster_lib.parse_speeds(speeds)
    missing = sorted(set(kinds) - set(rates))
    if missing:
      raise ValueError(f"config.speeds has no speed for {missing}")
    return cluster_lib.dynamic_batch_sizes(
      global_batch, [rates[k] for k in kinds]
    )
  raise ValueError(f"unknown batch_mode {batch_mode!r}; valid: equal, dynamic")


def resume_batch_sizes(
  config: ml_collections.ConfigDict, meta: Mapping[str, Any] | None
) -> list[int] | None:
  """The per-worker batches of a run that resumes from ``meta``.

  A run directory keeps the global batch its checkpoint records
  (``meta["batch_sizes"]``), so that the data continues with no example
  repeated or skipped: the same workers keep their saved batches; other
  workers (other kinds, or another count) split the same global batch
  (:func:`split_batch` in ``config.batch_mode``).

  Args:
    config: the job's config, its cluster resolved.
    meta: the newest checkpoint's metadata, or None (no checkpoint).

  Returns:
    The batch sizes, or None where the checkpoint records none (none, or
    one written before it recorded them): ``config``'s own then.

  Raises:
    ValueError: the global batch has fewer examples than this run has
      workers, or the split fails (see :func:`split_batch`).
  """
  saved = (meta or {}).get("batch_sizes")
  if not saved:
    return None
  saved = [int(b) for b in saved]
  kinds = list(cluster_lib.parse_cluster(config.cluster).kinds)
  total = sum(saved)
  if list(meta.get("kinds") or []) == kinds and len(saved) == len(kinds):
    sizes = saved
  elif total < len(kinds):
    raise ValueError(
      f"the checkpoint at step {meta.get('step')} was written with a global "
      f"batch of {total} examples, fewer than the {len(kinds)} workers of "
      f"--cluster={config.cluster}; resume on at most {total} workers, or "
      "start a new run directory"
    )
  else:
    sizes = split_batch(
      total, kinds, config.batch_mode, config.get("speeds", "")
    )
  if sizes != [config.batch_size] * len(kinds):
    logging.info(
      "the checkpoint's global batch of %d examples is kept: per-worker "
      "batches %s on %s (its own: %s on %s)",
      total,
      sizes,
      config.cluster,
      saved,
      _spec(meta.get("kinds") or []),
    )
  return sizes


def sized_for(
  config: ml_collections.ConfigDict, batch_sizes: Sequence[int] | None
) -> ml_collections.ConfigDict:
  """``config`` whose per-worker batch covers ``batch_sizes``, for the
  memory checks (a resume onto fewer workers gives each a larger batch).

  Returns:
    ``config`` itself when its ``batch_size`` is at least the even share
    of the global batch; else a copy with that share.
  """
  if not batch_sizes:
    return config
  share = math.ceil(sum(batch_sizes) / len(batch_sizes))
  if share <= config.batch_size:
    return config
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.batch_size = share
  return config


def write_preempted(path: str, step: int, agreed: float, seconds: float):
  """Writes the :data:`PREEMPTED` file.

  Args:
    path: the file.
    step: the checkpointed step, agreed by every process.
    agreed: ``time.time()`` when the step was agreed.
    seconds: from then until its checkpoint was complete.
  """
  run_files.write_json(
    path, {"step": step, "time": agreed, "checkpoint_s": seconds}
  )


@dataclasses.dataclass(frozen=True)
class RunStart:
  """How a run starts in its directory: anew, or from its checkpoint.

  Attributes:
    resuming: the run continues the directory's newest checkpoint: with
      ``config.resume``, after a preemption (:data:`PREEMPTED`), or in an
      elastic world after the first (``world.restart > 0``).
    was_preempted: the :data:`PREEMPTED` file is there.
    restarted: an elastic world after the first.
    previous: what the run before left (read before anything changes).
    checkpointer: the directory's checkpointer where ``checkpoints/``
      exists (opening one creates it), else None.
    batch_sizes: the per-worker batches a resume keeps
      (:func:`resume_batch_sizes`), or None (``config``'s own).
  """

  resuming: bool
  was_preempted: bool
  restarted: bool
  previous: PreviousRun
  checkpointer: Checkpointer | None
  batch_sizes: list[int] | None

  @classmethod
  def open(
    cls,
    config: ml_collections.ConfigDict,
    out_dir: str,
    world: ElasticWorld | None,
  ) -> RunStart:
    """Reads how the run in ``out_dir`` starts; writes nothing.

    Args:
      config: the job's config, its cluster resolved.
      out_dir: the run directory.
      world: the elastic world, or None.

    Raises:
      ValueError: ``out_dir`` holds checkpoints and the run does not
        resume, or what :func:`resume_batch_sizes` raises.
    """
    was_preempted = os.path.exists(os.path.join(out_dir, PREEMPTED))
    restarted = world is not None and world.restart > 0
    resuming = bool(config.resume) or was_preempted or restarted
    checkpoints = os.path.join(out_dir, "checkpoints")
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
      resume_batch_sizes(config, meta),
    )


def _number(value: Any) -> float | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value) if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class PreviousRun:
  """What the run before this one left in the run directory.

  Read before this run changes anything there.

  Attributes:
    preempted: the :data:`PREEMPTED` file's record (``step``, ``time``,
      ``checkpoint_s``; fields an older file lacks are absent), or None.
    last_logged_step: the largest step of ``metrics.jsonl`` (its whole
      records), or None.
  """

  preempted: Mapping[str, Any] | None
  last_logged_step: int | None

  @classmethod
  def read(cls, out_dir: str) -> PreviousRun:
    """Reads ``out_dir``'s :data:`PREEMPTED` and ``metrics.jsonl``."""
    preempted = None
    try:
      with open(os.path.join(out_dir, PREEMPTED)) as f:
        record = json.load(f)
      if isinstance(record, dict):
        preempted = record
    except (OSError, ValueError):
      pass
    last = None
    try:
      with open(os.path.join(out_dir, "metrics.jsonl"), "rb") as f:
        for line in f:
          try:
            step = json.loads(line).get("step")
          except (ValueError, AttributeError):
            continue  # a torn last record: the resume drops it
          if isinstance(step, int) and not isinstance(step, bool):
            last = step if last is None else max(last, step)
    except OSError:
      pass
    return cls(preempted, last)

  def last_step(self) -> int | None:
    """The last step the previous run reached, as far as its files tell."""
    steps = [
      s
      for s in (
        self.last_logged_step,
        (self.preempted or {}).get("step"),
      )
      if isinstance(s, int) and not isinstance(s, bool)
    ]
    return max(steps) if steps else None

  def notice(self, step: int, change: Change | None) -> tuple[float, float]:
    """``(agreed time, checkpoint seconds)`` of the notice that ended the
    previous run at ``step``, or ``(nan, nan)``.

    The :data:`PREEMPTED` record counts where it is of ``step`` and, for a
    change, was written after the change's event (not one left by an
    earlier world).
    """
    record = self.preempted or {}
    agreed = _number(record.get("time"))
    seconds = _number(record.get("checkpoint_s"))
    if (
      record.get("step") != step
      or agreed is None
      or seconds is None
      or (change is not None and agreed < change.event_time)
    ):
      return math.nan, math.nan
    return agreed, seconds


def _seconds(value: float) -> float | None:
  return None if math.isnan(value) else value


def _spec(kinds: Sequence[str]) -> str:
  return cluster_lib.cluster_string(cluster_lib.ClusterSpec(tuple(kinds)))


class MembershipRecord:
  """The membership changes of a run directory, and this run's own.

  Every checkpoint carries the list (:meth:`checkpoint_meta`); a resume reads it
  back (:meth:`resumed`) and, where its workers differ from the
  checkpoint's or an elastic launcher started it after a change, adds an
  entry for the change: ``{"step", "workers_before", "cluster_before",
  "workers_after", "cluster_after", "cause", "detail", "steps_lost",
  "seconds_lost", "breakdown"}``. The entry is completed at the end of the
  first step after the resume (:meth:`first_step_done`).

  The seconds are wall-clock times (``time.time()``, process 0's) and
  follow one another, so that the breakdown adds up to ``seconds_lost``,
  from the change's event to the end of the first step:

  - ``detect_s``: the event (the launcher's notice) until the processes
    agreed on a step (the :data:`PREEMPTED` record's time); after a death,
    the event (the launcher saw it) until the last process exited;
  - ``checkpoint_s``: that agreed step's checkpoint (None after a death);
  - ``restart_s``: the end of the checkpoint (after a death: the last exit)
    until this process starts building its workers: the processes' exit,
    the launcher's restart, the interpreter, JAX and the distributed
    runtime starting, the data loaded and the model built;
  - ``plan_s``: building the workers: the checkpoint's metadata read, the
    batch re-split, the plans (``--plan=auto``: planned again);
  - ``restore_s``: the trainer built and the checkpoint restored onto it;
  - ``compile_s``: the programs compiled and the first step run.

  Without an elastic launcher's change (``cause`` ``"resume"``: a manual
  ``--resume`` with another ``--cluster``), ``seconds_lost``, ``detect_s``
  and ``restart_s`` are None (the time between two commands is not the
  run's); ``checkpoint_s`` is the :data:`PREEMPTED` record's when the
  previous run ended on a notice.

  Args:
    world: the elastic world, or None.
  """

  def __init__(self, world: ElasticWorld | None = None):
    self.world = world
    self.entries: list[dict[str, Any]] = []
    self._pending: dict[str, Any] | None = None
    self._marks: dict[str, float] = {}

  def mark(self, phase: str) -> None:
    """Notes that ``phase`` (one of :data:`PHASES`) starts now."""
    if phase not in PHASES:
      raise ValueError(f"unknown phase {phase!r}; valid: {PHASES}")
    self._marks[phase] = time.time()

  def resumed(
    self,
    meta: Mapping[str, Any],
    kinds: Sequence[str],
    previous: PreviousRun,
  ) -> dict[str, Any] | None:
    """Takes the list from a restored checkpoint; adds this run's change.

    Marks the start of the ``compile`` phase.

    Args:
      meta: the restored checkpoint's metadata.
      kinds: this run's workers' kinds.
      previous: what the previous run left.

    Returns:
      The new entry (completed by :meth:`first_step_done`), or None where
      the workers are the checkpoint's and no change started this run.
    """
    self.mark("compile")
    self.entries = [dict(e) for e in meta.get("membership") or []]
    before = [str(k) for k in meta.get("kinds") or []]
    change = self.world.change if self.world is not None else None
    if before == list(kinds) and change is None:
      return None
    step = int(meta["step"])
    last = previous.last_step()
    agreed, saved_s = previous.notice(step, change)
    detect = restart = math.nan
    if change is not None and change.cause in NOTICE_CAUSES:
      detect = agreed - change.event_time
      restart = self._marks["plan"] - (
        change.exit_time if math.isnan(agreed) else agreed + saved_s
      )
    elif change is not None:  # died: the launcher saw the death at once
      detect = change.exit_time - change.event_time
      restart = self._marks["plan"] - change.exit_time
      saved_s = math.nan
    entry = {
      "step": step,
      "workers_before": len(before),
      "cluster_before": _spec(before) if before else "",
      "workers_after": len(kinds),
      "cluster_after": _spec(kinds),
      "cause": change.cause if change is not None else RESUME_CAUSE,
      "detail": (
        change.detail
        if change is not None and change.detail
        else f"resumed on {len(kinds)} workers from a checkpoint of "
        f"{len(before)}"
      ),
      "steps_lost": max(0, (last if last is not None else step) - step),
      "seconds_lost": None,
      "breakdown": {
        "detect_s": _seconds(detect),
        "checkpoint_s": _seconds(saved_s),
        "restart_s": _seconds(restart),
        "plan_s": self._marks["restore"] - self._marks["plan"],
        "restore_s": self._marks["compile"] - self._marks["restore"],
        "compile_s": None,
      },
    }
    self.entries.append(entry)
    self._pending = entry
    return entry

  def first_step_done(self) -> None:
    """Completes the entry :meth:`resumed` added (if any) and logs it."""
    entry, self._pending = self._pending, None
    if entry is None:
      return
    now = time.time()
    entry["breakdown"]["compile_s"] = now - self._marks["compile"]
    change = self.world.change if self.world is not None else None
    if change is not None:
      entry["seconds_lost"] = now - change.event_time
    logging.info("%s", describe(entry))

  def checkpoint_meta(self, data: Any) -> dict[str, Any]:
    """A checkpoint's extra metadata: the data position ``data`` and the
    record."""
    return {"data": data, "membership": self.entries}


def describe(entry: Mapping[str, Any]) -> str:
  """One log line of a membership entry."""
  lost = f"{entry['steps_lost']} step(s)"
  if entry.get("seconds_lost") is not None:
    lost += f" and {entry['seconds_lost']:.2f} s"
  parts = ", ".join(
    f"{name[:-2]} {value:.2f} s"
    for name, value in entry["breakdown"].items()
    if value is not None
  )
  return (
    f"membership change at step {entry['step']}: "
    f"{entry['cluster_before']} ({entry['workers_before']} workers) -> "
    f"{entry['cluster_after']} ({entry['workers_after']} workers), "
    f"{entry['cause']} ({entry['detail']}); {lost} lost ({parts})"
  )
