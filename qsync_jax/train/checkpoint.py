"""Checkpoints of a training state with orbax.

This module owns how a :class:`~qsync_jax.train.state.TrainState` is written
and read (:class:`Checkpointer`); what a checkpoint holds is
:mod:`.saved_state`'s (the state's arrays, global arrays over the workers,
and its host fields and the trainer's workers and plans as JSON), its
checksums :mod:`.integrity`'s. Orbax writes a step to a temporary directory
and renames it when complete, so a run killed with SIGKILL mid-save leaves
the previous checkpoint intact; resuming restores the latest complete one
and continues bit-identically on CPU.

A restore verifies the checksums of what it read; a corrupt checkpoint
(checksum mismatch, unreadable, truncated, empty, no metadata) is skipped
with one warning line for the newest intact one, and set aside so that the
resumed run can save that step again. It never loads state that failed its
check.

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

from collections.abc import Callable, Iterator
import contextlib
import json
import logging as std_logging
import os
import shutil
import sys
import threading
import time
import traceback
from typing import Any, NamedTuple

from absl import logging
from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from qsync_jax import files
from qsync_jax.task import sharding
from qsync_jax.train import integrity
from qsync_jax.train import resharding
from qsync_jax.train import saved_state
from qsync_jax.train.state import TrainState
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


def _drop_late_callbacks() -> Callable[[], None]:
  """Silences what orbax's writes print around a failed save.

  When one write of a save fails (a full disk), orbax closes its event loop
  while tensorstore still finishes the other writes: each of their
  callbacks raises ``RuntimeError('Event loop is closed')`` from asyncio's
  ``call_soon_threadsafe``, most of them before the failure reaches
  :meth:`Checkpointer.save`, and at exit the abandoned write coroutines fail
  to close. Python prints every one as an unraisable exception, dozens of
  tracebacks beside the failure itself. This filter on
  ``sys.unraisablehook`` drops those two kinds (the closed-loop error raised
  by asyncio itself, a coroutine of orbax's) and passes everything else on.
  A save installs it for its writes and keeps it once one has failed; a
  restore for its reads, kept once one found a damaged checkpoint (orbax's
  failed reads leave the same callbacks behind).

  Returns:
    A function that puts back the hook and the log filters as they were
    (nothing to do when the filter was installed already).
  """
  previous = sys.unraisablehook
  if getattr(previous, "qsync_drops_late_callbacks", False):
    return lambda: None

  def hook(unraisable: Any) -> None:
    if _is_closed_loop_callback(unraisable) or _is_orbax_coroutine(unraisable):
      return
    previous(unraisable)

  hook.qsync_drops_late_callbacks = True  # type: ignore[attr-defined]
  sys.unraisablehook = hook
  # The same abandoned writes, when garbage-collected, are logged by asyncio
  # as "Task exception was never retrieved" with the write's traceback.
  asyncio_log = std_logging.getLogger("asyncio")
  added = _drop_abandoned_orbax_tasks not in asyncio_log.filters
  asyncio_log.addFilter(_drop_abandoned_orbax_tasks)

  def undo() -> None:
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous
    if added:  # one a failed save left before stays
      asyncio_log.removeFilter(_drop_abandoned_orbax_tasks)

  return undo


def _is_closed_loop_callback(unraisable: Any) -> bool:
  """An ``Event loop is closed`` error raised by asyncio's own check."""
  error = unraisable.exc_value
  if not (
    isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
  ):
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback)
  return bool(frames) and (
    frames[-1].name == "_check_closed"
    and frames[-1].filename.endswith(os.path.join("asyncio", "base_events.py"))
  )


def _is_orbax_coroutine(unraisable: Any) -> bool:
  code = getattr(unraisable.object, "cr_code", None)
  return f"{os.sep}orbax{os.sep}" in getattr(code, "co_filename", "")


def _drop_abandoned_orbax_tasks(record: std_logging.LogRecord) -> bool:
  """False (drop) for asyncio's record of a failed save's abandoned write."""
  if "exception was never retrieved" not in record.getMessage():
    return True
  tb = record.exc_info[2] if record.exc_info else None
  files = [f.filename for f in traceback.extract_tb(tb)] if tb else []
  return not any(f"{os.sep}orbax{os.sep}" in f for f in files)


