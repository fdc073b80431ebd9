"""Applying a precision plan to a Flax NNX model.

A plan addresses *layers*: the contractions whose precision can change.
Flax's layers with an injectable op are planned through it: ``nnx.Linear``,
``nnx.LinearGeneral``, ``nnx.Conv``, ``nnx.Einsum``, ``nnx.Embed`` (its
table's dtype) and :class:`qsync_jax.plan.layers.MatMul`. Every other
contraction a module computes with jax ops (``jnp.einsum``, ``@``,
``lax.dot_general``, ``lax.conv_general_dilated``...; ``nnx.ConvTranspose``,
the attention matmuls of ``nnx.MultiHeadAttention``, a user's own layer) is
found by :mod:`qsync_jax.plan.intercept` and gets a *site*, a small module
attached to its owner whose op a plan swaps the same way. A layer's path is
its attribute path in the module tree joined by ``/``
(``"layers/0/attention/query"``); a site's is its owner's path and the op's
order in the call (``"block1/einsum_0"``). Paths are stable across runs and
independent of the plan.

A Linen model wrapped as a :class:`qsync_jax.plan.bridge.LinenModel` takes
part too: its layers are :class:`~qsync_jax.plan.bridge.LayerProxy` modules
with the attributes below, named by their Linen paths (:func:`layer_kind`,
:func:`is_embedding` and :func:`weight_paths` hide the difference).

Applying a plan swaps each layer's injectable op (``dot_general``,
``conv_general_dilated``, ``einsum_op``; ``dtype`` for embeddings) for a
precision-aware op from :mod:`qsync_jax.numerics.ops`. Parameters are never
touched: they stay float32 master weights, so a plan changes compute only and
any plan can be applied on top of another.

The forced precisions (FP32 head, 16-bit floor for embeddings and attention
matmuls, and for sites that contract two activations unless a rule names
them) are :mod:`qsync_jax.plan.rules`, shared with the Linen API. Softmax
and GELU inputs are FP32 and norms keep FP32; the built-in models do this
themselves (these are not addressable layers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any

from flax import nnx
import flax.linen as nn
import jax

from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan import bridge
from qsync_jax.plan import intercept
from qsync_jax.plan import linen as linen_plan
from qsync_jax.plan.layers import MatMul
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.plan.rules import embed_dtype
from qsync_jax.plan.rules import OP_FOR_ATTRIBUTE
from qsync_jax.plan.rules import resolve_with_forced
from qsync_jax.task import calling

# The attribute each layer type computes through, and the op that replaces it.
_OP_ATTR: Mapping[type, tuple[str, Callable[..., Any]]] = {
  layer_type: (attr, OP_FOR_ATTRIBUTE[attr])
  for layer_type, attr in (
    (nnx.Linear, "dot_general"),
    (nnx.LinearGeneral, "dot_general"),
    (nnx.Conv, "conv_general_dilated"),
    (nnx.Einsum, "einsum_op"),
    (MatMul, "einsum_op"),
    (bridge.DenseProxy, "dot_general"),
    (bridge.ConvProxy, "conv_general_dilated"),
    (intercept.DotSite, "dot_general"),
    (intercept.ConvSite, "conv_general_dilated"),
  )
}
#: Embedding layers: a plan sets the dtype of their table (no op to swap).
EMBEDDING_TYPES = (nnx.Embed, bridge.EmbedProxy)
#: Layer types that never compute below 16 bits.
SIXTEEN_BIT_FLOOR = (*EMBEDDING_TYPES, MatMul)
ADDRESSABLE_TYPES: tuple[type[nnx.Module], ...] = (*_OP_ATTR, *EMBEDDING_TYPES)
# What a layer computes with while its op attribute is None.
_DEFAULT_OPS: Mapping[str, Callable[..., Any]] = {
  "dot_general": jax.lax.dot_general,
  "conv_general_dilated": jax.lax.conv_general_dilated,
}
# Modules planned through an attribute: interception leaves their ops alone.
# Embeddings are not among them: their lookup is planned through the table's
# dtype, and the product of ``attend`` (a tied head) is a site.
_ATTRIBUTE_PLANNED: tuple[type, ...] = (
  *ADDRESSABLE_TYPES,
  bridge.LayerProxy,
  *linen_plan.ADDRESSABLE_TYPES,
)
_KNOWN_TYPES = tuple(
  t
  for t in _ATTRIBUTE_PLANNED
  if t not in (*intercept.SITE_TYPES, *EMBEDDING_TYPES, nn.Embed)
)
intercept.pass_through(_KNOWN_TYPES)


@dataclasses.dataclass(frozen=True)
class Layer:
  """One addressable layer of a model.

  Attributes:
    path: the '/'-joined attribute path.
    module: the layer module itself.
    kind: the layer's class name (``"Linear"``, ``"Conv"``, ...).
  """

  path: str
  module: nnx.Module
  kind: str


def op_attribute(module: nnx.Module) -> tuple[str, Callable[..., Any]]:
  """Returns (attribute name, precision-aware op class) of a layer."""
  for layer_type, attr_op in _OP_ATTR.items():
    if isinstance(module, layer_type):
      return attr_op
  raise TypeError(f"{type(module).__name__} is not an addressable layer")


def is_embedding(module: nnx.Module) -> bool:
  """Whether ``module`` is an embedding (NNX ``Embed`` or a Linen one's
  proxy): its hook is ``promote_dtype`` on the table, its weight
  ``embedding``."""
  return isinstance(module, EMBEDDING_TYPES)


def is_floored(module: nnx.Module) -> bool:
  """Whether a layer computes at 16 bits or more unless a rule names it:
  embeddings, attention matmuls, and intercepted contractions of two
  activations."""
  return isinstance(module, SIXTEEN_BIT_FLOOR) or (
    intercept.is_site(module) and bool(module.floored)
  )


def op_class(kind: str) -> Callable[..., Any]:
  """The precision-aware op class a layer of ``kind`` computes with.

  Embeddings have none (a plan sets their table's dtype).
  """
  if kind == "Conv" or kind in intercept.CONV_KINDS:
    return OP_FOR_ATTRIBUTE["conv_general_dilated"]
  if kind in ("Einsum", "MatMul"):
    return OP_FOR_ATTRIBUTE["einsum_op"]
  return OP_FOR_ATTRIBUTE["dot_general"]


def layer_kind(module: nnx.Module) -> str:
  """The kind of a layer: its NNX class name (``"Linear"``, ``"Conv"``,
  ...), or for a Linen layer's proxy the NNX class it stands for."""
  if isinstance(module, (bridge.LayerProxy, *intercept.SITE_TYPES)):
    return module.kind
  return type(module).__name__


def weight_variable(module: nnx.Module) -> nnx.Variable | None:
  """The layer's weight (``kernel``, or ``embedding`` for embeddings);
  None for the attention matmuls and the intercepted contractions, which
  hold none."""
  if isinstance(module, (MatMul, *intercept.SITE_TYPES)):
    return None
  # Attributes of the concrete layer types (Embed, Linear, Conv, proxies).
  return module.embedding if is_embedding(module) else module.kernel  # type: ignore[attr-defined]


def weight_paths(
  model: nnx.Module, layer_list: list[Layer]
) -> dict[str, tuple | None]:
  """``{layer path: state path of its weight}`` (None: no weight).

  The state path indexes ``nnx.state(model)`` (and any state split from
  it, e.g. a gradient): for NNX layers it is the layer path plus
  ``"kernel"`` / ``"embedding"``, for a Linen layer the path of the variable
  inside the :class:`~qsync_jax.plan.bridge.LinenModel`.
  """
  first: dict[int, tuple] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable):
      first.setdefault(id(node), path)
  modules = addressable_modules(model)
  out = {}
  for layer in layer_list:
    var = weight_variable(modules.get(layer.path, layer.module))
    out[layer.path] = None if var is None else first.get(id(var))
  return out


