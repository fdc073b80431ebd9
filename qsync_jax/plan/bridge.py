"""Linen models as NNX modules that precision plans can address.

The library's machinery (layer listing, :func:`~qsync_jax.plan.policy.apply_plan`,
the indicator, the predictor, the trainer) works on NNX modules by swapping
layer attributes. This module owns the bridge that gives a Linen model the
same surface:

* :class:`LinenModel` is an NNX module that holds a Linen module's variables
  (``params`` as ``nnx.Param``, ``batch_stats`` as ``nnx.BatchStat``, other
  collections as the ``nnx.Variable`` subclass flax registers for their
  name) and applies the Linen module on them;
* for every addressable Linen layer (``nn.Dense``, ``nn.DenseGeneral``,
  ``nn.Conv``, ``nn.Embed``) it holds one :class:`LayerProxy`, a small NNX
  module with the attributes an NNX layer exposes (``promote_dtype``, the op
  ``dot_general`` / ``conv_general_dilated``, ``dtype`` / ``param_dtype``, the
  weight variables) and a ``kind`` (``"Linear"``, ``"LinearGeneral"``,
  ``"Conv"``, ``"Embed"``). While the Linen module runs, a method
  interceptor hands each layer its proxy's attributes for that call, so
  whatever the library writes into a proxy is what the layer computes with;
* :func:`from_linen` builds a :class:`LinenModel` from a Linen module or
  from an ``(init, apply)`` pair of functions.

Layer paths are the Linen module paths (``"Conv_0"``, ``"block1/Dense_0"``)
when the :class:`LinenModel` is the root, prefixed by its attribute path
when it is nested in an NNX module (:mod:`qsync_jax.plan.policy`).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import inspect
from typing import Any

from flax import core as flax_core
from flax import nnx
import flax.linen as nn
from flax.linen import dtypes as linen_dtypes
from flax.nnx.bridge import variables as bridge_vars
from flax.nnx.nn import dtypes as nnx_dtypes
import jax
from jax import lax
import jax.numpy as jnp

from qsync_jax.plan import intercept
from qsync_jax.plan import linen as linen_plan
from qsync_jax.task import calling
from qsync_jax.task import sharding

# Call keywords that carry a Linen module's mode, and whether they are the
# negation of "train" (flax's Dropout / BatchNorm conventions).
_TRAIN_KEYWORDS = (
  ("train", False),
  ("training", False),
  ("is_training", False),
  ("deterministic", True),
  ("use_running_average", True),
)
# Linen layer type -> (proxy kind, op attribute or None for an embedding).
# DenseGeneral first: the lookup takes the first isinstance match.
_KINDS = (
  (nn.DenseGeneral, "LinearGeneral", "dot_general"),
  (nn.Dense, "Linear", "dot_general"),
  (nn.Conv, "Conv", "conv_general_dilated"),
  (nn.Embed, "Embed", None),
)
# The weights a proxy exposes, as NNX layers name them.
_WEIGHTS = ("kernel", "bias", "embedding")


def _tuple_promote(
  fn: Callable[..., Any],
  args: tuple,
  /,
  *,
  dtype: Any = None,
  inexact: bool = True,
) -> tuple:
  """A Linen ``promote_dtype(*args)`` in NNX's ``promote_dtype(args)`` form."""
  return tuple(fn(*args, dtype=dtype, inexact=inexact))


class LayerProxy(nnx.Module):
  """The NNX face of one addressable Linen layer.

  It is never called: :class:`LinenModel` reads its attributes while the
  Linen layer runs. Its weights are the very variables the
  :class:`LinenModel` holds (shared references, no copies).

  Attributes:
    linen_path: the Linen module path joined by ``/``.
    kind: ``"Linear"``, ``"LinearGeneral"``, ``"Conv"`` or ``"Embed"``.
    promote_dtype: NNX-style ``promote_dtype(arrays, dtype=, inexact=)``.
    dtype: the layer's computation dtype (None: inferred).
    param_dtype: the layer's parameter dtype.
    kernel, bias, embedding: the layer's weight variables (None if absent).
  """

  def __init__(
    self,
    linen_path: str,
    kind: str,
    layer: nn.Module,
    weights: dict[str, nnx.Variable],
  ):
    self.linen_path = linen_path
    self.kind = kind
    own = layer.promote_dtype
    # Linen's default promote_dtype is NNX's with another signature; a
    # user's own is kept, adapted to NNX's tuple form.
    self.promote_dtype = (
      nnx_dtypes.promote_dtype
      if own is linen_dtypes.promote_dtype
      else functools.partial(_tuple_promote, own)
    )
    self.dtype = layer.dtype
    self.param_dtype = layer.param_dtype
    for name in _WEIGHTS:
      setattr(self, name, weights.get(name))

  def layer_attributes(self) -> dict[str, Any]:
    """The Linen layer attributes this proxy sets for one call."""
    promote = self.promote_dtype
    return {
      "promote_dtype": lambda *args, dtype=None, inexact=True: list(
        promote(tuple(args), dtype=dtype, inexact=inexact)
      ),
      "dtype": self.dtype,
    }