def _one_line(error: Exception) -> str:
  # Orbax and tensorstore errors span lines; the warning must not.
  text = " ".join(str(error).split()) or type(error).__name__
  return text if len(text) <= 160 else text[:157] + "..."


class Restored(NamedTuple):
  """What :meth:`Checkpointer.restore_latest` restored.

  Attributes:
    state: the restored training state.
    meta: the checkpoint's JSON metadata (``kinds``: the saving workers').
  """

  state: TrainState
  meta: dict[str, Any]


def _checked_directory(directory: Any, max_to_keep: Any) -> str:
  """``directory`` as an absolute path, refused where no checkpoint could be
  written: not a path, empty, a file or under one."""
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(
      f"Checkpointer directory must be a path (str or os.PathLike), got "
      f"{type(directory).__name__}"
    )
  if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int):
    raise TypeError(
      f"Checkpointer max_to_keep must be an int, got {max_to_keep!r}"
    )
  if max_to_keep < 1:
    raise ValueError(
      f"Checkpointer max_to_keep must be >= 1, got {max_to_keep}: a "
      "checkpointer that keeps none could not restore"
    )
  if not os.fspath(directory):
    raise ValueError(
      "Checkpointer directory is empty; name the directory checkpoints go "
      "in (e.g. 'runs/a/checkpoints')"
    )
  path = os.path.abspath(directory)
  parent = path
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    where = "is" if parent == path else f"lies under {parent!r}, which is"
    raise ValueError(
      f"Checkpointer directory {path!r} {where} a file, not a directory; "
      "point it at a directory (it is created if missing)"
    )
  return path


