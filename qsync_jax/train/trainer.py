"""HybridTrainer: synchronous data parallelism over workers with different plans.

This module owns :class:`Worker` and :class:`HybridTrainer`, which drives the
pieces of the ``train`` package through a run: the per-plan gradient
functions of :mod:`.step`, the shard_map programs of :mod:`.programs` over the
stacked state of :mod:`.layout`, and evaluation (:mod:`.evaluation`);
:mod:`.checkpoint` saves and restores it.

Each worker is a (device, device kind, precision plan, local batch size). One
SPMD program cannot span different GPU models, and each plan is a different
computation, so every worker gets its own jitted gradient function compiled
for its device from its plan. The workers meet in one separate jitted
``jax.shard_map`` over a mesh of all workers, which averages the gradients and
applies the (identical) optax update on every worker.

Synchronization follows a schedule (:mod:`qsync_jax.parallel.schedules`). A step
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

State layout, chosen so a step costs few host operations:

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
  a reference to an earlier ``params`` array, not a copy, so data
  parallelism pays nothing for them.

Every worker's parameters and optimizer state stay identical under data
parallelism; the stacked layout is what local SGD (per-worker parameters)
needs too. The same code runs single-process (several local devices) and
multi-process (``jax.distributed``, one device per process): each process
runs the gradient functions of its own workers only.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from qsync_jax.parallel import schedules
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.task import calling
from qsync_jax.task import objective as objective_lib
from qsync_jax.task import sharding
from qsync_jax.train import evaluation
from qsync_jax.train import layout
from qsync_jax.train import programs
from qsync_jax.train import step as step_lib
from qsync_jax.train.layout import AXIS

LossFn = step_lib.LossFn


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


def _check_workers(workers: Sequence[Worker]) -> None:
  """Raises ValueError for no worker, a shared device or a bad batch size."""
  if not workers:
    raise ValueError("HybridTrainer needs at least one worker")
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


class HybridTrainer:
  """Synchronous training over workers that run different precision plans.

  Args:
    model: the NNX model (FP32 parameters); its mode is left as it was.
    workers: the workers, one distinct device each.
    tx: the optax optimizer every worker applies.
    loss_fn, call: the objective and call hook :func:`qsync_jax.task.
      as_objective` takes (default: classification on ``(x, y)`` batches).
    averager: how gradients are averaged (:mod:`qsync_jax.parallel.averagers`).
    schedule: when workers synchronize (:mod:`qsync_jax.parallel.schedules`).
    grad_weights: each worker's share of the averaged gradient (summing to
      1); by default ``b_i / sum(b)``, so that every example counts once.
    loss_scaling: ``"auto"`` (dynamic loss scaling when any worker computes
      a layer in FP16), ``True`` or ``False``.
    sample_input, sample_batch: the model's inputs (or a
      :class:`qsync_jax.task.Probe`), else one worker's batch, to trace the
      layers with (default: the model's ``input_spec``).
    error_feedback: keep each worker's compression error (unscaled) and
      send it again with the next average
      (:func:`qsync_jax.parallel.averagers.compress_with_feedback`).
    seed: seeds the averagers' rounding noise and the step rngs (a layer's
      own RNG stream is folded with the worker's index).
    bn_stats: the BatchNorm statistics :meth:`evaluate` uses:
      ``"reestimate"`` (the QSR code's: recomputed for the evaluated
      parameters on training batches) or ``"average"`` (the workers').
    opt_fields_to_average: optimizer-state fields (``"mu"``, ...) averaged
      with the parameters at each sync of a local schedule (default none).
    outer_tx: an optax outer optimizer (DiLoCo) stepping the anchor by
      ``anchor - mean`` at each parameter average; None: plain averaging.

  The trainer runs on its own mesh of the workers' devices (one axis,
  ``workers``), one full replica of the parameters per worker; a mesh in
  context (``jax.set_mesh``) does not move it, and the parameters' sharding
  annotations (:mod:`qsync_jax.task.sharding`) stay on the model, applied
  by none of its programs.

  With local steps and loss scaling, each worker keeps its own loss scale
  and skips only its own non-finite steps; :attr:`skipped_steps` and
  :attr:`current_loss_scale` report the first local worker.

  Raises:
    ValueError: no worker, two workers on one device, a bad batch size, an
      unknown ``bn_stats`` or optimizer-state field.
    qsync_jax.PlanError: a plan does not fit the model or its device kind.
  """

  @sharding.without_mesh
  def __init__(
    self,
    model: nnx.Module,
    workers: Sequence[Worker],
    tx: optax.GradientTransformation,
    *,
    loss_fn: LossFn = None,
    call: calling.CallFn | None = None,
    averager: averagers.Averager | None = None,
    schedule: schedules.Schedule | None = None,
    grad_weights: Sequence[float] | None = None,
    loss_scaling: bool | str = "auto",
    sample_input: Any = None,
    sample_batch: Any = None,
    error_feedback: bool = False,
    seed: int = 0,
    bn_stats: str = "reestimate",
    opt_fields_to_average: Sequence[str] = (),
    outer_tx: optax.GradientTransformation | None = None,
  ):
    _check_workers(workers)
    self.workers = list(workers)
    self.num_workers = len(workers)
    self.tx = tx
    self.objective = objective_lib.as_objective(loss_fn, call=call)
    if sample_input is None and sample_batch is not None:
      sample_input = self.objective.probe(calling.abstract(sample_batch))
    self.averager = averager or averagers.MeanAverager()
    self.schedule = schedule or schedules.EveryStep()
    self.error_feedback = bool(error_feedback)
    self.seed = int(seed)
    self.mesh = Mesh(np.array([w.device for w in workers]), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self.local_workers = [
      i
      for i, w in enumerate(workers)
      if w.device.process_index == jax.process_index()
    ]
    # {worker index: device} of this process's workers.
    self._devices = {i: workers[i].device for i in self.local_workers}
    self.grad_weights = _grad_weights(workers, grad_weights)

    split = step_lib.plan_graphdefs(
      model, [(w.plan, w.kind) for w in workers], sample_input
    )
    self.precisions = split.precisions
    flat, self._unravel = ravel_pytree(split.params)
    self.num_params = int(flat.size)
    self.loss_scaling = (
      bool(loss_scaling)
      if loss_scaling != "auto"
      else any(Precision.FP16 in eff.values() for eff in self.precisions)
    )

    grad_fns = step_lib.grad_functions(
      split.graphdefs, self._unravel, self.objective, self.seed
    )
    self._grad_fns = {i: grad_fns[i] for i in self.local_workers}
    self._update = programs.update_program(
      self.mesh,
      self._unravel,
      tx,
      self.averager,
      self.seed,
      self.error_feedback,
    )
    self._local_update = programs.local_update_program(
      self.mesh, self._unravel, tx
    )
    self._average_params = programs.average_params_program(
      self.mesh, self.averager, self.seed, outer_tx, self._unravel
    )
    self._eval_fn = evaluation.eval_function(
      split.fp32_graphdef, self._unravel, self.objective
    )
    self._bn_fn = evaluation.bn_function(
      split.fp32_graphdef, self._unravel, model, bn_stats, self.objective
    )
    self._mean_rest = programs.mean_rest_program(self.mesh)
    self._mean_params = programs.mean_params_program(self.mesh)

    state = programs.initial_state(
      self.mesh,
      self._devices,
      self._unravel,
      tx,
      flat,
      self.grad_weights,
      self.loss_scaling,
      self.error_feedback,
      self.averager,
    )
    self.params, self.opt_state = state.params, state.opt_state
    self.loss_scale, self._weights = state.loss_scale, state.weights
    self._counter, self.residual = state.counter, state.residual
    self.averager_state = state.averager_state
    self.outer_state = programs.initial_outer_state(
      self.mesh, self._unravel, outer_tx, self.params, self.schedule
    )
    self.rest = {
      i: jax.device_put(_worker_rest(split.rest, i), d)
      for i, d in self._devices.items()
    }
    self._average_opt, size = programs.opt_fields_program(
      self.mesh, self.opt_state, tuple(opt_fields_to_average)
    )
    self._opt_bytes = averagers.MeanAverager().wire_bytes(size, len(workers))
    self._anchor = self.params
    self._finite: jax.Array | None = None
    self.step = self.sync_rounds = 0
    self.comm_bytes = 0.0

  # ------------------------------------------------------------------
  # Training.
  # ------------------------------------------------------------------

  @sharding.without_mesh
  def train_step(
    self, batches: dict[int, Any]
  ) -> dict[int, dict[str, jax.Array]]:
    """Runs one synchronous step.

    Args:
      batches: ``{worker index: batch}`` for this process's workers (a batch
        is what the objective takes, ``(x, y)`` for classification); worker
        ``i``'s batch has ``workers[i].batch_size`` examples.

    Returns:
      ``{worker index: {"loss", ...the objective's metrics}}`` as device
      scalars (not synchronized with the host, so logging them is the
      caller's choice).
    """
    missing = [i for i in self.local_workers if i not in batches]
    if missing:
      raise ValueError(f"no batch for local workers {missing}")
    grads, metrics = step_lib.local_gradients(
      self._grad_fns,
      self._devices,
      self.params,
      self.loss_scale.scale,
      self.rest,
      batches,
      self.sharding,
      self.step,
    )
    step = self.step + 1
    if self.schedule.averages_gradients_at(step):
      out: programs.UpdateResult = self._update(
        self.params,
        self.opt_state,
        self.loss_scale,
        grads,
        self._weights,
        self._counter,
        self.residual,
        self.averager_state,
      )
      self.params, self.opt_state = out.params, out.opt_state
      self.loss_scale, self._finite = out.loss_scale, out.finite
      self._counter, self.residual = out.counter, out.residual
      self.averager_state = out.averager_state
      synced = True
    else:
      local: programs.LocalUpdateResult = self._local_update(
        self.params, self.opt_state, self.loss_scale, grads
      )
      self.params, self.opt_state = local.params, local.opt_state
      self.loss_scale, self._finite = local.loss_scale, local.finite
      synced = self.schedule.is_sync_step(step)
      if synced:
        avg: programs.AverageResult = self._average_params(
          self.params,
          self._anchor,
          self._weights,
          self._counter,
          self.residual,
          self.averager_state,
          self.outer_state,
        )
        self.params, self._counter = avg.params, avg.counter
        self.residual, self.averager_state = avg.residual, avg.averager_state
        self.outer_state = avg.outer_state
        if self._average_opt is not None:
          self.opt_state = self._average_opt(self.opt_state, self._weights)
          self.comm_bytes += self._opt_bytes
    self.step = step
    if synced:
      self._anchor = self.params
      self.sync_rounds += 1
      self.comm_bytes += self.averager.wire_bytes(
        self.num_params, self.num_workers
      )
    return metrics

  @sharding.without_mesh
  def compile(self, total_steps: int) -> None:
    """:func:`compile_programs` of this trainer, up to ``total_steps``."""
    compile_programs(self, total_steps)

  @property
  def in_sync(self) -> bool:
    """Whether every worker holds the same parameters (after a sync)."""
    return self._anchor is self.params

  def last_step_finite(self) -> bool:
    """Whether the last step's gradient was finite (the step not skipped).

    After a data-parallel step this is the averaged gradient, the same on
    every worker; after a local step, the first local worker's.

    Raises:
      ValueError: no step has run yet.
    """
    if self._finite is None:
      raise ValueError("no step has run yet")
    return bool(layout.local_scalar(self._finite))

  @property
  def skipped_steps(self) -> int:
    """Steps skipped so far because a gradient was not finite."""
    return int(layout.local_scalar(self.loss_scale.skipped))

  @property
  def current_loss_scale(self) -> float:
    """The loss scale the next step uses (1 when scaling is off)."""
    return float(layout.local_scalar(self.loss_scale.scale))

  # ------------------------------------------------------------------
  # Evaluation and inspection.
  # ------------------------------------------------------------------

  @property
  def _first_device(self) -> jax.Device:
    return self.workers[self.local_workers[0]].device

  @sharding.without_mesh
  def worker_params(self, index: int | None = None) -> Any:
    """Returns a worker's parameters as a pytree (default: first local)."""
    i = self.local_workers[0] if index is None else index
    return self._unravel(layout.rows(self.params)[self.workers[i].device][0])

  def params_digest(self) -> str:
    """SHA-256 of the first local worker's parameter bytes."""
    row = np.asarray(layout.rows(self.params)[self._first_device])
    return hashlib.sha256(row.tobytes()).hexdigest()

  def _stacked_rest(self, rests: Any = None) -> Any:
    """The workers' non-parameter state (default :attr:`rest`) stacked into
    global arrays."""
    rests = self.rest if rests is None else rests
    return layout.stack_trees(
      {d: rests[i] for i, d in self._devices.items()},
      self.num_workers,
      self.sharding,
    )

  @sharding.without_mesh
  def evaluate(
    self, data: Any, batch_size: int = 256, train_batches: Any = None
  ) -> dict[str, float]:
    """The objective's mean loss and metrics over ``data`` (one batch,
    ``(x, y)`` for classification), in eval mode with FP32 compute.

    The model evaluated is the workers' average: mid-round parameters are
    their exact float32 mean (no wire bytes, no sync round); BatchNorm
    statistics the workers' mean (``bn_stats="average"``) or the mean of
    each worker's re-estimate for those parameters on ``train_batches``
    (per step ``{worker index: batch}``, as :meth:`train_step` takes).
    Training state is untouched. The first local worker's device runs it.

    Raises:
      ValueError: re-estimation without ``train_batches``.
    """
    params = self.params
    if not self.in_sync:
      params = self._mean_params(self.params, self._weights)
    rests = self.rest
    if self._bn_fn is not None:
      rests = evaluation.reestimate(
        self._bn_fn, params, self.rest, self._devices, train_batches or ()
      )
    first = self._first_device
    rest = layout.unstack_tree(
      self._mean_rest(self._stacked_rest(rests)),
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


def compile_programs(trainer: HybridTrainer, total_steps: int) -> None:
  """Compiles a trainer's update and averaging programs of the coming steps.

  jit compiles a program at its first call. A data-parallel run calls its update
  at the first step, but a local schedule's first parameter average comes at its
  first sync step, in the middle of a timed run, whose training clock would
  count the compile. After this call, steps ``trainer.step + 1`` to
  ``total_steps`` compile only the workers' gradient functions, at the first
  step (their inputs are the batches). Compiling does not run the programs, so
  nothing changes and no worker waits for another.

  Args:
    trainer: the trainer (``trainer.compile(total_steps)`` calls this).
    total_steps: the last step the run will take (it selects the programs
      the schedule will call).
  """
  t = trainer
  steps = range(t.step + 1, int(total_steps) + 1)
  local = [s for s in steps if not t.schedule.averages_gradients_at(s)]
  grads = t.params  # The stacked gradients' type and sharding.
  # pylint: disable=protected-access
  if len(local) < len(steps):
    t._update.lower(
      t.params,
      t.opt_state,
      t.loss_scale,
      grads,
      t._weights,
      t._counter,
      t.residual,
      t.averager_state,
    ).compile()
  if not local:
    return
  t._local_update.lower(t.params, t.opt_state, t.loss_scale, grads).compile()
  if set(local) & set(t.schedule.sync_steps(int(total_steps))):
    t._average_params.lower(
      t.params,
      t._anchor,
      t._weights,
      t._counter,
      t.residual,
      t.averager_state,
      t.outer_state,
    ).compile()
    if t._average_opt is not None:
      t._average_opt.lower(t.opt_state, t._weights).compile()
