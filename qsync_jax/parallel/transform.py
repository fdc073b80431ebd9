"""An optax transformation that averages updates across a named mesh axis.

This module owns :func:`averaged`, the piece a user's own training loop
chains in front of an optimizer, inside the user's ``jax.shard_map``:

    tx = optax.chain(averaged(make_averager("gqsgd"), "data"),
                     optax.sgd(0.1))

Each worker's update pytree goes through any
:class:`~qsync_jax.parallel.wire.Averager` as one raveled vector
(:func:`~qsync_jax.parallel.averagers.average_tree`) with equal weights
``1 / n``, optionally with error feedback
(:func:`~qsync_jax.parallel.averagers.compress_with_feedback`) whose
residual lives in the transformation's state, as does a stateful averager's
state (PowerSGD's warm-start ``Q``, :class:`~qsync_jax.parallel.wire.Stateful`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from qsync_jax.parallel import averagers
from qsync_jax.parallel.wire import Averager


class AveragedState(NamedTuple):
  """The state of :func:`averaged`.

  Attributes:
    count: ``uint32`` calls so far; keys the rounding noise, so it must be
      the same on every worker.
    residual: this worker's error-feedback residual, float32 zeros shaped
      like the parameters at init (in units of ``w_i x_i``); ``None``
      without error feedback.
    averager_state: the averager's own state
      (:func:`~qsync_jax.parallel.averagers.init_state`), the same on every
      worker; ``None`` for a stateless averager.
  """

  # Named as optax names its states' counts; it shadows tuple.count.
  count: jax.Array  # type: ignore[assignment]
  residual: Any
  averager_state: Any = None


def averaged(
  averager: Averager,
  axis_name: str,
  error_feedback: bool = False,
  seed: int = 0,
) -> optax.GradientTransformation:
  """Averages updates over ``axis_name`` with ``averager``.

  ``update`` runs inside ``jax.shard_map`` (or ``jax.vmap(...,
  axis_name=...)``) over ``axis_name`` and returns ``sum_i x_i / n``, the
  same on every worker, each leaf in its own dtype. The rounding noise of
  call ``t`` is keyed by ``fold_in(key(seed), t)``, the same on every
  worker. With ``error_feedback`` each worker re-sends what compression
  dropped in the previous call (Seide et al., "1-Bit Stochastic Gradient
  Descent ...", Interspeech 2014; Karimireddy et al., "Error Feedback
  Fixes SignSGD ...", arXiv 1901.09847), so over ``T`` calls the sum of
  the averaged updates misses the exact sum by the last residuals only.
  A stateful averager's state (PowerSGD's warm-start ``Q``) is kept in the
  state too, the same on every worker. The residual differs per worker:
  under ``shard_map`` with ``check_vma=True`` the state must then be
  per-worker (stacked, with ``P(axis_name)`` specs); without feedback it may
  be replicated.

  Args:
    averager: any :class:`~qsync_jax.parallel.wire.Averager`
      (e.g. ``make_averager("gqsgd")``).
    axis_name: the workers' mesh axis.
    error_feedback: carry the compression residual in the state.
    seed: seeds the rounding noise.

  Returns:
    The transformation; ``init(params)`` and ``update(updates, state,
    params=None)``.

  Raises:
    ValueError: (from ``init`` or ``update``) a leaf that is not a
      floating-point array.
  """

  def init_fn(params: Any) -> AveragedState:
    residual, state = (
      None,
      averagers.init_state(
        averager, sum(jnp.size(p) for p in jax.tree.leaves(params))
      ),
    )
    if error_feedback:
      averagers.ravel_floats(params)  # refuse non-float leaves up front
      residual = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return AveragedState(jnp.zeros((), jnp.uint32), residual, state)

  def update_fn(
    updates: Any, state: AveragedState, params: Any = None
  ) -> tuple[Any, AveragedState]:
    del params
    key = jax.random.fold_in(jax.random.key(seed), state.count)
    weight = jnp.float32(1) / lax.axis_size(axis_name)
    state = state._replace(count=state.count + jnp.uint32(1))
    if state.residual is None and state.averager_state is None:
      mean = averagers.average_tree(averager, updates, weight, axis_name, key)
      return mean, state
    flat, unravel = averagers.ravel_floats(updates)
    if flat.size == 0:
      return updates, state
    res_flat = unravel_res = None
    if state.residual is not None:
      res_flat, unravel_res = averagers.ravel_floats(state.residual)
      if res_flat.shape != flat.shape:
        raise ValueError(
          f"the error-feedback residual holds {res_flat.size} elements but "
          f"the updates {flat.size}: init with parameters shaped like them"
        )
    mean, new_res, new_state = averagers.average(
      averager, flat, weight, axis_name, key, res_flat, state.averager_state
    )
    return unravel(mean.astype(flat.dtype)), state._replace(
      residual=(
        None if new_res is None or unravel_res is None else unravel_res(new_res)
      ),
      averager_state=new_state,
    )

  return optax.GradientTransformation(init_fn, update_fn)
