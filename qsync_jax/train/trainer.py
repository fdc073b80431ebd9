"""HybridTrainer: synchronous data parallelism over workers with different plans.

Each worker is a (device, device kind, precision plan, local batch size). One
SPMD program cannot span different GPU models, and each plan is a different
computation, so every worker gets its own jitted gradient function compiled
for its device from its plan. The workers meet in one separate jitted
``jax.shard_map`` over a mesh of all workers, which averages the gradients and
applies the (identical) optax update on every worker.

Synchronization follows a schedule (:mod:`qsync_jax.parallel.schedules`). A step that
averages gradients runs the averaging program above. Any other step is a
local step: every worker applies its own gradient with its own optimizer
state, with no collective. After a local step that ends a round, the workers
average their parameters: each sends its change since the last
synchronization (a pseudo-gradient, whose magnitudes suit the quantizing
averagers of :mod:`qsync_jax.parallel.averagers` where the raw parameters would not) and
adds the averaged change to the common starting point. Optimizer state stays
local, as in the QSR reference code.

State layout, chosen so a step costs few host operations:

* parameters are one flat float32 vector per worker, stacked into a global
  ``(num_workers, P)`` array sharded over the ``workers`` mesh axis, so the
  gradient of a worker is a single buffer (one all-reduce bucket) and the
  global array is assembled with one ``make_array_from_single_device_arrays``;
* optimizer state and the loss scale are stacked the same way and only ever
  touched inside the shard_map program;
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

import dataclasses
import hashlib
import json
from typing import Any, Callable, Sequence

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import optax

from qsync_jax.parallel import averagers
from qsync_jax.train import loss_scale as ls
from qsync_jax.train import losses
from qsync_jax.train import step as step_lib
from qsync_jax.plan import policy
from qsync_jax.parallel import schedules
from qsync_jax.plan.precision import Precision, PrecisionPlan

AXIS = "workers"


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


LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def _stack_local(rows: dict[jax.Device, jax.Array], shape: tuple[int, ...],
                 sharding: NamedSharding) -> jax.Array:
  """Assembles per-device (1, ...) rows into a global (n, ...) array."""
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [rows[d] for d in sharding.addressable_devices])


def _rows(x: jax.Array) -> dict[jax.Device, jax.Array]:
  """Returns the per-device (1, ...) rows of a stacked global array."""
  return {s.device: s.data for s in x.addressable_shards}


def _local_scalar(x: jax.Array) -> Any:
  """The value of a stacked per-worker scalar (identical on all workers)."""
  return x.addressable_shards[0].data[0].item()


class HybridTrainer:
  """Synchronous training over workers that run different precision plans.

  Args:
    model: the NNX model (FP32 parameters); it is left in train mode.
    workers: the workers, one distinct device each.
    tx: the optax optimizer every worker applies.
    loss_fn: ``loss_fn(logits, labels) -> scalar`` (float32).
    averager: how gradients are averaged (:mod:`qsync_jax.parallel.averagers`).
    schedule: when workers synchronize (:mod:`qsync_jax.parallel.schedules`).
    grad_weights: each worker's share of the averaged gradient (summing to
      1); by default ``b_i / sum(b)`` so that every example counts once,
      which is the plain mean when batch sizes are equal.
    loss_scaling: ``"auto"`` (dynamic loss scaling when any worker computes
      a layer in FP16), ``True`` or ``False``.
    sample_input: an input the model accepts, to trace layer paths (default
      ``model.input_spec``).
    error_feedback: keep each worker's compression error and send it again
      with the next average (:func:`qsync_jax.parallel.averagers.compress_with_feedback`).
      The residual is kept in unscaled units, so a changing loss scale does
      not distort it.
    seed: seeds the averagers' rounding noise (a fresh key per average,
      the same on every worker).

  With local steps and loss scaling, each worker keeps its own loss scale
  and skips only its own non-finite steps; :attr:`skipped_steps` and
  :attr:`current_loss_scale` report the first local worker.

  Raises:
    ValueError: no worker, two workers on one device, or a bad batch size.
    qsync_jax.PlanError: a plan does not fit the model or its device kind.
  """

  def __init__(self, model: nnx.Module, workers: Sequence[Worker],
               tx: optax.GradientTransformation, *,
               loss_fn: LossFn = losses.cross_entropy,
               averager: Any = None, schedule: Any = None,
               grad_weights: Sequence[float] | None = None,
               loss_scaling: bool | str = "auto",
               sample_input: Any = None, error_feedback: bool = False,
               seed: int = 0):
    if not workers:
      raise ValueError("HybridTrainer needs at least one worker")
    devices = [w.device for w in workers]
    if len(set(devices)) != len(devices):
      raise ValueError(f"workers must run on distinct devices, got {devices}")
    bad = [w.batch_size for w in workers if w.batch_size <= 0]
    if bad:
      raise ValueError(f"batch sizes must be positive, got {bad}")
    self.workers = list(workers)
    self.num_workers = n = len(workers)
    self.tx = tx
    self.loss_fn = loss_fn
    self.averager = averager or averagers.MeanAverager()
    self.schedule = schedule or schedules.EveryStep()
    self.error_feedback = bool(error_feedback)
    self.seed = int(seed)
    self.mesh = Mesh(np.array(devices), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self.local_workers = [i for i, w in enumerate(workers)
                          if w.device.process_index == jax.process_index()]

    if grad_weights is None:
      sizes = np.array([w.batch_size for w in workers], np.float64)
      grad_weights = sizes / sizes.sum()
    grad_weights = np.asarray(grad_weights, np.float32)
    if grad_weights.shape != (n,) or not np.isclose(grad_weights.sum(), 1.0):
      raise ValueError(f"grad_weights must be {n} numbers summing to 1, got "
                       f"{grad_weights.tolist()}")
    self.grad_weights = grad_weights

    # One graph definition per plan; the parameters are shared.
    model.train()
    layer_list = policy.model_layers(model, sample_input)  # traced once
    self.precisions: list[dict[str, Precision]] = []
    graphdefs: dict[str, Any] = {}
    self._graphdef_of: list[Any] = []
    for w in workers:
      eff = policy.resolve_layers(layer_list, w.plan, device_kind=w.kind)
      self.precisions.append(eff)
      key = w.plan.to_json()
      if key not in graphdefs:
        policy.set_precisions(layer_list, eff, w.plan.quant)
        graphdefs[key] = nnx.split(model, nnx.Param, ...)[0]
      self._graphdef_of.append(graphdefs[key])
    policy.set_precisions(layer_list, policy.resolve_layers(
        layer_list, PrecisionPlan()), PrecisionPlan().quant)
    model.eval()
    self._eval_graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    model.train()
    flat, self._unravel = ravel_pytree(params)
    self.num_params = int(flat.size)

    if loss_scaling == "auto":
      loss_scaling = any(Precision.FP16 in eff.values()
                         for eff in self.precisions)
    self.loss_scaling = bool(loss_scaling)

    # Gradient functions, one per distinct graph definition.
    self._grad_fns: dict[int, Callable] = {}
    for gd in self._graphdef_of:
      self._grad_fns.setdefault(id(gd), self._make_grad_fn(gd))
    self._update = self._make_update()
    self._local_update = self._make_local_update()
    self._average_params = self._make_average_params()
    self._eval_fn = self._make_eval_fn()
    self._mean_rest = None
    self._mean_params = None

    # Initial state: the same parameters on every worker.
    self.params = _stack_local(
        {self.workers[i].device: jax.device_put(flat[None],
                                                self.workers[i].device)
         for i in self.local_workers},
        (n, self.num_params), self.sharding)
    self.rest = {i: jax.device_put(rest, workers[i].device)
                 for i in self.local_workers}
    init_scale = (ls.LossScale.create() if self.loss_scaling
                  else ls.LossScale.disabled())
    self.opt_state, self.loss_scale = self._make_init(init_scale)(self.params)
    self._weights = self._stacked_constant(self.grad_weights)
    # Counts averages; keys each one's rounding noise (same on all workers).
    self._counter = self._stacked_constant(np.zeros(n, np.uint32))
    self.residual = (self._zeros_like_params()
                     if self.error_feedback else None)
    self._anchor = self.params
    self._finite = None
    self.step = 0
    self.sync_rounds = 0
    self.comm_bytes = 0.0

  # ------------------------------------------------------------------
  # Compiled pieces.
  # ------------------------------------------------------------------

  def _stacked_constant(self, values: np.ndarray) -> jax.Array:
    return _stack_local(
        {self.workers[i].device: jax.device_put(values[i:i + 1],
                                                self.workers[i].device)
         for i in self.local_workers}, values.shape, self.sharding)

  def _zeros_like_params(self) -> jax.Array:
    # out_shardings: an output that reads no input would land on one device.
    return jax.jit(jnp.zeros_like, out_shardings=self.sharding)(self.params)

  def _shard_map(self, fn, num_in: int, out_specs=P(AXIS)):
    return jax.jit(jax.shard_map(fn, mesh=self.mesh,
                                 in_specs=(P(AXIS),) * num_in,
                                 out_specs=out_specs))

  def _make_init(self, init_scale: ls.LossScale):
    unravel, tx = self._unravel, self.tx

    def init(params):
      opt_state = tx.init(unravel(params[0]))
      expand = lambda x: jnp.asarray(x)[None]
      return (jax.tree.map(expand, opt_state),
              jax.tree.map(expand, init_scale))

    return self._shard_map(init, 1)

  def _make_grad_fn(self, graphdef):
    return step_lib.grad_function(graphdef, self._unravel, self.loss_fn)

  def _average(self, x, weight, counter, residual):
    """``sum_i w_i x_i`` through the averager; error feedback if on.

    Runs inside the shard_map programs. Returns ``(mean, new_residual)``.
    """
    key = jax.random.fold_in(jax.random.key(self.seed), counter)
    if residual is None:
      return self.averager(x, weight, AXIS, key), None
    return averagers.compress_with_feedback(self.averager, x, residual, weight,
                                       AXIS, key)

  def _apply(self, params, opt_state, scale, g, finite):
    """One optax step on gradient ``g``, skipped where not ``finite``."""
    unravel, tx = self._unravel, self.tx
    opt = jax.tree.map(lambda x: x[0], opt_state)
    p = unravel(params[0])
    updates, new_opt = tx.update(unravel(g), opt, p)
    new_p = ravel_pytree(optax.apply_updates(p, updates))[0]
    new_p = jnp.where(finite, new_p, params[0])
    new_opt = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt, opt)
    new_scale = ls.update(jax.tree.map(lambda x: x[0], scale), finite)
    expand = lambda x: jnp.asarray(x)[None]
    return (new_p[None], jax.tree.map(expand, new_opt),
            jax.tree.map(expand, new_scale), finite[None])

  def _make_update(self):
    """The data-parallel step: average gradients, then the optax update."""
    feedback = self.error_feedback

    def update(params, opt_state, scale, grads, weight, counter, residual):
      s = scale.scale[0]
      if feedback:
        # The residual is unscaled: average g / s, not the scaled gradient.
        g, new_res = self._average(grads[0] / s, weight[0], counter[0],
                                   residual[0])
      else:
        g, new_res = self._average(grads[0], weight[0], counter[0], None)
        g = g / s
      # A non-finite gradient on any worker skips the step everywhere.
      finite = jnp.all(jnp.isfinite(g))
      out = self._apply(params, opt_state, scale, g, finite)
      if feedback:
        new_res = jnp.where(finite, new_res, residual[0])[None]
      else:
        new_res = residual
      return (*out, counter + 1, new_res)

    return self._shard_map(update, 7)

  def _make_local_update(self):
    """A local step: each worker applies its own gradient; no collective."""

    def local_update(params, opt_state, scale, grads):
      g = grads[0] / scale.scale[0]
      return self._apply(params, opt_state, scale, g,
                         jnp.all(jnp.isfinite(g)))

    return self._shard_map(local_update, 4)

  def _make_average_params(self):
    """Averages the parameters' change since the last synchronization."""

    def average(params, anchor, weight, counter, residual):
      delta, new_res = self._average(params[0] - anchor[0], weight[0],
                                     counter[0],
                                     None if residual is None else residual[0])
      new_p = anchor[0] + delta
      new_res = residual if new_res is None else new_res[None]
      return new_p[None], counter + 1, new_res

    return self._shard_map(average, 5)

  def _make_eval_fn(self):
    unravel, graphdef, loss_fn = self._unravel, self._eval_graphdef, (
        self.loss_fn)

    @jax.jit
    def eval_fn(params_row, rest, x, y):
      model = nnx.merge(graphdef, unravel(params_row[0]), rest)
      logits = model(x)
      n = y.size
      return loss_fn(logits, y) * n, (jnp.argmax(logits, -1) == y).sum()

    return eval_fn

  # ------------------------------------------------------------------
  # Training.
  # ------------------------------------------------------------------

  def train_step(self, batches: dict[int, tuple[Any, Any]]
                 ) -> dict[int, dict[str, jax.Array]]:
    """Runs one synchronous step.

    Args:
      batches: ``{worker index: (x, y)}`` for this process's workers; worker
        ``i``'s batch has ``workers[i].batch_size`` examples.

    Returns:
      ``{worker index: {"loss", "accuracy"}}`` as device scalars (not
      synchronized with the host, so logging them is the caller's choice).
    """
    missing = [i for i in self.local_workers if i not in batches]
    if missing:
      raise ValueError(f"no batch for local workers {missing}")
    params_rows = _rows(self.params)
    scale_rows = _rows(self.loss_scale.scale)
    grad_rows, metrics = {}, {}
    for i in self.local_workers:
      w = self.workers[i]
      x, y = (v if isinstance(v, jax.Array) and v.devices() == {w.device}
              else jax.device_put(v, w.device) for v in batches[i])
      grad_fn = self._grad_fns[id(self._graphdef_of[i])]
      g, self.rest[i], loss, acc = grad_fn(params_rows[w.device], self.rest[i],
                                           scale_rows[w.device], x, y)
      grad_rows[w.device] = g
      metrics[i] = {"loss": loss, "accuracy": acc}
    grads = _stack_local(grad_rows, self.params.shape, self.sharding)
    step = self.step + 1
    if self.schedule.averages_gradients_at(step):
      (self.params, self.opt_state, self.loss_scale, self._finite,
       self._counter, self.residual) = self._update(
           self.params, self.opt_state, self.loss_scale, grads, self._weights,
           self._counter, self.residual)
      synced = True
    else:
      self.params, self.opt_state, self.loss_scale, self._finite = (
          self._local_update(self.params, self.opt_state, self.loss_scale,
                             grads))
      synced = self.schedule.is_sync_step(step)
      if synced:
        self.params, self._counter, self.residual = self._average_params(
            self.params, self._anchor, self._weights, self._counter,
            self.residual)
    self.step = step
    if synced:
      self._anchor = self.params
      self.sync_rounds += 1
      self.comm_bytes += self.averager.wire_bytes(self.num_params,
                                                  self.num_workers)
    return metrics

  @property
  def in_sync(self) -> bool:
    """Whether every worker holds the same parameters (after a sync)."""
    return self._anchor is self.params

  def update_call(self) -> Callable[[], Any]:
    """A call that runs the update program once on zero gradients.

    The state is left unchanged; the predictor times this call (averaging
    plus optimizer, no layers) as one piece of a profile.
    """
    zeros = self._zeros_like_params()

    def run():
      return self._update(self.params, self.opt_state, self.loss_scale, zeros,
                          self._weights, self._counter, self.residual)
    return run

  def last_step_finite(self) -> bool:
    """Whether the last step's gradient was finite (the step not skipped).

    After a data-parallel step this is the averaged gradient, the same on
    every worker; after a local step, the first local worker's.
    """
    if self._finite is None:
      raise ValueError("no step has run yet")
    return bool(_local_scalar(self._finite))

  @property
  def skipped_steps(self) -> int:
    """Steps skipped so far because a gradient was not finite."""
    return int(_local_scalar(self.loss_scale.skipped))

  @property
  def current_loss_scale(self) -> float:
    """The loss scale the next step uses (1 when scaling is off)."""
    return float(_local_scalar(self.loss_scale.scale))

  # ------------------------------------------------------------------
  # Evaluation and inspection.
  # ------------------------------------------------------------------

  def worker_params(self, index: int | None = None) -> Any:
    """Returns a worker's parameters as a pytree (default: first local)."""
    i = self.local_workers[0] if index is None else index
    return self._unravel(_rows(self.params)[self.workers[i].device][0])

  def params_digest(self) -> str:
    """SHA-256 of the first local worker's parameter bytes."""
    row = np.asarray(_rows(self.params)[
        self.workers[self.local_workers[0]].device])
    return hashlib.sha256(row.tobytes()).hexdigest()

  def _stacked_rest(self) -> Any:
    """The workers' non-parameter state stacked into global arrays."""
    per_worker = {i: jax.tree.leaves(self.rest[i]) for i in self.local_workers}
    leaves, treedef = jax.tree.flatten(self.rest[self.local_workers[0]])
    stacked = [
        _stack_local({self.workers[i].device: per_worker[i][k][None]
                      for i in self.local_workers},
                     (self.num_workers, *leaf.shape), self.sharding)
        for k, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, stacked)

  def _averaged_rest(self) -> Any:
    """The non-parameter state (BatchNorm statistics) averaged over workers."""
    stacked = self._stacked_rest()
    if self._mean_rest is None:
      def mean(tree):
        return jax.tree.map(
            lambda x: jax.lax.pmean(x, AXIS)
            if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
      self._mean_rest = self._shard_map(mean, 1)
    first = self.workers[self.local_workers[0]].device
    return jax.tree.map(lambda a: _rows(a)[first][0],
                        self._mean_rest(stacked))

  def _evaluated_params(self) -> jax.Array:
    """The stacked parameters to evaluate: the workers' weighted mean.

    In sync that is every worker's own row; in the middle of a local-SGD
    round the workers' exact float32 mean, which leaves training untouched
    (no wire bytes, no sync round).
    """
    if self.in_sync:
      return self.params
    if self._mean_params is None:
      self._mean_params = self._shard_map(
          lambda p, w: jax.lax.psum(p * w[0], AXIS), 2)
    return self._mean_params(self.params, self._weights)

  def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 256
               ) -> dict[str, float]:
    """Mean loss and accuracy over (x, y) with FP32 compute.

    The model evaluated is the workers' average: BatchNorm statistics are
    averaged across workers first, and so are the parameters in the middle
    of a local-SGD round. The first local worker's device runs it.
    """
    from qsync_jax import data as data_lib  # local: data imports are heavy
    rest = self._averaged_rest()
    first = self.workers[self.local_workers[0]].device
    row = _rows(self._evaluated_params())[first]
    loss_sum = correct = count = 0.0
    for xb, yb in data_lib.eval_batches(x, y, batch_size):
      xb, yb = jax.device_put((xb, yb), first)
      l, c = self._eval_fn(row, rest, xb, yb)
      loss_sum += float(l)
      correct += float(c)
      count += yb.size
    return {"loss": loss_sum / count, "accuracy": correct / count}

  def describe_workers(self) -> list[dict[str, Any]]:
    """Returns [{kind, device, batch_size, plan}] for summaries."""
    return [{"kind": w.kind, "device": str(w.device),
             "batch_size": w.batch_size, "plan": w.plan.to_dict()}
            for w in self.workers]

  # ------------------------------------------------------------------
  # Checkpoints.
  # ------------------------------------------------------------------

  def state_tree(self) -> dict[str, Any]:
    """The arrays a checkpoint holds (global arrays over the workers)."""
    tree = {"params": self.params, "opt_state": self.opt_state,
            "loss_scale": self.loss_scale, "rest": self._stacked_rest(),
            "anchor": self._anchor, "counter": self._counter}
    if self.residual is not None:
      tree["residual"] = self.residual
    return tree

  def state_meta(self) -> dict[str, Any]:
    """The host-side state a checkpoint holds (JSON)."""
    return {"step": self.step, "sync_rounds": self.sync_rounds,
            "comm_bytes": self.comm_bytes,
            "schedule": self.schedule.state_dict(),
            "in_sync": self.in_sync,
            "plans": [w.plan.to_dict() for w in self.workers],
            "kinds": [w.kind for w in self.workers]}

  def load_state(self, tree: dict[str, Any], meta: dict[str, Any]) -> None:
    """Restores :meth:`state_tree` and :meth:`state_meta` output.

    Raises:
      ValueError: the checkpoint was written for other workers or plans.
    """
    plans = [w.plan.to_dict() for w in self.workers]
    kinds = [w.kind for w in self.workers]
    if meta.get("plans") != plans or meta.get("kinds") != kinds:
      raise ValueError(
          "the checkpoint was written by a run with other workers or plans "
          f"(kinds {meta.get('kinds')} vs {kinds}); resume with the same "
          "cluster and plans, or start a new run directory")
    self.params = tree["params"]
    # A synced checkpoint's anchor is its params: keep them one array.
    self._anchor = (self.params if meta.get("in_sync", True)
                    else tree["anchor"])
    self._counter = tree["counter"]
    if self.residual is not None:
      self.residual = tree["residual"]
    self.opt_state = tree["opt_state"]
    self.loss_scale = ls.LossScale(*tree["loss_scale"])
    leaves, treedef = jax.tree.flatten(tree["rest"])
    for i in self.local_workers:
      d = self.workers[i].device
      self.rest[i] = jax.tree.unflatten(treedef,
                                        [_rows(a)[d][0] for a in leaves])
    self.step = int(meta["step"])
    self.sync_rounds = int(meta["sync_rounds"])
    self.comm_bytes = float(meta["comm_bytes"])
    self.schedule.load_state_dict(meta.get("schedule", {}))


def plans_json(workers: Sequence[Worker]) -> str:
  """The workers' plans as one JSON document (for run directories)."""
  return json.dumps([{"kind": w.kind, "device": str(w.device),
                      "plan": w.plan.to_dict()} for w in workers], indent=2)