def _path_str(path: tuple, node: Any) -> str:
  # A bare layer as the root has no attribute path: it is named by its class.
  return "/".join(str(p) for p in path) if path else type(node).__name__


def _layer_entries(
  model: nnx.Module,
) -> list[tuple[str, tuple | None, nnx.Module]]:
  """``[(layer path, site key or None, module)]`` in graph order.

  A site's key is ``(owner path, site name)``, as discovery names it.
  """
  graph = list(nnx.iter_graph(model))
  in_bridge = {
    id(proxy)
    for _, node in graph
    if isinstance(node, bridge.LinenModel)
    for proxy in node.proxies.values()
  }
  entries: list[tuple[str, tuple | None, nnx.Module]] = []
  for path, node in graph:
    prefix = tuple(map(str, path))
    if isinstance(node, bridge.LinenModel):
      for linen_path, proxy in node.proxies.items():
        parts = tuple(linen_path.split("/"))
        if intercept.is_site(proxy):
          shown = parts[:-1] if proxy.collapsed else parts
          entries.append(
            (
              "/".join((*prefix, *shown)) or parts[-1],
              ((*prefix, *parts[:-1]), parts[-1]),
              proxy,
            )
          )
        else:
          entries.append(("/".join((*prefix, *parts)), None, proxy))
    elif id(node) in in_bridge:
      continue
    elif intercept.is_site(node):
      key = (prefix[:-1], prefix[-1])
      entries.append((_site_path(path, node, model), key, node))
    elif isinstance(node, ADDRESSABLE_TYPES) and not isinstance(
      node, bridge.LayerProxy
    ):
      entries.append((_path_str(path, node), None, node))
  return entries


