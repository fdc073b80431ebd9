"""What a checkpoint of a training run holds, and putting it back.

This module owns the contents of a checkpoint: the arrays of a
:class:`~qsync_jax.train.state.TrainState` (:func:`state_tree`: global
arrays over the workers, the non-parameter state stacked too), its host
fields and what the trainer was (:func:`state_meta`: JSON), the checks that
a checkpoint fits a trainer before any array is read
(:func:`check_compatible`, :func:`structure_mismatch`), and the state made
from what was read (:func:`load_state`). :mod:`.checkpoint` writes and
reads them with orbax; :mod:`.resharding` maps them onto other workers.

The layout is the same as that of the checkpoints written before the state
became one pytree (the same entries and metadata keys), so those restore
unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qsync_jax.train import layout
from qsync_jax.train import loss_scale as ls
from qsync_jax.train import resharding
from qsync_jax.train import step as step_lib
from qsync_jax.train.state import TrainState
from qsync_jax.train.trainer import HybridTrainer


def state_tree(trainer: HybridTrainer, state: TrainState) -> dict[str, Any]:
  """The arrays a checkpoint holds (global arrays over the workers).

  Args:
    trainer: the trainer the state is of.
    state: the state to save.

  Returns:
    ``{"params", "opt_state", "loss_scale", "rest", "anchor", "counter"}``
    and, where the state has them, ``"residual"``, ``"averager_state"``
    and ``"outer_state"``; ``rest`` is the local workers' non-parameter
    state stacked (:meth:`HybridTrainer.stacked_rest`).
  """
  tree = {
    "params": state.params,
    "opt_state": state.opt_state,
    "loss_scale": state.loss_scale,
    "rest": trainer.stacked_rest(state.rest),
    "anchor": state.anchor,
    "counter": state.counter,
  }
  if state.residual is not None:
    tree["residual"] = state.residual
  if state.averager_state is not None:  # PowerSGD's warm-start Q
    tree["averager_state"] = state.averager_state
  if state.outer_state is not None:  # DiLoCo's outer optimizer state
    tree["outer_state"] = state.outer_state
  return tree


def state_meta(trainer: HybridTrainer, state: TrainState) -> dict[str, Any]:
  """The host side of a checkpoint (JSON): the state's host fields and what
  the trainer was (its schedule, workers, plans and parameter shapes)."""
  schedule = trainer.sync.schedule
  return {
    "step": state.step,
    "sync_rounds": state.sync_rounds,
    "comm_bytes": state.comm_bytes,
    "schedule": schedule.state_dict(),
    "in_sync": state.in_sync,
    "sync": schedule.name,
    "plans": [w.plan.to_dict() for w in trainer.workers],
    "kinds": [w.kind for w in trainer.workers],
    "batch_sizes": [w.batch_size for w in trainer.workers],
    "optimizer_state": optimizer_state_layout(trainer),
    "param_shapes": param_specs(trainer),
    "data": state.data,
  }


def optimizer_state_layout(trainer: HybridTrainer) -> str:
  """``"flat"`` for an optimizer declared elementwise, else ``"pytree"``."""
  return "flat" if step_lib.is_elementwise(trainer.tx) else "pytree"


def path_name(path: tuple[Any, ...]) -> str:
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
    trainer.unravel,
    jax.ShapeDtypeStruct((trainer.num_params,), jnp.float32),
  )
  return [
    [path_name(path).removesuffix(".value"), list(x.shape), str(x.dtype)]
    for path, x in jax.tree_util.tree_leaves_with_path(shapes)
  ]


#: What each top-level entry of :func:`state_tree` belongs to, for messages:
#: the config field that changes it, in words.
STATE_OWNERS = {
  "params": "model",
  "anchor": "model",
  "rest": "model",
  "opt_state": "optimizer",
  "residual": "error-feedback setting",
  "averager_state": "averager",
  "outer_state": "outer optimizer",
}


def array_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{dotted path: (shape, dtype)}`` of the array leaves of ``tree``."""
  return {
    path_name(path).removesuffix(".value"): (
      tuple(int(n) for n in leaf.shape),
      str(leaf.dtype),
    )
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
  }


