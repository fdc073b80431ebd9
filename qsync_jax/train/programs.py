"""The shard_map programs where the workers meet.

This module owns the jitted ``jax.shard_map`` programs over the mesh of all
workers (:data:`~qsync_jax.train.layout.AXIS`), built as functions of what
they close over (the mesh, the parameters' ``unravel``, the optimizer, the
averager, ...):

* :func:`init_program`: each worker's optimizer state and loss scale (and
  :func:`initial_state`: the whole
  :class:`~qsync_jax.train.state.TrainState` before a first step);
* :func:`update_program`: the data-parallel update (average the gradients
  through the averager, then the optax update of :mod:`.step`);
* :func:`local_update_program`: a local step (each worker applies its own
  gradient; no collective);
* :func:`average_params_program`: the average of the parameters' change
  since the last synchronization (local SGD), optionally through an outer
  optimizer (DiLoCo; its state from :func:`initial_outer_state`);
* :func:`opt_fields_program`: the average of chosen optimizer-state fields
  at the same synchronizations (the QSR code's ``optim_fields_to_average``;
  :func:`opt_field_mask` finds and checks the fields);
* :func:`mean_rest_program` and :func:`mean_params_program`: the workers'
  mean non-parameter state and parameters, for evaluation;
* :func:`step_programs`: all of the above a trainer runs, as one
  :class:`StepPrograms`, which also compiles them ahead of the steps
  (:func:`waits_for_local_work`: when a parameter average waits for queued
  work).

Every input and output is stacked over the workers (:mod:`.layout`). Each
average threads the error-feedback residual and the averager's own state
(:attr:`~qsync_jax.train.state.TrainState.averager_state`, PowerSGD's
warm-start ``Q``) to the
next. The trainer runs these programs; the predictor times the same update
program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from qsync_jax.numerics import flatten
from qsync_jax.parallel import averagers
from qsync_jax.parallel import schedules
from qsync_jax.train import layout
from qsync_jax.train import loss_scale as ls
from qsync_jax.train import step as step_lib
from qsync_jax.train.layout import AXIS
from qsync_jax.train.state import TrainState

Unravel = Callable[[jax.Array], Any]


class LocalUpdateResult(NamedTuple):
  """What a step's optimizer update returns, stacked over the workers
  (:func:`local_update_program`).

  Attributes:
    params: ``(n, P)`` the updated flat parameters.
    opt_state: the updated optimizer state.
    loss_scale: the updated :class:`~qsync_jax.train.loss_scale.LossScale`.
    finite: ``(n,)`` whether each worker's gradient was finite (the step
      not skipped).
  """

  params: jax.Array
  opt_state: Any
  loss_scale: ls.LossScale
  finite: jax.Array


class UpdateResult(NamedTuple):
  """What the data-parallel update returns (:func:`update_program`), stacked
  over the workers.

  Attributes:
    params: ``(n, P)`` the updated flat parameters.
    opt_state: the updated optimizer state.
    loss_scale: the updated :class:`~qsync_jax.train.loss_scale.LossScale`.
    finite: ``(n,)`` whether the averaged gradient was finite.
    counter: ``(n,)`` averages so far, one more.
    residual: ``(n, P)`` error-feedback residuals, or None without feedback.
    averager_state: the averager's state for the next average, or None.
  """

  params: jax.Array
  opt_state: Any
  loss_scale: ls.LossScale
  finite: jax.Array
  counter: jax.Array
  residual: jax.Array | None
  averager_state: Any


class AverageResult(NamedTuple):
  """What a parameter average returns (:func:`average_params_program`),
  stacked over the workers.

  Attributes:
    params: ``(n, P)`` the averaged flat parameters, the same on every
      worker.
    counter: ``(n,)`` averages so far, one more.
    residual: ``(n, P)`` error-feedback residuals, or None without feedback.
    averager_state: the averager's state for the next average, or None.
    outer_state: the outer optimizer's state, or None without one.
  """

  params: jax.Array
  counter: jax.Array
  residual: jax.Array | None
  averager_state: Any
  outer_state: Any


def _shard_map(
  mesh: Mesh, fn: Callable[..., Any], num_in: int
) -> jax.stages.Wrapped:
  """``fn`` jitted as a shard_map whose inputs and outputs are all stacked.

  The outputs' sharding is stated: on a one-device mesh jit would give an
  output that did not change per worker a replicated one, which the next
  call, taking it back, would compile for again.
  """
  return jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(P(AXIS),) * num_in, out_specs=P(AXIS)
    ),
    out_shardings=NamedSharding(mesh, P(AXIS)),
  )


def _expand(x: Any) -> jax.Array:
  return jnp.asarray(x)[None]


def init_program(
  mesh: Mesh,
  unravel: Unravel,
  tx: optax.GradientTransformation,
  init_scale: ls.LossScale,
) -> jax.stages.Wrapped:
  """``init(params) -> (params, opt_state, loss_scale)``, stacked per worker.

  The parameters come back as a copy made by the program: rows put from the
  host have a different sharding type from every later program's output,
  and the gradient functions, which read the rows, would compile a second
  time at the second step.
  """

  def init(params):
    opt_state = step_lib.init_optimizer(unravel, tx, params[0])
    return (
      params * 1,
      jax.tree.map(_expand, opt_state),
      jax.tree.map(_expand, init_scale),
    )

  return _shard_map(mesh, init, 1)


def initial_state(
  mesh: Mesh,
  devices: Mapping[int, jax.Device],
  unravel: Unravel,
  tx: optax.GradientTransformation,
  flat: jax.Array,
  rest: Mapping[int, Any],
  *,
  loss_scaling: bool,
  error_feedback: bool,
  averager: averagers.Averager | None = None,
  outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
  """The state before the first step: the same parameters on every worker.

  Args:
    mesh: the mesh of all workers.
    devices: ``{worker index: device}`` of this process's workers.
    unravel: flat parameter vector to parameter pytree.
    tx: the optimizer.
    flat: the initial flat float32 parameters.
    rest: ``{worker index: non-parameter model state}`` of the same
      workers, each on its device.
    loss_scaling: start a dynamic loss scale (else a disabled one).
    error_feedback: keep (zero) error-feedback residuals.
    averager: the averager, whose initial state
      (:func:`qsync_jax.parallel.averagers.init_state`) is stacked per
      worker; None: no averager state.
    outer_tx: the outer optimizer, whose initial state is stacked per
      worker (:func:`initial_outer_state`); None: none.

  Returns:
    The :class:`~qsync_jax.train.state.TrainState` at step 0, in sync.
  """
  sharding = NamedSharding(mesh, P(AXIS))
  num_workers = mesh.devices.size
  params = layout.put_rows(
    dict.fromkeys(devices.values(), flat[None]),
    (num_workers, flat.size),
    sharding,
  )
  init_scale = (
    ls.LossScale.create() if loss_scaling else ls.LossScale.disabled()
  )
  params, opt_state, loss_scale = init_program(mesh, unravel, tx, init_scale)(
    params
  )
  return TrainState(
    params=params,
    opt_state=opt_state,
    loss_scale=loss_scale,
    rest=dict(rest),
    anchor=params,
    counter=layout.stacked_constant(
      np.zeros(num_workers, np.uint32), devices, sharding
    ),
    residual=layout.zeros_like(params, sharding) if error_feedback else None,
    averager_state=_initial_averager_state(mesh, averager, params),
    outer_state=initial_outer_state(mesh, unravel, outer_tx, params),
  )


def _initial_averager_state(
  mesh: Mesh, averager: averagers.Averager | None, params: jax.Array
) -> Any:
  """The averager's initial state stacked per worker, or None (stateless)."""
  state = averagers.init_state(averager, params.shape[1])
  if state is None:
    return None
  return _shard_map(mesh, lambda p: jax.tree.map(_expand, state), 1)(params)


