"""The layer graph of a model and its precision cascades.

This module owns :class:`LayerNode`, :class:`ModelGraph` and
:func:`trace_graph`, which records one forward pass of a model: every
addressable layer's contraction (its operands' shapes, which layers produce
them, whether the backward pass needs their gradient) in forward order, and
how activation dtypes flow between layers.

Cascade rules (QSync's "precision-dependent operator cascades", arXiv
2407.02327, and QSync's official code, bytedance/QSync, its function
``change_dag_bit``, as they hold for the JAX ops of
:mod:`qsync_jax.numerics.ops`):

* a layer's output dtype follows its precision: FP16 and BF16 layers emit
  that dtype, every other precision (INT8 and FP8 dequantize) emits float32;
* operations without a precision of their own (activations, pooling,
  reshapes) keep the dtype of their inputs, so a layer's input dtype is the
  promotion of its producers' output dtypes, unless the path from them
  crosses an operation that computes in float32 (a norm, a residual sum with
  a float32 stream); :func:`trace_graph` finds which by tracing once with
  every layer in FP16;
* a cast is inserted where the dtype arriving at a layer differs from the
  dtype the layer computes in (:func:`casts`), forward and backward, since a
  cotangent has its primal's dtype; the FP32 master-weight cast of every step
  is part of each layer's own cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import hashlib
import json
from typing import Any

from flax import nnx
import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics.precision import Precision
from qsync_jax.plan import policy
from qsync_jax.task import calling

#: Model input as a producer.
INPUT = -1
_LOW_FLOAT = {Precision.FP16: "float16", Precision.BF16: "bfloat16"}


def output_dtype(precision: Precision) -> str:
  """The dtype a layer at ``precision`` emits (and computes its input in)."""
  return _LOW_FLOAT.get(precision, "float32")


def promote(dtypes: Sequence[str]) -> str:
  """JAX's type promotion of activation dtypes (f16 with bf16 is f32)."""
  return _promote(tuple(sorted(set(dtypes))))


@functools.cache
def _promote(dtypes: tuple[str, ...]) -> str:
  return str(jnp.result_type(*[jnp.dtype(d) for d in dtypes]))


@dataclasses.dataclass(frozen=True)
class Operand:
  """One activation operand of a layer.

  Attributes:
    shape: its shape.
    producers: indices of the layers whose outputs reach it (``INPUT`` for
      the model input), through operations that have no precision.
    follows: whether its dtype follows the producers' (False when a float32
      operation sits in between).
    needs_grad: whether the backward pass computes its gradient (False for
      the first layer, whose input is the data).
  """

  shape: tuple[int, ...]
  producers: tuple[int, ...]
  follows: bool
  needs_grad: bool

  @property
  def numel(self) -> int:
    return int(np.prod(self.shape))


@dataclasses.dataclass(frozen=True)
class LayerNode:
  """One addressable layer, as the forward pass calls it.

  Attributes:
    path: the layer's path.
    kind: the layer's class name.
    operands: the activation operands (one; two for attention matmuls; none
      for an embedding, whose table is its only operand).
    weight_shape: the parameter operand's shape (``()`` for none).
    out_shape: the output shape.
    flops: forward FLOPs of the contraction (0 for an embedding's cast).
    floored: whether the layer never computes below 16 bits.
    call: re-invokes the layer's op as ``call(op, *arrays)`` with the
      recorded static arguments; arrays are the activation operands, then the
      weight (not serialized).
  """

  path: str
  kind: str
  operands: tuple[Operand, ...]
  weight_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  flops: float
  floored: bool
  call: Callable[..., Any] | None = dataclasses.field(
    default=None, compare=False, repr=False
  )

  @property
  def weight_numel(self) -> int:
    return int(np.prod(self.weight_shape)) if self.weight_shape else 0

  @property
  def out_numel(self) -> int:
    return int(np.prod(self.out_shape))

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.pop("call")
    return d


