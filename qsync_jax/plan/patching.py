"""Replacing jax functions only while a planned model runs, per thread.

:mod:`qsync_jax.plan.intercept` routes jax's contraction ops to sites; this
module owns *when* those ops are replaced, as google/qwix does it:

* A :class:`Patch` says how one function is replaced: a plain function gets
  a trampoline ``__code__`` (so every alias of it is caught), a jitted one a
  wrapper in its module. Both are made once; patching only assigns them.
* :func:`active` opens an activation for the calling thread; activations
  nest. The first thread to open one patches every registered function
  under a process-wide lock, and the last to close its outermost one puts
  back what was there, on an exception too. A patch that fails half-way
  undoes what it had done and raises. In a thread where no activation is
  open, a patched function's handler is to call jax's own at once
  (:func:`is_active`).
* :func:`activate_when_called` gives a module a subclass of its class whose
  ``__call__`` runs inside an activation. The subclass has the original's
  name, module and metaclass (one per class, cached); flax's graph keeps a
  node's class, so ``nnx.split`` / ``nnx.merge`` / ``nnx.clone`` and a
  graphdef keep the behaviour, and so does pickling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import inspect
import sys
import threading
import types
from typing import Any

_LOCAL = threading.local()
# Guards the patching: the registered patches, how many threads are active,
# the undo list, and the activating classes.
_LOCK = threading.Lock()
_ACTIVE_THREADS = [0]
_UNDO: list[Callable[[], None]] = []
_TRAMPOLINES: set[types.CodeType] = set()
_REGISTERED: list[Callable[[], Sequence[Patch]]] = []
_PATCHES: list[Patch] = []
_ON_LAST_EXIT: list[Callable[[], None]] = []


def clone(fn: types.FunctionType) -> types.FunctionType:
  """A new function object with ``fn``'s code, so it survives a patch."""
  out = types.FunctionType(
    fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
  )
  out.__kwdefaults__ = fn.__kwdefaults__
  out.__doc__, out.__qualname__ = fn.__doc__, fn.__qualname__
  return out


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


class Patch:
  """How one function is replaced while an activation is open.

  The handler is called as ``handler(original, *args, **kwargs)``, with
  ``original`` the function as it was.

  Args:
    module: the module holding the function.
    attr: its name there.
    handler: what a call runs instead.
    also_in: another module (by name) that holds the same jitted function
      under the same name and is replaced too (where ``@`` looks it up).
  """

  def __init__(
    self,
    module: Any,
    attr: str,
    handler: Callable[..., Any],
    also_in: str | None = None,
  ):
    self.module, self.attr, self.also_in = module, attr, also_in
    fn = self.fn = getattr(module, attr, None)
    self.code: types.CodeType | None = None
    self.replacement: Callable[..., Any] | None = None
    if isinstance(fn, types.FunctionType) and not fn.__code__.co_freevars:
      # The trampoline finds the handler among the function's globals. It
      # stays there once the patch is undone: a call that entered the
      # trampoline just before still completes.
      hook_name = f"_qsync_jax_intercepted_{attr}"
      fn.__globals__[hook_name] = functools.partial(handler, clone(fn))
      self.code = _trampoline_code(fn, hook_name)
      _TRAMPOLINES.add(self.code)
    elif fn is not None:
      original = fn

      @functools.wraps(fn)
      def replaced(*args, **kwargs):
        return handler(original, *args, **kwargs)

      self.replacement = replaced

  def apply(self, undo: list[Callable[[], None]]) -> None:
    """Patches the function, appending to ``undo`` what reverts each step."""
    fn = self.fn
    if self.code is not None:
      saved = fn.__code__  # type: ignore[union-attr]
      fn.__code__ = self.code  # type: ignore[union-attr]
      undo.append(functools.partial(setattr, fn, "__code__", saved))
      return
    for module in (self.module, self.also_in and sys.modules.get(self.also_in)):
      if module and getattr(module, self.attr, None) is fn:
        setattr(module, self.attr, self.replacement)
        undo.append(functools.partial(setattr, module, self.attr, fn))


def register(
  patches: Callable[[], Sequence[Patch]],
  on_last_exit: Callable[[], None] | None = None,
) -> None:
  """Adds functions to patch while an activation is open.

  Args:
    patches: makes the :class:`Patch` list (called once, at the first
      activation).
    on_last_exit: called in a thread when its outermost activation closes.
  """
  with _LOCK:
    _REGISTERED.append(patches)
    if on_last_exit is not None:
      _ON_LAST_EXIT.append(on_last_exit)