def addressable_modules(model: nnx.Module) -> dict[str, nnx.Module]:
  """Returns {path: module} of the addressable layers (graph order).

  A bare layer as the root is its own single layer, named by its class
  (``"Linear"``). The layers of a :class:`~qsync_jax.plan.bridge.LinenModel`
  are its proxies, named by their Linen paths below the model's own path.
  The sites of intercepted contractions are listed once a pass has found
  them (:func:`model_layers`).
  """
  found: dict[str, nnx.Module] = {}
  for path, _, module in _layer_entries(model):
    found.setdefault(path, module)
  return found


def _site_paths(model: nnx.Module) -> dict[tuple, str]:
  return {key: path for path, key, _ in _layer_entries(model) if key}


def _check_not_stacked(path: str, stored: tuple | None, args: Any) -> None:
  """Raises if a layer runs on a slice of its stored weight (a stack)."""
  if stored is None:
    return
  shapes = {
    tuple(a.shape) for a in jax.tree.leaves(args) if hasattr(a, "shape")
  }
  if stored in shapes:
    return
  if any(stored[k:] in shapes for k in range(1, len(stored))):
    raise intercept.StackedLayerError(
      f"{path} runs under nnx.scan or nnx.vmap: its weight of shape "
      f"{stored} is a stack of {stored[0]} layers, and a plan sets one "
      "precision per layer; call the layers in a Python loop (e.g. over an "
      "nnx.List of blocks) to plan them"
    )


