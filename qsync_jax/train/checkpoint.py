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
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import hashlib
import json
import os
import sys
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from qsync_jax.train import layout
from qsync_jax.train import loss_scale as ls
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
    "plans": [w.plan.to_dict() for w in trainer.workers],
    "kinds": [w.kind for w in trainer.workers],
    "optimizer_state": _optimizer_state_layout(trainer),
  }


def _optimizer_state_layout(trainer: HybridTrainer) -> str:
  """``"flat"`` for an optimizer declared elementwise, else ``"pytree"``."""
  return "flat" if step_lib.is_elementwise(trainer.tx) else "pytree"


def load_state(
  trainer: HybridTrainer, tree: dict[str, Any], meta: dict[str, Any]
) -> None:
  """Restores :func:`state_tree` and :func:`state_meta` output into
  ``trainer``.

  Raises:
    ValueError: the checkpoint was written for other workers or plans.
  """
  _check_workers(trainer, meta)
  trainer.params = tree["params"]
  # A synced checkpoint's anchor is its params: keep them one array.
  trainer._anchor = (
    trainer.params if meta.get("in_sync", True) else tree["anchor"]
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
  if meta.get("plans") != plans or meta.get("kinds") != kinds:
    raise ValueError(
      "the checkpoint was written by a run with other workers or plans "
      f"(kinds {meta.get('kinds')} vs {kinds}); resume with the same "
      "cluster and plans, or start a new run directory"
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

  Args:
    directory: where checkpoints live (one subdirectory per step).
    max_to_keep: how many recent checkpoints to keep.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(directory)
    # ERROR: orbax warns about a damaged step here; restore_latest says it.
    with _quiet(logging.ERROR):
      self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep, create=True
        ),
      )

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    return self._manager.latest_step()

  def save(
    self, trainer: HybridTrainer, extra_meta: dict | None = None
  ) -> None:
    """Saves the trainer's state at its current step (blocks until done).

    The JSON metadata also holds the checksums of the host state and of
    every array shard, per process (a collective in multi-process runs).

    Args:
      trainer: the trainer to save.
      extra_meta: more JSON to store beside the host state.
    """
    tree = state_tree(trainer)
    # Through JSON first, so the digest covers what a restore reads back.
    meta = json.loads(json.dumps({**state_meta(trainer), **(extra_meta or {})}))
    digests = _allgather_json(array_digests(tree))
    meta[INTEGRITY] = {
      "meta": meta_digest(meta),
      "arrays": {str(k): d for k, d in enumerate(digests)},
    }
    with _quiet():
      self._manager.save(
        trainer.step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
        ),
      )
      self._manager.wait_until_finished()

  def restore_latest(self, trainer: HybridTrainer) -> dict[str, Any] | None:
    """Restores the newest intact checkpoint into ``trainer``.

    A newer checkpoint that fails its check is skipped with one warning line
    on stderr and moved to ``corrupt-<step>`` beside the others, so that the
    resumed run can save that step again. A checkpoint without checksums
    (written before they existed) is restored with a warning.

    Returns:
      The checkpoint's JSON metadata, or None when there is no checkpoint.

    Raises:
      ValueError: the checkpoint does not match the trainer's workers, or no
        checkpoint under the directory is intact.
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

    Raises:
      ValueError: the checkpoint was written for other workers or plans.
    """
    # Orbax and tensorstore raise many kinds of errors on missing, truncated
    # or garbled files; each of them means this checkpoint is unreadable.
    try:
      with _quiet(logging.ERROR):
        meta = self._manager.restore(
          step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
    except Exception as e:  # pylint: disable=broad-except
      return None, None, f"its metadata is unreadable ({_one_line(e)})"
    if not isinstance(meta, dict):
      return None, None, "it has no metadata"
    record = meta.get(INTEGRITY, {})
    if not isinstance(record, dict):
      return None, None, "its checksum record is not a JSON object"
    if record and meta_digest(meta) != record.get("meta"):
      return None, None, "checksum mismatch in its metadata"
    _check_workers(trainer, meta)
    try:
      with _quiet(logging.ERROR):
        tree = self._manager.restore(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)),
        )["state"]
    except Exception as e:  # pylint: disable=broad-except
      return None, None, f"its arrays are unreadable ({_one_line(e)})"
    if INTEGRITY in meta:
      problem = _array_problem(meta, tree)
      if problem:
        return None, None, problem
    return tree, meta, None

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