@dataclasses.dataclass(frozen=True)
class ModelGraph:
  """A model's layers in forward order, with the data flow between them.

  Attributes:
    nodes: the layers in forward order.
    num_params: the model's parameter count.
    input_shape: the shape of the traced data's first array (the model's
      input when it has one; its leading axis is the batch).
    input_dtype: that array's dtype.
    data_bytes: bytes of all the traced data's arrays (every input, and the
      labels when traced through an objective); None: the first array's.
    probe: the :class:`qsync_jax.task.Probe` the graph was traced with, on
      abstract data, to trace the model again (not serialized).
  """

  nodes: tuple[LayerNode, ...]
  num_params: int
  input_shape: tuple[int, ...]
  input_dtype: str = "float32"
  data_bytes: int | None = None
  probe: calling.Probe | None = dataclasses.field(
    default=None, compare=False, repr=False
  )

  @property
  def input_spec(self) -> jax.ShapeDtypeStruct:
    """The first traced array's spec (the input of a one-input model)."""
    return jax.ShapeDtypeStruct(self.input_shape, jnp.dtype(self.input_dtype))

  @property
  def sample(self) -> Any:
    """What re-traces the model: the probe, or :attr:`input_spec`."""
    return self.probe if self.probe is not None else self.input_spec

  @property
  def batch_size(self) -> int:
    """The per-worker batch the graph was traced at."""
    return int(self.input_shape[0]) if self.input_shape else 1

  @property
  def batch_bytes(self) -> int:
    """Bytes of the traced batch (:attr:`data_bytes`, else the input's)."""
    if self.data_bytes is not None:
      return int(self.data_bytes)
    return int(np.prod(self.input_shape)) * jnp.dtype(self.input_dtype).itemsize

  @functools.cached_property
  def paths(self) -> list[str]:
    """The layer paths in forward order (do not modify)."""
    return [n.path for n in self.nodes]

  def index(self, path: str) -> int:
    for i, n in enumerate(self.nodes):
      if n.path == path:
        return i
    raise KeyError(path)

  def fingerprint(self) -> str:
    """A short hash of the layers' shapes and flow (for profile caches)."""
    doc = json.dumps(
      [n.to_dict() for n in self.nodes], sort_keys=True, default=str
    )
    return hashlib.sha256(doc.encode()).hexdigest()[:16]

  def check_precisions(self, precisions: dict[str, Precision]) -> None:
    """Raises ValueError naming missing or unknown layers."""
    if len(precisions) == len(self.paths) and all(
      p in precisions for p in self.paths
    ):
      return
    known = set(self.paths)
    missing = [p for p in self.paths if p not in precisions]
    unknown = [p for p in precisions if p not in known]
    if missing or unknown:
      parts = []
      if unknown:
        parts.append(f"unknown layer(s) {', '.join(unknown)}")
      if missing:
        parts.append(f"no precision for {', '.join(missing)}")
      raise ValueError(
        f"precisions do not match the model's layers: {'; '.join(parts)} "
        f"(layers: {', '.join(self.paths)})"
      )


def input_dtypes(
  graph: ModelGraph, precisions: Sequence[Precision]
) -> list[list[str]]:
  """The dtype arriving at each activation operand under ``precisions``.

  Args:
    graph: the model graph.
    precisions: one precision per node, in node order.

  Returns:
    ``[[dtype per operand] per node]``.
  """
  outs = [output_dtype(p) for p in precisions]
  result = []
  for node in graph.nodes:
    dts = []
    for op in node.operands:
      if not op.follows:
        dts.append("float32")
      else:
        dts.append(
          promote(
            [outs[p] if p != INPUT else "float32" for p in op.producers]
            or ["float32"]
          )
        )
    result.append(dts)
  return result


@dataclasses.dataclass(frozen=True)
class Cast:
  """A cast the step performs because neighbouring dtypes differ.

  Attributes:
    layer: the index of the layer whose operand is cast.
    src: the dtype that arrives.
    dst: the dtype the layer computes in.
    numel: elements cast; the backward pass casts the gradient back
      (``dst`` to ``src``) when the operand needs a gradient.
    backward: whether that backward cast happens.
  """

  layer: int
  src: str
  dst: str
  numel: int
  backward: bool


def casts(graph: ModelGraph, precisions: Sequence[Precision]) -> list[Cast]:
  """The activation casts of a plan (QSync's cast-node insertion).

  A layer computes in :func:`output_dtype` of its precision (INT8 and FP8
  layers quantize from float32); an operand arriving in another dtype is cast
  forward, and its gradient cast back in the backward pass.
  """
  arriving = input_dtypes(graph, precisions)
  out = []
  for i, (node, prec) in enumerate(zip(graph.nodes, precisions)):
    want = output_dtype(prec)
    for op, have in zip(node.operands, arriving[i]):
      if have != want:
        out.append(Cast(i, have, want, op.numel, op.needs_grad))
  return out


# --------------------------------------------------------------------------
# Tracing.
# --------------------------------------------------------------------------


def _flops(
  node_call: Callable[..., Any],
  kind: str,
  arrays: Sequence[jax.ShapeDtypeStruct],
) -> float:
  """Forward FLOPs of a layer's contraction at FP32, from XLA's cost model.

  ``Lowered.cost_analysis`` counts dot and convolution FLOPs exactly on
  every backend before compilation; an
  embedding's cast has none.
  """
  if kind == "Embed":
    return 0.0
  op = policy.op_class(kind)()
  lowered = jax.jit(lambda *a: node_call(op, *a)).lower(*arrays)
  cost = lowered.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax returns one per program
    cost = cost[0]
  return float((cost or {}).get("flops", 0.0))


