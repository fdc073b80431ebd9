"""How the library calls a model it did not write.

This module owns the call contract between the library and a user's model:

* a model's *inputs* are one array, a tuple of positional arrays, or a dict
  of keyword arrays (arrays or ``jax.ShapeDtypeStruct``);
* :func:`call_model` calls a model on its inputs in train or eval mode the
  way flax users write models: it sets NNX's ``deterministic`` /
  ``use_running_average`` attributes for the call only (:func:`mode`), and
  passes ``train=`` (or ``deterministic=``) and ``rngs=`` when ``__call__``
  takes them;
* a :class:`Probe` is a function of the model and example data that runs the
  model abstractly: the library traces layers, shapes and steps through it,
  so it needs no ``input_spec`` method and no mode switch from the user.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import functools
import importlib
import inspect
from typing import Any

from flax import nnx
import jax

#: ``call(model, inputs, *, train, rngs) -> outputs``: how a model is called.
CallFn = Callable[..., Any]

# The NNX attributes that hold a layer's mode; ``mode`` flips them as
# ``nnx.Module.train()`` / ``eval()`` do, then puts the old values back.
_MODE_ATTRIBUTES = {
  "deterministic": lambda train: not train,
  "use_running_average": lambda train: not train,
}


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
  """``(args, kwargs)`` of a model's inputs (see the module docstring)."""
  if isinstance(inputs, tuple):
    return inputs, {}
  if isinstance(inputs, dict):
    return (), dict(inputs)
  return (inputs,), {}


@contextlib.contextmanager
def mode(model: Any, train: bool) -> Iterator[None]:
  """Puts an NNX model in train or eval mode for the ``with`` block only.

  Every submodule's ``deterministic`` and ``use_running_average`` attribute
  (Dropout, BatchNorm, attention, ...) is set as ``model.train()`` /
  ``model.eval()`` would, and restored on exit, so the caller's mode
  survives. Non-NNX callables are left alone.
  """
  if not isinstance(model, nnx.Module):
    yield
    return
  saved = []
  for _, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module):
      continue
    for name, value_of in _MODE_ATTRIBUTES.items():
      old = vars(node).get(name, 0)
      if isinstance(old, (bool, type(None))) and old != value_of(train):
        saved.append((node, name, old))
        # A static flag, not state: set it even on a module captured from
        # an outer trace (NNX's setattr would refuse).
        object.__setattr__(node, name, value_of(train))
  try:
    yield
  finally:
    for node, name, value in reversed(saved):
      object.__setattr__(node, name, value)


@functools.lru_cache(maxsize=256)
def _call_keywords(cls: type) -> frozenset[str]:
  try:
    params = inspect.signature(cls.__call__).parameters
  except (TypeError, ValueError):
    return frozenset()
  return frozenset(
    name
    for name, p in params.items()
    if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
  )


def call_model(
  model: Any, inputs: Any, *, train: bool, rngs: nnx.Rngs | None = None
) -> Any:
  """Calls ``model`` on ``inputs`` in train or eval mode.

  The model's own mode attributes are set for the call (:func:`mode`); when
  its ``__call__`` takes ``train`` (or ``training``, or ``deterministic``)
  and ``rngs`` keywords, they are passed too, unless ``inputs`` already
  names them.

  Args:
    model: an NNX module (or any callable model).
    inputs: one array, a tuple of positional arrays, or a dict of keyword
      arrays.
    train: train mode (dropout on, batch statistics) or eval mode.
    rngs: the RNG streams for the call (dropout), if the model takes them.

  Returns:
    The model's outputs.
  """
  args, kwargs = split_inputs(inputs)
  cls: type = type(model)
  keywords = _call_keywords(cls)
  for name in ("train", "training"):
    if name in keywords:
      kwargs.setdefault(name, train)
      break
  else:
    if "deterministic" in keywords:
      kwargs.setdefault("deterministic", not train)
  if rngs is not None and "rngs" in keywords:
    kwargs.setdefault("rngs", rngs)
  with mode(model, train):
    return model(*args, **kwargs)


def trace_rngs() -> nnx.Rngs:
  """RNG streams for abstract traces (shapes only, any values will do)."""
  return nnx.Rngs(0)


def abstract(data: Any) -> Any:
  """``data`` with every array replaced by its ``jax.ShapeDtypeStruct``."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), data)


@dataclasses.dataclass(frozen=True)
class Probe:
  """A function that runs a model on example data, to trace it.

  Attributes:
    fn: ``fn(model, data)``; it runs the model the way training does.
    data: example data (a pytree of arrays or ``jax.ShapeDtypeStruct``).
  """

  fn: Callable[[Any, Any], Any]
  data: Any

  def run(self, model: Any, data: Any = None) -> Any:
    """Runs ``fn`` on ``model`` and ``data`` (default: the example data)."""
    return self.fn(model, self.data if data is None else data)

  @property
  def batch_size(self) -> int:
    """The leading dimension of the example data's first array."""
    leaves = jax.tree.leaves(self.data)
    return int(leaves[0].shape[0]) if leaves and leaves[0].shape else 1


def input_probe(sample_input: Any, call: CallFn = call_model) -> Probe:
  """A :class:`Probe` that calls the model on ``sample_input`` in train mode.

  Args:
    sample_input: the model's inputs (arrays or ``jax.ShapeDtypeStruct``).
    call: the call hook, ``call(model, inputs, *, train, rngs)``.
  """

  def fn(model, inputs):
    return call(model, inputs, train=True, rngs=trace_rngs())

  return Probe(fn, sample_input)


def as_probe(model: Any, sample: Any = None) -> Probe:
  """The :class:`Probe` of ``sample``.

  Args:
    model: the model (its ``input_spec(2)`` is the default sample).
    sample: a :class:`Probe`, or the model's inputs (arrays or
      ``jax.ShapeDtypeStruct``: one, a tuple or a dict), or None.

  Raises:
    ValueError: no sample and the model has no ``input_spec`` method.
  """
  if isinstance(sample, Probe):
    return sample
  if sample is None:
    input_spec = getattr(model, "input_spec", None)
    if not callable(input_spec):
      raise ValueError(
        f"{type(model).__name__} has no input_spec method: pass "
        "sample_input (an array or "
        "jax.ShapeDtypeStruct the model accepts; a tuple or dict for "
        "several inputs) so the model can be traced"
      )
    sample = input_spec(2)
  return input_probe(sample)


def load_callable(spec: str, what: str, hint: str = "") -> Callable[..., Any]:
  """Resolves ``"package.module:name"`` to the callable it names.

  Args:
    spec: the spec.
    what: what the callable is, for messages (``"model spec"``).
    hint: what else the caller would accept, appended to messages.

  Raises:
    ValueError: a malformed spec, a module that cannot be imported, or no
      callable of that name in it.
  """
  hint = hint or "expected 'package.module:name'"
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr.isidentifier():
    raise ValueError(f"invalid {what} {spec!r}: {hint}")
  try:
    module = importlib.import_module(module_name)
  except Exception as err:  # Any import-time failure makes the spec unusable.
    raise ValueError(
      f"{what} {spec!r}: cannot import module {module_name!r} "
      f"({type(err).__name__}: {err}); {hint}"
    ) from err
  found = getattr(module, attr, None)
  if found is None:
    raise ValueError(
      f"{what} {spec!r}: module {module_name!r} has no "
      f"attribute {attr!r}; {hint}"
    )
  if not callable(found):
    raise ValueError(
      f"{what} {spec!r}: {module_name}.{attr} is not callable; {hint}"
    )
  return found
