"""Evaluating the workers' model with FP32 compute.

This module owns :func:`eval_function` (one jitted evaluation batch of the
model in eval mode, with the default FP32 plan) and :func:`evaluate` (the
mean loss and accuracy over a dataset, batch by batch on one device). Which
parameters and statistics are evaluated (the workers' mean) is the
trainer's choice (:meth:`qsync_jax.train.trainer.HybridTrainer.evaluate`).
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.data.batching import eval_batches

LossFn = Callable[[jax.Array, jax.Array], jax.Array]


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
