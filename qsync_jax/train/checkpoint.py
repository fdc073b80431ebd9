"""Checkpoints of a HybridTrainer with orbax.

This module owns what a checkpoint holds (:func:`state_tree`,
:func:`state_meta`, and :func:`load_state` to put it back) and how it is
written and read (:class:`Checkpointer`). A checkpoint holds the trainer's
arrays (parameters, optimizer state, loss scale, BatchNorm statistics,
error-feedback residuals, the averager's and the outer optimizer's state:
global arrays over the workers) and its host state as JSON (step, sync counters,
schedule state, the plans). Orbax writes a step to a temporary directory and
renames it when complete, so a run killed with SIGKILL mid-save leaves the
previous checkpoint intact; resuming restores the latest complete one and
continues bit-identically on CPU.

It also owns the checkpoints' integrity. A save records in the JSON metadata
the SHA-256 of every array shard it writes, keyed by the process that wrote it
(each process sees only its addressable shards), and of the host state. A
restore verifies both on what it read; a corrupt checkpoint (checksum
mismatch, unreadable, truncated, empty, no metadata) is skipped with one
warning line for the newest intact one, and set aside so that the resumed run
can save that step again. It never loads state that failed its check.

A checkpoint of another run's model or optimizer is not a corrupt one: before
any array is read, the shapes the checkpoint records (each parameter's, and
orbax's tree of the saved arrays) are compared with the trainer's, and the
first difference is a ``ValueError`` naming it; such a checkpoint is left
where it is. A save that fails for a reason of the file system (no space,
read-only, no permission) raises one ``OSError`` naming the step's directory;
the partial step is removed and the checkpoints before it stay intact.

A checkpoint resumes onto other workers than those that wrote it (another
count, or other device kinds; :mod:`.resharding` owns the mapping): its
arrays are read whole on every process at their saved shapes, checked
against every process's checksums, and every worker starts from the mean:
each floating array (parameters, optimizer state, loss scale, BatchNorm
statistics, residuals, the averager's and the outer optimizer's state) is
the float64 mean of the saved workers' rows, cast back, on every new
worker; integer leaves come from saved worker 0; the workers are in sync.
The model and optimizer must still match (everything but the workers axis),
and the same kinds with other plans is still refused. The metadata records
each worker's batch size (``batch_sizes``), and
:meth:`Checkpointer.latest_meta` reads the newest metadata alone, so that a
caller can build the new workers before the trainer exists.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import errno
import hashlib
import json
import logging as std_logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
from typing import Any

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from qsync_jax.task import sharding
from qsync_jax.train import layout
from qsync_jax.train import loss_scale as ls
from qsync_jax.train import resharding
from qsync_jax.train import step as step_lib
from qsync_jax.train.trainer import HybridTrainer


@contextlib.contextmanager
def _quiet(most: int = logging.WARNING) -> Iterator[None]:
  # Orbax logs a dozen INFO lines per save; keep the job's log readable.
  # Reads of a checkpoint being verified pass ERROR: what orbax warns about
  # a damaged one is said once, in the restore's own warning line.
  level = logging.get_verbosity()  # absl: larger means more verbose
  logging.set_verbosity(min(level, most))
  try:
    yield
  finally:
    logging.set_verbosity(level)


def state_tree(trainer: HybridTrainer) -> dict[str, Any]:
  """The arrays a checkpoint holds (global arrays over the workers)."""
  tree = {
    "params": trainer.params,
    "opt_state": trainer.opt_state,
    "loss_scale": trainer.loss_scale,
    "rest": trainer._stacked_rest(),
    "anchor": trainer._anchor,
    "counter": trainer._counter,
  }
  if trainer.residual is not None:
    tree["residual"] = trainer.residual
  if trainer.averager_state is not None:  # PowerSGD's warm-start Q
    tree["averager_state"] = trainer.averager_state
  if trainer.outer_state is not None:  # DiLoCo's outer optimizer state
    tree["outer_state"] = trainer.outer_state
  return tree


def state_meta(trainer: HybridTrainer) -> dict[str, Any]:
  """The host-side state a checkpoint holds (JSON)."""
  return {
    "step": trainer.step,
    "sync_rounds": trainer.sync_rounds,
    "comm_bytes": trainer.comm_bytes,
    "schedule": trainer.schedule.state_dict(),
    "in_sync": trainer.in_sync,
    "sync": trainer.schedule.name,
    "plans": [w.plan.to_dict() for w in trainer.workers],
    "kinds": [w.kind for w in trainer.workers],
    "batch_sizes": [w.batch_size for w in trainer.workers],
    "optimizer_state": _optimizer_state_layout(trainer),
    "param_shapes": param_specs(trainer),
  }


def _optimizer_state_layout(trainer: HybridTrainer) -> str:
  """``"flat"`` for an optimizer declared elementwise, else ``"pytree"``."""
  return "flat" if step_lib.is_elementwise(trainer.tx) else "pytree"


def _path_name(path: tuple[Any, ...]) -> str:
  """A pytree key path as dotted names, e.g. ``opt_state.0.mu``."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return ".".join(parts)