def _row(x: Any) -> Any:
  """This worker's row of every stacked leaf (None stays None)."""
  return jax.tree.map(lambda a: a[0], x)


def _average(
  averager: averagers.Averager,
  seed: int,
  x: jax.Array,
  weight: jax.Array,
  counter: jax.Array,
  residual: jax.Array | None,
  averager_state: Any,
) -> tuple[jax.Array, jax.Array | None, Any]:
  """``sum_i w_i x_i`` through the averager (:func:`.averagers.average`).

  Runs inside the shard_map programs on one worker's stacked rows of
  ``counter``, ``residual`` (error feedback unless None) and
  ``averager_state`` (None for a stateless averager); ``counter`` keys the
  rounding noise (a fresh key per average, the same on every worker).
  Returns ``(mean, new_residual, new_averager_state)``, the last two
  stacked.
  """
  key = jax.random.fold_in(jax.random.key(seed), counter[0])
  mean, residual, state = averagers.average(
    averager, x, weight, AXIS, key, _row(residual), _row(averager_state)
  )
  return mean, jax.tree.map(_expand, residual), jax.tree.map(_expand, state)


def _apply(
  unravel: Unravel,
  tx: optax.GradientTransformation,
  params: jax.Array,
  opt_state: Any,
  scale: ls.LossScale,
  g: jax.Array,
) -> LocalUpdateResult:
  """:func:`.step.apply_update` on one worker's stacked rows, and the loss
  scale's update; returns the stacked ``(params, opt_state, scale,
  finite)``."""
  opt = _row(opt_state)
  new_p, new_opt, finite = step_lib.apply_update(unravel, tx, params[0], opt, g)
  new_scale = ls.update(_row(scale), finite)
  return LocalUpdateResult(
    new_p[None],
    jax.tree.map(_expand, new_opt),
    jax.tree.map(_expand, new_scale),
    finite[None],
  )


