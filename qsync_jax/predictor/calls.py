"""Zero-argument calls of a step's pieces on the devices at hand.

This module owns the calls a measured profile times (each dispatches its
compiled work and returns the output, for
:func:`qsync_jax.predictor.timing.interleaved`): one layer's forward and
forward+backward (:func:`layer_calls`), the step without its layers
(:func:`rest_calls`), one optimizer update (:func:`optimizer_call`), and for
a host that carries workers: k copies of the whole gradient pass at
once (:func:`pass_concurrency_calls`), host all-reduces
(:func:`allreduce_calls`) and the trainer's step at a uniform precision,
whose times against the passes give the step's fixed part and the host work
a pass hides (:func:`uniform_step_calls`). The step is built from
:mod:`qsync_jax.train.step` and :mod:`qsync_jax.train.programs`, the pieces
the trainer runs, not from the trainer itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
from typing import Any, NamedTuple

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.parallel import averagers
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import pieces
from qsync_jax.train import layout
from qsync_jax.train import programs
from qsync_jax.train import step as step_lib
from qsync_jax.train.state import TrainState


def _random_operands(node: graph_lib.LayerNode, device, seed: int = 0):
  rng = np.random.default_rng(seed)
  shapes = [op.shape for op in node.operands]
  if node.weight_shape:
    shapes.append(node.weight_shape)
  return [
    jax.device_put(rng.standard_normal(s).astype(np.float32), device)
    for s in shapes
  ]


def layer_calls(
  node: graph_lib.LayerNode,
  precision: Precision,
  device: jax.Device,
  quant: QuantConfig | None = None,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
  """(forward, forward_and_backward) zero-argument calls of one layer."""
  arrays = _random_operands(node, device)
  fwd, fb = pieces.layer_functions(node, precision, quant)
  out = jax.eval_shape(fwd, *arrays)
  ct = jax.device_put(
    np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype),
    device,
  )
  return (lambda: fwd(*arrays)), (lambda: fb(*arrays, ct))


def _batch_arrays(sample_batch, device):
  """The batch (any pytree) on ``device``."""
  return jax.device_put(jax.tree.map(jnp.asarray, sample_batch), device)


def step_ids(worker: int = 0, step: int = 0) -> np.ndarray:
  """The ``ids`` argument of the trainer's gradient function."""
  return np.array([worker, step], np.uint32)