def _trace_for_sites(
  model: nnx.Module, probe: calling.Probe, discovery: intercept.Discovery
) -> None:
  """Traces one pass of ``probe`` with contractions recorded into
  ``discovery``, then marks which operands depend on the inputs."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  # An abstract model's leaves are traced as inputs; a concrete model's
  # stay constants, as a pass over it sees them.
  abstract_at = [
    i for i, v in enumerate(leaves) if isinstance(v, jax.ShapeDtypeStruct)
  ]

  def traced(abstract_leaves, data):
    full = list(leaves)
    for i, a in zip(abstract_at, abstract_leaves):
      full[i] = a
    m = nnx.merge(graphdef, treedef.unflatten(full))
    discovery.set_model(m)
    with intercept.discovering(discovery):
      return probe.fn(m, data)

  closed = jax.make_jaxpr(traced)([leaves[i] for i in abstract_at], probe.data)
  discovery.mark_dependence(
    closed.jaxpr, closed.jaxpr.invars[len(abstract_at) :]
  )


def _attach_sites(model: nnx.Module, found: list[intercept.Found]) -> None:
  """Gives every found contraction its site module in ``model``.

  Every NNX module holding a site, itself or below it, then activates
  interception when called (:func:`intercept.activate_when_called`): the
  model, and any of those modules called on its own. A Linen model's sites
  live in its bridge, whose call activates it.
  """
  modules = {
    tuple(map(str, path)): node
    for path, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Module)
  }
  for f, site in zip(found, intercept.make_sites(found)):
    site_type = type(site)
    if f.linen_path is not None:
      bridge_path = f.owner_path[: len(f.owner_path) - len(f.linen_path)]
      proxies = modules[bridge_path].proxies  # type: ignore[attr-defined]
      key = "/".join((*f.linen_path, f.name))
      if not isinstance(proxies.get(key), site_type):
        proxies[key] = site
      continue
    owner = modules[f.owner_path]
    existing = vars(owner).get(f.name)
    if existing is None:
      setattr(owner, f.name, site)
    elif not isinstance(existing, site_type):
      where = "/".join(f.owner_path) or type(owner).__name__
      raise ValueError(
        f"{where} has an attribute {f.name!r}, the name its contraction "
        f"site {f.name} needs (a {f.kind}); rename the attribute"
      )
  owners = {f.owner_path for f in found if f.linen_path is None}
  for path in {p[:i] for p in owners for i in range(len(p) + 1)}:
    if path in modules:  # not a list or dict holding modules
      intercept.activate_when_called(modules[path])


def _site_path(path: tuple, site: Any, root: nnx.Module) -> str:
  """A site's layer path: its owner's for a collapsed site."""
  return intercept.site_path(
    tuple(map(str, path[:-1])), str(path[-1]), site, type(root).__name__
  )


def model_layers(model: nnx.Module, sample_input: Any = None) -> list[Layer]:
  """Returns the model's addressable layers in forward order.

  The order comes from tracing one training pass abstractly (no FLOPs, rngs
  supplied); the model's mode and state are left as they were. A layer the
  pass never calls is not listed. The pass also finds every contraction a
  module computes with jax ops (:mod:`qsync_jax.plan.intercept`): each gets
  a site attached to its module, listed as ``owner/einsum_0`` (or by the
  owner's path when it is one of flax's layers with one contraction, e.g.
  ``nnx.ConvTranspose``). The modules holding sites, and the modules above
  them, then intercept the jax ops whenever they are called (their class
  becomes a subclass of the same name that does; see
  :mod:`qsync_jax.plan.intercept`).

  Args:
    model: an NNX module (a bare layer works too).
    sample_input: the model's inputs (an array or ``jax.ShapeDtypeStruct``,
      a tuple of them for several positional inputs, a dict for keyword
      inputs), or a :class:`qsync_jax.task.Probe`; by default
      ``model.input_spec(2)`` where the model has one.

  Raises:
    ValueError: the model has no addressable layer or contraction, no
      sample input is available, or its layers run stacked under
      ``nnx.scan`` / ``nnx.vmap`` (:class:`intercept.StackedLayerError`).
  """
  if any(isinstance(n, nnx.bridge.ToNNX) for _, n in nnx.iter_graph(model)):
    raise ValueError(
      f"{type(model).__name__} wraps a Linen module in nnx.bridge.ToNNX, "
      "whose layers a plan cannot reach: wrap it with "
      "qsync_jax.from_linen(module, sample_input, rngs=...) instead"
    )
  probe = calling.as_probe(model, sample_input)
  order: list[Any] = []
  saved = []
  for path, module in addressable_modules(model).items():
    if intercept.is_site(module):
      continue  # met through the interception below
    # Every attribute-planned layer calls promote_dtype (NNX) or einsum_op
    # (MatMul) exactly once per call: wrap it to log the call order.
    attr = "einsum_op" if isinstance(module, MatMul) else "promote_dtype"
    original = getattr(module, attr)
    weight = weight_variable(module)
    stored = None if weight is None else tuple(weight.get_value().shape)
    saved.append((module, attr, original))

    def recorder(*args, _path=path, _fn=original, _stored=stored, **kwargs):
      _check_not_stacked(_path, _stored, args)
      if _path not in order:
        order.append(_path)
      return _fn(*args, **kwargs)

    setattr(module, attr, recorder)
  discovery = intercept.Discovery(order.append)
  try:
    _trace_for_sites(model, probe, discovery)
  finally:
    for module, attr, original in saved:
      setattr(module, attr, original)
  _attach_sites(model, discovery.found)
  by_path = addressable_modules(model)
  site_paths = _site_paths(model)
  paths: list[str] = []
  for item in order:
    if isinstance(item, intercept.Found):
      item = site_paths[item.site_key]
    if item not in paths:
      paths.append(item)
  if not paths:
    raise ValueError(
      f"{type(model).__name__} has no layer a precision plan can address: "
      "no flax contracting layer and no contraction (jnp.einsum, @, "
      "lax.dot_general, lax.conv_general_dilated...) in its modules"
    )
  return [Layer(p, by_path[p], layer_kind(by_path[p])) for p in paths]


def operand_positions(module: nnx.Module) -> tuple[int, int]:
  """Positions of the two contracted operands in the layer's op call.

  ``dot_general`` and ``conv_general_dilated`` take ``(lhs, rhs, ...)``;
  ``einsum_op`` takes ``(subscripts, lhs, rhs)``.
  """
  return (1, 2) if isinstance(module, (nnx.Einsum, MatMul)) else (0, 1)


def hook_attribute(module: nnx.Module) -> str:
  """The attribute :func:`instrument` wraps: the op, or an embedding's cast."""
  return "promote_dtype" if is_embedding(module) else op_attribute(module)[0]


