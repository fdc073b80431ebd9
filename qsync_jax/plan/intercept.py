"""The contractions a model computes with jax ops, found and routed to sites.

Flax layers with an injectable op (``nnx.Linear``'s ``dot_general``,
``nnx.Conv``'s ``conv_general_dilated``, ``nnx.Einsum``'s ``einsum_op``, and
their Linen counterparts through the bridge's proxies) are planned through
that attribute. Every other contraction is found here, as google/qwix finds
them: the jax ops themselves are intercepted while a model runs.

* The bottom ops, ``lax.dot_general`` and ``lax.conv_general_dilated``, and
  the entry points built on them (``jnp.einsum``, ``jnp.matmul`` and ``@``,
  ``jnp.dot``, ``jnp.tensordot``, ``jnp.inner``, ``jnp.vdot``, ``lax.dot``,
  ``lax.batch_matmul``, ``lax.conv``, ``lax.conv_transpose``,
  ``jax.nn.dot_product_attention``, computed as its XLA implementation
  does) are patched
  once per process, the first time a model's layers are listed. A plain
  function has its ``__code__`` replaced, so every alias of it is caught
  (``from jax.lax import dot_general`` included); a jitted one (``jnp.matmul``)
  is replaced in its module, where ``@`` looks it up too.
* An intercepted call belongs to the nearest module on the Python stack (the
  nearest frame whose ``self`` is an NNX or Linen module). Calls from inside
  jax's own functions, and calls in the layers planned through an attribute,
  pass through unchanged, as does everything while no site is being run.
* An entry point runs its own implementation with jit disabled, so that each
  of its bottom ops is seen every time (a jitted ``jnp.matmul`` would
  otherwise be traced once per shape and its result reused for every site).
* Each contraction of one call of a module is numbered in call order and
  named by the entry point it came through: ``einsum_0``, ``matmul_1``...
  The site with that name is a small module (:class:`DotSite`,
  :class:`ConvSite`) attached to the owning module; its hook attribute
  (``dot_general`` / ``conv_general_dilated``) is what a plan replaces, as for
  the flax layers. A call with no site computes as written.

:func:`discover` runs a model once and reports every intercepted
contraction, with the module path of its owner and whether each operand
depends on the model's inputs (two activations: the attention-score kind).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import inspect
import sys
import threading
import types
from typing import Any, TypeGuard
import warnings

from flax import nnx
import flax.linen as nn
import jax
from jax import lax
from jax.extend import core as jex_core
import jax.numpy as jnp


class DotSite(nnx.Module):
  """A contraction a module computes through ``lax.dot_general``.

  Attributes:
    kind: the entry point it came through (``"einsum"``, ``"matmul"``...).
    floored: both operands are activations (the 16-bit floor applies
      unless a rule names the site).
    collapsed: the site stands for its whole flax layer (one contraction in
      a flax layer class) and is named by the layer's path.
    in_embedding: the site is an embedding's ``attend`` (a tied head): the
      16-bit floor holds even where a rule names it.
    dot_general: the op the contraction runs; a plan replaces it.
  """

  hook = "dot_general"

  def __init__(
    self, kind: str, floored: bool, collapsed: bool, in_embedding: bool
  ):
    self.kind = kind
    self.floored = floored
    self.collapsed = collapsed
    self.in_embedding = in_embedding
    self.dot_general: Callable[..., jax.Array] = _ORIGINAL_DOT_GENERAL


class ConvSite(nnx.Module):
  """A contraction a module computes through ``lax.conv_general_dilated``.

  Attributes are those of :class:`DotSite`, with the op in
  ``conv_general_dilated``.
  """

  hook = "conv_general_dilated"

  def __init__(
    self, kind: str, floored: bool, collapsed: bool, in_embedding: bool
  ):
    self.kind = kind
    self.floored = floored
    self.collapsed = collapsed
    self.in_embedding = in_embedding
    self.conv_general_dilated: Callable[..., jax.Array] = _ORIGINAL_CONV


SITE_TYPES = (DotSite, ConvSite)


def _clone(fn: types.FunctionType) -> types.FunctionType:
  """A new function object with ``fn``'s code, so it survives the patch."""
  out = types.FunctionType(
    fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
  )
  out.__kwdefaults__ = fn.__kwdefaults__
  out.__doc__, out.__qualname__ = fn.__doc__, fn.__qualname__
  return out