def _describe(spec: tuple[tuple[int, ...], str] | None) -> str:
  return "absent" if spec is None else f"{spec[0]} {spec[1]}"


def param_specs(trainer: HybridTrainer) -> list[list[Any]]:
  """Each model parameter's path, shape and dtype, in the flat vector's order.

  A checkpoint's parameters are one flat vector per worker; these name what
  its entries are, so that a resume with another model can name the first
  parameter that differs.

  Returns:
    ``[[path, shape, dtype], ...]``, e.g. ``["conv1.kernel", [3, 3, 1, 16],
    "float32"]`` (JSON).
  """
  shapes = jax.eval_shape(
    trainer._unravel,
    jax.ShapeDtypeStruct((trainer.num_params,), jnp.float32),
  )
  return [
    [_path_name(path).removesuffix(".value"), list(x.shape), str(x.dtype)]
    for path, x in jax.tree_util.tree_leaves_with_path(shapes)
  ]


#: What each top-level entry of :func:`state_tree` belongs to, for messages:
#: the config field that changes it, in words.
_STATE_OWNERS = {
  "params": "model",
  "anchor": "model",
  "rest": "model",
  "opt_state": "optimizer",
  "residual": "error-feedback setting",
  "averager_state": "averager",
  "outer_state": "outer optimizer",
}


