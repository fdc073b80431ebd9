"""The one training step a worker runs, shared by the trainer and the predictor.

This module owns what one step computes, so that a profile measures what
training runs:

* :func:`plan_graphdefs`: one graph definition per distinct precision plan
  (the plan is baked into the graph; the parameters are shared);
* :func:`grad_function`: one worker's jitted forward, loss and backward of
  the scaled loss;
* :func:`local_gradients`: every local worker's gradient of one step,
  stacked into one global array (the host side of a step);
* :func:`elementwise`: an optax optimizer declared to treat every element
  alike, which :func:`init_optimizer` and :func:`apply_update` then run on
  the flat parameter vector instead of the parameter pytree;
* :func:`apply_update`: the optax update on a gradient, skipped where the
  gradient is not finite.

The shard_map programs that average and apply (:mod:`.programs`) and the
trainer that drives them (:mod:`.trainer`) build on these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np
import optax

from qsync_jax.numerics import cpu_gemm
from qsync_jax.numerics import flatten
from qsync_jax.numerics.precision import Precision
from qsync_jax.plan import policy
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn
from qsync_jax.train import layout


class PlanGraphdefs(NamedTuple):
  """What :func:`plan_graphdefs` splits a model into.

  Attributes:
    graphdefs: each worker's graph definition, its plan applied (workers
      with equal plans share one object).
    precisions: each worker's effective layer precisions.
    fp32_graphdef: the FP32 graph definition (for evaluation).
    params: the model's parameters (``nnx.Param`` state).
    rest: the model's other state (BatchNorm statistics, RNG state, ...).
  """

  graphdefs: list[nnx.GraphDef]
  precisions: list[dict[str, Precision]]
  fp32_graphdef: nnx.GraphDef
  params: nnx.State
  rest: nnx.State


def plan_graphdefs(
  model: nnx.Module,
  plans: Sequence[tuple[PrecisionPlan, str]],
  sample_input: Any = None,
) -> PlanGraphdefs:
  """One graph definition per distinct plan, sharing the model's parameters.

  Args:
    model: the NNX model (FP32 parameters); it is left with the default
      plan applied, in the mode it was in.
    plans: ``(plan, device kind)`` of each worker.
    sample_input: the model's inputs or a :class:`qsync_jax.task.Probe`, to
      trace layer paths (default ``model.input_spec``).

  Returns:
    A :class:`PlanGraphdefs`: each worker's graph definition (workers with
    equal plans share one object), each worker's effective layer
    precisions, the FP32 graph definition (for evaluation), and the model's
    parameters and other state.

  Raises:
    qsync_jax.PlanError: a plan does not fit the model or its device kind.
  """
  layer_list = policy.model_layers(model, sample_input)  # traced once
  precisions: list[dict[str, Precision]] = []
  by_plan: dict[str, nnx.GraphDef] = {}
  graphdefs: list[nnx.GraphDef] = []
  for plan, kind in plans:
    eff = policy.resolve_layers(layer_list, plan, device_kind=kind)
    precisions.append(eff)
    key = plan.to_json()
    if key not in by_plan:
      policy.set_precisions(layer_list, eff, plan.quant)
      by_plan[key] = nnx.split(model, nnx.Param, ...)[0]
    graphdefs.append(by_plan[key])
  policy.set_precisions(
    layer_list,
    policy.resolve_layers(layer_list, PrecisionPlan()),
    PrecisionPlan().quant,
  )
  # mypy cannot unpack nnx.split's variadic return type into three names.
  fp32_graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  return PlanGraphdefs(graphdefs, precisions, fp32_graphdef, params, rest)


def step_rngs(seed: int, ids: jax.Array) -> nnx.Rngs:
  """The RNG streams of one worker's step (dropout and the like).

  Args:
    seed: the run's seed.
    ids: ``uint32[2]``: the worker's index and the step.

  Returns:
    ``nnx.Rngs`` whose default stream is ``key(seed)`` folded with both, so
    workers draw different masks and every step new ones, reproducibly.
  """
  key = jax.random.fold_in(
    jax.random.fold_in(jax.random.key(seed), ids[0]), ids[1]
  )
  return nnx.Rngs(key)


def grad_function(
  graphdef: Any,
  unravel: Callable[[jax.Array], Any],
  loss_fn: LossFn = None,
  seed: int = 0,
) -> Callable:
  """One worker's jitted gradient computation (its plan is in ``graphdef``).

  Args:
    graphdef: the worker's graph definition (its plan applied).
    unravel: flat parameter vector to parameter pytree.
    loss_fn: the objective, in any form :func:`qsync_jax.task.as_objective`
      takes (default: classification).
    seed: seeds the step's rngs (:func:`step_rngs`).

  Returns:
    ``grad_fn(params_row, rest, scale_row, batch, ids) -> (grads_row,
    new_rest, metrics)`` where ``params_row`` is the ``(1, P)`` flat float32
    parameter row, ``rest`` the non-parameter state, ``scale_row`` the
    ``(1,)`` loss scale, ``ids`` the ``uint32[2]`` (worker, step) of
    :func:`step_rngs`; ``grads_row`` is the ``(1, P)`` flat gradient of the
    scaled loss and ``metrics`` ``{"loss", ...the objective's metrics}``.
  """
  objective = as_objective(loss_fn)

  @jax.jit
  def grad_fn(params_row, rest, scale_row, batch, ids):
    model = nnx.merge(graphdef, unravel(params_row[0]), rest)

    def scaled_loss(m):
      loss, metrics = objective(m, batch, step_rngs(seed, ids), train=True)
      return loss * scale_row[0], {"loss": loss, **metrics}

    # nnx.grad carries the BatchNorm statistics' (and RNG counts') updates
    # back to `model`. Weight gradients as library GEMMs on XLA:CPU, which
    # would otherwise run them through Eigen (numerics.cpu_gemm).
    with cpu_gemm.gemm_gradients():
      grads, metrics = nnx.grad(scaled_loss, has_aux=True)(model)
    new_rest = nnx.split(model, nnx.Param, ...)[2]
    return flatten.ravel(grads)[None], new_rest, metrics

  return grad_fn


def grad_functions(
  graphdefs: Sequence[Any],
  unravel: Callable[[jax.Array], Any],
  loss_fn: LossFn = None,
  seed: int = 0,
) -> list[Callable]:
  """Each worker's :func:`grad_function`, one per distinct graph definition
  (workers with equal plans share one compiled function)."""
  objective = as_objective(loss_fn)
  by_graphdef: dict[int, Callable] = {}
  return [
    by_graphdef.setdefault(id(gd), grad_function(gd, unravel, objective, seed))
    for gd in graphdefs
  ]


class LocalGradients(NamedTuple):
  """What :func:`local_gradients` returns for one step.

  Attributes:
    grads: the stacked ``(n, P)`` gradients of the scaled losses.
    rest: ``{worker index: non-parameter state}`` after the step (BatchNorm
      statistics and RNG counts updated).
    metrics: ``{worker index: {"loss", ...the objective's metrics}}`` as
      device scalars.
  """

  grads: jax.Array
  rest: dict[int, Any]
  metrics: dict[int, dict[str, jax.Array]]


def local_gradients(
  grad_fns: Mapping[int, Callable],
  devices: Mapping[int, jax.Device],
  params: jax.Array,
  scale: jax.Array,
  rests: Mapping[int, Any],
  batches: Mapping[int, Any],
  sharding: NamedSharding,
  step: int = 0,
) -> LocalGradients:
  """Runs every local worker's gradient function on its batch.

  Args:
    grad_fns: ``{worker index: grad_fn}`` of this process's workers.
    devices: ``{worker index: device}`` of the same workers.
    params: the stacked ``(n, P)`` parameters.
    scale: the stacked ``(n,)`` loss scales.
    rests: ``{worker index: non-parameter state}``; left untouched.
    batches: ``{worker index: batch}`` (any pytree the objective takes).
    sharding: the stacked arrays' sharding.
    step: the step's number, which seeds its rngs.

  Returns:
    The :class:`LocalGradients` of the step.
  """
  params_rows = layout.rows(params)
  scale_rows = layout.rows(scale)
  grad_rows, new_rests, metrics = {}, {}, {}
  for i, device in devices.items():
    batch = jax.device_put(batches[i], device)
    ids = np.array([i, step], np.uint32)
    g, new_rests[i], metrics[i] = grad_fns[i](
      params_rows[device], rests[i], scale_rows[device], batch, ids
    )
    grad_rows[device] = g
  return LocalGradients(
    layout.stack_local(grad_rows, params.shape, sharding), new_rests, metrics
  )


class ElementwiseTransformation(optax.GradientTransformation):
  """An optax transformation declared elementwise (see :func:`elementwise`).

  The same ``(init, update)`` pair; only its type carries the declaration.
  """

  __slots__ = ()


def elementwise(tx: optax.GradientTransformation) -> ElementwiseTransformation:
  """Declares that ``tx`` updates every parameter element on its own.

  Then the trainer (and the predictor, which times the trainer's update)
  keeps ``tx``'s state and runs its update on the flat parameter vector the
  trainer holds, instead of splitting it into the parameter pytree and
  joining the result back: on XLA:CPU the split and re-join are passes over
  all parameters of their own.

  Only declare what holds: SGD, momentum, Adam, AdamW without a mask,
  RMSProp and their schedules and global-norm clipping give the same update
  either way; a transformation that tells leaves apart (a mask, per-layer
  trust ratios as in LARS and LAMB, Adafactor's factored moments,
  ``optax.multi_transform``) does not, and must be left undeclared. The
  optimizer state's structure follows: a checkpoint holds the flat state
  and restores into a run with the same declaration.

  Args:
    tx: the optax transformation.

  Returns:
    The same transformation, declared elementwise.
  """
  return ElementwiseTransformation(tx.init, tx.update)


def is_elementwise(tx: optax.GradientTransformation) -> bool:
  """Whether ``tx`` was declared with :func:`elementwise`."""
  return isinstance(tx, ElementwiseTransformation)


def init_optimizer(
  unravel: Callable[[jax.Array], Any],
  tx: optax.GradientTransformation,
  flat: jax.Array,
) -> Any:
  """``tx``'s initial state for the flat parameters ``flat``: on the flat
  vector if ``tx`` is :func:`elementwise`, else on the parameter pytree."""
  return tx.init(flat if is_elementwise(tx) else unravel(flat))


def apply_update(
  unravel: Callable[[jax.Array], Any],
  tx: optax.GradientTransformation,
  flat: jax.Array,
  opt_state: Any,
  g: jax.Array,
) -> tuple[jax.Array, Any, jax.Array]:
  """One optax step on the flat gradient ``g``, skipped if it is not finite.

  Args:
    unravel: flat parameter vector to parameter pytree.
    tx: the optimizer; an :func:`elementwise` one runs on the flat vectors.
    flat: the flat float32 parameters.
    opt_state: ``tx``'s state.
    g: the flat (unscaled) gradient.

  Returns:
    ``(new_flat, new_opt_state, finite)``; where ``g`` is not finite the
    parameters and the optimizer state are returned unchanged.
  """
  finite = jnp.all(jnp.isfinite(g))
  keep = lambda new, old: jnp.where(finite, new, old)
  if is_elementwise(tx):
    updates, new_opt = tx.update(g, opt_state, flat)
    return (
      keep(optax.apply_updates(flat, updates), flat),
      jax.tree.map(keep, new_opt, opt_state),
      finite,
    )
  p = unravel(flat)
  updates, new_opt = tx.update(unravel(g), opt_state, p)
  # Selected leaf by leaf, before raveling: each select fuses into its
  # leaf's update. One select on the raveled vector is a pass of its own.
  new_flat = flatten.ravel(
    jax.tree.map(keep, optax.apply_updates(p, updates), p)
  )
  return new_flat, jax.tree.map(keep, new_opt, opt_state), finite