def update_program(
  mesh: Mesh,
  unravel: Unravel,
  tx: optax.GradientTransformation,
  averager: averagers.Averager,
  seed: int,
  error_feedback: bool,
) -> jax.stages.Wrapped:
  """The data-parallel step: average the gradients, then the optax update.

  Returns:
    ``update(params, opt_state, scale, grads, weight, counter, residual,
    averager_state) -> UpdateResult``; ``grads`` are the scaled gradients,
    ``weight`` each worker's share of the average, ``residual`` the
    error-feedback residual (``None`` without feedback), ``averager_state``
    the averager's stacked state (``TrainState.averager_state``;
    ``None`` for a stateless averager). A non-finite averaged gradient
    skips the step on every worker and leaves the residual and the
    averager's state as they were.
  """

  def update(
    params, opt_state, scale, grads, weight, counter, residual, averager_state
  ):
    s = scale.scale[0]
    res = residual if error_feedback else None
    # The residual is unscaled: with feedback average g / s, not the scaled
    # gradient.
    g, new_res, new_state = _average(
      averager,
      seed,
      grads[0] / s if error_feedback else grads[0],
      weight[0],
      counter,
      res,
      averager_state,
    )
    out = _apply(
      unravel, tx, params, opt_state, scale, g if error_feedback else g / s
    )
    new_res, new_state = jax.tree.map(
      lambda new, old: jnp.where(out.finite[0], new, old),
      (new_res, new_state),
      (res, averager_state),
    )
    return UpdateResult(
      *out,
      counter + 1,
      new_res if error_feedback else residual,
      new_state,
    )

  return _shard_map(mesh, update, 8)


def local_update_program(
  mesh: Mesh, unravel: Unravel, tx: optax.GradientTransformation
) -> jax.stages.Wrapped:
  """A local step: each worker applies its own gradient; no collective.

  Returns:
    ``local_update(params, opt_state, scale, grads) ->
    LocalUpdateResult``.
  """

  def local_update(params, opt_state, scale, grads):
    return _apply(
      unravel, tx, params, opt_state, scale, grads[0] / scale.scale[0]
    )

  return _shard_map(mesh, local_update, 4)