class Checkpointer:
  """Saves and restores the :class:`~qsync_jax.train.state.TrainState` of a
  :class:`HybridTrainer` under ``directory``.

  A checkpoint holds values, not the parameters' sharding annotations
  (:mod:`qsync_jax.task.sharding`): those belong to the model, which the
  resumed run builds again from its code, and the arrays are the trainer's
  own layout (a row per worker over its ``workers`` axis) whatever the
  annotations say. A model annotated differently, or not at all, resumes
  the same values. A mesh in context does not move the trainer's state.

  Args:
    directory: where checkpoints live (one subdirectory per step).
    max_to_keep: how many recent checkpoints to keep.

  Raises:
    TypeError: ``directory`` is not a path or ``max_to_keep`` not an int.
    ValueError: ``directory`` is empty, a file or under one, or
      ``max_to_keep`` is below 1.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = _checked_directory(directory, max_to_keep)
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
    self,
    trainer: HybridTrainer,
    state: TrainState,
    extra_meta: dict[str, Any] | None = None,
  ) -> None:
    """Saves ``state`` at its step (blocks until done).

    The JSON metadata also holds the checksums of the host state and of
    every array shard, per process (a collective in multi-process runs).

    Args:
      trainer: the trainer the state is of.
      state: the state to save.
      extra_meta: more JSON to store beside the host state.

    Raises:
      OSError: the file system refused the write (no space, read-only, no
        permission: :data:`qsync_jax.files.WRITE_ERRNOS`), naming the step's directory; the
        partial step is removed (single process) and the checkpoints before
        it are intact.
    """
    tree = saved_state.state_tree(trainer, state)
    # Through JSON first, so the digest covers what a restore reads back.
    meta = json.loads(
      json.dumps(
        {**saved_state.state_meta(trainer, state), **(extra_meta or {})}
      )
    )
    digests = integrity.allgather_json(integrity.array_digests(tree))
    meta[integrity.INTEGRITY] = {
      "meta": integrity.meta_digest(meta),
      "arrays": {str(k): d for k, d in enumerate(digests)},
    }
    previous = self._manager.latest_step()
    try:
      # FATAL: a failed save is raised below; orbax's threads would also log
      # its traceback several times over.
      with _quiet(logging.FATAL):
        # Installed before the writes: their failing callbacks come before
        # the failure is raised. Kept after a failure, when more come.
        restore_hooks = _drop_late_callbacks()
        try:
          self._manager.save(
            state.step,
            args=ocp.args.Composite(
              state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
          )
          self._manager.wait_until_finished()
        except Exception:
          _join_orbax_threads()
          raise
        restore_hooks()
    except Exception as e:  # pylint: disable=broad-except
      code = files.write_errno(e)
      if code is None:
        raise
      self._discard_partial(state.step)
      kept = (
        "there is none before it"
        if previous is None
        else f"step {previous} before it is intact"
      )
      raise OSError(
        code,
        f"{os.strerror(code)}; checkpoint step {state.step} was not saved "
        f"({kept})",
        os.path.join(self.directory, str(state.step)),
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
  def restore_latest(
    self, trainer: HybridTrainer, state: TrainState
  ) -> Restored | None:
    """The newest intact checkpoint, as a state of ``trainer``.

    A newer checkpoint that fails its check is skipped with one warning line
    on stderr and moved to ``corrupt-<step>`` beside the others, so that the
    resumed run can save that step again. A checkpoint without checksums
    (written before they existed) is restored with a warning.

    A checkpoint written by workers of other kinds (another count, or a
    kind that differs) is resharded onto the trainer's workers: each starts
    from the saved workers' mean (:mod:`.resharding`), in sync.

    Args:
      trainer: the trainer to restore into.
      state: a state of the trainer (e.g. :meth:`HybridTrainer.init`'s):
        the arrays' shapes and shardings, and what stays the trainer's own
        on a reshard.

    Returns:
      The :class:`Restored` state and the checkpoint's JSON metadata (its
      ``kinds`` are the saving workers'), or None when there is no
      checkpoint.

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
      saved_state.state_tree(trainer, state),
    )
    bad: list[str] = []
    # Installed before the reads, kept once one has failed (see
    # _drop_late_callbacks).
    restore_hooks = _drop_late_callbacks()
    for step in steps:
      try:
        tree, meta, problem = self._read(step, trainer, state, abstract)
      except ValueError:  # of another model or plans: refused, not damaged
        if not bad:
          restore_hooks()
        raise
      # Every process must restore the same step: a step is corrupt when
      # any process finds it so.
      problems = integrity.allgather_json(problem)
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
    if not bad:
      restore_hooks()
    if bad:
      moved = self._set_aside(steps[: len(bad)])
      print(
        f"warning: skipped corrupt checkpoint(s) in {self.directory} "
        f"({'; '.join(bad)}); moved them to {', '.join(moved)} and "
        f"restored step {step}",
        file=sys.stderr,
      )
    if integrity.INTEGRITY not in meta:
      print(
        f"warning: checkpoint step {step} in {self.directory} has no "
        "checksums (written by an older version) and cannot be "
        "verified",
        file=sys.stderr,
      )
    return Restored(saved_state.load_state(trainer, state, tree, meta), meta)

  def _read(
    self, step: int, trainer: HybridTrainer, state: TrainState, abstract: Any
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
    saved_state.check_compatible(trainer, meta)
    reshard = resharding.reshards(trainer, meta)
    try:
      saved = ocp.StandardCheckpointHandler().metadata(
        epath.Path(self.directory) / str(step) / "state"
      )
    except Exception as e:  # pylint: disable=broad-except
      return None, None, f"its arrays' metadata is unreadable ({_one_line(e)})"
    mismatch = saved_state.structure_mismatch(
      meta, saved.tree, trainer, state, reshard
    )
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
      specs = saved_state.array_specs(saved.tree)
      abstract = jax.tree_util.tree_map_with_path(
        lambda path, a: np.empty(
          specs[saved_state.path_name(path).removesuffix(".value")][0],
          a.dtype,
        ),
        saved_state.state_tree(trainer, state),
      )
    try:
      with _quiet(logging.ERROR):
        tree = self._manager.restore(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
        )["state"]
    except Exception as e:  # pylint: disable=broad-except
      return None, None, f"its arrays are unreadable ({_one_line(e)})"
    if integrity.INTEGRITY in meta:
      problem = (
        integrity.digest_problem(tree, meta[integrity.INTEGRITY].get("arrays"))
        if reshard
        else integrity.array_problem(meta, tree)
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
    record = meta.get(integrity.INTEGRITY, {})
    if not isinstance(record, dict):
      return None, "its checksum record is not a JSON object"
    if record and integrity.meta_digest(meta) != record.get("meta"):
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
    names = integrity.allgather_json(names)[
      0
    ]  # the primary's names, on every process
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