def instrument(
  model: nnx.Module,
  layer_list: list[Layer],
  make_wrapper: Callable[[int, Layer, Any], Any],
) -> None:
  """Replaces each layer's hook by ``make_wrapper(i, layer, original)``.

  Contractions wrap their op (:func:`operand_positions` says where the
  operands are); embeddings wrap ``promote_dtype``, which casts the table.
  The wrappers become static attributes, so differentiate ``model`` with
  ``nnx`` transforms (they also carry BatchNorm updates across trace levels).
  Undo with :func:`set_precisions`.
  """
  modules = addressable_modules(model)
  for i, layer in enumerate(layer_list):
    module = modules[layer.path]
    attr = hook_attribute(module)
    # An NNX LinearGeneral's op is None until set: lax.dot_general.
    base = getattr(module, attr) or _DEFAULT_OPS[attr]
    wrapper = make_wrapper(i, layer, base)
    if is_embedding(module):
      wrapper = _lookup_only(wrapper, base)
    setattr(module, attr, wrapper)


def _lookup_only(wrapper: Any, base: Any) -> Any:
  """An embedding's hook for its lookup only: ``attend`` promotes two arrays
  (the query and the table) and passes through (its product is a site)."""

  def promote(arrays, **kwargs):
    fn = wrapper if len(arrays) == 1 else base
    return fn(arrays, **kwargs)

  return promote


def layer_paths(model: nnx.Module, sample_input: Any = None) -> list[str]:
  """Returns the paths of the model's addressable layers in forward order.

  See :func:`model_layers` for the arguments.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qsync_jax as qs
    >>> x = jax.ShapeDtypeStruct((1, 4), jnp.float32)
    >>> qs.layer_paths(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), x)
    ['Linear']
  """
  return [layer.path for layer in model_layers(model, sample_input)]


