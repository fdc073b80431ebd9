"""The contractions a model computes with jax ops, found and routed to sites.

Flax layers with an injectable op (``nnx.Linear``'s ``dot_general``,
``nnx.Conv``'s ``conv_general_dilated``, ``nnx.Einsum``'s ``einsum_op``, and
their Linen counterparts through the bridge's proxies) are planned through
that attribute. Every other contraction is found here, as google/qwix finds
them: the jax ops themselves are intercepted while a planned model runs.

* The bottom ops, ``lax.dot_general`` and ``lax.conv_general_dilated``, and
  the entry points built on them (``jnp.einsum``, ``jnp.matmul`` and ``@``,
  ``jnp.dot``, ``jnp.tensordot``, ``jnp.inner``, ``jnp.vdot``, ``lax.dot``,
  ``lax.batch_matmul``, ``lax.conv``, ``lax.conv_transpose``,
  ``jax.nn.dot_product_attention``, computed as its XLA implementation does)
  are replaced only while interception is *active*
  (:mod:`qsync_jax.plan.patching`: per thread, nested, jax's own put back
  when the last thread leaves). A plain function has its ``__code__``
  replaced, so every alias of it is caught (``from jax.lax import
  dot_general`` included); a jitted one (``jnp.matmul``) is replaced in its
  module, where ``@`` looks it up too.
* Interception is active while a model's layers are listed
  (:func:`discovering`) and while a planned model runs: every NNX module
  holding a site, itself or below it, activates it in ``__call__``
  (:func:`activate_when_called`; ``nnx.split`` / ``nnx.merge`` /
  ``nnx.clone`` keep it), and a Linen model with sites activates it in its
  bridge's call (:class:`linen_scope`). A model without sites never does.
* An intercepted call belongs to the nearest module on the Python stack (the
  nearest frame whose ``self`` is an NNX or Linen module). Calls from inside
  jax's own functions, calls in the layers planned through an attribute, and
  (outside listing) every call of a module that holds no site compute with
  jax's own op at once.
* An entry point called by a module with sites runs its own implementation
  with jit disabled, so that each of its bottom ops is seen every time (a
  jitted ``jnp.matmul`` would otherwise be traced once per shape and its
  result reused for every site).
* Each contraction of one call of a module is numbered in call order and
  named by the entry point it came through: ``einsum_0``, ``matmul_1``...
  The counts live in a per-thread stack of the module calls under way, each
  record holding the call's Python frame: a record is popped once its frame
  has returned, so the stack is as deep as the calls and no running call
  loses its count. The site with that name is a small module
  (:class:`DotSite`, :class:`ConvSite`) attached to the owning module; its
  hook attribute (``dot_general`` / ``conv_general_dilated``) is what a plan
  replaces, as for the flax layers. A call with no site computes as written.

A :class:`Discovery` records, over one traced pass, every intercepted
contraction, with the module path of its owner and whether each operand
depends on the model's inputs (two activations: the attention-score kind).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
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

from qsync_jax.plan import patching


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


# The unpatched bottom ops: a site's default op, and what a passing call runs.
_ORIGINAL_DOT_GENERAL = patching.clone(lax.dot_general)  # type: ignore[arg-type]
_ORIGINAL_CONV = patching.clone(lax.conv_general_dilated)  # type: ignore[arg-type]

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
    patching.__name__,
    "jax._src.numpy.array_methods",
    "jax._src.core",
    "jax._src.array",
  }
)
#: Site kinds that are convolutions (their op is ``conv_general_dilated``).
CONV_KINDS = frozenset({"conv", "conv_transpose"})


@dataclasses.dataclass
class _Call:
  """One call of a module under way that has met contractions."""

  owner: Any
  # The outermost frame of the call. Held, so that no later frame can take
  # its identity while the record exists.
  frame: types.FrameType
  next_index: int = 0


@dataclasses.dataclass
class _ThreadState:
  handling: bool = False
  # (label, owner, frame) of the entry point running, if any.
  entry: tuple[str, Any, Any] | None = None
  # The module calls under way, outermost first (see _next_name).
  calls: list[_Call] = dataclasses.field(default_factory=list)
  discovery: Discovery | None = None
  # The homes of Linen sites running (innermost last), with the Linen paths
  # of the modules that own sites there.
  linen_models: list[tuple[Any, frozenset[str]]] = dataclasses.field(
    default_factory=list
  )


_LOCAL = threading.local()
_LOCK = threading.Lock()
# Module types planned through an attribute: their calls pass.
_PASSING: list[tuple[type, ...]] = [()]


def _state() -> _ThreadState:
  s = getattr(_LOCAL, "state", None)
  if s is None:
    s = _LOCAL.state = _ThreadState()
  return s


def pass_through(types_: Sequence[type]) -> None:
  """Lets the contractions of modules of these types pass unintercepted.

  Args:
    types_: module types planned through an attribute (``nnx.Linear``...).
  """
  with _LOCK:
    known = _PASSING[0]
    _PASSING[0] = (*known, *(t for t in types_ if t not in known))


def _patches() -> list[patching.Patch]:
  return [
    patching.Patch(
      lax, "dot_general", functools.partial(_bottom, "dot_general")
    ),
    patching.Patch(
      lax, "conv_general_dilated", functools.partial(_bottom, "conv")
    ),
    *(
      patching.Patch(
        jnp, attr, functools.partial(_entry, label), also_in=_OPERATOR_MODULE
      )
      for attr, label in _JNP_ENTRIES
    ),
    *(
      patching.Patch(lax, attr, functools.partial(_entry, label))
      for attr, label in _LAX_ENTRIES
    ),
    patching.Patch(jax.nn, "dot_product_attention", _attention_entry),
  ]


def _forget_calls() -> None:
  # The frames of the finished calls go with their records.
  _state().calls = []


patching.register(_patches, _forget_calls)


def activate_when_called(module: nnx.Module) -> None:
  """Makes every call of ``module`` run with interception active
  (:func:`qsync_jax.plan.patching.activate_when_called`)."""
  patching.activate_when_called(module)


def _module_name(frame) -> str:
  return frame.f_globals.get("__name__", "")


def _caller(frame):
  """The first frame outside this module, the trampolines and forwarders."""
  while frame is not None and (
    _module_name(frame) in _FORWARDING_MODULES
    or patching.is_trampoline(frame.f_code)
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
  if isinstance(owner, (*_PASSING[0], *SITE_TYPES)):
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


def _has_sites(s: _ThreadState, owner: Any) -> bool:
  """Whether ``owner``'s contractions may be planned: it holds a site, or
  the model is being listed."""
  if s.discovery is not None:
    return True
  if isinstance(owner, nn.Module):
    if not s.linen_models or owner.scope is None:
      return False
    return "/".join(owner.path) in s.linen_models[-1][1]
  return any(isinstance(v, SITE_TYPES) for v in vars(owner).values())


def _calling_owner(s: _ThreadState) -> tuple[Any, Any]:
  """The owner of an entry point's call and its call frame, or (None, None)
  where the call computes as written."""
  caller = _caller(sys._getframe(2))
  if caller is None or _is_jax_internal(caller):
    return None, None
  owner, frame = _owner(caller)
  if owner is None or not _has_sites(s, owner):
    return None, None
  return owner, frame


def _next_name(s: _ThreadState, label: str, owner: Any, frame: Any) -> str:
  """The next site name of ``owner``'s call whose outermost frame is
  ``frame``.

  ``s.calls`` holds the calls under way that met contractions, outermost
  first: a call's record is pushed above every running one, and one whose
  frame has returned is popped before a new one is pushed. Records of
  returned calls are thus always on top, and the one of ``frame``'s call,
  if any, is the top once they are gone.
  """
  calls = s.calls
  top = calls[-1] if calls else None
  if top is None or top.frame is not frame or top.owner is not owner:
    running = set()
    f = frame
    while f is not None:
      running.add(id(f))
      f = f.f_back
    while calls and id(calls[-1].frame) not in running:
      calls.pop()
    top = calls[-1] if calls else None
    if top is None or top.frame is not frame or top.owner is not owner:
      top = _Call(owner, frame)
      calls.append(top)
  index = top.next_index
  top.next_index += 1
  return f"{label}_{index}"


def _entry(label: str, original: Callable[..., Any], *args, **kwargs):
  s = _state()
  if not patching.is_active() or s.handling or s.entry is not None:
    return original(*args, **kwargs)
  owner, frame = _calling_owner(s)
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
  if not patching.is_active() or s.handling or s.entry is not None:
    return original(*args, **kwargs)
  owner, frame = _calling_owner(s)
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
  if not patching.is_active() or s.handling:
    return original(*args, **kwargs)
  if s.entry is not None:
    label, owner, frame = s.entry
  else:
    owner, frame = _calling_owner(s)
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
    site = s.linen_models[-1][0].proxies.get(key)
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
  """Marks ``model`` as the home of Linen sites for the ``with`` block.

  ``model`` (a bridge LinenModel, or a planned Linen module's home) holds
  the sites in its ``proxies``; interception is active for the block when
  it holds any.
  """

  def __init__(self, model: Any):
    self.model = model
    self.activated = False

  def __enter__(self) -> None:
    owners = frozenset(
      key.rpartition("/")[0]
      for key, proxy in self.model.proxies.items()
      if isinstance(proxy, SITE_TYPES)
    )
    if owners:
      patching.active().__enter__()
      self.activated = True
    _state().linen_models.append((self.model, owners))

  def __exit__(self, *exc: Any) -> None:
    _state().linen_models.pop()
    if self.activated:
      self.activated = False
      patching.active().__exit__()


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
      prefix = self.paths.get(id(models[-1][0])) if models else None
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
  """Context manager: interception is active, and the contractions of every
  module are recorded into ``discovery``, not planned."""
  return _Discovering(discovery)


class _Discovering:
  def __init__(self, discovery: Discovery | None):
    self.discovery = discovery

  def __enter__(self) -> None:
    patching.active().__enter__()
    s = _state()
    # Numbered afresh: the listing's names are those of a call of its own.
    self.saved = s.discovery, s.calls
    s.discovery, s.calls = self.discovery, []

  def __exit__(self, *exc: Any) -> None:
    s = _state()
    s.discovery, s.calls = self.saved
    patching.active().__exit__()