def average_params_program(
  mesh: Mesh,
  averager: averagers.Averager,
  seed: int,
  outer_tx: optax.GradientTransformation | None = None,
  unravel: Unravel | None = None,
  settle: bool = False,
) -> jax.stages.Wrapped:
  """Averages the parameters' change since the last synchronization.

  Each worker sends its change since the anchor (a pseudo-gradient, whose
  magnitudes suit the quantizing averagers) and adds the average to it.
  With ``outer_tx`` (DiLoCo, Douillard et al., arXiv 2311.08105) the
  average goes through an outer optimizer instead: ``anchor - mean`` is its
  gradient, and its update is applied to the anchor. Every worker holds the
  same outer state and gets the same averaged change, so the workers stay
  identical. ``optax.sgd(1.0)`` gives back plain averaging bit for bit
  (``anchor + -1 * -delta``).

  Args:
    mesh: the mesh of all workers.
    averager: how the changes are averaged.
    seed: seeds the averager's rounding noise.
    outer_tx: the outer optimizer, or None for plain averaging.
    unravel: flat vector to parameter pytree (needed with ``outer_tx``,
      which sees the parameters' pytree, so masks and per-leaf rules work).
    settle: a call first waits until its arguments are computed
      (:func:`waits_for_local_work`).

  Returns:
    ``average(params, anchor, weight, counter, residual, averager_state=None,
    outer_state=None) -> AverageResult``; ``averager_state`` is the
    averager's stacked state (as for :func:`update_program`),
    ``outer_state`` the stacked state of
    :func:`initial_outer_state` (None without ``outer_tx``). Like a jitted
    function it has ``lower(...)`` with the same arguments.

  Raises:
    ValueError: ``outer_tx`` without ``unravel``.
  """
  if outer_tx is not None and unravel is None:
    raise ValueError("average_params_program needs unravel with an outer_tx")

  def average(
    params, anchor, weight, counter, residual, averager_state, outer_state
  ):
    delta, residual, averager_state = _average(
      averager,
      seed,
      params[0] - anchor[0],
      weight[0],
      counter,
      residual,
      averager_state,
    )
    if outer_tx is None:
      return AverageResult(
        (anchor[0] + delta)[None],
        counter + 1,
        residual,
        averager_state,
        outer_state,
      )
    state = _row(outer_state)
    updates, state = outer_tx.update(unravel(-delta), state, unravel(anchor[0]))
    new_p = anchor[0] + flatten.ravel(updates)
    return AverageResult(
      new_p[None],
      counter + 1,
      residual,
      averager_state,
      jax.tree.map(_expand, state),
    )

  program = _shard_map(mesh, average, 7)

  def checked(
    params,
    anchor,
    weight,
    counter,
    residual,
    averager_state=None,
    outer_state=None,
  ):
    if (outer_state is None) != (outer_tx is None):
      raise ValueError(
        "average_params_program: pass outer_state exactly "
        "when the program has an outer_tx"
      )
    return (
      params,
      anchor,
      weight,
      counter,
      residual,
      averager_state,
      outer_state,
    )

  return _CheckedProgram(program, checked, settle)


class _CheckedProgram:
  """A jitted ``program`` whose arguments ``check`` checks and completes
  first, for calls and, as jit's own, for ``lower`` (ahead-of-time
  compiles fill the cache the calls read). With ``settle``, a call first
  waits until its arguments are computed (:func:`waits_for_local_work`)."""

  def __init__(
    self,
    program: jax.stages.Wrapped,
    check: Callable[..., tuple[Any, ...]],
    settle: bool = False,
  ):
    self._program = program
    self._check = check
    self._settle = settle

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    args = self._check(*args, **kwargs)
    if self._settle:
      jax.block_until_ready(args)
    return self._program(*args)

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    return self._program.lower(*self._check(*args, **kwargs))

  def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
    return self._program.trace(*self._check(*args, **kwargs))


def initial_outer_state(
  mesh: Mesh,
  unravel: Unravel,
  outer_tx: optax.GradientTransformation | None,
  params: jax.Array,
) -> Any:
  """``outer_tx``'s initial state, stacked per worker, or None without one.

  Args:
    mesh: the mesh of all workers.
    unravel: flat vector to parameter pytree.
    outer_tx: the outer optimizer, or None.
    params: the stacked ``(n, P)`` parameters, the same on every worker (so
      is the state).

  Returns:
    The state, each leaf stacked ``(n, ...)``; None without ``outer_tx``.
  """
  if outer_tx is None:
    return None
  return _shard_map(
    mesh, lambda p: jax.tree.map(_expand, outer_tx.init(unravel(p[0]))), 1
  )(params)