def _array_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{dotted path: (shape, dtype)}`` of the array leaves of ``tree``."""
  return {
    _path_name(path).removesuffix(".value"): (
      tuple(int(n) for n in leaf.shape),
      str(leaf.dtype),
    )
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
  }


def _structure_mismatch(
  meta: dict[str, Any],
  saved: Any,
  trainer: HybridTrainer,
  per_worker: bool = False,
) -> tuple[str, str] | None:
  """How the trainer's state differs from a checkpoint's, or None.

  Args:
    meta: the checkpoint's JSON metadata.
    saved: orbax's metadata tree of its arrays (shapes and dtypes).
    trainer: the trainer to restore into.
    per_worker: compare each array without its leading workers axis (a
      resume onto another number of workers).

  Returns:
    ``(what, difference)``: what differs (``"model"``, ``"optimizer"``, ...)
    and the first entry that does, with both shapes.
  """
  if isinstance(meta.get("param_shapes"), list):
    theirs = {p[0]: (tuple(p[1]), p[2]) for p in meta["param_shapes"]}
    ours = {p[0]: (tuple(p[1]), p[2]) for p in param_specs(trainer)}
    for path in [*ours, *(p for p in theirs if p not in ours)]:
      if theirs.get(path) != ours.get(path):
        return "model", (
          f"parameter {path} is {_describe(theirs.get(path))} in the "
          f"checkpoint and {_describe(ours.get(path))} in this run"
        )
  theirs = _array_specs(saved)
  ours = _array_specs(state_tree(trainer))

  def row(spec: tuple[tuple[int, ...], str] | None) -> Any:
    return spec if spec is None or not per_worker else (spec[0][1:], spec[1])

  for path in [*ours, *(p for p in theirs if p not in ours)]:
    if row(theirs.get(path)) != row(ours.get(path)):
      what = _STATE_OWNERS.get(path.split(".")[0], "trainer state")
      return what, (
        f"{path} is {_describe(theirs.get(path))} in the checkpoint and "
        f"{_describe(ours.get(path))} in this run"
      )
  return None


#: File-system errors of a save: the disk is full, or not writable.
WRITE_ERRNOS = (
  errno.ENOSPC,
  errno.EDQUOT,
  errno.EROFS,
  errno.EACCES,
  errno.EPERM,
)


def write_errno(error: BaseException) -> int | None:
  """The file-system errno behind a failed write, or None.

  Orbax raises Python's ``OSError`` for what it does itself, and
  tensorstore a ``ValueError`` whose text carries the OS error code (e.g.
  ``RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']``);
  both are looked for along the exception's causes.

  Returns:
    One of :data:`WRITE_ERRNOS`, or None for any other error.
  """
  seen: set[int] = set()
  todo: list[BaseException | None] = [error]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
      return e.errno
    for code in re.findall(r"os_error_code='?(\d+)", str(e)):
      if int(code) in WRITE_ERRNOS:
        return int(code)
    todo += [e.__cause__, e.__context__]
  return None


def _join_orbax_threads(timeout_s: float = 10.0) -> None:
  """Waits for the threads of a failed orbax call to end.

  The first failing write ends the save while orbax's other threads may
  still be failing theirs; each logs its traceback as it ends, so the caller
  waits for them under :func:`_quiet`.
  """
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and type(
      thread
    ).__module__.startswith("orbax."):
      thread.join(max(0.0, deadline - time.monotonic()))


def _drop_late_callbacks() -> None:
  """Silences what orbax's writes print after a failed save is raised.

  When one write of a save fails (a full disk), orbax closes its event loop
  while tensorstore still finishes the other writes: each of their
  callbacks raises ``RuntimeError('Event loop is closed')``, and at exit the
  abandoned write coroutines fail to close. Python prints every one as an
  unraisable exception, dozens of tracebacks after the failure itself was
  raised (:meth:`Checkpointer.save`). This filter on ``sys.unraisablehook``
  drops those two kinds and passes everything else on; installed once.
  """
  previous = sys.unraisablehook
  if getattr(previous, "qsync_drops_late_callbacks", False):
    return

  def hook(unraisable: Any) -> None:
    error = unraisable.exc_value
    code = getattr(unraisable.object, "cr_code", None)
    if (
      isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    ) or f"{os.sep}orbax{os.sep}" in getattr(code, "co_filename", ""):
      return
    previous(unraisable)

  hook.qsync_drops_late_callbacks = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook
  # The same abandoned writes, when garbage-collected, are logged by asyncio
  # as "Task exception was never retrieved" with the write's traceback.
  std_logging.getLogger("asyncio").addFilter(_drop_abandoned_orbax_tasks)


def _drop_abandoned_orbax_tasks(record: std_logging.LogRecord) -> bool:
  """False (drop) for asyncio's record of a failed save's abandoned write."""
  if "exception was never retrieved" not in record.getMessage():
    return True
  tb = record.exc_info[2] if record.exc_info else None
  files = [f.filename for f in traceback.extract_tb(tb)] if tb else []
  return not any(f"{os.sep}orbax{os.sep}" in f for f in files)


def load_state(
  trainer: HybridTrainer, tree: dict[str, Any], meta: dict[str, Any]
) -> None:
  """Restores :func:`state_tree` and :func:`state_meta` output into
  ``trainer``.

  Args:
    trainer: the trainer to restore into.
    tree: the arrays: global arrays over the trainer's workers, or, when
      the checkpoint's workers are of other kinds
      (:func:`.resharding.reshards`), the saved rows as numpy, mapped by
      :func:`.resharding.reshard`.
    meta: the host state.

  Raises:
    ValueError: the checkpoint was written for the same kinds of workers
      with other plans.
  """
  _check_workers(trainer, meta)
  resharded = resharding.reshards(trainer, meta)
  if resharded:
    tree = resharding.reshard(trainer, tree, state_tree(trainer), meta)
  trainer.params = tree["params"]
  # A synced checkpoint's anchor is its params: keep them one array. The
  # workers of a reshard all start from the mean, in sync.
  trainer._anchor = (
    trainer.params if resharded or meta.get("in_sync", True) else tree["anchor"]
  )
  trainer._counter = tree["counter"]
  if trainer.residual is not None:
    trainer.residual = tree["residual"]
  if trainer.averager_state is not None:
    trainer.averager_state = tree["averager_state"]
  if trainer.outer_state is not None:
    trainer.outer_state = tree["outer_state"]
  trainer.opt_state = tree["opt_state"]
  trainer.loss_scale = ls.LossScale(*tree["loss_scale"])
  for i in trainer.local_workers:
    trainer.rest[i] = layout.unstack_tree(
      tree["rest"], trainer.workers[i].device, like=trainer.rest[i]
    )
  trainer.step = int(meta["step"])
  trainer.sync_rounds = int(meta["sync_rounds"])
  trainer.comm_bytes = float(meta["comm_bytes"])
  trainer.schedule.load_state_dict(meta.get("schedule", {}))


#: The key of the integrity record in a checkpoint's JSON metadata.
INTEGRITY = "integrity"


def _index_key(index: tuple[slice, ...]) -> str:
  # Where a shard sits in its global array, e.g. "1:2,:,:".
  return ",".join(
    f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"
    for s in index
  )


def array_digests(tree: Any) -> dict[str, dict[str, str]]:
  """SHA-256 of every array shard this process holds.

  Args:
    tree: a pytree of ``jax.Array`` (e.g. :func:`state_tree` output).

  Returns:
    ``{leaf path: {shard index: hex digest}}`` over this process's
    addressable shards (a replicated shard is hashed once).
  """
  out: dict[str, dict[str, str]] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shards = out.setdefault(jax.tree_util.keystr(path), {})
    for shard in leaf.addressable_shards:
      key = _index_key(shard.index)
      if key not in shards:
        data = np.ascontiguousarray(np.asarray(shard.data))
        shards[key] = hashlib.sha256(data.tobytes()).hexdigest()
  return out


def meta_digest(meta: dict[str, Any]) -> str:
  """SHA-256 of a checkpoint's JSON metadata.

  Args:
    meta: the metadata, as JSON reads it back.

  Returns:
    The hex digest of ``meta`` without its integrity record, keys sorted.
  """
  body = {k: v for k, v in meta.items() if k != INTEGRITY}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _allgather_json(obj: Any) -> list[Any]:
  """``obj`` (JSON) from every process, in process order; a collective."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size])))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[: int(n)])) for row, n in zip(rows, sizes[:, 0])]


def _one_line(error: Exception) -> str:
  # Orbax and tensorstore errors span lines; the warning must not.
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= 160 else text[:157] + "..."


def _array_problem(meta: dict[str, Any], tree: Any) -> str | None:
  """Why the arrays read do not match the checksums saved, or None."""
  want = meta[INTEGRITY].get("arrays", {}).get(str(jax.process_index()))
  if want is None:
    return f"it holds no checksums for process {jax.process_index()}"
  got = array_digests(tree)
  for key in sorted(set(want) | set(got)):
    if want.get(key) != got.get(key):
      return f"checksum mismatch in {key}"
  return None


def _check_workers(trainer: HybridTrainer, meta: dict[str, Any]) -> None:
  # Raises the ValueError of load_state before any array is read.
  plans = [w.plan.to_dict() for w in trainer.workers]
  kinds = [w.kind for w in trainer.workers]
  if meta.get("kinds") == kinds and meta.get("plans") != plans:
    # The same workers: name the first plan that differs.
    saved = meta.get("plans") or []
    i = next(
      (i for i, p in enumerate(plans) if i >= len(saved) or saved[i] != p), 0
    )
    raise ValueError(
      "the checkpoint was written by a run with other workers or plans "
      f"(worker {i}, {kinds[i]}: plan {saved[i] if i < len(saved) else None} "
      f"vs {plans[i]}); resume with the same cluster and plans, or start a "
      "new run directory"
    )
  # Other kinds of workers reshard (.resharding): their parameters are
  # averaged, so a round saved mid-way needs no parameter-averaging schedule.
  saved_sync = meta.get("sync", "a schedule that averages parameters")
  if (
    meta.get("kinds") == kinds
    and not meta.get("in_sync", True)
    and trainer.schedule.averages_gradients_at(int(meta["step"]) + 1)
  ):
    # Averaged gradients keep equal parameters equal; they would keep these
    # apart for good.
    raise ValueError(
      f"the checkpoint was saved mid-round of sync {saved_sync!r}, its "
      "workers' parameters apart, and this run's sync "
      f"{trainer.schedule.name!r} averages gradients at step "
      f"{int(meta['step']) + 1}, which needs them equal; resume with the "
      "schedule it was saved with, or start a new run directory"
    )
  # Checkpoints from before the declaration existed hold pytree states.
  saved = meta.get("optimizer_state", "pytree")
  if saved != _optimizer_state_layout(trainer):
    raise ValueError(
      f"the checkpoint holds a {saved} optimizer state and this run's "
      f"optimizer keeps a {_optimizer_state_layout(trainer)} one: declare "
      "it as the saving run did (qsync_jax.elementwise(tx) keeps a flat "
      "state), or start a new run directory"
    )


class Checkpointer:
  """Saves and restores a :class:`HybridTrainer` under ``directory``.

  A checkpoint holds values, not the parameters' sharding annotations
  (:mod:`qsync_jax.task.sharding`): those belong to the model, which the
  resumed run builds again from its code, and the arrays are the trainer's
  own layout (a row per worker over its ``workers`` axis) whatever the
  annotations say. A model annotated differently, or not at all, resumes
  the same values. A mesh in context does not move the trainer's state.

  Args:
    directory: where checkpoints live (one subdirectory per step).
    max_to_keep: how many recent checkpoints to keep.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    _drop_late_callbacks()
    # ERROR: orbax warns about a damaged step here; restore_latest says it.
    with _quiet(logging.ERROR):
      self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep,
          create=True,
          # A save blocks until done anyway; saved synchronously, a failed
          # write is raised at once, with no background thread left
          # waiting for a step directory that was never made.
          enable_async_checkpointing=False,
        ),
      )

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def latest_meta(self) -> dict[str, Any] | None:
    """The JSON metadata of the newest checkpoint whose metadata is intact.

    No array is read (cheap, and possible before the trainer exists, e.g.
    to build the workers from the saved ``batch_sizes``). A checkpoint whose
    metadata fails its check is passed over for an older one and left where
    it is; :meth:`restore_latest` checks the arrays too, and may restore an
    older step than this one's when they are damaged.

    Returns:
      The metadata, or None when no checkpoint has intact metadata.
    """
    with _quiet(logging.ERROR):
      self._manager.reload()
    for step in sorted(self._manager.all_steps(), reverse=True):
      meta, problem = self._read_meta(step)
      if problem is None:
        return meta
    return None

  @sharding.without_mesh
  def save(
    self, trainer: HybridTrainer, extra_meta: dict | None = None
  ) -> None:
    """Saves the trainer's state at its current step (blocks until done).

    The JSON metadata also holds the checksums of the host state and of
    every array shard, per process (a collective in multi-process runs).

    Args:
      trainer: the trainer to save.
      extra_meta: more JSON to store beside the host state.

    Raises:
      OSError: the file system refused the write (no space, read-only, no
        permission: :data:`WRITE_ERRNOS`), naming the step's directory; the
        partial step is removed (single process) and the checkpoints before
        it are intact.
    """
    tree = state_tree(trainer)
    # Through JSON first, so the digest covers what a restore reads back.
    meta = json.loads(json.dumps({**state_meta(trainer), **(extra_meta or {})}))
    digests = _allgather_json(array_digests(tree))
    meta[INTEGRITY] = {
      "meta": meta_digest(meta),
      "arrays": {str(k): d for k, d in enumerate(digests)},
    }
    previous = self._manager.latest_step()
    try:
      # FATAL: a failed save is raised below; orbax's threads would also log
      # its traceback several times over.
      with _quiet(logging.FATAL):
        try:
          self._manager.save(
            trainer.step,
            args=ocp.args.Composite(
              state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
          )
          self._manager.wait_until_finished()
        except Exception:
          _join_orbax_threads()
          raise
    except Exception as e:  # pylint: disable=broad-except
      code = write_errno(e)
      if code is None:
        raise
      self._discard_partial(trainer.step)
      kept = (
        "there is none before it"
        if previous is None
        else f"step {previous} before it is intact"
      )
      raise OSError(
        code,
        f"{os.strerror(code)}; checkpoint step {trainer.step} was not saved "
        f"({kept})",
        os.path.join(self.directory, str(trainer.step)),
      ) from None

  def _discard_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left, to free its space.

    Only a single process may: in a multi-process run another one may still
    be writing there, and the next run's orbax ignores the leftover.
    """
    if jax.process_count() > 1:
      return
    prefix = f"{step}.orbax-checkpoint-tmp"
    with contextlib.suppress(OSError):
      for name in os.listdir(self.directory):
        if name.startswith(prefix):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  @sharding.without_mesh
  def restore_latest(self, trainer: HybridTrainer) -> dict[str, Any] | None:
    """Restores the newest intact checkpoint into ``trainer``.

    A newer checkpoint that fails its check is skipped with one warning line
    on stderr and moved to ``corrupt-<step>`` beside the others, so that the
    resumed run can save that step again. A checkpoint without checksums
    (written before they existed) is restored with a warning.

    A checkpoint written by workers of other kinds (another count, or a
    kind that differs) is resharded onto the trainer's workers: each starts
    from the saved workers' mean (:mod:`.resharding`), in sync.

    Returns:
      The checkpoint's JSON metadata (its ``kinds`` are the saving
      workers'), or None when there is no checkpoint.

    Raises:
      ValueError: the checkpoint was written by the same kinds of workers
        with other plans, or is of another model or optimizer (left in
        place), or no checkpoint under the directory is intact.
    """
    with _quiet(logging.ERROR):
      self._manager.reload()
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      state_tree(trainer),
    )
    bad = []
    for step in steps:
      tree, meta, problem = self._read(step, trainer, abstract)
      # Every process must restore the same step: a step is corrupt when
      # any process finds it so.
      problems = _allgather_json(problem)
      problem = "; ".join(
        p if len(problems) == 1 else f"process {k}: {p}"
        for k, p in enumerate(problems)
        if p
      )
      if not problem:
        break
      bad.append(f"step {step}: {problem}")
    else:
      raise ValueError(
        f"no intact checkpoint in {self.directory}: " + "; ".join(bad)
      )
    if bad:
      moved = self._set_aside(steps[: len(bad)])
      print(
        f"warning: skipped corrupt checkpoint(s) in {self.directory} "
        f"({'; '.join(bad)}); moved them to {', '.join(moved)} and "
        f"restored step {step}",
        file=sys.stderr,
      )
    if INTEGRITY not in meta:
      print(
        f"warning: checkpoint step {step} in {self.directory} has no "
        "checksums (written by an older version) and cannot be "
        "verified",
        file=sys.stderr,
      )
    load_state(trainer, tree, meta)
    return meta

  def _read(
    self, step: int, trainer: HybridTrainer, abstract: Any
  ) -> tuple[Any, Any, str | None]:
    """Reads and verifies one checkpoint: (tree, meta, problem or None).

    A checkpoint of other kinds of workers (:func:`.resharding.reshards`)
    is read as numpy at its saved shapes, whole on every process.

    Raises:
      ValueError: the checkpoint was written for the same kinds of workers
        with other plans, or is of another model or optimizer (its arrays'
        shapes differ).
    """
    meta, problem = self._read_meta(step)
    if meta is None:
      return None, None, problem
    _check_workers(trainer, meta)
    reshard = resharding.reshards(trainer, meta)
    try:
      saved = ocp.StandardCheckpointHandler().metadata(
        epath.Path(self.directory) / str(step) / "state"
      )
    except Exception as e:  # pylint: disable=broad-except
      return None, None, f"its arrays' metadata is unreadable ({_one_line(e)})"
    mismatch = _structure_mismatch(meta, saved.tree, trainer, reshard)
    if mismatch is not None:
      what, difference = mismatch
      raise ValueError(
        f"checkpoint step {step} in {self.directory} is of another {what}: "
        f"{difference}; resume with the {what} it was saved with, or start "
        "a new run directory"
      )
    if reshard:
      # Every process needs every saved row for the mean: numpy targets
      # read the arrays whole, at the shapes they were saved with.
      specs = _array_specs(saved.tree)
      abstract = jax.tree_util.tree_map_with_path(
        lambda path, a: np.empty(
          specs[_path_name(path).removesuffix(".value")][0], a.dtype
        ),
        state_tree(trainer),
      )
    try:
      with _quiet(logging.ERROR):
        tree = self._manager.restore(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
        )["state"]
    except Exception as e:  # pylint: disable=broad-except
      return None, None, f"its arrays are unreadable ({_one_line(e)})"
    if INTEGRITY in meta:
      problem = (
        resharding.digest_problem(tree, meta[INTEGRITY].get("arrays"))
        if reshard
        else _array_problem(meta, tree)
      )
      if problem:
        return None, None, problem
    return tree, meta, None

  def _read_meta(self, step: int) -> tuple[Any, str | None]:
    """Reads and verifies one checkpoint's JSON metadata: (meta or None,
    problem or None)."""
    # Orbax and tensorstore raise many kinds of errors on missing, truncated
    # or garbled files; each of them means this checkpoint is unreadable.
    try:
      with _quiet(logging.ERROR):
        meta = self._manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
    except Exception as e:  # pylint: disable=broad-except
      return None, f"its metadata is unreadable ({_one_line(e)})"
    if not isinstance(meta, dict):
      return None, "it has no metadata"
    record = meta.get(INTEGRITY, {})
    if not isinstance(record, dict):
      return None, "its checksum record is not a JSON object"
    if record and meta_digest(meta) != record.get("meta"):
      return None, "checksum mismatch in its metadata"
    return meta, None

  def _set_aside(self, steps: list[int]) -> list[str]:
    """Moves corrupt checkpoints out of orbax's way; returns their names."""
    names = []
    for step in steps:
      name, n = f"corrupt-{step}", 1
      while os.path.exists(os.path.join(self.directory, name)):
        n += 1
        name = f"corrupt-{step}-{n}"
      names.append(name)
    names = _allgather_json(names)[0]  # the primary's names, on every process
    if jax.process_index() == 0:
      for step, name in zip(steps, names):
        os.replace(
          os.path.join(self.directory, str(step)),
          os.path.join(self.directory, name),
        )
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("qsync_checkpoint_set_aside")
    with _quiet(logging.ERROR):
      self._manager.reload()
    return names

  def close(self) -> None:
    with _quiet():
      self._manager.close()
