"""The pieces a profile times, as jitted functions of a model's parts.

This module owns what each timed piece of a step computes:

* a layer's op alone at its real operand shapes (:func:`layer_op`,
  :func:`layer_functions`), and :func:`piece_signature`, which tells layers
  with the same pieces apart from the rest (a ResNet's repeated blocks are
  timed once);
* the step without its layers (:func:`stand_in_step_functions`): the
  trainer's gradient function (:func:`qsync_jax.train.step.grad_function`)
  on a copy of the model whose layers only emit an output of the right shape
  and dtype;
* the whole gradient pass at one uniform precision (:func:`pass_function`).

The zero-argument calls that run them on a device are in :mod:`.calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx
import jax
from jax import lax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp

from qsync_jax.numerics import cpu_gemm
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan import policy
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.task.objective import as_objective
from qsync_jax.train import step as step_lib


def _embed_cast(dtype: str):
  def promote(arrays, dtype_=None, **unused):
    del dtype_, unused
    return tuple(a.astype(dtype) for a in arrays)

  return lambda arrays, **kw: promote(arrays)


def layer_op(
  node: graph_lib.LayerNode,
  precision: Precision,
  quant: QuantConfig | None = None,
) -> Callable[..., Any]:
  """The precision-aware op a layer runs at ``precision``."""
  quant = quant or QuantConfig()
  if node.kind == "Embed":
    return _embed_cast(graph_lib.output_dtype(precision))
  return policy.op_class(node.kind)(precision, quant)


def _grad_positions(node: graph_lib.LayerNode) -> list[int]:
  pos = [i for i, op in enumerate(node.operands) if op.needs_grad]
  if node.weight_shape:
    pos.append(len(node.operands))
  return pos


def layer_functions(
  node: graph_lib.LayerNode,
  precision: Precision,
  quant: QuantConfig | None = None,
):
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

    # Traced as the trainer's step traces its layers (its weight gradients
    # as library GEMMs on XLA:CPU).
    with cpu_gemm.gemm_gradients():
      out, vjp = jax.vjp(g, *[arrays[p] for p in positions])
      return out, vjp(ct)

  return jax.jit(f), jax.jit(fb)


def piece_signature(node: graph_lib.LayerNode) -> str:
  """What a layer's profile pieces compute, as a comparable string.

  Two layers with equal signatures (the same op, operand shapes, static
  arguments and differentiated operands; e.g. the repeated blocks of a
  ResNet or the projections of a transformer) have the same pieces, so a
  profile times them once. The forward pass lowered at FP32 carries the op,
  shapes and static arguments; which operands the backward differentiates is
  added.
  """
  avals = [jax.ShapeDtypeStruct(op.shape, jnp.float32) for op in node.operands]
  if node.weight_shape:
    avals.append(jax.ShapeDtypeStruct(node.weight_shape, jnp.float32))
  fwd, _ = layer_functions(node, Precision.FP32)
  text = fwd.lower(*avals).as_text()
  return "|".join(
    [node.kind, str(_grad_positions(node)), str(node.floored), text]
  )


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
        jnp.broadcast_to(seed.astype(dtype), out_shape)
      )

    def fwd(*a):
      return f(*a), a

    def bwd(saved, g):
      # Gradients shaped like the operands, computed from them at memory
      # speed: what a real backward pass writes, without the contraction.
      s = g.ravel()[0].astype(jnp.float32) * 0.0 + 1.0
      return tuple((x.astype(jnp.float32) * s).astype(x.dtype) for x in saved)

    f.defvjp(fwd, bwd)
    return f(*arrays)

  return op


def _stand_in_wrapper(nodes: Sequence[graph_lib.LayerNode], dtype: str):
  def make_wrapper(i, layer, base):
    del base
    node = nodes[i]
    module = layer.module
    if policy.is_embedding(module):

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


def _edited_grad_function(
  model: nnx.Module, loss_fn, edit: Callable[[nnx.Module], None]
):
  """The trainer's gradient function of a copy of ``model`` that ``edit``
  changed in place (``model`` is left unchanged). ``loss_fn`` is any form
  :func:`qsync_jax.task.as_objective` takes.

  Returns:
    ``(grad_fn, graphdef, unravel, flat_params, rest)`` of the copy;
    ``grad_fn`` is :func:`qsync_jax.train.step.grad_function` (what the trainer
    runs).
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  copy = nnx.merge(graphdef, params, rest)
  edit(copy)
  c_graphdef, c_params, c_rest = nnx.split(copy, nnx.Param, ...)  # type: ignore[misc]
  flat, unravel = ravel_pytree(c_params)
  return (
    step_lib.grad_function(c_graphdef, unravel, loss_fn),
    c_graphdef,
    unravel,
    flat,
    c_rest,
  )


def stand_in_step_functions(
  model: nnx.Module, g: graph_lib.ModelGraph, loss_fn, dtype: str
):
  """(forward, gradient) functions of the step with stand-in layers: on a
  copy of the model whose layers only emit ``dtype``.

  Returns:
    ``(forward, grad_fn, flat, rest)``: ``forward(params_row, rest, batch,
    ids)`` the loss, ``grad_fn`` the trainer's gradient function
    (:func:`qsync_jax.train.step.grad_function`, same arguments plus the
    loss scale), the copy's flat parameters and other state.
  """
  objective = as_objective(loss_fn)
  layer_list = policy.model_layers(model, g.sample)

  def stand_in(copy):
    found = policy.addressable_modules(copy)
    policy.instrument(
      copy,
      [policy.Layer(l.path, found[l.path], l.kind) for l in layer_list],
      _stand_in_wrapper(g.nodes, dtype),
    )

  grad_fn, s_graphdef, unravel, flat, s_rest = _edited_grad_function(
    model, objective, stand_in
  )

  @jax.jit
  def forward(params_row, rest_state, batch, ids):
    m = nnx.merge(
      s_graphdef, unravel(params_row[0]), jax.tree.map(lambda v: v, rest_state)
    )
    # The rngs of the trainer's step (the same dropout as its gradient).
    return objective(m, batch, step_lib.step_rngs(0, ids), train=True)[0]

  return forward, grad_fn, flat, s_rest


def pass_function(
  model: nnx.Module,
  g: graph_lib.ModelGraph,
  loss_fn,
  precision: Precision,
  quant: QuantConfig | None = None,
):
  """(gradient function, flat parameters, rest) of the whole model's pass
  at one uniform precision (forced precisions applied): what a worker with
  that plan computes, on a copy of the model."""
  plan = PrecisionPlan.uniform(precision, quant)

  def set_plan(copy):
    layer_list = policy.model_layers(copy, g.sample)
    policy.set_precisions(
      layer_list, policy.resolve_layers(layer_list, plan), plan.quant
    )

  grad_fn, _, _, flat, rest = _edited_grad_function(model, loss_fn, set_plan)
  return grad_fn, flat, rest