def structure_mismatch(
  meta: dict[str, Any],
  saved: Any,
  trainer: HybridTrainer,
  state: TrainState,
  per_worker: bool = False,
) -> tuple[str, str] | None:
  """How the trainer's state differs from a checkpoint's, or None.

  Args:
    meta: the checkpoint's JSON metadata.
    saved: orbax's metadata tree of its arrays (shapes and dtypes).
    trainer: the trainer to restore into.
    state: a state of the trainer (its arrays' shapes and dtypes).
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
  theirs = array_specs(saved)
  ours = array_specs(state_tree(trainer, state))

  def row(spec: tuple[tuple[int, ...], str] | None) -> Any:
    return spec if spec is None or not per_worker else (spec[0][1:], spec[1])

  for path in [*ours, *(p for p in theirs if p not in ours)]:
    if row(theirs.get(path)) != row(ours.get(path)):
      what = STATE_OWNERS.get(path.split(".")[0], "trainer state")
      return what, (
        f"{path} is {_describe(theirs.get(path))} in the checkpoint and "
        f"{_describe(ours.get(path))} in this run"
      )
  return None


def check_compatible(trainer: HybridTrainer, meta: dict[str, Any]) -> None:
  """Raises if a checkpoint cannot resume into ``trainer``, before any array
  is read.

  Args:
    trainer: the trainer to restore into.
    meta: the checkpoint's JSON metadata.

  Raises:
    ValueError: the same kinds of workers with other plans; a checkpoint
      saved mid-round resumed under a schedule that averages gradients next;
      or another optimizer-state layout (flat vs pytree).
  """
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
    and trainer.sync.schedule.averages_gradients_at(int(meta["step"]) + 1)
  ):
    # Averaged gradients keep equal parameters equal; they would keep these
    # apart for good.
    raise ValueError(
      f"the checkpoint was saved mid-round of sync {saved_sync!r}, its "
      "workers' parameters apart, and this run's sync "
      f"{trainer.sync.schedule.name!r} averages gradients at step "
      f"{int(meta['step']) + 1}, which needs them equal; resume with the "
      "schedule it was saved with, or start a new run directory"
    )
  # Checkpoints from before the declaration existed hold pytree states.
  saved = meta.get("optimizer_state", "pytree")
  if saved != optimizer_state_layout(trainer):
    raise ValueError(
      f"the checkpoint holds a {saved} optimizer state and this run's "
      f"optimizer keeps a {optimizer_state_layout(trainer)} one: declare "
      "it as the saving run did (qsync_jax.elementwise(tx) keeps a flat "
      "state), or start a new run directory"
    )


def load_state(
  trainer: HybridTrainer,
  state: TrainState,
  tree: dict[str, Any],
  meta: dict[str, Any],
) -> TrainState:
  """The state that :func:`state_tree` and :func:`state_meta` output hold.

  Args:
    trainer: the trainer to restore into.
    state: a state of the trainer, e.g. :meth:`HybridTrainer.init`'s (the
      arrays' shardings, and what stays the trainer's own on a reshard).
    tree: the arrays: global arrays over the trainer's workers, or, when
      the checkpoint's workers are of other kinds
      (:func:`.resharding.reshards`), the saved rows as numpy, mapped by
      :func:`.resharding.reshard`.
    meta: the host state.

  Returns:
    The restored state.

  Raises:
    ValueError: the checkpoint does not fit the trainer
      (:func:`check_compatible`).
  """
  check_compatible(trainer, meta)
  resharded = resharding.reshards(trainer, meta)
  if resharded:
    tree = resharding.reshard(
      trainer, state, tree, state_tree(trainer, state), meta
    )
  params = tree["params"]
  rest = {
    i: layout.unstack_tree(tree["rest"], device, like=state.rest[i])
    for i, device in trainer.local_devices.items()
  }
  # A synced checkpoint's anchor is its params: keep them one array. The
  # workers of a reshard all start from the mean, in sync. The schedule's
  # own state is not read back: a schedule is a function of the step.
  in_sync = bool(resharded or meta.get("in_sync", True))
  return state.replace(
    params=params,
    opt_state=tree["opt_state"],
    loss_scale=ls.LossScale(*tree["loss_scale"]),
    rest=rest,
    anchor=params if in_sync else tree["anchor"],
    counter=tree["counter"],
    residual=tree.get("residual"),
    averager_state=tree.get("averager_state"),
    outer_state=tree.get("outer_state"),
    step=int(meta["step"]),
    sync_rounds=int(meta["sync_rounds"]),
    comm_bytes=float(meta["comm_bytes"]),
    in_sync=in_sync,
    data=meta.get("data"),
  )
