"""Profiles: what each piece of a training step costs on one device kind.

This module owns :class:`Profile` and the two ways to get one:

* :func:`profile` measures, on the device at hand, every layer's forward and
  forward+backward time at each precision (its op jitted alone at the real
  operand shapes recorded by :func:`~qsync_jax.predictor.graph.trace_graph`,
  warm, median of repeats, dispatch overhead removed), the rest of the step
  (the same gradient function the trainer compiles, with every layer's op
  replaced by a stand-in that only emits an output of the right shape and
  dtype), the optimizer update, the cast costs (fitted, :mod:`.casting`), the
  memory of the compiled step at each uniform precision, the whole gradient
  pass at each uniform precision (alone, and on hosts that carry several
  workers as k copies at once: how they share the host), and what a host
  all-reduce costs. Layers whose pieces are the same computation
  (:func:`piece_signature`: a ResNet's repeated blocks) are timed once.
  Profiles are cached as JSON keyed by model graph, batch shape, device kind
  and jax version.
* :func:`analytic_profile` derives the same table for a GPU kind that is not
  present from the catalog (:mod:`.devices`): a roofline per layer from its
  FLOPs and bytes, the non-layer rest from XLA's byte count of the stand-in
  step, an optimizer pass from the parameter bytes.

The step times :mod:`.simulation` predicts are built from the isolated
pieces, scaled per precision to the model's whole gradient pass at that
uniform precision (:func:`.simulation.pass_factors`), as QSync's replayer
builds mixed plans on uniform-precision traces. No mixed plan is ever timed
whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Sequence

from flax import nnx
import jax
from jax import lax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax
from scipy import optimize

from qsync_jax.train import losses
from qsync_jax.numerics import ops
from qsync_jax.plan import policy
from qsync_jax.train import step as step_lib
from qsync_jax.train import trainer
from qsync_jax.plan.precision import Precision, PrecisionPlan, supported_precisions
from qsync_jax.predictor import casting, devices, graph as graph_lib, memory
from qsync_jax.predictor import timing
from qsync_jax.numerics.quant import QuantConfig

DEFAULT_PRECISIONS = (Precision.FP32, Precision.BF16, Precision.FP16,
                      Precision.INT8)
#: The dtype activation operands arrive in when layers are profiled: NNX
#: layers promote their input to their float32 parameters' dtype.
PROFILED_INPUT_DTYPE = "float32"
#: Version of what a profile holds; a cached profile of another is measured
#: again (2: whole uniform passes, host sharing no longer per piece).
PROFILE_FORMAT = 2


@dataclasses.dataclass
class Profile:
  """Costs of a model's step pieces on one device kind.

  Attributes:
    device_kind: the kind the costs hold for.
    source: ``"measured"`` or ``"analytic"``.
    key: what the profile is valid for (model graph fingerprint, batch shape,
      jax version, ...).
    layers: ``{path: {precision: (forward_s, forward_and_backward_s)}}``,
      with operands arriving in :data:`PROFILED_INPUT_DTYPE`.
    rest: ``{dtype: (forward_s, forward_and_backward_s)}``: everything that
      is not a layer, when every layer emits ``dtype``.
    optimizer_s: one optimizer update of all parameters.
    casts: the cast model.
    memory: see :class:`qsync_jax.predictor.memory.MemoryModel`.
    host: for measured profiles of a host that carries several workers:
      ``{"allreduce": [alpha_s, seconds_per_byte], "step_overhead_s": {k:
      s}, "update_s": {k: the trainer's update program over k workers}}``.
    passes: for measured profiles, ``{precision: {k: seconds}}``: k copies
      of the model's whole gradient pass at that uniform precision, run at
      once on k of the host's devices (k = 1: one pass alone). The
      simulation scales the pieces to these uniform passes
      (:func:`.simulation.pass_factors`).
  """
  device_kind: str
  source: str
  key: dict[str, Any]
  layers: dict[str, dict[str, tuple[float, float]]]
  rest: dict[str, tuple[float, float]]
  optimizer_s: float
  casts: casting.CastModel
  memory: memory.MemoryModel
  host: dict[str, Any] = dataclasses.field(default_factory=dict)
  passes: dict[str, dict[int, float]] = dataclasses.field(
      default_factory=dict)

  @property
  def precisions(self) -> list[Precision]:
    """Every precision some layer was costed at."""
    present = {p for per in self.layers.values() for p in per}
    return [p for p in Precision if p.value in present]

  def layer_cost(self, path: str, precision: Precision) -> tuple[float, float]:
    """(forward_s, backward_s) of a layer at ``precision``.

    Raises:
      KeyError: the layer or the precision was not profiled.
    """
    try:
      per = self.layers[path]
    except KeyError:
      raise KeyError(f"layer {path!r} is not in the {self.device_kind} "
                     "profile") from None
    if precision.value not in per:
      raise KeyError(
          f"the {self.device_kind} profile has no {precision.value} cost for "
          f"{path} (profiled: {', '.join(per)})")
    f, fb = per[precision.value]
    return f, max(fb - f, 0.0)

  def to_dict(self) -> dict[str, Any]:
    return {"device_kind": self.device_kind, "source": self.source,
            "key": self.key, "layers": self.layers, "rest": self.rest,
            "optimizer_s": self.optimizer_s, "casts": self.casts.to_dict(),
            "memory": self.memory.to_dict(),
            "host": _host_to_json(self.host),
            "passes": _host_to_json(self.passes)}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Profile":
    host = _host_from_json(d.get("host") or {})
    return cls(
        device_kind=d["device_kind"], source=d["source"], key=dict(d["key"]),
        layers={p: {k: tuple(v) for k, v in per.items()}
                for p, per in d["layers"].items()},
        rest={k: tuple(v) for k, v in d["rest"].items()},
        optimizer_s=float(d["optimizer_s"]),
        casts=casting.CastModel.from_dict(d["casts"]),
        memory=memory.MemoryModel.from_dict(d["memory"]), host=host,
        passes=_host_from_json(d.get("passes") or {}))

  def save(self, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.to_dict(), f, indent=1)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> "Profile":
    with open(path) as f:
      return cls.from_dict(json.load(f))


def _map_counts(tree: Any, key: Callable[[Any], Any]) -> Any:
  """Maps the worker-count keys (the innermost dict keys) of a host tree."""
  if isinstance(tree, Mapping):
    inner = all(not isinstance(v, Mapping) for v in tree.values())
    return {(key(k) if inner else k): (float(v) if inner else
                                       _map_counts(v, key))
            for k, v in tree.items()}
  return tree


def _host_to_json(host: Mapping[str, Any]) -> dict[str, Any]:
  """JSON needs string keys: worker counts become strings."""
  return {k: _map_counts(v, str) if isinstance(v, Mapping) else v
          for k, v in host.items()}


def _host_from_json(host: Mapping[str, Any]) -> dict[str, Any]:
  return {k: _map_counts(v, int) if isinstance(v, Mapping) else v
          for k, v in host.items()}


# --------------------------------------------------------------------------
# Layer ops and their stand-ins.
# --------------------------------------------------------------------------


def _embed_cast(dtype: str):
  def promote(arrays, dtype_=None, **unused):
    del dtype_, unused
    return tuple(a.astype(dtype) for a in arrays)
  return lambda arrays, **kw: promote(arrays)


def layer_op(node: graph_lib.LayerNode, precision: Precision,
             quant: QuantConfig | None = None) -> Callable[..., Any]:
  """The precision-aware op a layer runs at ``precision``."""
  quant = quant or QuantConfig()
  if node.kind == "Embed":
    return _embed_cast(graph_lib.output_dtype(precision))
  if node.kind == "Conv":
    return ops.ConvGeneralDilated(precision, quant)
  if node.kind in ("Einsum", "MatMul"):
    return ops.Einsum(precision, quant)
  return ops.DotGeneral(precision, quant)


def _random_operands(node: graph_lib.LayerNode, device, seed: int = 0):
  rng = np.random.default_rng(seed)
  shapes = [op.shape for op in node.operands]
  if node.weight_shape:
    shapes.append(node.weight_shape)
  return [jax.device_put(rng.standard_normal(s).astype(np.float32), device)
          for s in shapes]


def _grad_positions(node: graph_lib.LayerNode) -> list[int]:
  pos = [i for i, op in enumerate(node.operands) if op.needs_grad]
  if node.weight_shape:
    pos.append(len(node.operands))
  return pos


def layer_functions(node: graph_lib.LayerNode, precision: Precision,
                    quant: QuantConfig | None = None):
  """(forward, forward_and_backward) jitted functions of one layer.

  ``forward(*arrays) -> out``; ``forward_and_backward(*arrays, cotangent)
  -> (out, grads)`` differentiates the operands the step differentiates (the
  weight, and activations that depend on parameters) and returns the output
  too, so XLA cannot drop the forward computation.
  """
  op = layer_op(node, precision, quant)
  positions = _grad_positions(node)

  def f(*arrays):
    return node.call(op, *arrays)

  def fb(*args):
    *arrays, ct = args

    def g(*wrt):
      full = list(arrays)
      for p, a in zip(positions, wrt):
        full[p] = a
      return f(*full)

    out, vjp = jax.vjp(g, *[arrays[p] for p in positions])
    return out, vjp(ct)

  return jax.jit(f), jax.jit(fb)


def layer_calls(node: graph_lib.LayerNode, precision: Precision,
                device: jax.Device, quant: QuantConfig | None = None
                ) -> tuple[Callable[[], Any], Callable[[], Any]]:
  """(forward, forward_and_backward) zero-argument calls of one layer."""
  arrays = _random_operands(node, device)
  fwd, fb = layer_functions(node, precision, quant)
  out = jax.eval_shape(fwd, *arrays)
  ct = jax.device_put(np.random.default_rng(1).standard_normal(
      out.shape).astype(out.dtype), device)
  return (lambda: fwd(*arrays)), (lambda: fb(*arrays, ct))


def piece_signature(node: graph_lib.LayerNode) -> str:
  """What a layer's profile pieces compute, as a comparable string.

  Two layers with equal signatures (the same op, operand shapes, static
  arguments and differentiated operands; e.g. the repeated blocks of a
  ResNet or the projections of a transformer) have the same pieces, so a
  profile times them once. The forward pass lowered at FP32 carries the op,
  shapes and static arguments; which operands the backward differentiates is
  added.
  """
  avals = [jax.ShapeDtypeStruct(op.shape, jnp.float32)
           for op in node.operands]
  if node.weight_shape:
    avals.append(jax.ShapeDtypeStruct(node.weight_shape, jnp.float32))
  fwd, _ = layer_functions(node, Precision.FP32)
  text = fwd.lower(*avals).as_text()
  return "|".join([node.kind, str(_grad_positions(node)), str(node.floored),
                   text])


def _stand_in(out_shape: tuple[int, ...], dtype: str):
  """An op emitting ``out_shape`` in ``dtype`` at (almost) no cost.

  The optimization barriers keep XLA from folding the constant-like output
  into its consumers, which would make them cheaper than they are.
  """
  def op(*arrays):
    @jax.custom_vjp
    def f(*a):
      # Depend on the operands but stay O(1) (values near 1: products of
      # tiny values would turn denormal and slow the rest down).
      seed = sum(x.ravel()[0].astype(jnp.float32) for x in a) * 0.0 + 1.0
      return lax.optimization_barrier(
          jnp.broadcast_to(seed.astype(dtype), out_shape))

    def fwd(*a):
      return f(*a), a

    def bwd(saved, g):
      # Gradients shaped like the operands, computed from them at memory
      # speed: what a real backward pass writes, without the contraction.
      s = g.ravel()[0].astype(jnp.float32) * 0.0 + 1.0
      return tuple((x.astype(jnp.float32) * s).astype(x.dtype)
                   for x in saved)

    f.defvjp(fwd, bwd)
    return f(*arrays)
  return op


def _stand_in_wrapper(nodes: Sequence[graph_lib.LayerNode], dtype: str):
  def make_wrapper(i, layer, base):
    del base
    node = nodes[i]
    module = layer.module
    if isinstance(module, nnx.Embed):
      def promote(arrays, **kw):
        del kw
        (table,) = arrays
        return (_stand_in(tuple(table.shape), dtype)(table),)
      return promote
    li, ri = policy.operand_positions(module)

    def wrapped(*args, **kwargs):
      del kwargs
      return _stand_in(node.out_shape, dtype)(args[li], args[ri])
    return wrapped
  return make_wrapper


def _edited_grad_function(model: nnx.Module, loss_fn,
                          edit: Callable[[nnx.Module], None]):
  """The trainer's gradient function of a copy of ``model`` that ``edit``
  changed in place (``model`` is left unchanged).

  Returns:
    ``(grad_fn, graphdef, unravel, flat_params, rest)`` of the copy;
    ``grad_fn`` is :func:`qsync_jax.train.step.grad_function` (what the trainer
    runs).
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  copy = nnx.merge(graphdef, params, rest)
  edit(copy)
  c_graphdef, c_params, c_rest = nnx.split(copy, nnx.Param, ...)
  flat, unravel = ravel_pytree(c_params)
  return (step_lib.grad_function(c_graphdef, unravel, loss_fn), c_graphdef,
          unravel, flat, c_rest)


def stand_in_step_functions(model: nnx.Module, g: graph_lib.ModelGraph,
                            loss_fn, dtype: str):
  """(forward, gradient) functions of the step with stand-in layers: on a
  copy of the model whose layers only emit ``dtype``."""
  layer_list = policy.model_layers(model, g.input_spec)

  def stand_in(copy):
    found = policy.addressable_modules(copy)
    policy.instrument(copy, [policy.Layer(l.path, found[l.path], l.kind)
                             for l in layer_list],
                      _stand_in_wrapper(g.nodes, dtype))

  grad_fn, s_graphdef, unravel, flat, s_rest = _edited_grad_function(
      model, loss_fn, stand_in)

  @jax.jit
  def forward(params_row, rest_state, x, y):
    m = nnx.merge(s_graphdef, unravel(params_row[0]),
                  jax.tree.map(lambda v: v, rest_state))
    return loss_fn(m(x), y)

  return forward, grad_fn, flat, s_rest


def pass_function(model: nnx.Module, g: graph_lib.ModelGraph, loss_fn,
                  precision: Precision, quant: QuantConfig | None = None):
  """(gradient function, flat parameters, rest) of the whole model's pass
  at one uniform precision (forced precisions applied): what a worker with
  that plan computes, on a copy of the model."""
  plan = PrecisionPlan.uniform(precision, quant)

  def set_plan(copy):
    layer_list = policy.model_layers(copy, g.input_spec)
    policy.set_precisions(layer_list, policy.resolve_layers(layer_list, plan),
                          plan.quant)

  grad_fn, _, _, flat, rest = _edited_grad_function(model, loss_fn, set_plan)
  return grad_fn, flat, rest


def _batch_arrays(sample_batch, device):
  x, y = sample_batch
  return (jax.device_put(jnp.asarray(x), device),
          jax.device_put(jnp.asarray(y), device))


def rest_calls(model: nnx.Module, g: graph_lib.ModelGraph, sample_batch,
               loss_fn, dtype: str, device: jax.Device
               ) -> tuple[Callable[[], Any], Callable[[], Any]]:
  """(forward, gradient) zero-argument calls of the stand-in step."""
  forward, grad_fn, flat, rest = stand_in_step_functions(model, g, loss_fn,
                                                         dtype)
  x, y = _batch_arrays(sample_batch, device)
  row = jax.device_put(flat[None], device)
  rest = jax.device_put(rest, device)
  scale = jax.device_put(jnp.ones((1,), jnp.float32), device)
  return (lambda: forward(row, rest, x, y),
          lambda: grad_fn(row, rest, scale, x, y))


def update_function(unravel, tx: optax.GradientTransformation):
  """The optimizer part of the trainer's update, for one worker."""

  @jax.jit
  def update(flat, opt_state, g):
    finite = jnp.all(jnp.isfinite(g))
    p = unravel(flat)
    updates, new_opt = tx.update(unravel(g), opt_state, p)
    new_p = ravel_pytree(optax.apply_updates(p, updates))[0]
    return jnp.where(finite, new_p, flat), new_opt

  return update


def optimizer_call(model: nnx.Module, tx: optax.GradientTransformation,
                   device: jax.Device) -> Callable[[], Any]:
  """A zero-argument call of one optimizer update of all parameters."""
  params = nnx.state(model, nnx.Param)
  flat, unravel = ravel_pytree(params)
  flat = jax.device_put(flat, device)
  opt_state = jax.device_put(tx.init(unravel(flat)), device)
  g = jax.device_put(jnp.full_like(flat, 1e-3), device)
  update = update_function(unravel, tx)
  return lambda: update(flat, opt_state, g)


# --------------------------------------------------------------------------
# Host sharing (several workers on one device at hand).
# --------------------------------------------------------------------------


def concurrency_calls(make_call: Callable[[jax.Device, int], Callable],
                      local_devices: Sequence[jax.Device]
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
  return {k: (lambda k=k: [c() for c in calls[:k]])
          for k in host_counts(len(calls))}


def pass_concurrency_calls(model: nnx.Module, g: graph_lib.ModelGraph,
                           sample_batch, loss_fn, precision: Precision,
                           quant: QuantConfig | None,
                           local_devices: Sequence[jax.Device]
                           ) -> dict[int, Callable[[], Any]]:
  """:func:`concurrency_calls` of the model's whole gradient pass at one
  uniform precision (:func:`pass_function`), one copy per host device."""
  fn, flat, rest = pass_function(model, g, loss_fn, precision, quant)

  def make(d, i):
    x, y = _batch_arrays(sample_batch, d)
    row = jax.device_put(flat[None], d)
    rest_d = jax.device_put(rest, d)
    scale = jax.device_put(jnp.ones((1,), jnp.float32), d)
    return lambda: fn(row, rest_d, scale, x, y)

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


def allreduce_calls(local_devices: Sequence[jax.Device],
                    sizes: Sequence[int] = (2**14, 2**18, 2**20, 2**22)
                    ) -> dict[tuple[int, int], Callable[[], Any]]:
  """``{(k, elements): call}``: float32 ``psum`` over k host devices."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  calls = {}
  for k in range(2, len(local_devices) + 1):
    mesh = Mesh(np.array(local_devices[:k]), ("w",))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "w"), mesh=mesh,
                              in_specs=P("w"), out_specs=P("w")))
    for n in sizes:
      x = jax.device_put(jnp.ones((k, n), jnp.float32),
                         NamedSharding(mesh, P("w")))
      calls[(k, n)] = lambda f=f, x=x: f(x)
  return calls


def fit_allreduce(times: Mapping[tuple[int, int], float]
                  ) -> tuple[float, float]:
  """Fits ``2 (k-1) alpha + 2 (k-1)/k bytes beta`` (non-negative) to
  ``{(k, float32 elements): seconds}``."""
  if not times:
    return 0.0, 0.0
  keys = list(times)
  rows = [(2.0 * (k - 1), 2.0 * (k - 1) / k * 4 * n) for k, n in keys]
  (alpha, beta), _ = optimize.nnls(np.array(rows),
                                   np.array([times[k] for k in keys]))
  return float(alpha), float(beta)


def update_calls(model: nnx.Module, tx: optax.GradientTransformation,
                 local_devices: Sequence[jax.Device], sample_input
                 ) -> dict[int, Callable[[], Any]]:
  """``{k: call}``: the trainer's update program (averaging and optimizer,
  no layers) over k of the host's workers."""
  out = {}
  for k in host_counts(len(local_devices)):
    workers = [trainer.Worker(d, "cpu", PrecisionPlan(), 1)
               for d in local_devices[:k]]
    tr = trainer.HybridTrainer(model, workers, tx, loss_scaling=False,
                               sample_input=sample_input)
    out[k] = tr.update_call()
  return out


def step_overhead_calls(local_devices: Sequence[jax.Device]
                        ) -> dict[int, Callable[[], Any]]:
  """``{k: call}``: a trainer step with k workers and (almost) no compute,
  whose time is the trainer's host overhead per step."""

  class Tiny(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.fc(x)

  out = {}
  for k in host_counts(len(local_devices)):
    workers = [trainer.Worker(d, "cpu", PrecisionPlan(), 2)
               for d in local_devices[:k]]
    tr = trainer.HybridTrainer(Tiny(), workers, optax.sgd(0.0),
                               sample_input=jnp.zeros((2, 2)))
    batches = {i: (jax.device_put(jnp.zeros((2, 2)), w.device),
                   jax.device_put(jnp.zeros((2,), jnp.int32), w.device))
               for i, w in enumerate(workers)}

    def step(tr=tr, batches=batches):
      tr.train_step(batches)
      return tr.params
    out[k] = step
  return out


# --------------------------------------------------------------------------
# Profiles.
# --------------------------------------------------------------------------


def profile_key(g: graph_lib.ModelGraph, model_name: str, device_kind: str,
                precisions: Sequence[Precision], optimizer: str) -> dict:
  """What a cached profile must match."""
  return {"model": model_name, "graph": g.fingerprint(),
          "batch_shape": list(g.input_shape), "device_kind": device_kind,
          "precisions": [p.value for p in precisions],
          "optimizer": optimizer, "jax": jax.__version__,
          "format": PROFILE_FORMAT}


def _cache_path(cache_dir: str, key: dict) -> str:
  import hashlib
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()
                          ).hexdigest()[:16]
  return os.path.join(cache_dir, f"{key['model']}-{key['device_kind']}-"
                      f"{digest}.json")


def profile(model: nnx.Module, sample_batch: tuple[Any, Any], *,
            device: jax.Device | None = None, device_kind: str = "cpu",
            precisions: Sequence[Precision | str] = DEFAULT_PRECISIONS,
            loss_fn=losses.cross_entropy,
            tx: optax.GradientTransformation | None = None,
            optimizer_name: str = "adam",
            model_name: str | None = None, cache_dir: str | None = None,
            host_devices: Sequence[jax.Device] | None = None,
            quant: QuantConfig | None = None, repeats: int = 9,
            graph: graph_lib.ModelGraph | None = None) -> Profile:
  """Measures a model's profile on the device at hand.

  Args:
    model: the NNX model (FP32 parameters; left unchanged).
    sample_batch: ``(x, y)`` at the worker's batch size.
    device: the device to measure on (default: the first).
    device_kind: the kind this device stands for.
    precisions: precisions to profile each layer at (FP32 is always added).
    loss_fn: the training loss.
    tx: the optimizer (default ``optax.adam(1e-3)``).
    optimizer_name: its name in the cache key.
    model_name: the model's name in the cache key (default: class name).
    cache_dir: if given, load the profile from / save it to this directory.
    host_devices: devices sharing this host for co-located workers: when
      given, the trainer's update program and host overhead per step are
      measured for each worker count (:func:`host_counts`); with more than
      one, host sharing and the host all-reduce too.
    quant: operand quantization of INT8 / FP8 layers.
    repeats: timed calls per measurement (at least).
    graph: the model's graph if already traced at this batch.

  Returns:
    The :class:`Profile`.

  Raises:
    ValueError: the device kind lacks one of ``precisions``.
  """
  device = device or jax.devices()[0]
  precisions = [Precision.parse(p) for p in precisions]
  if Precision.FP32 not in precisions:
    precisions.insert(0, Precision.FP32)
  lacking = [p.value for p in precisions
             if p not in supported_precisions(device_kind)]
  if lacking:
    raise ValueError(f"device kind {device_kind!r} does not support "
                     f"{', '.join(lacking)}")
  tx = tx or optax.adam(1e-3)
  x, _ = sample_batch
  g = graph or graph_lib.trace_graph(
      model, jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype))
  key = profile_key(g, model_name or type(model).__name__, device_kind,
                    precisions, optimizer_name)
  host_devices = list(host_devices or [])
  key["host_devices"] = len(host_devices)
  path = _cache_path(cache_dir, key) if cache_dir else None
  if path and os.path.exists(path):
    cached = Profile.load(path)
    if cached.key == key:
      return cached

  job = profile_job(model, sample_batch, g, key, device=device,
                    device_kind=device_kind, precisions=precisions,
                    loss_fn=loss_fn, tx=tx, host_devices=host_devices,
                    quant=quant)
  result = job.finish(timing.interleaved(job.calls, repeats,
                                         subtract_overhead=False))
  if path:
    result.save(path)
  return result


@dataclasses.dataclass
class ProfileJob:
  """The timed calls of a profile, and how to turn their times into it.

  Run ``calls`` with :func:`qsync_jax.predictor.timing.interleaved`
  (``subtract_overhead=False``), possibly together with other calls (the
  predictor's accuracy check times its real steps in the same rounds, so
  both see the same machine load), then ``finish(times)``.
  """
  calls: dict[tuple, Callable[[], Any]]
  finish: Callable[[Mapping[tuple, float]], Profile]


def profile_job(model: nnx.Module, sample_batch, g: graph_lib.ModelGraph,
                key: dict[str, Any], *, device: jax.Device, device_kind: str,
                precisions: Sequence[Precision], loss_fn,
                tx: optax.GradientTransformation,
                host_devices: Sequence[jax.Device] = (),
                quant: QuantConfig | None = None,
                casts: casting.CastModel | None = None,
                memory_model: memory.MemoryModel | None = None
                ) -> ProfileJob:
  """Builds the calls of :func:`profile` (see there); keys are tuples.

  ``casts`` and ``memory_model``, when given, are reused instead of fitted
  and compiled again (for several jobs on one model).
  """
  calls: dict[tuple, Callable[[], Any]] = {}
  host_devices = list(host_devices)
  # Layers with equal pieces are timed once, under the first one's path:
  # fewer timings, and fewer live executables (a process can map only so
  # many; each piece is compiled once per host device).
  first_of: dict[str, str] = {}
  timed_as = {node.path: first_of.setdefault(piece_signature(node), node.path)
              for node in g.nodes}
  for node in g.nodes:
    if timed_as[node.path] != node.path:
      continue
    for p in precisions:
      if node.floored and p.bits < 16:
        continue
      f, fb = layer_calls(node, p, device, quant)
      calls[("layer", node.path, p.value, "f")] = f
      calls[("layer", node.path, p.value, "fb")] = fb
  dtypes = sorted({graph_lib.output_dtype(p) for p in precisions})
  for dt in dtypes:
    f, fb = rest_calls(model, g, sample_batch, loss_fn, dt, device)
    calls[("rest", dt, "f")] = f
    calls[("rest", dt, "fb")] = fb
  calls[("optimizer",)] = optimizer_call(model, tx, device)
  # The whole pass at each uniform precision, alone and (several workers
  # on this host) as k copies at once. Copies of one isolated piece
  # overstated the slowdown of sharing (ResNet-18 on 4 workers: predicted
  # 18-27 % too slow): in real steps the workers are at different pieces,
  # and one's serial stretch fills the cores another leaves idle.
  pass_devices = host_devices if len(host_devices) > 1 else [device]
  for p in precisions:
    for k, c in pass_concurrency_calls(model, g, sample_batch, loss_fn, p,
                                       quant, pass_devices).items():
      calls[("pass", p.value, k)] = c
  if len(host_devices) > 1:
    for kn, c in allreduce_calls(host_devices).items():
      calls[("allreduce", *kn)] = c
  if host_devices:
    for k, c in step_overhead_calls(host_devices).items():
      calls[("overhead", k)] = c
    for k, c in update_calls(model, tx, host_devices, g.input_spec).items():
      calls[("update", k)] = c

  def finish(raw: Mapping[tuple, float]) -> Profile:
    over = timing.call_overhead(device)
    t = {k: max(raw[k] - over, 0.0) for k in calls
         if k[0] in ("layer", "rest", "optimizer", "allreduce", "pass")}
    layers: dict[str, dict[str, tuple[float, float]]] = {}
    for node in g.nodes:
      q = timed_as[node.path]
      layers[node.path] = {
          p.value: (t[("layer", q, p.value, "f")],
                    max(t[("layer", q, p.value, "fb")],
                        t[("layer", q, p.value, "f")]))
          for p in precisions if not (node.floored and p.bits < 16)}
    rest = {dt: (t[("rest", dt, "f")], max(t[("rest", dt, "fb")],
                                            t[("rest", dt, "f")]))
            for dt in dtypes}
    host = {}
    if host_devices:
      ks = host_counts(len(host_devices))
      host = {"step_overhead_s": {k: raw[("overhead", k)] for k in ks},
              "update_s": {k: raw[("update", k)] for k in ks}}
    if len(host_devices) > 1:
      host.update({
          "allreduce": list(fit_allreduce(
              {k[1:]: v for k, v in t.items() if k[0] == "allreduce"}))})
    return Profile(
        device_kind, "measured", key, layers, rest, t[("optimizer",)],
        casts or casting.fit_cast_model(device),
        memory_model or memory.measure_memory_model(
            model, g, sample_batch, loss_fn, tx, precisions, quant), host,
        {p.value: {k: t[("pass", p.value, k)]
                   for k in host_counts(len(pass_devices))}
         for p in precisions})

  return ProfileJob(calls, finish)


def analytic_profile(g: graph_lib.ModelGraph, device_kind: str,
                     base: Profile | None = None,
                     precisions: Sequence[Precision | str] | None = None,
                     optimizer_state_copies: int = 2) -> Profile:
  """A profile for a GPU kind that is not present, from the catalog.

  Args:
    g: the model graph (at the batch size to predict).
    device_kind: a kind of :data:`qsync_jax.predictor.devices.DEVICES`.
    base: a measured profile of the same graph, whose memory model (from the
      compiled step) and non-layer byte count it reuses; without it both
      come from shapes (:func:`.memory.analytic_memory_model`).
    precisions: precisions to cost (default: every one the kind supports).
    optimizer_state_copies: float32 copies of the parameters the optimizer
      keeps (Adam: 2).

  Raises:
    ValueError: an unknown device kind, or a precision it lacks.
  """
  spec = devices.device_spec(device_kind)
  supported = supported_precisions(device_kind)
  if precisions is None:
    precisions = [p for p in Precision if p in supported]
  precisions = [Precision.parse(p) for p in precisions]
  for p in precisions:
    spec.flops_rate(p)  # raises for a precision the kind lacks
  casts = casting.analytic_cast_model(spec)
  layers = {}
  for node in g.nodes:
    layers[node.path] = {p.value: _roofline_layer(node, p, spec, casts)
                         for p in precisions
                         if not (node.floored and p.bits < 16)}
  mem = (base.memory.for_device(g, spec.memory_bytes) if base is not None
         else memory.analytic_memory_model(g, spec.memory_bytes,
                                           optimizer_state_copies))
  rest = {}
  kernels = 6 * len(g.nodes)  # bias, activation, norm: forward and backward
  for dt in sorted({graph_lib.output_dtype(p) for p in precisions}):
    scale = 1.0 if dt == "float32" else 0.75  # half the bytes up to a cast
    total = (mem.rest_bytes_accessed * scale / spec.bandwidth
             + kernels * devices.KERNEL_LAUNCH_S)
    rest[dt] = (total / 3.0, total)  # backward does about twice the forward
  # Adam: read params, grads, two moments; write params and moments.
  opt_bytes = 4.0 * g.num_params * (3 + 2 * optimizer_state_copies)
  optimizer_s = opt_bytes / spec.bandwidth + 4 * devices.KERNEL_LAUNCH_S
  key = dict(base.key if base is not None else
             {"graph": g.fingerprint(), "batch_shape": list(g.input_shape),
              "jax": jax.__version__},
             device_kind=device_kind, precisions=[p.value for p in precisions])
  return Profile(device_kind, "analytic", key, layers, rest, optimizer_s,
                 casts, mem)


_OPERAND_BYTES = {Precision.FP32: 4, Precision.TF32: 4, Precision.BF16: 2,
                  Precision.FP16: 2, Precision.INT8: 1, Precision.FP8: 1}


def _roofline_layer(node: graph_lib.LayerNode, p: Precision,
                    spec: devices.DeviceSpec, casts: casting.CastModel
                    ) -> tuple[float, float]:
  """Roofline (forward_s, forward_and_backward_s) of one layer at ``p``.

  Forward: operand preparation from float32 (cast, or quantization for INT8
  and FP8, including the master-weight cast), then the contraction at ``p``.
  Backward: one contraction of the forward's size per gradient (input, if
  needed, and weight), in FP16 for INT8 (QSync) and at ``p`` otherwise, plus
  dequantizing the saved codes and casting the input gradient back.
  """
  act = sum(op.numel for op in node.operands)
  w = node.weight_numel
  low = graph_lib.output_dtype(p)
  quantized = p in (Precision.INT8, Precision.FP8)
  prep_dtype = "int8" if quantized else low
  prep = casts.time("float32", prep_dtype, act) + casts.time(
      "float32", prep_dtype, w)
  if node.kind == "Embed":
    return prep, prep + casts.time(low, "float32", w)
  out_bytes = 4 if quantized else _OPERAND_BYTES[p]
  fwd = prep + devices.roofline_time(
      node.flops, _OPERAND_BYTES[p] * (act + w) + out_bytes * node.out_numel,
      p, spec)
  bwd_p = Precision.FP16 if p is Precision.INT8 else p
  grads = sum(1 for op in node.operands if op.needs_grad) + (1 if w else 0)
  bwd = grads * devices.roofline_time(
      node.flops, _OPERAND_BYTES[bwd_p] * (act + w + node.out_numel), bwd_p,
      spec)
  if quantized:
    bwd += casts.time("int8", "float16", act + w)
  bwd += casts.time(graph_lib.output_dtype(bwd_p), "float32", act)
  return fwd, fwd + bwd