class DenseProxy(LayerProxy):
  """Proxy of an ``nn.Dense`` / ``nn.DenseGeneral``: computes through
  ``dot_general``."""

  def __init__(
    self,
    linen_path: str,
    kind: str,
    layer: nn.Module,
    weights: dict[str, nnx.Variable],
  ):
    super().__init__(linen_path, kind, layer, weights)
    self.dot_general = layer.dot_general or lax.dot_general

  def layer_attributes(self) -> dict[str, Any]:
    return {
      **super().layer_attributes(),
      "dot_general": self.dot_general,
      "dot_general_cls": None,
    }


class ConvProxy(LayerProxy):
  """Proxy of an ``nn.Conv``: computes through ``conv_general_dilated``."""

  def __init__(
    self,
    linen_path: str,
    kind: str,
    layer: nn.Module,
    weights: dict[str, nnx.Variable],
  ):
    super().__init__(linen_path, kind, layer, weights)
    self.conv_general_dilated = (
      layer.conv_general_dilated or lax.conv_general_dilated
    )

  def layer_attributes(self) -> dict[str, Any]:
    return {
      **super().layer_attributes(),
      "conv_general_dilated": self.conv_general_dilated,
      "conv_general_dilated_cls": None,
    }


class EmbedProxy(LayerProxy):
  """Proxy of an ``nn.Embed``: a plan sets the ``dtype`` of its table."""


_PROXY_FOR_KIND = {
  "Linear": DenseProxy,
  "LinearGeneral": DenseProxy,
  "Conv": ConvProxy,
  "Embed": EmbedProxy,
}


def _kind_of(layer: nn.Module) -> str | None:
  """The proxy kind of a Linen layer, None if a plan cannot address it."""
  for layer_type, kind, attr in _KINDS:
    if isinstance(layer, layer_type):
      # A layer that builds its op from a class (dot_general_cls, e.g. AQT)
      # keeps it: the plan's op would silently replace the user's choice.
      if attr is not None and getattr(layer, f"{attr}_cls", None) is not None:
        return None
      if isinstance(layer, nn.Conv) and not layer.shared_weights:
        return None
      return kind
  return None


def train_keyword(fn: Callable[..., Any]) -> tuple[str, bool] | None:
  """``(name, negated)`` of the mode keyword ``fn`` takes, or None.

  Looks for ``train``, ``training``, ``is_training``, then ``deterministic``
  and ``use_running_average`` (these two are the negation of train).
  """
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return None
  for name, negated in _TRAIN_KEYWORDS:
    p = params.get(name)
    if p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
      return name, negated
  return None


def _accepts(fn: Callable[..., Any], name: str) -> bool:
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _rng_dict(rngs: Any) -> dict[str, jax.Array]:
  """Linen rngs from ``nnx.Rngs``, a key or a dict of keys.

  ``params`` and ``dropout`` are always there; Linen falls back to
  ``params`` for any other stream a module asks for and the dict lacks.
  """
  if isinstance(rngs, nnx.Rngs):
    keys = {name: stream() for name, stream in rngs.items()}
    keys.pop("default", None)
    keys.setdefault("params", rngs.params())
    keys.setdefault("dropout", rngs.dropout())
    return keys
  if isinstance(rngs, dict):
    return dict(rngs)
  if isinstance(rngs, jax.Array):
    return {"params": rngs, "dropout": jax.random.fold_in(rngs, 1)}
  raise ValueError(
    f"rngs must be nnx.Rngs, a jax key or a dict of keys, "
    f"got {type(rngs).__name__}"
  )