def resolve_layers(
  layer_list: list[Layer], plan: PrecisionPlan, device_kind: str | None = None
) -> dict[str, Precision]:
  """Like :func:`effective_precisions`, for layers already listed."""
  floored = {
    layer.path
    for layer in layer_list
    if isinstance(layer.module, SIXTEEN_BIT_FLOOR)
    or getattr(layer.module, "in_embedding", False)
  }
  soft = {
    layer.path
    for layer in layer_list
    if intercept.is_site(layer.module) and layer.module.floored
  }
  effective = resolve_with_forced(
    [layer.path for layer in layer_list], floored, plan, soft_floored=soft
  )
  if device_kind is not None:
    PrecisionPlan.from_precisions(effective).validate_for(
      device_kind, list(effective)
    )
  return effective


def effective_precisions(
  model: nnx.Module,
  plan: PrecisionPlan,
  sample_input: Any = None,
  *,
  device_kind: str | None = None,
) -> dict[str, Precision]:
  """Returns the precision each layer computes at under ``plan``.

  This is ``plan.resolve(layer_paths(model))`` with the forced precisions of
  the module docstring applied (head FP32 unless named, 16-bit floors).

  Args:
    model: an NNX module.
    plan: the precision plan.
    sample_input: see :func:`model_layers`.
    device_kind: if given, every precision must be native to this kind.

  Raises:
    PlanError: a rule matches no layer, a rule puts a 16-bit-floored layer
      below 16 bits, or the device kind lacks a precision.
  """
  return resolve_layers(model_layers(model, sample_input), plan, device_kind)


def apply_plan(
  model: nnx.Module,
  plan: PrecisionPlan,
  sample_input: Any = None,
  *,
  device_kind: str | None = None,
) -> nnx.Module:
  """Makes ``model`` compute with the plan's precisions, in place.

  Args:
    model: an NNX module; its parameters are left unchanged (FP32).
    plan: the precision plan; applying a new plan replaces the previous one.
    sample_input: see :func:`model_layers`.
    device_kind: if given, the plan is validated against this device kind.

  Returns:
    ``model`` itself (for chaining).

  Raises:
    PlanError: see :func:`effective_precisions`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qsync_jax as qs
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.hidden = nnx.Linear(4, 8, rngs=rngs)
    ...     self.out = nnx.Linear(8, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.out(jax.nn.relu(self.hidden(x)))
    >>> model, x = MLP(nnx.Rngs(0)), jax.ShapeDtypeStruct((1, 4), jnp.float32)
    >>> qs.layer_paths(model, x)
    ['hidden', 'out']
    >>> plan = qs.PrecisionPlan([("hidden", "int8")])
    >>> model = qs.apply_plan(model, plan, x, device_kind="t4")
    >>> print(qs.describe(model, plan, x))  # the head stays FP32
    layer   kind          precision
    hidden  Linear        int8
    out     Linear        fp32
  """
  layer_list = model_layers(model, sample_input)
  set_precisions(
    layer_list, resolve_layers(layer_list, plan, device_kind), plan.quant
  )
  return model


def set_precisions(
  layer_list: list[Layer], precisions: dict[str, Precision], quant: QuantConfig
) -> None:
  """Sets each listed layer's op to compute at ``precisions[path]``."""
  for layer in layer_list:
    prec = precisions[layer.path]
    module = layer.module
    if is_embedding(module):
      # An Embed (or its proxy) holds its compute and parameter dtypes.
      module.dtype = embed_dtype(prec, module.param_dtype)  # type: ignore[attr-defined]
    else:
      attr, op_cls = op_attribute(module)
      setattr(module, attr, op_cls(prec, quant))


def describe(
  model: nnx.Module, plan: PrecisionPlan, sample_input: Any = None
) -> str:
  """Returns a readable table: layer path, kind, precision under ``plan``."""
  layer_list = model_layers(model, sample_input)
  effective = resolve_layers(layer_list, plan)
  width = max(len(layer.path) for layer in layer_list)
  kinds = max(13, *(len(layer.kind) for layer in layer_list))
  rows = [f"{'layer':<{width}}  {'kind':<{kinds}} precision"]
  rows += [
    f"{layer.path:<{width}}  {layer.kind:<{kinds}} "
    f"{effective[layer.path].value}"
    for layer in layer_list
  ]
  return "\n".join(rows)
