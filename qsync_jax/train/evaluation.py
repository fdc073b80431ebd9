"""Evaluating the workers' model with FP32 compute.

This module owns :func:`eval_function` (one jitted evaluation batch of the
model in eval mode, with the default FP32 plan), :func:`evaluate` (the mean
loss and accuracy over a dataset, batch by batch on one device) and the
BatchNorm statistics the evaluated model uses: :data:`BN_STATS` names the
choices, :func:`bn_function` and :func:`reestimate` re-estimate them for the
evaluated parameters on training batches, as the official QSR code's
``estimate_BN_params`` does. Which parameters and statistics are evaluated
(the workers' mean) is the trainer's choice
(:meth:`qsync_jax.train.trainer.HybridTrainer.evaluate`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.data.batching import eval_batches
from qsync_jax.train import layout

LossFn = Callable[[jax.Array, jax.Array], jax.Array]

#: How evaluation sets the BatchNorm statistics: ``"average"`` (the mean of
#: the workers' running statistics) or ``"reestimate"`` (recomputed for the
#: evaluated parameters on training batches, then averaged over workers).
BN_STATS = ("average", "reestimate")


def eval_function(graphdef: Any, unravel: Callable[[jax.Array], Any],
                  loss_fn: LossFn) -> Callable:
  """The jitted evaluation of one batch.

  Args:
    graphdef: the model's graph definition in eval mode.
    unravel: flat parameter vector to parameter pytree.
    loss_fn: ``loss_fn(logits, labels) -> scalar`` (a mean).

  Returns:
    ``eval_fn(params_row, rest, x, y) -> (loss_sum, correct)`` over the
    batch, where ``params_row`` is a ``(1, P)`` flat parameter row.
  """

  @jax.jit
  def eval_fn(params_row, rest, x, y):
    model = nnx.merge(graphdef, unravel(params_row[0]), rest)
    logits = model(x)
    n = y.size
    return loss_fn(logits, y) * n, (jnp.argmax(logits, -1) == y).sum()

  return eval_fn


def evaluate(eval_fn: Callable, params_row: jax.Array, rest: Any,
             x: np.ndarray, y: np.ndarray, device: jax.Device,
             batch_size: int = 256) -> dict[str, float]:
  """Mean loss and accuracy of ``eval_fn`` over ``(x, y)`` on ``device``.

  Args:
    eval_fn: from :func:`eval_function`.
    params_row: the ``(1, P)`` parameters, on ``device``.
    rest: the non-parameter state, on ``device``.
    x: inputs (leading axis: examples).
    y: labels.
    device: the device that runs the evaluation.
    batch_size: examples per evaluation batch.

  Returns:
    ``{"loss", "accuracy"}`` over all examples.
  """
  loss_sum = correct = count = 0.0
  for xb, yb in eval_batches(x, y, batch_size):
    xb, yb = jax.device_put((xb, yb), device)
    l, c = eval_fn(params_row, rest, xb, yb)
    loss_sum += float(l)
    correct += float(c)
    count += yb.size
  return {"loss": loss_sum / count, "accuracy": correct / count}


def bn_function(graphdef: Any, unravel: Callable[[jax.Array], Any],
                model: nnx.Module, bn_stats: str) -> Callable | None:
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

  Returns:
    ``bn_fn(params_row, rest, x, m) -> rest``: ``rest`` with every
    ``BatchStat`` replaced by ``(1 - m) * old + m * batch`` (the batch's
    statistics of ``x`` under the ``(1, P)`` parameters ``params_row``),
    other entries unchanged; None for ``"average"`` or a model without
    BatchNorm statistics.

  Raises:
    ValueError: an unknown ``bn_stats``, or (for ``"reestimate"``) batch
      statistics outside ``nnx.BatchNorm`` layers, whose update this cannot
      steer.
  """
  if bn_stats not in BN_STATS:
    raise ValueError(f"unknown bn_stats {bn_stats!r}; valid: "
                     f"{', '.join(BN_STATS)}")
  nodes = list(nnx.iter_graph(model))
  stats = [p for p, n in nodes if isinstance(n, nnx.BatchStat)]
  if bn_stats == "average" or not stats:
    return None
  norms = {p for p, n in nodes if isinstance(n, nnx.BatchNorm)}
  outside = ["/".join(map(str, p)) for p in stats if p[:-1] not in norms]
  if outside:
    raise ValueError(
        f"bn_stats='reestimate' re-estimates nnx.BatchNorm statistics, but "
        f"{', '.join(outside)} lie outside nnx.BatchNorm layers; use "
        "bn_stats='average'")

  @jax.jit
  def bn_fn(params_row, rest, x, m):
    model = nnx.merge(graphdef, unravel(params_row[0]), rest)
    # A snapshot: the state's variables alias the model's, which the
    # forward pass overwrites.
    old = jax.tree.map(jnp.asarray, nnx.state(model, nnx.BatchStat))
    model.train()
    for _, node in nnx.iter_graph(model):
      if isinstance(node, nnx.BatchNorm):
        node.momentum = 0.0  # the running statistics become the batch's
    model(x)
    new = jax.tree.map(lambda a, b: (1 - m) * a + m * b, old,
                       nnx.state(model, nnx.BatchStat))
    # A fresh merge: the forward pass may have moved other state (dropout
    # RNG counts), which evaluation must not see.
    out = nnx.merge(graphdef, unravel(params_row[0]), rest)
    nnx.update(out, new)
    return nnx.split(out, nnx.Param, ...)[2]

  return bn_fn


def reestimate(bn_fn: Callable, params: jax.Array,
               rests: Mapping[int, Any], devices: Mapping[int, jax.Device],
               train_batches: Iterable[Mapping[int, tuple[Any, Any]]]
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
    train_batches: per step, ``{worker index: (x, y)}`` as
      :meth:`~qsync_jax.train.trainer.HybridTrainer.train_step` takes.

  Returns:
    ``{worker index: non-parameter state}`` with re-estimated statistics.

  Raises:
    ValueError: no batch, or a step without a batch for a local worker.
  """
  steps = list(train_batches)
  if not steps:
    raise ValueError("bn_stats='reestimate' needs training batches: pass "
                     "train_batches (or build the trainer with "
                     "bn_stats='average')")
  missing = sorted({i for s in steps for i in devices if i not in s})
  if missing:
    raise ValueError(f"train_batches has no batch for local workers "
                     f"{missing}")
  rows = layout.rows(params)
  out = {}
  for i, device in devices.items():
    rest = rests[i]
    for idx, batches in enumerate(steps):
      x = jax.device_put(batches[i][0], device)
      rest = bn_fn(rows[device], rest, x, np.float32(1 / (1 + idx)))
    out[i] = rest
  return out
