"""Resuming a checkpoint onto another set of workers.

This module owns what a resume does with a checkpoint written by other
workers: ``N`` saved workers of kinds ``K`` restored into a trainer of ``M``
workers of kinds ``K' != K`` (another count, or other kinds). Every array of
:func:`qsync_jax.train.saved_state.state_tree` is stacked over the workers,
one row per worker, so the rows are what changes; this module reads the
saved rows on the host (:func:`.integrity.digest_problem` checks them
against the checksums the saving processes recorded) and maps them onto the
new workers
(:func:`reshard`). :mod:`.checkpoint` decides when a resume reshards and
reads the arrays; the host state (step, sync counters)
continues by global step as in any resume.

The mapping rule, *every worker starts from the mean*:

* every floating leaf (parameters, optimizer state such as Adam's ``mu`` and
  ``nu``, the loss scale, BatchNorm statistics and the rest of the model
  state, the error-feedback residual, the averager's state such as
  PowerSGD's warm-start ``Q``, DiLoCo's outer optimizer state) becomes the
  unweighted mean of its ``N`` saved rows, given to each of the ``M`` new
  workers. The mean is computed in float64 with numpy (``np.mean`` over the
  workers axis) and cast back to the leaf's dtype: deterministic, and exact
  where the saved rows are equal (data parallelism's parameters and
  optimizer state, PowerSGD's shared ``Q``, the outer state), which come
  back bit for bit;
* every other leaf (optimizer step counts, the averages counter that keys
  the rounding noise, a loss scale's counters, a layer's RNG counts) is
  equal across the workers and carried from saved worker 0;
* a layer's own typed PRNG key (``nnx.Dropout(rngs=...)``) is folded with
  each worker's index when the trainer is built, so that workers draw
  different masks: it stays the new worker's own (the same key a saved
  worker of that index had; its count is carried as above);
* the loss scale follows the new workers' plans: when the saving run scaled
  and this one does not (or the reverse), the trainer's own scale is kept
  and only the count of skipped steps carried;
* the result is in sync: the local-SGD anchor is the new parameters, so a
  checkpoint saved mid-round resumes with the round's progress averaged in
  (with DiLoCo, as a plain average: the outer optimizer sees the next
  round), whatever the new schedule.

The same checkpoint resumed onto the same workers therefore gives the same
state bit for bit, so a membership history replays identically.
"""

from __future__ import annotations

from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.train import layout
from qsync_jax.train.state import TrainState
from qsync_jax.train.trainer import HybridTrainer


def _kinds(trainer: HybridTrainer) -> list[str]:
  return [w.kind for w in trainer.workers]


def reshards(trainer: HybridTrainer, meta: dict[str, Any]) -> bool:
  """Whether a checkpoint resumes onto other workers than it was saved by.

  Args:
    trainer: the trainer to restore into.
    meta: the checkpoint's JSON metadata.

  Returns:
    True when the saved workers' kinds (their count, or a kind) differ from
    the trainer's; the same kinds with other plans is not a reshard.
  """
  return meta.get("kinds") != _kinds(trainer)


def mean_rows(x: np.ndarray) -> np.ndarray:
  """The workers' mean of a stacked leaf: float64 over axis 0, cast back.

  Args:
    x: ``(N, ...)`` one row per saved worker, of a floating dtype.

  Returns:
    The ``(...)`` mean row, of ``x``'s dtype.
  """
  return np.mean(np.asarray(x, np.float64), axis=0).astype(x.dtype)


def _put(full: np.ndarray, like: jax.Array) -> jax.Array:
  """``full`` as a global array with ``like``'s sharding: each process puts
  the rows its devices hold."""
  return jax.make_array_from_callback(
    like.shape, like.sharding, lambda index: np.ascontiguousarray(full[index])
  )


def _names(entries: set[str]) -> str:
  return ", ".join(sorted(entries)) or "none"


def reshard(
  trainer: HybridTrainer,
  state: TrainState,
  saved: dict[str, Any],
  own: dict[str, Any],
  meta: dict[str, Any],
) -> dict[str, Any]:
  """Maps a checkpoint's arrays onto the trainer's workers.

  Args:
    trainer: the trainer to restore into (built for the new workers).
    state: a state of that trainer (its workers' own PRNG keys).
    saved: the checkpoint's arrays as numpy, ``(N, ...)`` rows each, in the
      structure of ``own``.
    own: the trainer's own arrays (``saved_state.state_tree`` of
      ``state``): their
      shardings, and the leaves that stay the trainer's own (typed PRNG
      keys; the loss scale when scaling changes).
    meta: the checkpoint's JSON metadata (its kinds and step, for the log).

  Returns:
    The state in ``own``'s structure and shardings, ``(M, ...)`` rows each,
    by the module's mapping rule; its anchor is its parameters.
  """
  first = state.rest[trainer.local_workers[0]]
  keys = jax.tree.map(layout.is_key, first)
  averaged: set[str] = set()
  carried: set[str] = set()

  def leaf(entry: str, x: np.ndarray, like: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
      row = mean_rows(x)
      averaged.add(entry)
    else:
      row = x[0]
      carried.add(entry)
    return _put(np.broadcast_to(row, like.shape), like)

  out = {}
  for entry, value in own.items():
    if entry == "anchor":
      continue
    if entry == "rest":
      out[entry] = jax.tree.map(
        lambda key, x, like: like if key else leaf("rest", x, like),
        keys,
        saved[entry],
        value,
      )
    else:
      out[entry] = jax.tree.map(
        lambda x, like, e=entry: leaf(e, x, like), saved[entry], value
      )
  out["anchor"] = out["params"]
  note = ""
  saved_scaling = bool(np.asarray(saved["loss_scale"].good_steps)[0] >= 0)
  if saved_scaling != trainer.loss_scaling:
    # A scale the saving plans needed (FP16 layers) or did not: the new
    # plans decide, as they do for a run that starts.
    out["loss_scale"] = own["loss_scale"]._replace(
      skipped=out["loss_scale"].skipped
    )
    averaged.discard("loss_scale")
    scaling = "on" if trainer.loss_scaling else "off"
    note = f"; the loss scale starts anew (scaling {scaling} for these plans)"
  logging.info(
    "resumed checkpoint step %s from %d workers (%s) onto %d workers (%s): "
    "every worker starts from the saved workers' float64 mean of %s; "
    "integer leaves of %s carried from saved worker 0; in sync%s",
    meta.get("step"),
    len(saved["params"]),
    ", ".join(map(str, meta.get("kinds") or ["unknown"])),
    trainer.num_workers,
    ", ".join(_kinds(trainer)),
    _names(averaged),
    _names(carried),
    note,
  )
  return out