def is_trampoline(code: types.CodeType) -> bool:
  """Whether ``code`` is the body a patch gives a plain function."""
  return code in _TRAMPOLINES


def _run_all(actions: Sequence[Callable[[], None]]) -> None:
  """Runs every action, then raises the first error any of them raised."""
  error: BaseException | None = None
  for action in actions:
    try:
      action()
    except BaseException as e:  # the rest must still run
      error = error or e
  if error is not None:
    raise error


def _install() -> None:
  while _REGISTERED:
    _PATCHES.extend(_REGISTERED[0]())
    del _REGISTERED[0]
  undo: list[Callable[[], None]] = []
  try:
    for patch in _PATCHES:
      patch.apply(undo)
  except BaseException:
    _run_all(undo[::-1])  # whatever was patched goes back
    raise
  _UNDO[:] = undo


def _uninstall() -> None:
  undo = _UNDO[::-1]
  _UNDO.clear()
  _run_all(undo)


def is_active() -> bool:
  """Whether the calling thread has an activation open."""
  return bool(getattr(_LOCAL, "depth", 0))


class _Active:
  """The context manager :func:`active` returns (it holds no state)."""

  def __enter__(self) -> None:
    depth = getattr(_LOCAL, "depth", 0)
    if not depth:
      with _LOCK:
        if not _ACTIVE_THREADS[0]:
          _install()
        _ACTIVE_THREADS[0] += 1
    _LOCAL.depth = depth + 1

  def __exit__(self, *exc: Any) -> None:
    _LOCAL.depth -= 1
    if _LOCAL.depth:
      return
    try:
      _run_all(_ON_LAST_EXIT)
    finally:
      with _LOCK:
        _ACTIVE_THREADS[0] -= 1
        if not _ACTIVE_THREADS[0]:
          _uninstall()


_ACTIVE = _Active()


def active() -> _Active:
  """Context manager: an activation of the calling thread for the block.

  Raises:
    Exception: whatever patching a function raised (on entering the
      outermost activation of the process); everything patched before it
      is put back.
  """
  return _ACTIVE


# Original class -> its subclass whose __call__ opens an activation.
_ACTIVATING: dict[type, type] = {}


def _remade(original: type, make: Callable[..., Any], *args: Any) -> Any:
  """Unpickles an instance of ``original``'s activating subclass."""
  return make(_activating_class(original), *args)


def _activating_class(cls: type) -> type:
  """``cls``'s subclass whose ``__call__`` runs inside an activation."""
  if "_qsync_jax_original" in vars(cls):
    return cls
  with _LOCK:
    made = _ACTIVATING.get(cls)
    if made is not None:
      return made
    holder: list[type] = []

    # Wrapping keeps the user's signature visible (inspect follows
    # __wrapped__): the library passes train= / rngs= where it is taken.
    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
      with _ACTIVE:
        return super(holder[0], self).__call__(*args, **kwargs)

    def __reduce_ex__(self, protocol):
      # The subclass cannot be found by its name: pickled as "the
      # activating subclass of the original class".
      reduced = super(holder[0], self).__reduce_ex__(protocol)
      if (
        isinstance(reduced, tuple)
        and len(reduced) > 1
        and reduced[1][:1] == (holder[0],)
      ):
        make, args = reduced[0], reduced[1][1:]
        return (_remade, (cls, make, *args), *reduced[2:])
      return reduced

    namespace = {
      "__call__": __call__,
      "__reduce_ex__": __reduce_ex__,
      "__module__": cls.__module__,
      "__qualname__": cls.__qualname__,
      "__doc__": cls.__doc__,
      "_qsync_jax_original": cls,
    }
    # A flax Pytree subclass takes its pytree setting as a class keyword.
    keywords = {}
    if isinstance(getattr(cls, "_pytree__is_pytree", None), bool):
      keywords["pytree"] = cls._pytree__is_pytree  # type: ignore[attr-defined]
    made = type(cls)(cls.__name__, (cls,), namespace, **keywords)
    holder.append(made)
    _ACTIVATING[cls] = made
    return made


def activate_when_called(module: Any) -> None:
  """Makes every call of ``module`` (through ``__call__``) run inside an
  activation, in place; a module whose class has no ``__call__`` is left as
  it is.

  Args:
    module: an object whose class may be subclassed (an NNX module).
  """
  cls = type(module)
  if any("__call__" in vars(c) for c in cls.__mro__):
    object.__setattr__(module, "__class__", _activating_class(cls))
