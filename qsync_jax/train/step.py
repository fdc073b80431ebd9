"""The one gradient function a worker runs, shared by the trainer and the predictor.

This module owns :func:`grad_function`: what one worker computes per step
(forward, loss, backward of the scaled loss) for a model whose precision plan
is baked into its graph definition. The trainer compiles one per plan; the
predictor times the same function, so a profile measures what training runs.
"""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree

from qsync_jax.train import losses

LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def grad_function(graphdef: Any, unravel: Callable[[jax.Array], Any],
                  loss_fn: LossFn) -> Callable:
  """One worker's jitted gradient computation (its plan is in ``graphdef``).

  Returns:
    ``grad_fn(params_row, rest, scale_row, x, y) -> (grads_row, new_rest,
    loss, accuracy)`` where ``params_row`` is the ``(1, P)`` flat float32
    parameter row, ``rest`` the non-parameter state, ``scale_row`` the
    ``(1,)`` loss scale; ``grads_row`` is the ``(1, P)`` flat gradient of the
    scaled loss.
  """

  @jax.jit
  def grad_fn(params_row, rest, scale_row, x, y):
    model = nnx.merge(graphdef, unravel(params_row[0]), rest)

    def scaled_loss(m):
      logits = m(x)
      loss = loss_fn(logits, y)
      return loss * scale_row[0], (loss, losses.accuracy(logits, y))

    # nnx.grad carries the BatchNorm statistics' updates back to `model`.
    grads, (loss, acc) = nnx.grad(scaled_loss, has_aux=True)(model)
    new_rest = nnx.split(model, nnx.Param, ...)[2]
    return ravel_pytree(grads)[0][None], new_rest, loss, acc

  return grad_fn