# The unpatched bottom ops: a site's default op, and what a passing call runs.
_ORIGINAL_DOT_GENERAL = _clone(lax.dot_general)  # type: ignore[arg-type]
_ORIGINAL_CONV = _clone(lax.conv_general_dilated)  # type: ignore[arg-type]

# Entry points: (module, attribute, label). Labels name the sites.
_JNP_ENTRIES = (
  ("einsum", "einsum"),
  ("matmul", "matmul"),
  ("dot", "dot"),
  ("tensordot", "tensordot"),
  ("inner", "inner"),
  ("vdot", "vdot"),
  ("matvec", "matmul"),
  ("vecmat", "matmul"),
  ("vecdot", "dot"),
)
_LAX_ENTRIES = (
  ("dot", "dot"),
  ("batch_matmul", "matmul"),
  ("conv", "conv"),
  ("conv_with_general_padding", "conv"),
  ("conv_transpose", "conv_transpose"),
)
# Where jax's array operators look ``matmul`` up (``x @ w``).
_OPERATOR_MODULE = "jax._src.numpy.tensor_contractions"
# Frames that only forward an operator to its function.
_FORWARDING_MODULES = frozenset(
  {
    __name__,
    "jax._src.numpy.array_methods",
    "jax._src.core",
    "jax._src.array",
  }
)
#: Site kinds that are convolutions (their op is ``conv_general_dilated``).
CONV_KINDS = frozenset({"conv", "conv_transpose"})


@dataclasses.dataclass
class _ThreadState:
  handling: bool = False
  # (label, owner, frame) of the entry point running, if any.
  entry: tuple[str, Any, Any] | None = None
  # id(owner) -> [call frame, owner, next index].
  counters: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
  discovery: Discovery | None = None
  # The bridge's LinenModels running (innermost last): where Linen sites live.
  linen_models: list[Any] = dataclasses.field(default_factory=list)


_LOCAL = threading.local()
_INSTALL_LOCK = threading.Lock()
_INSTALLED: list[Any] = []  # the trampolines' code objects, once installed
_KNOWN: list[tuple[type, ...]] = [()]


def _state() -> _ThreadState:
  s = getattr(_LOCAL, "state", None)
  if s is None:
    s = _LOCAL.state = _ThreadState()
  return s


def _trampoline_code(fn: types.FunctionType, hook_name: str) -> types.CodeType:
  """Code with ``fn``'s signature that calls ``hook_name(*args, **kwargs)``.

  The function object keeps its defaults; only its body changes.
  """
  parameters = list(inspect.signature(fn).parameters.values())
  last_positional_only = max(
    (i for i, p in enumerate(parameters) if p.kind is p.POSITIONAL_ONLY),
    default=-1,
  )
  varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
  params, call, star = [], [], False
  for i, p in enumerate(parameters):
    if p.kind is p.VAR_POSITIONAL:
      params.append(f"*{p.name}")
      call.append(f"*{p.name}")
      star = True
    elif p.kind is p.VAR_KEYWORD:
      params.append(f"**{p.name}")
      call.append(f"**{p.name}")
    elif p.kind is p.KEYWORD_ONLY:
      if not star:
        params.append("*")
        star = True
      params.append(p.name)
      call.append(f"{p.name}={p.name}")
    else:
      params.append(p.name)
      # Past the two operands, by keyword: a site's op need not take the
      # original's every optional argument positionally.
      by_keyword = p.kind is p.POSITIONAL_OR_KEYWORD and i >= 2 and not varargs
      call.append(f"{p.name}={p.name}" if by_keyword else p.name)
    if i == last_positional_only:
      params.append("/")
  source = (
    f"def {fn.__name__}({', '.join(params)}):\n"
    f"  return {hook_name}({', '.join(call)})\n"
  )
  namespace: dict[str, Any] = {}
  exec(source, namespace)
  return namespace[fn.__name__].__code__