def _concrete(data: Any) -> Any:
  # Linen init needs arrays; a jax.ShapeDtypeStruct stands for zeros.
  return jax.tree.map(
    lambda a: (
      jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a
    ),
    data,
  )


def _nested_get(tree: dict, path: tuple[str, ...]) -> Any:
  node: Any = tree
  for part in path:
    node = node.get(part) if isinstance(node, dict) else None
    if node is None:
      return None
  return node


def _linen_var(variable: nnx.Variable) -> Any:
  """A variable as the Linen module reads it.

  A sharding box (``nn.Partitioned``, ``nn.LogicallyPartitioned``) names
  only the axes the mesh in context keeps (:mod:`qsync_jax.task.sharding`),
  so Linen's constraint on reading it names no axis the mesh lacks; a box
  that keeps none is its bare value.
  """
  if (
    variable.get_metadata("linen_meta_type", None) is None
    or variable.get_metadata("out_sharding", None) is None
  ):
    return bridge_vars.to_linen_var(variable)
  names = sharding.kept_names(variable)
  if names is None:
    return variable.get_value()
  if names != tuple(variable.get_metadata("out_sharding")):
    variable = variable.replace(out_sharding=names)
  return bridge_vars.to_linen_var(variable)


class LinenModel(nnx.Module):
  """An NNX module that runs a Linen model on variables it holds.

  Call it like an NNX model: ``model(x)``, ``model(x, train=False)``,
  ``model(x, rngs=nnx.Rngs(1))``. ``train=None`` follows the module's own
  ``deterministic`` attribute, which ``model.train()`` / ``model.eval()``
  and :func:`qsync_jax.task.calling.mode` flip as they do for NNX layers.
  In train mode the non-parameter collections (``batch_stats``, ...) are
  mutable and their updates are written back into this module's variables.

  Attributes:
    linen_variables: ``{collection: nested dict of nnx.Variable}``.
    proxies: ``{Linen path: LayerProxy}`` of the addressable layers.
    deterministic: eval mode when True.
    batch_norm_momentum: if set, every ``nn.BatchNorm`` runs with this
      momentum (0: the running statistics become the batch's, as the
      trainer's re-estimation sets ``nnx.BatchNorm.momentum``).
    rngs: the module's own RNG streams (used when a call passes none).
  """

  def __init__(
    self,
    module: nn.Module | None,
    sample_input: Any,
    *,
    rngs: nnx.Rngs | int | jax.Array,
    init_fn: Callable[..., Any] | None = None,
    apply_fn: Callable[..., Any] | None = None,
    train_kwarg: str | None = "auto",
  ):
    """Initializes the Linen variables on ``sample_input``.

    Args:
      module: the Linen module, or None with ``init_fn`` and ``apply_fn``.
      sample_input: the model's inputs (see :mod:`qsync_jax.task.calling`);
        ``jax.ShapeDtypeStruct`` leaves stand for zeros.
      rngs: RNG streams (or a seed or key) for initialization; a fork stays
        in the module for dropout when a call passes none.
      init_fn: ``init(rngs_dict, *inputs, **train) -> variables``.
      apply_fn: ``apply(variables, *inputs, **train, rngs=, mutable=)``.
      train_kwarg: the keyword carrying the mode (``"train"``,
        ``"training"``, ``"is_training"``, or ``"deterministic"`` /
        ``"use_running_average"``, passed negated), None for none, or
        ``"auto"``: found in ``module.__call__``'s (or ``apply_fn``'s)
        signature.

    Raises:
      ValueError: neither a module nor both functions, or an unknown
        ``train_kwarg``.
    """
    if not isinstance(rngs, nnx.Rngs):
      rngs = nnx.Rngs(rngs)  # a seed or a key
    if module is not None:
      if not isinstance(module, nn.Module):
        raise ValueError(
          f"module must be a flax.linen.Module, got {type(module).__name__}"
        )
      init_fn, apply_fn = module.init, module.apply
      signature_of = type(module).__call__
    elif init_fn is None or apply_fn is None:
      raise ValueError(
        "LinenModel needs a Linen module or both init_fn and apply_fn"
      )
    else:
      signature_of = apply_fn
    negations = dict(_TRAIN_KEYWORDS)
    if train_kwarg == "auto":
      self.train_kwarg = train_keyword(signature_of)
    elif train_kwarg is None:
      self.train_kwarg = None
    elif train_kwarg in negations:
      self.train_kwarg = (train_kwarg, negations[train_kwarg])
    else:
      raise ValueError(
        f"unknown train_kwarg {train_kwarg!r}; valid: 'auto', "
        f"None, {', '.join(map(repr, negations))}"
      )
    self.init_fn, self.apply_fn = init_fn, apply_fn
    # Linen's own apply takes rngs and mutable; a user's apply may not.
    self.passes_rngs = module is not None or _accepts(apply_fn, "rngs")
    self.passes_mutable = module is not None or _accepts(apply_fn, "mutable")
    self.deterministic = False
    self.batch_norm_momentum = None

    args, kwargs = calling.split_inputs(_concrete(sample_input))
    mode = self._mode_kwargs(train=True)
    layers: dict[str, tuple[str, nn.Module]] = {}

    def record(next_fun, call_args, call_kwargs, context):
      layer = context.module
      if context.method_name == "__call__":
        kind = _kind_of(layer)
        if kind is not None:
          layers.setdefault("/".join(layer.path), (kind, layer))
      return next_fun(*call_args, **call_kwargs)

    # Eager, not jitted: a compile per model costs more than the dispatch.
    # Sharding annotations are not applied while the variables are created
    # (no mesh, or one that lacks their axes, would fail): place() applies
    # their kept parts below.
    with nn.intercept_methods(record), sharding.creating():
      variables = flax_core.unfreeze(
        # mypy matches **mode against Module.init's own keywords too.
        init_fn(_rng_dict(rngs), *args, **kwargs, **mode)  # type: ignore[arg-type]
      )
      # Every collection becomes the nnx.Variable type flax registers for
      # its name ('params' -> Param, 'batch_stats' -> BatchStat, ...).
      self.linen_variables = nnx.data(
        {
          col: jax.tree.map(
            functools.partial(bridge_vars.to_nnx_var, col),
            tree,
            is_leaf=lambda x: not isinstance(x, dict),
          )
          for col, tree in variables.items()
        }
      )
    params = self.linen_variables.get("params", {})
    # NNX walks attributes in sorted order and 'linen_variables' sorts
    # before 'proxies': the shared weights keep their Linen paths in
    # nnx.state(model).
    self.proxies = nnx.data(
      {
        path: _PROXY_FOR_KIND[kind](
          path,
          kind,
          layer,
          {
            name: _nested_get(params, (*path.split("/"), name))
            for name in _WEIGHTS
          },
        )
        for path, (kind, layer) in layers.items()
      }
    )
    self.rngs = rngs.fork()
    sharding.place(self)

  def _mode_kwargs(self, train: bool) -> dict[str, bool]:
    if self.train_kwarg is None:
      return {}
    name, negated = self.train_kwarg
    return {name: (not train) if negated else train}

  def _interceptor(self):
    proxies, momentum = self.proxies, self.batch_norm_momentum

    def intercept(next_fun, call_args, call_kwargs, context):
      layer = context.module
      if momentum is not None and isinstance(layer, nn.BatchNorm):
        with linen_plan.temporarily(layer, momentum=momentum):
          return next_fun(*call_args, **call_kwargs)
      proxy = (
        proxies.get("/".join(layer.path))
        # An embedding's attend (a tied head) casts to the table's dtype.
        if context.method_name in ("__call__", "attend")
        and isinstance(layer, linen_plan.ADDRESSABLE_TYPES)
        else None
      )
      if proxy is None:
        return next_fun(*call_args, **call_kwargs)
      with linen_plan.temporarily(layer, **proxy.layer_attributes()):
        return next_fun(*call_args, **call_kwargs)

    return intercept

  def linen_vars(self) -> dict[str, Any]:
    """The variables as Linen takes them: ``{collection: nested arrays}``
    (boxed where the Linen module boxed them, see :func:`_linen_var`)."""
    return jax.tree.map(
      _linen_var,
      dict(self.linen_variables),
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    )

  def __call__(
    self, *args, train: bool | None = None, rngs: Any = None, **kwargs
  ) -> Any:
    """Applies the Linen module.

    Args:
      *args: the model's positional inputs.
      train: train mode (dropout on, batch statistics updated); None
        follows ``not self.deterministic``.
      rngs: ``nnx.Rngs``, a key or a dict of keys for the Linen rng streams
        (``dropout``, ...); by default the module's own streams in train
        mode and none in eval mode.
      **kwargs: the model's keyword inputs.

    Returns:
      The Linen module's output.
    """
    if train is None:
      train = not self.deterministic
    kwargs = {**self._mode_kwargs(train), **kwargs}
    if rngs is None and train:
      rngs = self.rngs  # eval draws none: its state stays untouched
    if self.passes_rngs and rngs is not None:
      kwargs["rngs"] = _rng_dict(rngs)
    held = [c for c in self.linen_variables if c != "params"]
    mutable = held if train and held and self.passes_mutable else False
    if mutable:
      kwargs["mutable"] = mutable
    with nn.intercept_methods(self._interceptor()), intercept.linen_scope(self):
      out = self.apply_fn(self.linen_vars(), *args, **kwargs)
    if not mutable:
      return out
    out, updates = out
    self._write_back(flax_core.unfreeze(updates))
    return out

  def _write_back(self, updates: dict[str, Any]) -> None:
    for col, tree in updates.items():
      held = self.linen_variables.get(col)
      flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: not isinstance(x, dict)
      )[0]
      for key_path, value in flat:
        path = tuple(k.key for k in key_path)
        variable = _nested_get(held, path) if held is not None else None
        if not isinstance(variable, nnx.Variable):
          raise ValueError(
            f"the Linen module created {col}/"
            f"{'/'.join(path)} after init; LinenModel holds "
            "only the variables init returns"
          )
        variable.set_value(nn.meta.unbox(value))