def opt_field_mask(opt_state: Any, fields: Sequence[str]) -> Any:
  """Which leaves of an optax state lie under one of the named fields.

  A field is an attribute of an optax state (``mu`` and ``nu`` of Adam's
  ``ScaleByAdamState``, ``trace`` of SGD momentum's ``TraceState``), at any
  depth of a chained optimizer.

  Args:
    opt_state: an optax state (stacked, unstacked or abstract).
    fields: the field names.

  Returns:
    A pytree of bools shaped like ``opt_state``.

  Raises:
    ValueError: a field the state does not have, naming those it has.
  """
  paths = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  have = sorted(
    {
      k.name
      for path, _ in paths
      for k in path
      if isinstance(k, jax.tree_util.GetAttrKey)
    }
  )
  unknown = sorted(set(fields) - set(have))
  if unknown:
    raise ValueError(
      f"the optimizer state has no field(s) "
      f"{', '.join(unknown)} to average; its fields: "
      f"{', '.join(have) or 'none'}"
    )
  return jax.tree_util.tree_map_with_path(
    lambda path, _: any(
      isinstance(k, jax.tree_util.GetAttrKey) and k.name in fields for k in path
    ),
    opt_state,
  )


def opt_fields_program(
  mesh: Mesh, opt_state: Any, fields: Sequence[str]
) -> tuple[jax.stages.Wrapped | None, int]:
  """Averages the named optimizer-state fields over the workers.

  The QSR code (``LocalOptimizer``, ``optim_fields_to_average``) averages
  them in the same float32 all-reduce as the parameters at each sync of a
  local schedule; here they take an exact float32 weighted mean (the
  parameters' weights), beside the parameters' averager. Integer leaves
  (step counts, equal on every worker) stay as they are.

  Args:
    mesh: the mesh of all workers.
    opt_state: the stacked optimizer state.
    fields: the field names (see :func:`opt_field_mask`); may be empty.

  Returns:
    ``(average, size)``: ``average(opt_state, weight) -> opt_state`` (None
    without fields) and the number of floats each worker sends per sync.

  Raises:
    ValueError: a field the optimizer state does not have.
  """
  mask = opt_field_mask(opt_state, fields)
  mask = jax.tree.map(
    lambda m, x: m and jnp.issubdtype(x.dtype, jnp.floating), mask, opt_state
  )
  size = sum(
    int(np.prod(x.shape[1:]))
    for m, x in zip(jax.tree.leaves(mask), jax.tree.leaves(opt_state))
    if m
  )
  if not size:
    return None, 0

  def average(opt, weight):
    return jax.tree.map(
      lambda m, x: jax.lax.psum(x * weight[0], AXIS) if m else x, mask, opt
    )

  return _shard_map(mesh, average, 2), size


def mean_rest_program(mesh: Mesh) -> jax.stages.Wrapped:
  """``mean(tree)``: every floating leaf averaged over the workers (the
  BatchNorm statistics); other leaves (counters) as they are."""

  def mean(tree):
    return jax.tree.map(
      lambda x: (
        jax.lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.floating) else x
      ),
      tree,
    )

  return _shard_map(mesh, mean, 1)


def mean_params_program(mesh: Mesh) -> jax.stages.Wrapped:
  """``mean(params, weight)``: the workers' weighted mean parameters, on
  every worker (exact float32, outside the averager: no wire bytes)."""
  return _shard_map(mesh, lambda p, w: jax.lax.psum(p * w[0], AXIS), 2)


def waits_for_local_work(mesh: Mesh) -> bool:
  """Whether a parameter average first waits for the devices' queued work.

  XLA:CPU runs a process's devices on one pool of threads (as many as the
  larger of the cores and the devices) and caps each device's dispatched
  computations. A device's part of a collective holds a thread until every
  part has arrived; a device whose queue is full holds one too, in the
  launch of the next program. Local steps let the devices' queues drift
  apart, and the two can take every thread: the devices behind never run,
  and after 40 s XLA aborts (``Termination timeout for all reduce``).
  Waiting costs one pipeline bubble per synchronization.

  Args:
    mesh: the mesh of all workers.

  Returns:
    Whether two or more of this process's devices on ``mesh`` are XLA:CPU
    devices.
  """
  here = jax.process_index()
  local = [d for d in mesh.devices.flat if d.process_index == here]
  return len(local) > 1 and all(d.platform == "cpu" for d in local)