def _patch(module: Any, attr: str, handler: Callable[..., Any]) -> None:
  fn = getattr(module, attr, None)
  if fn is None:
    return
  if isinstance(fn, types.FunctionType) and not fn.__code__.co_freevars:
    original = _clone(fn)
    hook_name = f"_qsync_jax_intercepted_{attr}"
    fn.__globals__[hook_name] = functools.partial(handler, original)
    fn.__code__ = _trampoline_code(fn, hook_name)
    _INSTALLED.append(fn.__code__)
    return
  # A jitted function: replace it where it is looked up.
  original = fn

  @functools.wraps(fn)
  def replaced(*args, **kwargs):
    return handler(original, *args, **kwargs)

  setattr(module, attr, replaced)
  operators = sys.modules.get(_OPERATOR_MODULE)
  if operators is not None and getattr(operators, attr, None) is fn:
    setattr(operators, attr, replaced)


def install(known: Sequence[type]) -> None:
  """Patches the jax contraction ops (once per process).

  Args:
    known: module types planned through an attribute; their calls pass.
  """
  with _INSTALL_LOCK:
    _KNOWN[0] = (*_KNOWN[0], *(t for t in known if t not in _KNOWN[0]))
    if _INSTALLED:
      return
    _patch(lax, "dot_general", functools.partial(_bottom, "dot_general"))
    _patch(lax, "conv_general_dilated", functools.partial(_bottom, "conv"))
    for attr, label in _JNP_ENTRIES:
      _patch(jnp, attr, functools.partial(_entry, label))
    for attr, label in _LAX_ENTRIES:
      _patch(lax, attr, functools.partial(_entry, label))
    _patch(jax.nn, "dot_product_attention", _attention_entry)


def _module_name(frame) -> str:
  return frame.f_globals.get("__name__", "")


def _caller(frame):
  """The first frame outside this module, the trampolines and forwarders."""
  while frame is not None and (
    _module_name(frame) in _FORWARDING_MODULES or frame.f_code in _INSTALLED
  ):
    frame = frame.f_back
  return frame


def _is_jax_internal(frame) -> bool:
  name = _module_name(frame)
  return name == "jax" or name.startswith(("jax.", "jaxlib"))


def _frame_module(frame) -> Any:
  owner = frame.f_locals.get("self")
  return owner if isinstance(owner, (nnx.Module, nn.Module)) else None


def _owner(frame) -> tuple[Any, Any]:
  """(owning module, the outermost frame of its current call) or (None, None).

  The owner is the nearest module on the stack; a contraction in a layer
  planned through an attribute (or in a site's own op) has no owner here.
  """
  while frame is not None and _frame_module(frame) is None:
    frame = frame.f_back
  if frame is None:
    return None, None
  owner = _frame_module(frame)
  if isinstance(owner, (*_KNOWN[0], *SITE_TYPES)):
    return None, None
  call_frame, frame = frame, frame.f_back
  while frame is not None:
    module = _frame_module(frame)
    if module is owner:
      call_frame = frame
    elif module is not None:
      break
    frame = frame.f_back
  return owner, call_frame


def _next_name(s: _ThreadState, label: str, owner: Any, frame: Any) -> str:
  record = s.counters.get(id(owner))
  if record is None or record[0] is not frame or record[1] is not owner:
    if len(s.counters) > 256:  # bounded: frames of finished calls
      s.counters.clear()
    record = s.counters[id(owner)] = [frame, owner, 0]
  index = record[2]
  record[2] += 1
  return f"{label}_{index}"


def _entry(label: str, original: Callable[..., Any], *args, **kwargs):
  s = _state()
  if s.handling or s.entry is not None:
    return original(*args, **kwargs)
  caller = _caller(sys._getframe(1))
  if caller is None or _is_jax_internal(caller):
    return original(*args, **kwargs)
  owner, frame = _owner(caller)
  if owner is None:
    return original(*args, **kwargs)
  s.entry = (label, owner, frame)
  try:
    # Each bottom op of the entry point is seen on every call.
    with jax.disable_jit():
      return original(*args, **kwargs)
  finally:
    s.entry = None


