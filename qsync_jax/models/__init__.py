"""The model zoo: built-in NNX models by name, and user model factories.

This package owns the registry :data:`MODELS`, :func:`create_model` (a built-in
model from its default config plus overrides), :func:`load_model_factory`
(a built-in name or a ``package.module:factory`` spec resolved to a callable)
and :func:`build_model` (a spec's model sized for the data: the dataset's
facts go to the config fields or factory parameters that take them, a Linen
model is wrapped into NNX). A user's factory needs no special methods.

Every built-in model is built as ``cls(config, rngs=rngs)`` from a frozen dataclass
config (``cls.default_config`` when omitted) and exposes ``config``, ``task``
(``"classification"`` or ``"lm"``), ``input_spec(batch_size)`` and
``__call__(x)`` returning float32 logits, with the head as its last layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
import contextlib
import dataclasses
import functools
import inspect
import os
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.models.base import ModelClass
from qsync_jax.models.bert import BertConfig
from qsync_jax.models.bert import BertEncoderClassifier
from qsync_jax.models.cnn import SmallCNN
from qsync_jax.models.cnn import SmallCNNConfig
from qsync_jax.models.lm import DecoderLM
from qsync_jax.models.lm import DecoderLMConfig
from qsync_jax.models.resnet import ResNet
from qsync_jax.models.resnet import ResNet18
from qsync_jax.models.resnet import ResNet50
from qsync_jax.models.resnet import ResNetConfig
from qsync_jax.models.vgg import VGG16BN
from qsync_jax.models.vgg import VGGConfig
from qsync_jax.models.vit import ViTConfig
from qsync_jax.models.vit import ViTTiny
from qsync_jax.task import calling
from qsync_jax.task import sharding

#: The built-in models by name.
MODELS: dict[str, ModelClass] = {
  "cnn": SmallCNN,
  "resnet18": ResNet18,
  "resnet50": ResNet50,
  "vgg16_bn": VGG16BN,
  "bert": BertEncoderClassifier,
  "lm": DecoderLM,
  "vit_tiny": ViTTiny,
}


#: Config overrides that make a built-in model its paper size (QSync's
#: workloads, arXiv 2407.02327, as QSync's official code, bytedance/QSync,
#: runs them in ``benchmark_convs`` and ``benchmark_transformers``): ResNet-50
#: on 224 x 224 ImageNet and BERT-base on 384-token SQuAD windows.
PAPER_SIZE_KWARGS: dict[str, dict[str, Any]] = {
  "resnet50": {"image_size": 224, "cifar_stem": False, "num_classes": 1000},
  "bert": {
    "num_layers": 12,
    "num_heads": 12,
    "hidden": 768,
    "mlp_dim": 3072,
    "max_len": 384,
    "vocab_size": 30522,
  },
}


def _builtin_names() -> str:
  return ", ".join(MODELS)


def create_model(name: str, *, rngs: nnx.Rngs, **overrides: Any) -> nnx.Module:
  """Builds a built-in model from its default config with ``overrides``.

  Args:
    name: a key of :data:`MODELS`.
    rngs: RNG streams for parameter initialisation.
    **overrides: config fields to replace, e.g. ``width=8``.

  Returns:
    The model.

  Raises:
    ValueError: if ``name`` is not built in or an override is not a field of
      the model's config.
  """
  if name not in MODELS:
    raise ValueError(
      f"unknown model {name!r}; built-in models: {_builtin_names()}"
    )
  cls = MODELS[name]
  config = cls.default_config
  fields = [f.name for f in dataclasses.fields(config)]
  unknown = [key for key in overrides if key not in fields]
  if unknown:
    raise ValueError(
      f"unknown config field(s) {', '.join(map(repr, unknown))} for model "
      f"{name!r} ({type(config).__name__}); valid fields: "
      f"{', '.join(fields)}"
    )
  return cls(dataclasses.replace(config, **overrides), rngs=rngs)


def load_model_factory(spec: str) -> Callable[..., nnx.Module]:
  """Resolves a model spec to a factory called as ``factory(rngs=..., **kw)``.

  Args:
    spec: a built-in model name (see :data:`MODELS`), or
      ``"package.module:factory"`` naming a callable that returns an NNX
      module.

  Returns:
    For a built-in name, :func:`create_model` bound to it (keyword arguments
    are config overrides); otherwise the named callable.

  Raises:
    ValueError: if ``spec`` is neither a built-in name nor a well-formed
      ``module:factory``, the module cannot be imported, or it has no callable
      of that name.
  """
  if spec in MODELS:
    return functools.partial(create_model, spec)
  return calling.load_callable(
    spec,
    "model spec",
    f"expected a built-in model ({_builtin_names()}) "
    "or 'package.module:factory'",
  )


def _accepted_keywords(factory: Callable[..., Any]) -> tuple[list[str], bool]:
  """(named keyword parameters, whether it takes **kwargs) of a factory."""
  try:
    params = inspect.signature(factory).parameters.values()
  except (TypeError, ValueError):
    return [], True
  named = [
    p.name
    for p in params
    if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "rngs"
  ]
  return named, any(p.kind == p.VAR_KEYWORD for p in params)


def model_arguments(
  spec: str, data_kwargs: Mapping[str, Any] | None, kwargs: Mapping[str, Any]
) -> dict[str, Any]:
  """The keyword arguments :func:`build_model` calls the factory with.

  The dataset's facts (``data_kwargs``: ``num_classes``, ``input_shape``,
  ``image_size``, ``in_channels``, ``max_len``, ``vocab_size``) go to the
  fields or parameters that take them; ``kwargs`` (the user's) override
  them and must all be accepted.

  Raises:
    ValueError: a user keyword the model does not take (naming the ones it
      does).
  """
  if spec in MODELS:
    accepted = [f.name for f in dataclasses.fields(MODELS[spec].default_config)]
    open_ended = False
  else:
    accepted, open_ended = _accepted_keywords(load_model_factory(spec))
  unknown = [k for k in kwargs if k not in accepted]
  if unknown and not open_ended:
    raise ValueError(
      f"model {spec!r} takes no argument {', '.join(map(repr, unknown))}; "
      f"it accepts: {', '.join(accepted) or 'rngs only'}"
    )
  sized = {k: v for k, v in (data_kwargs or {}).items() if k in accepted}
  return {**sized, **kwargs}


class FactoryError(ValueError):
  """A user's model factory raised.

  The message names the factory and the exception in one line; the
  exception itself is the ``__cause__``, its traceback starting in the
  user's code, which a binary prints above its ``error:`` line
  (``show_cause``, :func:`qsync_jax.cli.bad_input_exits`).
  """

  show_cause = True


# What a factory that reads its weights in Python raises under eval_shape.
_TRACER_ERRORS = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerArrayConversionError,
  jax.errors.TracerBoolConversionError,
  jax.errors.TracerIntegerConversionError,
)


def without_weights(build: Callable[[], nnx.Module]) -> nnx.Module:
  """``build()``'s model with abstract weights (``nnx.eval_shape``).

  For code that needs only a model's shapes (tracing its graph, planning
  it): a deployment-sized model costs no init. A model whose construction
  needs concrete values (a factory that reads its weights in Python) is
  built for real instead, which gives the same shapes at the cost of its
  init.
  """
  try:
    return nnx.eval_shape(build)
  except _TRACER_ERRORS:
    return build()


def placeholder_weights(build: Callable[[], nnx.Module]) -> nnx.Module:
  """``build()``'s model with zeros for parameters and the rest as built.

  For a model whose parameters are overwritten before they are read, as a
  resume from a checkpoint overwrites them. ``build`` is traced once under
  ``jax.jit``. Its parameters' initializers then feed nothing, so XLA
  drops them and they are never compiled or run. On CPU that saves seconds
  per process: every initializer shape is an XLA program of its own
  (``truncated_normal`` takes 0.7-2.5 s each to compile). Every other
  variable is ``build()``'s value: BatchNorm statistics, a layer's RNG
  streams. Parameters keep their shapes and dtypes, and are placed as
  their sharding annotations say (:func:`qsync_jax.task.sharding.place`).

  A model whose construction needs concrete values (a factory that reads
  its weights in Python) is built for real instead. It then has its real
  initial weights.

  Args:
    build: makes the model, e.g. ``lambda: build_model(spec, rngs=...)``.

  Returns:
    The model, an NNX module, on the devices ``build()`` would use.

  Example:
    >>> from flax import nnx
    >>> model = placeholder_weights(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> float(abs(model.kernel[...]).sum())
    0.0
  """

  def zeroed() -> nnx.Module:
    model = build()
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    # The zeros do not inherit the initializers' placement: the parameters'
    # annotations place them again, as the build placed its values.
    sharding.place(model)
    return model

  try:
    return nnx.jit(zeroed)()
  except _TRACER_ERRORS:
    return build()


def build_model(
  spec: str,
  *,
  rngs: nnx.Rngs,
  data_kwargs: Mapping[str, Any] | None = None,
  sample_input: Any = None,
  **kwargs: Any,
) -> nnx.Module:
  """Builds the model of ``spec``, sized for the data.

  A factory's parameters may carry flax sharding annotations, with or
  without a mesh in context: they are applied as far as that mesh keeps them
  (:mod:`qsync_jax.task.sharding`).

  Args:
    spec: a built-in model name or ``"package.module:factory"``. A factory
      returns an NNX module, a Linen module, an ``(init, apply)`` pair or
      an ``nnx.bridge.ToNNX`` of a Linen module (the last three wrapped by
      :func:`qsync_jax.plan.bridge.from_linen`).
    rngs: RNG streams for parameter initialisation.
    data_kwargs: the dataset's facts
      (:meth:`qsync_jax.data.Dataset.model_kwargs`), passed where the
      model's config fields or the factory's parameters take them.
    sample_input: model inputs (arrays), to initialise a Linen model.
    **kwargs: config overrides (built-in) or the factory's keyword
      arguments; each must be one the model takes.

  Returns:
    The model, an NNX module.

  Raises:
    ValueError: a bad spec (see :func:`load_model_factory`), a keyword the
      model does not take, a factory that fails on its arguments, one that
      returns something else than a model, or a size argument below 1
      (``hidden=0``, ``widths=[4, 0]``) the build fails on, naming it.
    FactoryError: the factory raised (a ``ValueError``, its cause the
      user's exception).
  """
  arguments = model_arguments(spec, data_kwargs, kwargs)
  with _sizes_named(spec, arguments):
    return _build(spec, rngs, sample_input, arguments)


#: What a layer of size zero or below raises while it is built (initializer
#: fans divide by it; a negative shape is refused).
_SIZE_ERRORS = (ZeroDivisionError, TypeError, ValueError)
# Where a size error comes from when a size argument, not the code, is wrong.
_LIBRARY_DIRS = tuple(
  os.path.dirname(m.__file__ or "") + os.sep for m in (jax, nnx, np, calling)
) + (os.path.dirname(os.path.dirname(__file__)) + os.sep,)


def _not_sizes(arguments: Mapping[str, Any]) -> list[str]:
  """``name=value`` of the integer arguments (or entries) below 1."""

  def small(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v < 1

  return [
    f"{k}={v!r}"
    for k, v in arguments.items()
    if small(v) or (isinstance(v, (list, tuple)) and any(map(small, v)))
  ]


def _raised_in_library(err: BaseException) -> bool:
  """Whether ``err`` was raised in jax, flax, numpy or this package."""
  tb = err.__traceback__
  if tb is None:
    return False
  while tb.tb_next is not None:
    tb = tb.tb_next
  return tb.tb_frame.f_code.co_filename.startswith(_LIBRARY_DIRS)


@contextlib.contextmanager
def _sizes_named(spec: str, arguments: Mapping[str, Any]) -> Iterator[None]:
  """Turns the error a size argument below 1 causes into one naming it.

  A layer built with a zero width fails deep in jax (an initializer's fan
  divides by it); the argument that asked for it is the news. An error
  raised in a user's own code, or with every size argument >= 1, is left
  as it is.
  """
  try:
    yield
  except FactoryError:
    raise  # the user's code raised: its own message, not a size's
  except _SIZE_ERRORS as err:
    bad = _not_sizes(arguments)
    if not bad or not _raised_in_library(err):
      raise
    first = (str(err).strip().splitlines() or [""])[0]
    raise ValueError(
      f"model {spec!r} cannot be built with {', '.join(bad)}: sizes must "
      f"be >= 1 ({type(err).__name__}: {first})"
    ) from err


def _build(
  spec: str, rngs: nnx.Rngs, sample_input: Any, arguments: dict[str, Any]
) -> nnx.Module:
  """:func:`build_model` once the arguments are known."""
  if spec in MODELS:
    return create_model(spec, rngs=rngs, **arguments)
  factory = load_model_factory(spec)
  try:
    # An NNX module, a Linen module or an (init, apply) pair. Its
    # parameters' sharding annotations are applied once it is built, as far
    # as the mesh in context keeps them (flax's own eager sharding fails
    # without a mesh or on an axis the mesh lacks).
    with sharding.creating():
      model: object = factory(rngs=rngs, **arguments)
  except _TRACER_ERRORS:
    raise  # without_weights builds such a factory for real
  except TypeError as err:
    if _not_sizes(arguments) and _raised_in_library(err):
      raise  # a size argument below 1 (_sizes_named says which)
    # The call's signature does not fit: say which factory, not a traceback
    # from inside it.
    args = ", ".join(["rngs", *arguments])
    raise ValueError(
      f"model spec {spec!r} is not a model factory: calling it with "
      f"({args}) raised TypeError: {err}"
    ) from err
  except Exception as err:  # the user's code failed
    if _not_sizes(arguments) and _raised_in_library(err):
      raise  # a size argument below 1 (_sizes_named says which)
    tb = err.__traceback__
    raise FactoryError(
      f"model {spec!r} raised {type(err).__name__}: "
      f"{' '.join(str(err).split()) or '(no message)'} (its traceback is "
      "above)"
    ) from err.with_traceback(tb.tb_next if tb is not None else None)
  from qsync_jax.plan import bridge  # local: only Linen models need it

  if isinstance(model, nnx.bridge.ToNNX):
    # ToNNX hides the Linen layers from plans: wrap its module our way
    # (initialised afresh from the same rngs, as the factory did).
    model = model.to_nnx__module
  elif isinstance(model, nnx.Module):
    sharding.place(model)
    return model
  if bridge.is_linen(model):
    if sample_input is None:
      raise ValueError(
        f"model spec {spec!r} returned a Linen model: pass sample_input "
        "(the model's inputs) to initialise it"
      )
    return bridge.from_linen(model, sample_input, rngs=rngs)
  raise ValueError(
    f"model spec {spec!r} is not a model factory: it returned a "
    f"{type(model).__name__}, not an nnx.Module, a Linen module or an "
    "(init, apply) pair"
  )


__all__ = [
  "PAPER_SIZE_KWARGS",
  "MODELS",
  "BertConfig",
  "BertEncoderClassifier",
  "DecoderLM",
  "DecoderLMConfig",
  "FactoryError",
  "ResNet",
  "ResNet18",
  "ResNet50",
  "ResNetConfig",
  "SmallCNN",
  "SmallCNNConfig",
  "VGG16BN",
  "VGGConfig",
  "ViTConfig",
  "ViTTiny",
  "build_model",
  "create_model",
  "load_model_factory",
  "model_arguments",
  "placeholder_weights",
  "without_weights",
]