def from_linen(
  module_or_pair: Any,
  sample_input: Any,
  *,
  rngs: nnx.Rngs | int | jax.Array,
  train_kwarg: str | None = "auto",
) -> LinenModel:
  """Wraps a Linen model as an NNX module the whole library works on.

  Parameters boxed with sharding annotations (``nn.with_partitioning``,
  ``nn.with_logical_partitioning``) need no mesh: each keeps its annotation
  and is sharded over the axes of it the mesh in context has, if any
  (:mod:`qsync_jax.task.sharding`).

  Args:
    module_or_pair: a ``flax.linen.Module``, or an ``(init, apply)`` pair
      of functions: ``init(rngs, *inputs, **mode) -> variables`` with
      ``rngs`` a dict of keys (``params``, ``dropout``, ...), and
      ``apply(variables, *inputs, **mode, rngs=..., mutable=...)`` returning
      the output, or ``(output, updates)`` when it was passed ``mutable``
      (a list of collections, train mode only). ``mode`` is the
      ``train_kwarg`` keyword (e.g. ``train=True``); ``rngs`` and
      ``mutable`` are passed only if ``apply`` takes them (or ``**kwargs``).
      The pair's Linen layers are found while ``init`` runs, so ``apply``
      must call the same Linen modules.
    sample_input: the model's inputs (arrays or ``jax.ShapeDtypeStruct``;
      a tuple for several positional inputs, a dict for keyword inputs).
    rngs: RNG streams for initialization (and the model's own dropout
      streams).
    train_kwarg: see :class:`LinenModel`.

  Returns:
    The :class:`LinenModel`.

  Raises:
    ValueError: ``module_or_pair`` is neither a Linen module nor a pair of
      callables.
  """
  if isinstance(module_or_pair, nn.Module):
    return LinenModel(
      module_or_pair, sample_input, rngs=rngs, train_kwarg=train_kwarg
    )
  if is_linen(module_or_pair):
    init_fn, apply_fn = module_or_pair
    return LinenModel(
      None,
      sample_input,
      rngs=rngs,
      init_fn=init_fn,
      apply_fn=apply_fn,
      train_kwarg=train_kwarg,
    )
  raise ValueError(
    f"from_linen takes a flax.linen.Module or an (init, apply) "
    f"pair of functions, got {type(module_or_pair).__name__}"
  )


def is_linen(obj: Any) -> bool:
  """Whether :func:`from_linen` takes ``obj``: a Linen module or an
  ``(init, apply)`` pair of callables."""
  return isinstance(obj, nn.Module) or (
    isinstance(obj, (tuple, list))
    and len(obj) == 2
    and all(callable(f) for f in obj)
  )