def _grouped(t: jax.Array | None, k: int, g: int) -> jax.Array | None:
  """A ``(B, N, T, S)`` bias or mask as ``(B, K, G, T, S)``."""
  if t is None:
    return None
  t = jnp.asarray(t)
  if t.ndim < 4:
    t = t.reshape((1,) * (4 - t.ndim) + t.shape)
  b, n, q, s = t.shape
  if n == 1:
    return t[:, :, None]
  return t.reshape(b, k, g, q, s)


def _attention_as_written(
  query, key, value, bias=None, mask=None, *, scale=None, is_causal=False
) -> jax.Array:
  """``jax.nn.dot_product_attention``'s XLA computation, without its vmap.

  The two ``jnp.einsum`` calls are the sites ``attention_0`` (scores) and
  ``attention_1`` (the weighted values); masking and the FP32 softmax follow
  jax's implementation.
  """
  batch, q_len, heads, depth = query.shape
  kv_heads = key.shape[2]
  groups = heads // kv_heads
  if scale is None:
    scale = depth**-0.5
  grouped = jnp.reshape(query, (batch, q_len, kv_heads, groups, depth))
  logits_dtype = jnp.promote_types(query.dtype, jnp.float32)
  logits = jnp.einsum(
    "BTKGH,BSKH->BKGTS", grouped, key, preferred_element_type=logits_dtype
  )
  logits *= jnp.array(scale, dtype=logits.dtype)
  bias = _grouped(bias, kv_heads, groups)
  if bias is not None:
    logits = (logits + bias).astype(logits.dtype)
  keep = _grouped(mask, kv_heads, groups)
  if is_causal:
    causal = jnp.tril(jnp.ones(logits.shape[-2:], dtype=bool))
    keep = causal if keep is None else jnp.logical_and(keep, causal)
  if keep is not None:
    large_negative = jnp.asarray(-0.7 * jnp.finfo(logits.dtype).max)
    logits = jnp.where(keep, logits, large_negative.astype(logits.dtype))
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(key.dtype)
  encoded = jnp.einsum("BKGTS,BSKH->BTKGH", probs, value)
  return jnp.reshape(encoded, (batch, q_len, heads, depth))


# Arguments of jax.nn.dot_product_attention that its computation here lacks.
_ATTENTION_UNSUPPORTED = (
  "query_seq_lengths",
  "key_value_seq_lengths",
  "local_window_size",
  "return_residual",
)


def _attention_entry(original: Callable[..., Any], *args, **kwargs):
  """``jax.nn.dot_product_attention``: its two matmuls become sites.

  It computes as its XLA implementation does (:func:`_attention_as_written`)
  where a module calls it and the arguments allow; otherwise as jax wrote
  it, its matmuls not planned.
  """
  s = _state()
  if s.handling or s.entry is not None:
    return original(*args, **kwargs)
  caller = _caller(sys._getframe(1))
  if caller is None or _is_jax_internal(caller):
    return original(*args, **kwargs)
  owner, frame = _owner(caller)
  if owner is None:
    return original(*args, **kwargs)
  unsupported = [k for k in _ATTENTION_UNSUPPORTED if kwargs.get(k)]
  if unsupported or kwargs.get("implementation") not in (None, "xla"):
    warnings.warn(
      f"jax.nn.dot_product_attention in {type(owner).__name__} with "
      f"{', '.join(unsupported) or 'implementation=' + kwargs['implementation']}"
      " computes as jax wrote it: a plan does not reach its matmuls",
      stacklevel=2,
    )
    s.handling = True
    try:
      return original(*args, **kwargs)
    finally:
      s.handling = False
  kwargs.pop("implementation", None)
  for k in _ATTENTION_UNSUPPORTED:
    kwargs.pop(k, None)
  s.entry = ("attention", owner, frame)
  try:
    with jax.disable_jit():
      return _attention_as_written(*args, **kwargs)
  finally:
    s.entry = None