class StepPrograms(NamedTuple):
  """The programs a trainer's steps run over its mesh
  (:func:`step_programs`).

  Attributes:
    update: the data-parallel update (:func:`update_program`).
    local_update: a local step's update (:func:`local_update_program`).
    average_params: a parameter average (:func:`average_params_program`).
    average_opt: the average of the optimizer-state fields averaged at each
      parameter average (:func:`opt_fields_program`), or None.
    opt_floats: the floats each worker sends per ``average_opt``.
    mean_rest: the workers' mean non-parameter state, for evaluation.
    mean_params: the workers' exact weighted mean parameters.
  """

  update: jax.stages.Wrapped
  local_update: jax.stages.Wrapped
  average_params: Any
  average_opt: jax.stages.Wrapped | None
  opt_floats: int
  mean_rest: jax.stages.Wrapped
  mean_params: jax.stages.Wrapped

  def compile(
    self,
    state: TrainState,
    weights: jax.Array,
    schedule: schedules.Schedule,
    total_steps: int,
  ) -> None:
    """Compiles the programs steps ``state.step + 1`` to ``total_steps``
    will call under ``schedule``; runs none of them.

    Args:
      state: the state the steps start from (its types and shardings).
      weights: ``(n,)`` the workers' stacked shares of an average.
      schedule: when the workers synchronize.
      total_steps: the last step.
    """
    steps = range(state.step + 1, int(total_steps) + 1)
    local = [s for s in steps if not schedule.averages_gradients_at(s)]
    grads = state.params  # The stacked gradients' type and sharding.
    if len(local) < len(steps):
      self.update.lower(
        state.params,
        state.opt_state,
        state.loss_scale,
        grads,
        weights,
        state.counter,
        state.residual,
        state.averager_state,
      ).compile()
    if not local:
      return
    self.local_update.lower(
      state.params, state.opt_state, state.loss_scale, grads
    ).compile()
    if set(local) & set(schedule.sync_steps(int(total_steps))):
      self.average_params.lower(
        state.params,
        state.anchor,
        weights,
        state.counter,
        state.residual,
        state.averager_state,
        state.outer_state,
      ).compile()
      if self.average_opt is not None:
        self.average_opt.lower(state.opt_state, weights).compile()


def step_programs(
  mesh: Mesh,
  unravel: Unravel,
  tx: optax.GradientTransformation,
  num_params: int,
  *,
  averager: averagers.Averager,
  seed: int,
  error_feedback: bool,
  outer_tx: optax.GradientTransformation | None,
  opt_fields: Sequence[str],
) -> StepPrograms:
  """Every program of a trainer's steps, built for its mesh and settings.

  Args:
    mesh: the mesh of all workers.
    unravel: flat parameter vector to parameter pytree.
    tx: the optimizer.
    num_params: the flat parameters' size.
    averager: what an average sends.
    seed: seeds the averager's rounding noise.
    error_feedback: keep the compression error for the next average.
    outer_tx: the outer optimizer of a parameter average, or None.
    opt_fields: the optimizer-state fields averaged at a parameter average.

  Returns:
    The :class:`StepPrograms`.

  Raises:
    ValueError: an optimizer-state field ``tx``'s state does not have.
  """
  # The optimizer state's structure and shapes, stacked, without values.
  opt_shapes = jax.eval_shape(
    lambda p: jax.tree.map(
      lambda a: a[None], step_lib.init_optimizer(unravel, tx, p)
    ),
    jax.ShapeDtypeStruct((num_params,), jnp.float32),
  )
  average_opt, opt_floats = opt_fields_program(mesh, opt_shapes, opt_fields)
  return StepPrograms(
    update=update_program(mesh, unravel, tx, averager, seed, error_feedback),
    local_update=local_update_program(mesh, unravel, tx),
    average_params=average_params_program(
      mesh, averager, seed, outer_tx, unravel, waits_for_local_work(mesh)
    ),
    average_opt=average_opt,
    opt_floats=opt_floats,
    mean_rest=mean_rest_program(mesh),
    mean_params=mean_params_program(mesh),
  )
