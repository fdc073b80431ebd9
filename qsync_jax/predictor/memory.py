"""Memory of one worker's training step under a precision plan.

This module owns :class:`MemoryModel`, :func:`residual_bytes` (what a layer
saves for its backward pass at each precision: QSync's per-layer ``M_l``
scaled by bits, as QSync's official code, bytedance/QSync, estimates it in
``Predictor/core.py: calculate_mem_occuupation``) and
:func:`compiled_step_bytes` (what XLA reports for the compiled step:
arguments + outputs + temporaries - aliased, from ``memory_analysis``).

A worker's step is :func:`train_step_function`: gradient and optimizer update
in one program with parameters and optimizer state donated, as a JAX training
step is usually compiled. Its footprint is the parameters, the optimizer
state, the batch, the gradient and the activations saved for the backward
pass, less what XLA's buffer reuse overlaps.

Two sources, as for times:

* measured: the compiled step's bytes at FP32 plus, per layer, its analytic
  residual change at the plan's precision times a per-precision factor
  measured from the uniform-precision compiles. XLA:CPU fuses a cast or a
  quantization into the backward consumer and keeps the float32 input
  instead, so low-precision residuals save much less there than the bits
  say; the factor carries that from uniform plans to mixed ones.
* analytic (a GPU kind not present): the same base with the residual changes
  taken at face value (factor 1), as QSync's estimate does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from typing import Any

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import optax

from qsync_jax.numerics import cpu_gemm
from qsync_jax.numerics import flatten
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan import policy
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import pieces
from qsync_jax.task import calling
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn
from qsync_jax.train import step as step_lib

_BITS = {
  Precision.FP32: 32,
  Precision.TF32: 32,
  Precision.BF16: 16,
  Precision.FP16: 16,
  Precision.INT8: 8,
  Precision.FP8: 8,
}


def residual_bytes(node: graph_lib.LayerNode, precision: Precision) -> float:
  """Bytes a layer saves for its backward pass at ``precision``.

  FP32 / TF32 save their activation operands (the weight is the parameter
  itself); FP16 / BF16 save the cast activations and the cast weight; INT8 /
  FP8 save the codes of both (scales are negligible). Embeddings save
  nothing (a gather's backward needs only the indices).
  """
  if node.kind == "Embed":
    return 0.0
  act = sum(op.numel for op in node.operands)
  bits = _BITS[precision]
  if bits == 32:
    return 4.0 * act
  return bits / 8.0 * (act + node.weight_numel)


@dataclasses.dataclass(frozen=True)
class MemoryModel:
  """Predicts a worker's step memory from its per-layer precisions.

  Attributes:
    base_bytes: the compiled step's bytes with every layer in FP32.
    deltas: ``{path: {precision: bytes}}``, the change a layer makes by
      computing at that precision instead of FP32.
    rest_bytes_accessed: XLA's bytes accessed by the step without its layers
      (for analytic rest times).
    capacity_bytes: the device's memory, when known.
  """

  base_bytes: float
  deltas: Mapping[str, Mapping[str, float]]
  rest_bytes_accessed: float = 0.0
  capacity_bytes: float | None = None

  def predict(
    self, paths: Sequence[str], precisions: Sequence[Precision]
  ) -> float:
    """Step bytes when layer ``paths[i]`` computes at ``precisions[i]``."""
    total = self.base_bytes
    for path, p in zip(paths, precisions):
      if p is not Precision.FP32:
        total += self.deltas[path].get(p.value, 0.0)
    return float(total)

  def for_device(
    self, g: graph_lib.ModelGraph, capacity_bytes: float
  ) -> MemoryModel:
    """The analytic model for a GPU: residual changes at face value."""
    return dataclasses.replace(
      self, deltas=analytic_deltas(g), capacity_bytes=capacity_bytes
    )

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> MemoryModel:
    return cls(**d)


def analytic_deltas(g: graph_lib.ModelGraph) -> dict[str, dict[str, float]]:
  """Per layer and precision, :func:`residual_bytes` minus its FP32 value."""
  return {
    n.path: {
      p.value: residual_bytes(n, p) - residual_bytes(n, Precision.FP32)
      for p in Precision
    }
    for n in g.nodes
  }


def analytic_memory_model(
  g: graph_lib.ModelGraph,
  capacity_bytes: float,
  optimizer_state_copies: int = 2,
) -> MemoryModel:
  """A memory model from shapes alone (no compile), for analytic profiles.

  Parameters, gradients and ``optimizer_state_copies`` float32 copies of
  them, the batch, every layer's FP32 residuals, and one float32 copy of
  every layer output (what activations and norms keep). The non-layer bytes
  accessed are taken as six passes over the layer outputs (forward read and
  write, backward two of each). Rough: use measured models where possible.
  """
  params = 4.0 * g.num_params * (2 + optimizer_state_copies)
  batch = float(g.batch_bytes)
  outs = 4.0 * sum(n.out_numel for n in g.nodes if n.kind != "Embed")
  residual = sum(residual_bytes(n, Precision.FP32) for n in g.nodes)
  return MemoryModel(
    params + batch + residual + outs,
    analytic_deltas(g),
    rest_bytes_accessed=6.0 * outs,
    capacity_bytes=capacity_bytes,
  )


def train_step_function(
  graphdef, unravel, loss_fn, tx: optax.GradientTransformation
):
  """One worker's full step, ``(flat, opt_state, rest, batch, ids) -> (flat,
  opt_state, rest, loss)``, with parameters and optimizer state donated.

  ``loss_fn`` is any form :func:`qsync_jax.task.as_objective` takes; the
  batch any pytree it takes; ``ids`` the ``uint32[2]`` (worker, step) that
  seed the step's rngs, as in the trainer's step.
  """
  objective = as_objective(loss_fn)

  def step(flat, opt_state, rest, batch, ids):
    m = nnx.merge(graphdef, unravel(flat), rest)
    # As the trainer's gradient function traces it.
    with cpu_gemm.gemm_gradients():
      loss, grads = nnx.value_and_grad(
        lambda m: objective(m, batch, step_lib.step_rngs(0, ids), train=True)[0]
      )(m)
    g = flatten.ravel(grads)
    updates, opt_state = tx.update(g, opt_state, flat)
    new_rest = nnx.split(m, nnx.Param, ...)[2]
    return optax.apply_updates(flat, updates), opt_state, new_rest, loss

  return jax.jit(step, donate_argnums=(0, 1))


def _abstract(tree):
  return calling.abstract(jax.tree.map(jnp.asarray, tree))


_IDS = jax.ShapeDtypeStruct((2,), jnp.uint32)


def compiled_step_bytes(
  model: nnx.Module,
  precisions: Mapping[str, Precision],
  sample_batch,
  loss_fn: LossFn = None,
  tx: optax.GradientTransformation | None = None,
  quant: QuantConfig | None = None,
) -> float:
  """Bytes XLA reports for the compiled step of ``model`` at ``precisions``.

  Compiles (does not run) :func:`train_step_function` on abstract inputs and
  returns ``argument + output + temp - alias`` from ``memory_analysis``.

  Args:
    model: the NNX model (left unchanged).
    precisions: ``{layer path: precision}``.
    sample_batch: one batch (any pytree the objective takes).
    loss_fn: the loss in any form :func:`qsync_jax.task.as_objective` takes
      (default: classification).
    tx: the optimizer (default ``optax.adam(1e-3)``).
    quant: operand quantization of INT8 / FP8 layers.
  """
  tx = tx or optax.adam(1e-3)
  objective = as_objective(loss_fn)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  copy = nnx.merge(graphdef, params, rest)
  batch = _abstract(sample_batch)
  layer_list = policy.model_layers(copy, objective.probe(batch))
  policy.set_precisions(layer_list, dict(precisions), quant or QuantConfig())
  graphdef, params, rest = nnx.split(copy, nnx.Param, ...)  # type: ignore[misc]
  flat, unravel = ravel_pytree(params)
  opt_state = jax.eval_shape(tx.init, flat)
  step = train_step_function(graphdef, unravel, objective, tx)
  compiled = step.lower(
    _abstract(flat), opt_state, _abstract(rest), batch, _IDS
  ).compile()
  ma = compiled.memory_analysis()
  return float(
    ma.argument_size_in_bytes
    + ma.output_size_in_bytes
    + ma.temp_size_in_bytes
    - ma.alias_size_in_bytes
  )


def uniform_precisions(
  g: graph_lib.ModelGraph, precision: Precision
) -> dict[str, Precision]:
  """Effective precisions of the uniform plan (head FP32, 16-bit floors)."""
  floored = {n.path for n in g.nodes if n.floored}
  return policy.resolve_with_forced(
    g.paths, floored, PrecisionPlan(default=precision)
  )


def measure_memory_model(
  model: nnx.Module,
  g: graph_lib.ModelGraph,
  sample_batch,
  loss_fn,
  tx,
  precisions: Sequence[Precision],
  quant: QuantConfig | None = None,
) -> MemoryModel:
  """Builds the measured :class:`MemoryModel` from uniform-plan compiles.

  The change a uniform plan at ``p`` makes to the compiled step's bytes is
  shared among the layers it lowers in proportion to their operand sizes
  (activations plus weight), the bytes that their saved values occupy.
  """
  base = compiled_step_bytes(
    model,
    uniform_precisions(g, Precision.FP32),
    sample_batch,
    loss_fn,
    tx,
    quant,
  )
  size = {
    n.path: float(sum(op.numel for op in n.operands) + n.weight_numel)
    for n in g.nodes
  }
  deltas: dict[str, dict[str, float]] = {n.path: {} for n in g.nodes}
  for p in precisions:
    if p is Precision.FP32:
      continue
    eff = uniform_precisions(g, p)
    change = (
      compiled_step_bytes(model, eff, sample_batch, loss_fn, tx, quant) - base
    )
    lowered = [path for path, q in eff.items() if q is not Precision.FP32]
    total = sum(size[path] for path in lowered)
    for path in lowered:
      q = eff[path].value
      # A floored layer runs FP16 under a uniform INT8 plan: its share is
      # booked under FP16 unless FP16's own compile already set it.
      deltas[path].setdefault(q, change * size[path] / total if total else 0)
  return MemoryModel(
    base,
    deltas,
    rest_bytes_accessed=_rest_bytes(model, g, sample_batch, loss_fn),
  )


def _rest_bytes(model, g, sample_batch, loss_fn) -> float:
  """XLA's bytes accessed by the float32 step without its layers."""
  _, grad_fn, flat, rest = pieces.stand_in_step_functions(
    model, g, loss_fn, "float32"
  )
  lowered = grad_fn.lower(
    _abstract(flat[None]),
    _abstract(rest),
    jax.ShapeDtypeStruct((1,), jnp.float32),
    _abstract(sample_batch),
    _IDS,
  )
  cost = lowered.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float((cost or {}).get("bytes accessed", 0.0))
