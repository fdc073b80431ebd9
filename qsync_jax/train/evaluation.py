"""Evaluating the workers' model with FP32 compute.

This module owns :func:`eval_function` (one jitted evaluation batch of the
model in eval mode, with the default FP32 plan), :func:`evaluate` (the mean
metrics over a dataset, batch by batch on one device) and the
BatchNorm statistics the evaluated model uses: :data:`BN_STATS` names the
choices, :func:`bn_function` and :func:`reestimate` re-estimate them for the
evaluated parameters on training batches, as the official QSR code's
``estimate_BN_params`` does. Which parameters and statistics are evaluated
(the workers' mean) is the trainer's choice
(:meth:`qsync_jax.train.trainer.HybridTrainer.evaluate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.data.batching import eval_batches
from qsync_jax.plan import bridge
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import batch_size as batch_size_of
from qsync_jax.train import layout

#: How evaluation sets the BatchNorm statistics: ``"average"`` (the mean of
#: the workers' running statistics) or ``"reestimate"`` (recomputed for the
#: evaluated parameters on training batches, then averaged over workers).
BN_STATS = ("average", "reestimate")


def eval_function(
  graphdef: Any, unravel: Callable[[jax.Array], Any], loss_fn: Any = None
) -> Callable:
  """The jitted evaluation of one batch.

  Args:
    graphdef: the model's FP32 graph definition.
    unravel: flat parameter vector to parameter pytree.
    loss_fn: the objective, in any form :func:`qsync_jax.task.as_objective`
      takes (default: classification).

  Returns:
    ``eval_fn(params_row, rest, batch) -> {"loss", ...metrics}``, the
    batch's means with the model in eval mode, where ``params_row`` is a
    ``(1, P)`` flat parameter row.
  """
  objective = as_objective(loss_fn)

  @jax.jit
  def eval_fn(params_row, rest, batch):
    model = nnx.merge(graphdef, unravel(params_row[0]), rest)
    loss, metrics = objective(model, batch, train=False)
    return {"loss": loss, **metrics}

  return eval_fn


def evaluate(
  eval_fn: Callable,
  params_row: jax.Array,
  rest: Any,
  data: Any,
  device: jax.Device,
  batch_size: int = 256,
) -> dict[str, float]:
  """The means of ``eval_fn``'s metrics over ``data`` on ``device``.

  Args:
    eval_fn: from :func:`eval_function`.
    params_row: the ``(1, P)`` parameters, on ``device``.
    rest: the non-parameter state, on ``device``.
    data: the evaluation set as one batch pytree (``(x, y)`` for
      classification), leading axis examples.
    device: the device that runs the evaluation.
    batch_size: examples per evaluation batch.

  Returns:
    ``{"loss", ...metrics}``, each the example-weighted mean over ``data``.
  """
  sums: dict[str, float] = {}
  count = 0
  for batch in eval_batches(data, batch_size):
    n = batch_size_of(batch)
    out = eval_fn(params_row, rest, jax.device_put(batch, device))
    for name, value in out.items():
      sums[name] = sums.get(name, 0.0) + float(value) * n
    count += n
  return {name: total / count for name, total in sums.items()}


def bn_function(
  graphdef: Any,
  unravel: Callable[[jax.Array], Any],
  model: nnx.Module,
  bn_stats: str,
  loss_fn: Any = None,
) -> Callable | None:
  """The jitted step that re-estimates BatchNorm statistics on one batch.

  The official QSR code (``XModel.estimate_BN_params``) runs training
  batches through the model in train mode with BatchNorm momentum
  ``1 / (1 + idx)`` at the ``idx``-th batch: the running statistics become
  the cumulative mean of the batches' statistics, and the old ones are
  dropped at the first batch. NNX's BatchNorm keeps the biased batch
  variance (PyTorch's the unbiased one); the model's own convention is kept.

  Args:
    graphdef: the model's FP32 graph definition in eval mode.
    unravel: flat parameter vector to parameter pytree.
    model: the model (to find its BatchNorm layers).
    bn_stats: one of :data:`BN_STATS`.
    loss_fn: the objective (:func:`qsync_jax.task.as_objective`); its
      forward pass in train mode runs the batches.

  Returns:
    ``bn_fn(params_row, rest, batch, m) -> rest``: ``rest`` with every
    ``BatchStat`` replaced by ``(1 - m) * old + m * batch`` (the batch's
    statistics under the ``(1, P)`` parameters ``params_row``),
    other entries unchanged; None for ``"average"`` or a model without
    BatchNorm statistics.

  Raises:
    ValueError: an unknown ``bn_stats``, or (for ``"reestimate"``) batch
      statistics outside ``nnx.BatchNorm`` layers, whose update this cannot
      steer.
  """
  objective = as_objective(loss_fn)
  if bn_stats not in BN_STATS:
    raise ValueError(
      f"unknown bn_stats {bn_stats!r}; valid: {', '.join(BN_STATS)}"
    )
  nodes = list(nnx.iter_graph(model))
  stats = [p for p, n in nodes if isinstance(n, nnx.BatchStat)]
  if bn_stats == "average" or not stats:
    return None
  norms = {p for p, n in nodes if isinstance(n, nnx.BatchNorm)}
  # A wrapped Linen model steers its nn.BatchNorm layers' momentum itself.
  linen = [p for p, n in nodes if isinstance(n, bridge.LinenModel)]
  outside = [
    "/".join(map(str, p))
    for p in stats
    if p[:-1] not in norms and not any(p[: len(q)] == q for q in linen)
  ]
  if outside:
    raise ValueError(
      f"bn_stats='reestimate' re-estimates nnx.BatchNorm statistics, but "
      f"{', '.join(outside)} lie outside nnx.BatchNorm layers; use "
      "bn_stats='average'"
    )

  @jax.jit
  def bn_fn(params_row, rest, batch, m):
    model = nnx.merge(graphdef, unravel(params_row[0]), rest)
    # A snapshot: the state's variables alias the model's, which the
    # forward pass overwrites.
    old = jax.tree.map(jnp.asarray, nnx.state(model, nnx.BatchStat))
    for _, node in nnx.iter_graph(model):
      if isinstance(node, nnx.BatchNorm):
        node.momentum = 0.0  # the running statistics become the batch's
      elif isinstance(node, bridge.LinenModel):
        node.batch_norm_momentum = 0.0
    objective.forward(model, batch, train=True)
    new = jax.tree.map(
      lambda a, b: (1 - m) * a + m * b, old, nnx.state(model, nnx.BatchStat)
    )
    # A fresh merge: the forward pass may have moved other state (dropout
    # RNG counts), which evaluation must not see.
    out = nnx.merge(graphdef, unravel(params_row[0]), rest)
    nnx.update(out, new)
    return nnx.split(out, nnx.Param, ...)[2]

  return bn_fn


def reestimate(
  bn_fn: Callable,
  params: jax.Array,
  rests: Mapping[int, Any],
  devices: Mapping[int, jax.Device],
  train_batches: Iterable[Mapping[int, tuple[Any, Any]]],
) -> dict[int, Any]:
  """Each local worker's state with BatchNorm statistics re-estimated.

  Every worker runs its own batches through its row of ``params`` (the
  evaluated parameters), as each rank of the QSR code runs its own shard;
  the caller averages the results over the workers.

  Args:
    bn_fn: from :func:`bn_function`.
    params: the stacked ``(n, P)`` parameters to evaluate.
    rests: ``{worker index: non-parameter state}``; left untouched.
    devices: ``{worker index: device}`` of this process's workers.
    train_batches: per step, ``{worker index: batch}`` as
      :meth:`~qsync_jax.train.trainer.HybridTrainer.train_step` takes.

  Returns:
    ``{worker index: non-parameter state}`` with re-estimated statistics.

  Raises:
    ValueError: no batch, or a step without a batch for a local worker.
  """
  steps = list(train_batches)
  if not steps:
    raise ValueError(
      "bn_stats='reestimate' needs training batches: pass "
      "train_batches (or build the trainer with "
      "bn_stats='average')"
    )
  missing = sorted({i for s in steps for i in devices if i not in s})
  if missing:
    raise ValueError(f"train_batches has no batch for local workers {missing}")
  rows = layout.rows(params)
  out = {}
  for i, device in devices.items():
    rest = rests[i]
    for idx, batches in enumerate(steps):
      batch = jax.device_put(batches[i], device)
      rest = bn_fn(rows[device], rest, batch, np.float32(1 / (1 + idx)))
    out[i] = rest
  return out