def _is_real_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _bottom(label: str, original: Callable[..., Any], *args, **kwargs):
  s = _state()
  if s.handling:
    return original(*args, **kwargs)
  if s.entry is not None:
    label, owner, frame = s.entry
  else:
    caller = _caller(sys._getframe(1))
    if caller is None or _is_jax_internal(caller):
      return original(*args, **kwargs)
    owner, frame = _owner(caller)
    if owner is None:
      return original(*args, **kwargs)
  if not all(_is_real_float(a) for a in args[:2]):
    # Integer or complex operands: no precision applies, not a site.
    return original(*args, **kwargs)
  name = _next_name(s, label, owner, frame)
  if s.discovery is not None:
    return s.discovery.record(owner, name, label, original, args, kwargs)
  site = _lookup(s, owner, name)
  if site is None:
    return original(*args, **kwargs)
  s.handling = True
  try:
    with jax.disable_jit(False):
      return getattr(site, site.hook)(*args, **kwargs)
  finally:
    s.handling = False


def _lookup(s: _ThreadState, owner: Any, name: str) -> Any:
  if isinstance(owner, nn.Module):
    if not s.linen_models or owner.scope is None:
      return None
    key = "/".join((*owner.path, name))
    site = s.linen_models[-1].proxies.get(key)
  else:
    site = getattr(owner, name, None)
  if isinstance(site, SITE_TYPES):
    return site
  if site is not None:
    warnings.warn(
      f"{type(owner).__name__}.{name} is not a contraction site; the "
      "contraction computes as written",
      stacklevel=3,
    )
  return None


class linen_scope:
  """Marks ``model`` (a bridge LinenModel) as the home of Linen sites."""

  def __init__(self, model: Any):
    self.model = model

  def __enter__(self) -> None:
    _state().linen_models.append(self.model)

  def __exit__(self, *exc: Any) -> None:
    _state().linen_models.pop()


def is_site(module: Any) -> TypeGuard[DotSite | ConvSite]:
  """Whether ``module`` is an intercepted contraction's site."""
  return isinstance(module, SITE_TYPES)


# --------------------------------------------------------------------------
# Discovery.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Found:
  """One intercepted contraction of a traced call.

  Attributes:
    owner_path: the owning module's path (a tuple of attribute names; for a
      Linen module, its bridge's path followed by the Linen path).
    name: the site's name within the owner (``"einsum_0"``).
    kind: the entry point (``"einsum"``, ``"matmul"``, ``"conv"``...).
    flax_layer: the owner is one of flax's own layer classes.
    in_embedding: the owner is an embedding (``attend``: a tied head), which
      keeps the embeddings' 16-bit floor.
    linen_path: for a Linen owner, its path within the bridge.
    operands_from_inputs: per contracted operand, whether it depends on the
      model's inputs (None where the trace could not tell).
  """

  owner_path: tuple[str, ...]
  name: str
  kind: str
  flax_layer: bool
  in_embedding: bool = False
  linen_path: tuple[str, ...] | None = None
  operands_from_inputs: list[bool] | None = None

  @property
  def linen(self) -> bool:
    """The owner is a Linen module (its site lives in the bridge)."""
    return self.linen_path is not None

  @property
  def site_key(self) -> tuple[tuple[str, ...], str]:
    """``(owner path, name)``: the site's key in the model."""
    return self.owner_path, self.name

  @property
  def floored(self) -> bool:
    """Both operands are activations (or the trace could not tell), or the
    owner is an embedding."""
    deps = self.operands_from_inputs
    return self.in_embedding or deps is None or all(deps)


class StackedLayerError(ValueError):
  """A contraction runs under a transform that stacks its module."""


