"""HybridTrainer: synchronous data parallelism over workers with different plans.

This module owns :class:`Worker` and :class:`HybridTrainer`, which builds
the pieces of the ``train`` package for a set of workers (the per-plan
gradient functions of :mod:`.step`, the shard_map programs of
:mod:`.programs`, evaluation of :mod:`.evaluation`) and runs a step as a
pure function of the :class:`~qsync_jax.train.state.TrainState`
(``init``, ``train_step(state, batches) -> (state, metrics)``,
``evaluate(state, ...)``); :mod:`.checkpoint` saves and restores the state.

Each worker is a (device, device kind, precision plan, local batch size). One
SPMD program cannot span different GPU models, and each plan is a different
computation, so every worker gets its own jitted gradient function compiled
for its device from its plan. The workers meet in one separate jitted
``jax.shard_map`` over a mesh of all workers, which averages the gradients and
applies the (identical) optax update on every worker.

Synchronization follows the :class:`~qsync_jax.train.sync.SyncSettings`:
its schedule (:mod:`qsync_jax.parallel.schedules`) says when. A step
that averages gradients runs the averaging program above. Any other step is a
local step: every worker applies its own gradient with its own optimizer state,
with no collective. After a local step that ends a round, the workers average
their parameters: each sends its change since the last synchronization (a
pseudo-gradient, whose magnitudes suit the quantizing averagers of
:mod:`qsync_jax.parallel.averagers` where the raw parameters would not) and adds
the averaged change to the common starting point. Optimizer state stays local,
as in QSR's official code (hmgxr128/QSR, ``LocalOptimizer``), except the
fields named in ``opt_fields_to_average`` (that code's
``optim_fields_to_average``), averaged too.

The state's layout (:mod:`.state`), chosen so a step costs few host
operations:

* parameters are one flat float32 vector per worker, stacked into a global
  ``(num_workers, P)`` array sharded over the ``workers`` mesh axis, so the
  gradient of a worker is a single buffer (one all-reduce bucket) and the
  global array is assembled with one ``make_array_from_single_device_arrays``;
* optimizer state and the loss scale are stacked the same way and only ever
  touched inside the shard_map program, as are the error-feedback residuals
  (``residual``) and a stateful averager's state (``averager_state``,
  PowerSGD's warm-start ``Q``), which every average hands to the next;
* the rest of the model state (BatchNorm statistics) stays local per worker;
* the parameters at the last synchronization (the *anchor* of local SGD) are
  the same array as an earlier state's ``params``, not a copy, so data
  parallelism pays nothing for them.

Every worker's parameters and optimizer state stay identical under data
parallelism; the stacked layout is what local SGD (per-worker parameters)
needs too. The same code runs single-process (several local devices) and
multi-process (``jax.distributed``, one device per process): each process
runs the gradient functions of its own workers only.

The trainer runs on its own mesh of the workers' devices (one axis,
``workers``), one full replica of the parameters per worker; a mesh in
context (``jax.set_mesh``) does not move it, and the parameters' sharding
annotations (:mod:`qsync_jax.task.sharding`) stay on the model, applied by
none of its programs. With local steps and loss scaling, each worker keeps
its own loss scale and skips only its own non-finite steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import hashlib
from typing import Any

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel import averagers
from qsync_jax.plan.intercept import StackedLayerError
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.task import calling
from qsync_jax.task import objective as objective_lib
from qsync_jax.task import sharding
from qsync_jax.train import checks
from qsync_jax.train import evaluation
from qsync_jax.train import executable_cache
from qsync_jax.train import layout
from qsync_jax.train import programs
from qsync_jax.train import step as step_lib
from qsync_jax.train.layout import AXIS
from qsync_jax.train.state import TrainState
from qsync_jax.train.sync import SyncSettings


@dataclasses.dataclass(frozen=True)
class Worker:
  """One data-parallel worker.

  Attributes:
    device: the JAX device it runs on.
    kind: its device kind (``"v100"``, ``"t4"``, ...), which the plan must
      suit.
    plan: its precision plan.
    batch_size: its local batch size.
  """

  device: jax.Device
  kind: str
  plan: PrecisionPlan
  batch_size: int


def _worker_rest(rest: Any, index: int) -> Any:
  """Worker ``index``'s copy of the non-parameter state: every typed PRNG
  key (a layer's own RNG stream, e.g. ``nnx.Dropout(rngs=...)``) folded with
  the index, so workers draw different dropout masks."""
  return jax.tree.map(
    lambda a: jax.random.fold_in(a, index) if layout.is_key(a) else a, rest
  )


def _check_workers(workers: Any) -> None:
  """Raises for workers that are not a sequence of :class:`Worker` on
  distinct jax devices, with a :class:`PrecisionPlan` and a positive integer
  batch size each.

  Raises:
    TypeError: not a sequence of ``Worker``, or a field of the wrong type.
    ValueError: no worker, a shared device or a batch size below 1.
  """
  if isinstance(workers, Worker) or not isinstance(workers, Sequence):
    raise TypeError(
      f"workers must be a list of qsync_jax.Worker, got "
      f"{type(workers).__name__}"
    )
  if not workers:
    raise ValueError("HybridTrainer needs at least one worker")
  for i, w in enumerate(workers):
    checks.check_worker(w, i, Worker)
  devices = [w.device for w in workers]
  if len(set(devices)) != len(devices):
    raise ValueError(f"workers must run on distinct devices, got {devices}")
  bad = [w.batch_size for w in workers if w.batch_size <= 0]
  if bad:
    raise ValueError(f"batch sizes must be positive, got {bad}")


def _grad_weights(
  workers: Sequence[Worker], grad_weights: Sequence[float] | None
) -> np.ndarray:
  """The workers' shares of the average: by default ``b_i / sum(b)``."""
  n = len(workers)
  if grad_weights is None:
    sizes = np.array([w.batch_size for w in workers], np.float64)
    weights = np.asarray(sizes / sizes.sum(), np.float32)
  else:
    weights = np.asarray(grad_weights, np.float32)
  if weights.shape != (n,) or not np.isclose(weights.sum(), 1.0):
    raise ValueError(
      f"grad_weights must be {n} numbers summing to 1, got {weights.tolist()}"
    )
  return weights


def _loss_scaling(
  loss_scaling: bool | str, precisions: Sequence[dict[str, Precision]]
) -> bool:
  """Whether the trainer scales the loss: ``"auto"`` when any worker
  computes a layer in FP16.

  Raises:
    ValueError: neither ``"auto"`` nor a bool.
  """
  if loss_scaling == "auto":
    return any(Precision.FP16 in eff.values() for eff in precisions)
  if not isinstance(loss_scaling, bool):
    raise ValueError(
      f"loss_scaling must be 'auto', True or False, got {loss_scaling!r}"
    )
  return loss_scaling


def _sync_settings(sync: SyncSettings | None) -> SyncSettings:
  """``sync``, or the default settings for None.

  Raises:
    TypeError: ``sync`` is not a ``SyncSettings``.
  """
  if sync is None:
    return SyncSettings()
  if not isinstance(sync, SyncSettings):
    raise TypeError(
      f"sync must be a qsync_jax.SyncSettings, got {type(sync).__name__}"
    )
  return sync


def _probe(
  model: nnx.Module, objective: objective_lib.Objective, sample: Any
) -> calling.Probe | None:
  """The probe the layers are traced with: ``sample`` as one worker's batch
  run through the objective, or ``sample`` itself when it is a probe.

  A probe runs the objective only when the layers are traced, so its
  function is what turns the objective's failure on ``sample`` into the
  error that says what ``sample`` must be (a plan's own error passes).
  """
  if sample is None or isinstance(sample, calling.Probe):
    return sample

  def refused(err: Exception) -> ValueError:
    return ValueError(
      f"sample must be one worker's batch, as train_step takes it (for "
      f"classification an (inputs, labels) pair), or a qsync_jax.task.Probe "
      f"(qsync_jax.task.input_probe(inputs) for the model's inputs alone); "
      f"the objective could not run {type(model).__name__} on it: {err}"
    )

  try:
    probe = objective.probe(calling.abstract(sample))
  except (AttributeError, TypeError, ValueError) as err:  # not arrays
    raise refused(err) from err

  def run(m: nnx.Module, batch: Any) -> Any:
    try:
      return probe.fn(m, batch)
    except (PlanError, StackedLayerError):
      raise
    except (TypeError, ValueError) as err:
      raise refused(err) from err

  return calling.Probe(run, probe.data)


def _kept_grad_functions(
  grad_fns: Sequence[Callable], local_workers: Sequence[int]
) -> dict[int, Callable]:
  """Each local worker's gradient function, its compiled programs kept for
  every process (:mod:`.executable_cache`). Workers with equal plans share
  one function, and one cache of its programs (one per device)."""
  kept = {id(f): executable_cache.cached(f) for f in grad_fns}
  return {i: kept[id(grad_fns[i])] for i in local_workers}


class HybridTrainer:
  """Synchronous training over workers that run different precision plans.

  The trainer holds what a run does not change: the workers, their jitted
  gradient functions and the shard_map programs where they meet. What a
  step changes is a :class:`~qsync_jax.train.state.TrainState`, passed in
  and out (``state, metrics = trainer.train_step(state, batches)``).

  Args:
    model: the NNX model (FP32 parameters); :meth:`init` starts from its
      parameters as they are now. Its mode is left as it was.
    workers: the workers, one distinct device each.
    tx: the optax optimizer every worker applies.
    objective: what the workers minimize, in any form
      :func:`qsync_jax.task.as_objective` takes (a
      :class:`~qsync_jax.task.Objective`, a ``loss_fn``; default:
      classification on ``(x, y)`` batches).
    sample: one worker's batch, as :meth:`train_step` takes it, or a
      :class:`qsync_jax.task.Probe`, to trace the layers with (default:
      the model's ``input_spec``).
    sync: when and how the workers synchronize
      (:class:`~qsync_jax.train.sync.SyncSettings`; default: average the
      gradients every step, exact float32 mean).
    loss_scaling: ``"auto"`` (dynamic loss scaling when any worker computes
      a layer in FP16), ``True`` or ``False``.
    bn_stats: the BatchNorm statistics :meth:`evaluate` uses:
      ``"reestimate"`` (the QSR code's: recomputed for the evaluated
      parameters on training batches) or ``"average"`` (the workers').
    seed: seeds the averagers' rounding noise and the step rngs (a layer's
      own RNG stream is folded with the worker's index).

  Raises:
    ValueError: no worker, two workers on one device, a bad batch size, an
      unknown ``bn_stats``, ``loss_scaling`` or optimizer-state field, a
      ``sample`` the objective cannot run, a model without floating-point
      parameters or (default objective) whose output is not logits.
    TypeError: ``sync`` is not a ``SyncSettings``.
    qsync_jax.PlanError: a plan does not fit the model or its device kind.
  """

  @sharding.without_mesh
  def __init__(
    self,
    model: nnx.Module,
    workers: Sequence[Worker],
    tx: optax.GradientTransformation,
    *,
    objective: Any = None,
    sample: Any = None,
    sync: SyncSettings | None = None,
    loss_scaling: bool | str = "auto",
    bn_stats: str = "reestimate",
    seed: int = 0,
  ):
    _check_workers(workers)
    checks.check_model_and_optimizer(model, tx, seed)
    self.sync = sync = _sync_settings(sync)
    self.workers = list(workers)
    self.num_workers = len(workers)
    self.tx = tx
    self.objective = objective_lib.as_objective(objective)
    self.seed = int(seed)
    self.mesh = Mesh(np.array([w.device for w in workers]), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    here = jax.process_index()
    self.local_workers = [
      i for i, w in enumerate(workers) if w.device.process_index == here
    ]
    #: ``{worker index: device}`` of this process's workers.
    self.local_devices = {i: workers[i].device for i in self.local_workers}
    self.grad_weights = _grad_weights(workers, sync.grad_weights)
    self._weights = layout.stacked_constant(
      self.grad_weights, self.local_devices, self.sharding
    )

    classes = checks.default_classes(model, objective, self.objective, sample)
    split = step_lib.plan_graphdefs(
      model,
      [(w.plan, w.kind) for w in workers],
      _probe(model, self.objective, sample),
    )
    self.precisions = split.precisions
    checks.check_params(model, split.params)
    flat, self.unravel = ravel_pytree(split.params)  # flat vector -> pytree
    self.num_params = int(flat.size)
    self._door = checks.record(self, sample, classes)  # what calls check
    # The model's own arrays (no copy): what init() starts from.
    self._initial = (split.params, split.rest)
    self.loss_scaling = _loss_scaling(loss_scaling, self.precisions)
    # Bytes each worker sends per average of the parameters' size.
    self._params_bytes = sync.averager.wire_bytes(flat.size, len(workers))
    self._build_programs(split, model, bn_stats)

  def _build_programs(
    self, split: step_lib.PlanGraphdefs, model: nnx.Module, bn_stats: str
  ) -> None:
    """The jitted gradient functions, the step's and evaluation's programs."""
    sync, unravel = self.sync, self.unravel
    grad_fns = step_lib.grad_functions(
      split.graphdefs, unravel, self.objective, self.seed
    )
    self._grad_fns = _kept_grad_functions(grad_fns, self.local_workers)
    self.programs = programs.step_programs(
      self.mesh,
      unravel,
      self.tx,
      self.num_params,
      averager=sync.averager,
      seed=self.seed,
      error_feedback=sync.error_feedback,
      outer_tx=sync.outer_tx,
      opt_fields=sync.opt_fields_to_average,
    )
    self._eval_fn = executable_cache.cached(
      evaluation.eval_function(split.fp32_graphdef, unravel, self.objective)
    )
    bn_fn = evaluation.bn_function(
      split.fp32_graphdef, unravel, model, bn_stats, self.objective
    )
    self._bn_fn = bn_fn and executable_cache.cached(bn_fn)

  # ------------------------------------------------------------------
  # The state and the step.
  # ------------------------------------------------------------------

  @sharding.without_mesh
  def init(self) -> TrainState:
    """The state at step 0: the model's parameters on every worker, in sync.

    Returns:
      A :class:`~qsync_jax.train.state.TrainState`: the optimizer's initial
      state, the loss scale (dynamic where the trainer scales), each local
      worker's copy of the model's other state (a layer's own RNG stream
      folded with the worker's index), and zero residuals and the
      averager's and outer optimizer's initial state where they apply.
    """
    params, rest = self._initial
    return programs.initial_state(
      self.mesh,
      self.local_devices,
      self.unravel,
      self.tx,
      ravel_pytree(params)[0],
      {
        i: jax.device_put(_worker_rest(rest, i), d)
        for i, d in self.local_devices.items()
      },
      loss_scaling=self.loss_scaling,
      error_feedback=self.sync.error_feedback,
      averager=self.sync.averager,
      outer_tx=self.sync.outer_tx,
    )

  @sharding.without_mesh
  def train_step(
    self, state: TrainState, batches: Mapping[int, Any]
  ) -> tuple[TrainState, dict[int, dict[str, jax.Array]]]:
    """Runs one synchronous step; ``state`` itself is left as it was.

    Args:
      state: the state before the step (:meth:`init`, or the last step's).
      batches: ``{worker index: batch}`` for this process's workers (a batch
        is what the objective takes, ``(x, y)`` for classification); worker
        ``i``'s batch has ``workers[i].batch_size`` examples.

    Returns:
      ``(state, metrics)``: the state after the step, and ``{worker index:
      {"loss", ...the objective's metrics}}`` as device scalars (not
      synchronized with the host, so logging them is the caller's choice).

    Raises:
      TypeError, ValueError: a state or batches this trainer cannot take
        (:func:`.checks.check_step` says which).
    """
    checks.check_step(self._door, state, batches)
    local = step_lib.local_gradients(
      self._grad_fns,
      self.local_devices,
      state.params,
      state.loss_scale.scale,
      state.rest,
      batches,
      self.sharding,
      state.step,
    )
    step = state.step + 1
    if self.sync.schedule.averages_gradients_at(step):
      new = self._average_gradients(state, local.grads)
    else:
      new = self._local_step(state, local.grads, step)
    return new.replace(step=step, rest=local.rest), local.metrics

  def _average_gradients(
    self, state: TrainState, grads: jax.Array
  ) -> TrainState:
    """A data-parallel step's update: the averaged gradient, applied."""
    out: programs.UpdateResult = self.programs.update(
      state.params,
      state.opt_state,
      state.loss_scale,
      grads,
      self._weights,
      state.counter,
      state.residual,
      state.averager_state,
    )
    return state.replace(
      params=out.params,
      opt_state=out.opt_state,
      loss_scale=out.loss_scale,
      anchor=out.params,
      counter=out.counter,
      residual=out.residual,
      averager_state=out.averager_state,
      in_sync=True,
      sync_rounds=state.sync_rounds + 1,
      comm_bytes=state.comm_bytes + self._params_bytes,
    )

  def _local_step(
    self, state: TrainState, grads: jax.Array, step: int
  ) -> TrainState:
    """A local step's update, then the parameter average that ends a
    round."""
    local: programs.LocalUpdateResult = self.programs.local_update(
      state.params, state.opt_state, state.loss_scale, grads
    )
    state = state.replace(
      params=local.params,
      opt_state=local.opt_state,
      loss_scale=local.loss_scale,
      in_sync=False,
    )
    if not self.sync.schedule.is_sync_step(step):
      return state
    avg: programs.AverageResult = self.programs.average_params(
      state.params,
      state.anchor,
      self._weights,
      state.counter,
      state.residual,
      state.averager_state,
      state.outer_state,
    )
    opt_state, comm_bytes = state.opt_state, state.comm_bytes
    if self.programs.average_opt is not None:
      opt_state = self.programs.average_opt(opt_state, self._weights)
      comm_bytes += averagers.MeanAverager().wire_bytes(
        self.programs.opt_floats, self.num_workers
      )
    return state.replace(
      params=avg.params,
      opt_state=opt_state,
      anchor=avg.params,
      counter=avg.counter,
      residual=avg.residual,
      averager_state=avg.averager_state,
      outer_state=avg.outer_state,
      in_sync=True,
      sync_rounds=state.sync_rounds + 1,
      comm_bytes=comm_bytes + self._params_bytes,
    )

  @sharding.without_mesh
  def compile(self, state: TrainState, total_steps: int) -> None:
    """Compiles the update and averaging programs of the coming steps.

    jit compiles a program at its first call. A data-parallel run calls its
    update at the first step, but a local schedule's first parameter average
    comes at its first sync step, in the middle of a timed run, whose
    training clock would count the compile. After this call, steps
    ``state.step + 1`` to ``total_steps`` compile only the workers' gradient
    functions, at the first step (their inputs are the batches). Nothing
    runs, so nothing changes and no worker waits for another.

    Args:
      state: the state the steps start from (its types and shardings).
      total_steps: the last step the run will take.
    """
    self.programs.compile(state, self._weights, self.sync.schedule, total_steps)

  # ------------------------------------------------------------------
  # Evaluation and inspection.
  # ------------------------------------------------------------------

  @property
  def _first_device(self) -> jax.Device:
    return self.workers[self.local_workers[0]].device

  @sharding.without_mesh
  def worker_params(self, state: TrainState, index: int | None = None) -> Any:
    """A worker's parameters in ``state`` as a pytree (default: the first
    local worker's)."""
    i = self.local_workers[0] if index is None else index
    return self.unravel(layout.rows(state.params)[self.workers[i].device][0])

  def params_digest(self, state: TrainState) -> str:
    """SHA-256 of the first local worker's parameter bytes in ``state``."""
    row = np.asarray(layout.rows(state.params)[self._first_device])
    return hashlib.sha256(row.tobytes()).hexdigest()

  def stacked_rest(self, rests: Mapping[int, Any]) -> Any:
    """The local workers' non-parameter states stacked into global arrays
    (typed PRNG keys as their key data; :func:`.layout.stack_trees`)."""
    return layout.stack_trees(
      {d: rests[i] for i, d in self.local_devices.items()},
      self.num_workers,
      self.sharding,
    )

  @sharding.without_mesh
  def evaluate(
    self,
    state: TrainState,
    data: Any,
    batch_size: int = 256,
    train_batches: Any = None,
  ) -> dict[str, float]:
    """The objective's mean loss and metrics over ``data`` (one batch,
    ``(x, y)`` for classification), in eval mode with FP32 compute.

    The model evaluated is the workers' average: mid-round parameters are
    their exact float32 mean (no wire bytes, no sync round); BatchNorm
    statistics the workers' mean (``bn_stats="average"``) or the mean of
    each worker's re-estimate for those parameters on ``train_batches``
    (per step ``{worker index: batch}``, as :meth:`train_step` takes).
    ``state`` is left as it was. The first local worker's device runs it.

    Raises:
      TypeError, ValueError: a state, data or ``train_batches`` it cannot
        take (:func:`.checks.check_evaluation`), or none to re-estimate.
    """
    data = checks.check_evaluation(self._door, state, data, train_batches)
    params = state.params
    if not state.in_sync:
      params = self.programs.mean_params(state.params, self._weights)
    rests = state.rest
    if self._bn_fn is not None:
      rests = evaluation.reestimate(
        self._bn_fn, params, state.rest, self.local_devices, train_batches or ()
      )
    first = self._first_device
    rest = layout.unstack_tree(
      self.programs.mean_rest(self.stacked_rest(rests)),
      first,
      like=rests[self.local_workers[0]],
    )
    return evaluation.evaluate(
      self._eval_fn, layout.rows(params)[first], rest, data, first, batch_size
    )


def describe_workers(workers: Sequence[Worker]) -> list[dict[str, Any]]:
  """Returns [{kind, device, batch_size, plan}] of the workers, for
  summaries."""
  return [
    {
      "kind": w.kind,
      "device": str(w.device),
      "batch_size": w.batch_size,
      "plan": w.plan.to_dict(),
    }
    for w in workers
  ]