def _capture(
  model: nnx.Module, layer_list, probe: calling.Probe, uniform: Precision | None
):
  """Traces the probe's pass with each layer's op behind a named marker.

  Only shapes are used: the parameters are traced as one flat vector (the
  jaxpr's first input) and an abstract model's other state as the next
  inputs, before the data's, so a model built under ``nnx.eval_shape``
  works as well as a concrete one, and a deployment-sized model costs no
  init.

  Returns (jaxpr, records, number of parameters, number of other state
  arrays): records[i] holds the op's arguments, the positions of its array
  operands and its output aval.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  leaves, treedef = jax.tree.flatten(params)
  sizes = [int(np.prod(leaf.shape)) for leaf in leaves]
  flat = jax.ShapeDtypeStruct(
    (sum(sizes),),
    jnp.result_type(*[leaf.dtype for leaf in leaves])
    if leaves
    else jnp.float32,
  )

  def unravel(vector):
    parts = jnp.split(vector, np.cumsum(sizes)[:-1]) if leaves else []
    return treedef.unflatten(
      [
        part.reshape(leaf.shape).astype(leaf.dtype)
        for part, leaf in zip(parts, leaves)
      ]
    )

  # An abstract model's other state (batch statistics, RNG counts) is traced
  # as inputs; a concrete model's stays as constants, as a pass over it
  # sees them (a user's Python branch on a counter keeps working).
  rest_leaves, rest_def = jax.tree.flatten(rest)
  array_at = [
    i for i, v in enumerate(rest_leaves) if isinstance(v, jax.ShapeDtypeStruct)
  ]
  rest_arrays = [rest_leaves[i] for i in array_at]
  records: list[dict[str, Any] | None] = [None] * len(layer_list)

  def make_wrapper(i, layer, base):
    module = layer.module
    if policy.is_embedding(module):

      def promote(arrays, **kw):
        (table,) = arrays
        if uniform is not None:
          kw = {**kw, "dtype": jnp.dtype(output_dtype(uniform))}

        def body(t):
          return base((t,), **kw)[0]

        body.__name__ = f"qsync_layer_{i}"
        out = jax.jit(body)(table)
        records[i] = {
          "args": [table],
          "kwargs": kw,
          "arrays": [0],
          "out": jax.ShapeDtypeStruct(out.shape, out.dtype),
          "embed": True,
        }
        return (out,)

      return promote

    li, ri = policy.operand_positions(module)
    op = base
    if uniform is not None:
      op = policy.op_attribute(module)[1](uniform)

    def wrapped(*args, **kwargs):
      arrays = [args[li], args[ri]]

      def body(a, b):
        full = list(args)
        full[li], full[ri] = a, b
        return op(*full, **kwargs)

      body.__name__ = f"qsync_layer_{i}"
      out = jax.jit(body)(*arrays)
      records[i] = {
        "args": list(args),
        "kwargs": kwargs,
        "arrays": [li, ri],
        "out": jax.ShapeDtypeStruct(out.shape, out.dtype),
        "embed": False,
      }
      return out

    return wrapped

  def forward(flat, arrays, data):
    # Instrument a fresh copy so the caller's model is left as it was.
    state = list(rest_leaves)
    for i, a in zip(array_at, arrays):
      state[i] = a
    m = nnx.merge(graphdef, unravel(flat), rest_def.unflatten(state))
    found = policy.addressable_modules(m)
    policy.instrument(
      m,
      [policy.Layer(l.path, found[l.path], l.kind) for l in layer_list],
      make_wrapper,
    )
    return probe.fn(m, data)

  jaxpr = jax.make_jaxpr(forward)(flat, rest_arrays, probe.data)
  return jaxpr, records, sum(sizes), len(rest_arrays)


def _walk(jaxpr, n_layers: int, n_state: int):
  """Data flow between the layer markers of a traced forward pass.

  The jaxpr's inputs are the flat parameters, ``n_state`` other state
  arrays of an abstract model (neither parameter nor model input) and the
  data.

  Returns per layer: for each marker input, (producer set, depends-on-params).
  """
  info: dict[Any, tuple[frozenset, bool]] = {}
  params_var, *others = jaxpr.jaxpr.invars
  data_vars = others[n_state:]
  info[params_var] = (frozenset(), True)
  for v in data_vars:  # every array of the traced data is model input
    info[v] = (frozenset([INPUT]), False)
  inputs: list[list[tuple[frozenset, bool]] | None] = [None] * n_layers

  def get(v):
    if isinstance(v, jex_core.Literal):
      return frozenset(), False
    return info.get(v, (frozenset(), False))

  for eqn in jaxpr.jaxpr.eqns:
    name = str(eqn.params.get("name", ""))
    if name.startswith("qsync_layer_"):
      i = int(name.rsplit("_", 1)[1])
      inputs[i] = [get(v) for v in eqn.invars]
      for v in eqn.outvars:
        info[v] = (frozenset([i]), True)
      continue
    deps: frozenset = frozenset()
    param = False
    for v in eqn.invars:
      d, p = get(v)
      deps |= d
      param = param or p
    for v in eqn.outvars:
      info[v] = (deps, param)
  return inputs


def trace_graph(model: nnx.Module, sample_input: Any = None) -> ModelGraph:
  """Records the model's layer graph from one abstract training pass.

  Args:
    model: an NNX model (left unchanged, its mode included; a bare layer
      works too), concrete or abstract (built under ``nnx.eval_shape``: no
      weights are needed).
    sample_input: the model's inputs at the per-worker batch (an array or
      ``jax.ShapeDtypeStruct``, a tuple of them for several positional
      inputs, a dict for keyword inputs), or a :class:`qsync_jax.task.Probe`
      (e.g. ``objective.probe(batch)``); by default ``model.input_spec(2)``
      (use the real batch size: shapes matter).

  Returns:
    The :class:`ModelGraph`.

  Raises:
    ValueError: no sample input and no ``input_spec``, or a model with no
      addressable layer.
  """
  given = calling.as_probe(model, sample_input)
  probe = calling.Probe(given.fn, calling.abstract(given.data))
  layer_list = policy.model_layers(model, probe)
  leaves = jax.tree.leaves(probe.data)
  if not leaves:
    raise ValueError("the sample input holds no array to trace with")
  first = leaves[0]
  jaxpr, records, num_params, n_state = _capture(model, layer_list, probe, None)
  flow = _walk(jaxpr, len(layer_list), n_state)
  # Which operands keep the dtype their producers emit: trace once with every
  # layer (head and floors included) in FP16 and see what arrives.
  _, fp16_records, _, _ = _capture(model, layer_list, probe, Precision.FP16)
  nodes = []
  for i, layer in enumerate(layer_list):
    rec, flow_i = records[i], flow[i]
    embed = rec["embed"]
    arrays = [rec["args"][k] for k in rec["arrays"]]
    act_positions = (
      [] if embed else [j for j, (deps, _) in enumerate(flow_i) if deps]
    )
    weight_pos = next(
      (j for j in range(len(arrays)) if j not in act_positions), None
    )
    operands = []
    for j in act_positions:
      deps, param = flow_i[j]
      f16 = [fp16_records[i]["args"][k] for k in fp16_records[i]["arrays"]]
      operands.append(
        Operand(
          shape=tuple(arrays[j].shape),
          producers=tuple(sorted(deps)),
          follows=str(f16[j].dtype) == "float16" or deps == {INPUT},
          needs_grad=bool(param),
        )
      )
    weight_shape = (
      tuple(arrays[weight_pos].shape) if weight_pos is not None else ()
    )
    order = act_positions + ([weight_pos] if weight_pos is not None else [])
    call = _make_call(rec, order)
    avals = [
      jax.ShapeDtypeStruct(arrays[j].shape, arrays[j].dtype) for j in order
    ]
    nodes.append(
      LayerNode(
        path=layer.path,
        kind=layer.kind,
        operands=tuple(operands),
        weight_shape=weight_shape,
        out_shape=tuple(rec["out"].shape),
        flops=_flops(call, layer.kind, avals),
        floored=policy.is_floored(layer.module),
        call=call,
      )
    )
  return ModelGraph(
    tuple(nodes),
    int(num_params),
    tuple(int(d) for d in first.shape),
    str(first.dtype),
    sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in leaves),
    probe,
  )


def _make_call(rec: dict[str, Any], order: list[int]) -> Callable[..., Any]:
  """``call(op, *arrays)``: the layer's op on new arrays (graph order)."""
  positions, kwargs = rec["arrays"], rec["kwargs"]
  # Keep the static arguments only (the traced arrays are replaced per call).
  args = [None if i in positions else a for i, a in enumerate(rec["args"])]
  if rec["embed"]:

    def call_embed(op, table):
      return op((table,), **kwargs)[0]

    return call_embed

  def call(op, *arrays):
    full = list(args)
    for j, a in zip(order, arrays):
      full[positions[j]] = a
    return op(*full, **kwargs)

  return call