class Discovery:
  """Records the intercepted contractions of one traced call.

  Args:
    on_site: called with each :class:`Found` as it is met (forward order).
  """

  def __init__(self, on_site: Callable[[Found], None]):
    self.on_site = on_site
    self.found: list[Found] = []
    self.paths: dict[int, tuple[str, ...]] = {}
    self.linen_prefix: dict[int, tuple[str, ...]] = {}

  def set_model(self, model: nnx.Module) -> None:
    """Names the modules of the traced copy of the model by their paths."""
    self.paths = {
      id(node): tuple(map(str, path))
      for path, node in nnx.iter_graph(model)
      if isinstance(node, nnx.Module)
    }

  def _owner_path(
    self, owner: Any
  ) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    if isinstance(owner, nn.Module):
      models = _state().linen_models
      prefix = self.paths.get(id(models[-1])) if models else None
      if prefix is None or owner.scope is None:
        raise StackedLayerError(
          f"a contraction in the Linen module {type(owner).__name__} ran "
          "outside the bridge's call; wrap the model with "
          "qsync_jax.from_linen"
        )
      return (*prefix, *owner.path), tuple(owner.path)
    path = self.paths.get(id(owner))
    if path is None:
      raise StackedLayerError(
        f"a contraction in {type(owner).__name__} runs under an NNX "
        "transform inside the model (nnx.scan, nnx.vmap, nnx.remat...), "
        "whose copies of the module a plan cannot address one by one; "
        "call the layers in a Python loop (e.g. over an nnx.List of "
        "blocks) to plan them"
      )
    return path, None

  def record(self, owner, name, label, original, args, kwargs):
    """Records one contraction and computes it, marked for the trace."""
    path, linen_path = self._owner_path(owner)
    found = Found(
      owner_path=path,
      name=name,
      kind=label,
      flax_layer=type(owner).__module__.startswith("flax."),
      in_embedding=isinstance(owner, (nnx.Embed, nn.Embed)),
      linen_path=linen_path,
    )
    index = len(self.found)
    self.found.append(found)
    self.on_site(found)

    def body(lhs, rhs):
      return original(lhs, rhs, *args[2:], **kwargs)

    body.__name__ = f"qsync_site_{index}"
    s = _state()
    s.handling = True
    try:
      with jax.disable_jit(False):
        return jax.jit(body)(args[0], args[1])
    finally:
      s.handling = False

  def mark_dependence(self, jaxpr: Any, input_vars: Sequence[Any]) -> None:
    """Sets each site's ``operands_from_inputs`` from the traced program."""
    deps: set[Any] = set(input_vars)
    _walk(jaxpr, deps, self.found)


def _walk(jaxpr: Any, deps: set[Any], found: list[Found]) -> None:
  for eqn in jaxpr.eqns:
    inputs = [isinstance(v, jex_core.Var) and v in deps for v in eqn.invars]
    name = str(eqn.params.get("name", ""))
    if name.startswith("qsync_site_"):
      index = int(name.rsplit("_", 1)[1])
      if index < len(found):
        found[index].operands_from_inputs = inputs[:2]
    else:
      for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
          _walk(inner, {v for v, d in zip(inner.invars, inputs) if d}, found)
    if any(inputs):
      deps.update(eqn.outvars)


def make_sites(found: Sequence[Found]) -> list[DotSite | ConvSite]:
  """A new site per found contraction.

  A site is *collapsed* (listed by its owner's path) when its owner is one of
  flax's layer classes with that one contraction (``nnx.ConvTranspose``,
  ``nn.Einsum``), but not in an embedding, whose own path is its lookup.
  """
  names: dict[tuple[str, ...], set[str]] = {}
  for f in found:
    names.setdefault(f.owner_path, set()).add(f.name)
  sites: list[DotSite | ConvSite] = []
  for f in found:
    collapsed = (
      f.flax_layer and len(names[f.owner_path]) == 1 and not f.in_embedding
    )
    site_type = ConvSite if f.kind in CONV_KINDS else DotSite
    sites.append(site_type(f.kind, f.floored, collapsed, f.in_embedding))
  return sites


def site_path(
  owner_path: Sequence[str], name: str, site: Any, root: str
) -> str:
  """The layer path of a site: ``owner/name``, or the owner's path when
  collapsed (``root``, the root module's name, for a collapsed root)."""
  if site.collapsed:
    return "/".join(owner_path) or root
  return "/".join((*owner_path, name))


def discovering(discovery: Discovery | None):
  """Context manager: intercepted contractions are recorded, not planned."""
  return _Discovering(discovery)


class _Discovering:
  def __init__(self, discovery: Discovery | None):
    self.discovery = discovery

  def __enter__(self) -> None:
    s = _state()
    self.saved = s.discovery
    s.discovery = self.discovery
    s.counters.clear()

  def __exit__(self, *exc: Any) -> None:
    s = _state()
    s.discovery = self.saved
    s.counters.clear()