def rest_calls(
  model: nnx.Module,
  g: graph_lib.ModelGraph,
  sample_batch,
  loss_fn,
  dtype: str,
  device: jax.Device,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
  """(forward, gradient) zero-argument calls of the stand-in step."""
  forward, grad_fn, flat, rest = pieces.stand_in_step_functions(
    model, g, loss_fn, dtype
  )
  batch = _batch_arrays(sample_batch, device)
  row = jax.device_put(flat[None], device)
  rest = jax.device_put(rest, device)
  scale = jax.device_put(jnp.ones((1,), jnp.float32), device)
  ids = step_ids()
  return (
    lambda: forward(row, rest, batch, ids),
    lambda: grad_fn(row, rest, scale, batch, ids),
  )


def optimizer_call(
  model: nnx.Module, tx: optax.GradientTransformation, device: jax.Device
) -> Callable[[], Any]:
  """A zero-argument call of one optimizer update of all parameters."""
  params = nnx.state(model, nnx.Param)
  flat, unravel = ravel_pytree(params)
  flat = jax.device_put(flat, device)
  opt_state = jax.device_put(step_lib.init_optimizer(unravel, tx, flat), device)
  g = jax.device_put(jnp.full_like(flat, 1e-3), device)
  # The trainer's optimizer step (less the loss scale and the stacking).
  update = jax.jit(functools.partial(step_lib.apply_update, unravel, tx))
  return lambda: update(flat, opt_state, g)


# --------------------------------------------------------------------------
# Host sharing (several workers on one device at hand).
# --------------------------------------------------------------------------


def concurrency_calls(
  make_call: Callable[[jax.Device, int], Callable],
  local_devices: Sequence[jax.Device],
) -> dict[int, Callable[[], Any]]:
  """Calls that run one computation on k of the host's devices at once.

  Args:
    make_call: ``make_call(device, i)`` returns a function that dispatches
      the computation on ``device`` (asynchronously) and returns its output.
    local_devices: the host's devices.

  Returns:
    ``{k: call}`` for k in :func:`host_counts`; with times ``t``,
    ``k * t[1] / t[k]`` is the aggregate speedup of k copies (k: they do not
    slow each other down; 1: they run one after another).
  """
  calls = [make_call(d, i) for i, d in enumerate(local_devices)]

  def first(k: int) -> Callable[[], list[Any]]:
    return lambda: [c() for c in calls[:k]]

  return {k: first(k) for k in host_counts(len(calls))}


def pass_concurrency_calls(
  model: nnx.Module,
  g: graph_lib.ModelGraph,
  sample_batch,
  loss_fn,
  precision: Precision,
  quant: QuantConfig | None,
  local_devices: Sequence[jax.Device],
) -> dict[int, Callable[[], Any]]:
  """:func:`concurrency_calls` of the model's whole gradient pass at one
  uniform precision (:func:`.pieces.pass_function`), one copy per host
  device."""
  fn, flat, rest = pieces.pass_function(model, g, loss_fn, precision, quant)

  def make(d, i):
    batch = _batch_arrays(sample_batch, d)
    row = jax.device_put(flat[None], d)
    rest_d = jax.device_put(rest, d)
    scale = jax.device_put(jnp.ones((1,), jnp.float32), d)
    ids = step_ids(i)
    return lambda: fn(row, rest_d, scale, batch, ids)

  return concurrency_calls(make, local_devices)


def host_counts(num_devices: int) -> list[int]:
  """Co-located worker counts a host profile measures: 1, 2, 4, ... and all.

  Simulations interpolate between them (:func:`.simulation.host_value`).
  """
  ks = {num_devices}
  k = 1
  while k < num_devices:
    ks.add(k)
    k *= 2
  return sorted(ks)


def allreduce_calls(
  local_devices: Sequence[jax.Device],
  sizes: Sequence[int] = (2**14, 2**18, 2**20, 2**22),
) -> dict[tuple[int, int], Callable[[], Any]]:
  """``{(k, elements): call}``: float32 ``psum`` over k host devices."""
  calls: dict[tuple[int, int], Callable[[], Any]] = {}
  for k in range(2, len(local_devices) + 1):
    mesh = Mesh(np.array(local_devices[:k]), ("w",))
    f = jax.jit(
      jax.shard_map(
        lambda v: jax.lax.psum(v, "w"),
        mesh=mesh,
        in_specs=P("w"),
        out_specs=P("w"),
      )
    )
    for n in sizes:
      x = jax.device_put(
        jnp.ones((k, n), jnp.float32), NamedSharding(mesh, P("w"))
      )
      calls[(k, n)] = functools.partial(f, x)
  return calls


class _DataParallel(NamedTuple):
  """What the trainer builds for FP32 workers on some of the host's devices
  (:func:`_data_parallel`)."""

  devices: dict[int, jax.Device]
  sharding: NamedSharding
  grad_fns: dict[int, Callable]
  weights: jax.Array
  state: TrainState
  update: Callable


def _data_parallel(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  devices: Sequence[jax.Device],
  loss_fn,
  sample_input,
  plan: PrecisionPlan,
) -> _DataParallel:
  """The trainer's pieces for workers with ``plan`` on ``devices``, built as
  the trainer builds them (:mod:`qsync_jax.train.step`,
  :mod:`qsync_jax.train.programs`): no loss scaling, the mean averager, equal
  weights. ``model`` is prepared as the trainer prepares it."""
  k = len(devices)
  split = step_lib.plan_graphdefs(model, [(plan, "cpu")] * k, sample_input)
  flat, unravel = ravel_pytree(split.params)
  mesh = Mesh(np.array(devices), (layout.AXIS,))
  by_index = dict(enumerate(devices))
  sharding = NamedSharding(mesh, P(layout.AXIS))
  weights = (np.ones(k) / k).astype(np.float32)
  return _DataParallel(
    by_index,
    sharding,
    dict(enumerate(step_lib.grad_functions(split.graphdefs, unravel, loss_fn))),
    layout.stacked_constant(weights, by_index, sharding),
    programs.initial_state(
      mesh,
      by_index,
      unravel,
      tx,
      flat,
      {i: jax.device_put(split.rest, d) for i, d in by_index.items()},
      loss_scaling=False,
      error_feedback=False,
    ),
    programs.update_program(
      mesh, unravel, tx, averagers.MeanAverager(), seed=0, error_feedback=False
    ),
  )


# Kept arguments place the zeros on their device: jit would otherwise drop
# the unused ones and run on the default device.
@functools.partial(jax.jit, keep_unused=True)
def _free_gradients(params_row, rest, scale, batch, ids):
  """The gradient function's signature, computing nothing: zero gradients,
  the state unchanged, no metrics."""
  del scale, batch, ids
  return jnp.zeros_like(params_row), rest, {}


def _step_call(
  dp: _DataParallel, grad_fns: dict[int, Callable], sample_batch
) -> Callable[[], Any]:
  """A zero-argument call of the trainer's step over ``dp``'s workers, with
  ``grad_fns`` for their passes."""
  batches = {i: _batch_arrays(sample_batch, d) for i, d in dp.devices.items()}
  state = [dp.state]

  def step() -> jax.Array:
    s = state[0]
    local = step_lib.local_gradients(
      grad_fns,
      dp.devices,
      s.params,
      s.loss_scale.scale,
      s.rest,
      batches,
      dp.sharding,
    )
    out: programs.UpdateResult = dp.update(
      s.params,
      s.opt_state,
      s.loss_scale,
      local.grads,
      dp.weights,
      s.counter,
      s.residual,
      s.averager_state,
    )
    state[0] = s.replace(
      params=out.params,
      opt_state=out.opt_state,
      loss_scale=out.loss_scale,
      rest=local.rest,
      anchor=out.params,
      counter=out.counter,
      residual=out.residual,
      averager_state=out.averager_state,
    )
    return out.params

  return step


def uniform_step_calls(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  local_devices: Sequence[jax.Device],
  sample_batch,
  sample_input,
  loss_fn,
  precision: Precision,
  quant: QuantConfig | None = None,
) -> dict[int, Callable[[], Any]]:
  """``{k: call}``: the trainer's data-parallel step over k of the host's
  workers, every one at uniform ``precision``.

  Against the pass at the same precision over k workers
  (:func:`pass_concurrency_calls`), and the step whose passes compute
  nothing (:func:`compute_free_step_calls`), these steps give what a step
  pays besides its pass, as the trainer pays it (the host's work between
  dispatches, the transfers, every dispatch and the update program on this
  model's parameters), and how much of the host's work a pass hides: the
  trainer dispatches the pass and then prepares the update while it runs,
  so a pass shorter than that work costs the step nothing
  (:func:`.profiling.fit_step_overhead`). (Taken as the step's fixed part,
  the update program and a compute-free step, timed apart, counted the
  update's dispatch twice and hid nothing, pricing short steps slow.)

  Args:
    model: the model.
    tx: the optimizer.
    local_devices: the host's devices.
    sample_batch: one worker's batch (any pytree the objective takes).
    sample_input: the model's inputs or a ``Probe``
      (:attr:`.graph.ModelGraph.sample`), to list its layers.
    loss_fn: the objective, in any form
      :func:`qsync_jax.task.as_objective` takes.
    precision: every worker's uniform precision.
    quant: operand quantization of INT8 / FP8 layers.
  """
  plan = PrecisionPlan.uniform(precision, quant)
  out = {}
  for k in host_counts(len(local_devices)):
    dp = _data_parallel(
      model, tx, local_devices[:k], loss_fn, sample_input, plan
    )
    out[k] = _step_call(dp, dp.grad_fns, sample_batch)
  return out


def compute_free_step_calls(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  local_devices: Sequence[jax.Device],
  sample_batch,
  sample_input,
  loss_fn,
) -> tuple[dict[int, Callable[[], Any]], dict[int, Callable[[], Any]]]:
  """``({k: step}, {k: passes})``: the trainer's step over k workers whose
  gradient passes compute nothing (zero gradients), and those passes alone
  over k devices at once.

  The step with (almost) no pass bounds how much host work a pass can hide
  (:func:`.profiling.fit_step_overhead`), which the uniform steps alone
  cannot tell where their passes are alike.
  """
  steps, dp = {}, None
  for k in host_counts(len(local_devices)):
    dp = _data_parallel(
      model, tx, local_devices[:k], loss_fn, sample_input, PrecisionPlan()
    )
    steps[k] = _step_call(
      dp, dict.fromkeys(dp.grad_fns, _free_gradients), sample_batch
    )
  # The passes alone run on the largest count's state (all the devices).
  assert dp is not None, "no local devices"
  rows = layout.rows(dp.state.params)
  scales = layout.rows(dp.state.loss_scale.scale)

  def make(d, i):
    batch = _batch_arrays(sample_batch, d)
    return lambda: _free_gradients(
      rows[d], dp.state.rest[i], scales[d], batch, step_ids(i)
    )

  return steps, concurrency_calls(make, local_devices)
