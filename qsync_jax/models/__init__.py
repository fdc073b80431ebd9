"""The model zoo: built-in NNX models by name, and user model factories.

This package owns the registry :data:`MODELS`, :func:`create_model` (a built-in
model from its default config plus overrides), :func:`load_model_factory`
(a built-in name or a ``package.module:factory`` spec resolved to a callable)
and :func:`build_model` (a spec's model, checked to be an NNX module).

Every model is built as ``cls(config, rngs=rngs)`` from a frozen dataclass
config (``cls.default_config`` when omitted) and exposes ``config``, ``task``
(``"classification"`` or ``"lm"``), ``input_spec(batch_size)`` and
``__call__(x)`` returning float32 logits, with the head as its last layer.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

from flax import nnx

from qsync_jax.models.bert import BertConfig, BertEncoderClassifier
from qsync_jax.models.cnn import SmallCNN, SmallCNNConfig
from qsync_jax.models.lm import DecoderLM, DecoderLMConfig
from qsync_jax.models.resnet import ResNet, ResNet18, ResNet50, ResNetConfig
from qsync_jax.models.vgg import VGG16BN, VGGConfig
from qsync_jax.models.vit import ViTConfig, ViTTiny

MODELS: dict[str, type[nnx.Module]] = {
    'cnn': SmallCNN,
    'resnet18': ResNet18,
    'resnet50': ResNet50,
    'vgg16_bn': VGG16BN,
    'bert': BertEncoderClassifier,
    'lm': DecoderLM,
    'vit_tiny': ViTTiny,
}


#: Config overrides that make a built-in model its paper size (QSync's
#: workloads, reference qsync.md section 7.1): ResNet-50 on 224 x 224 ImageNet
#: and BERT-base on 384-token SQuAD windows.
PAPER_SIZE_KWARGS: dict[str, dict[str, Any]] = {
    'resnet50': {'image_size': 224, 'cifar_stem': False, 'num_classes': 1000},
    'bert': {'num_layers': 12, 'num_heads': 12, 'hidden': 768,
             'mlp_dim': 3072, 'max_len': 384, 'vocab_size': 30522},
}


def _builtin_names() -> str:
  return ', '.join(MODELS)


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
        f'unknown model {name!r}; built-in models: {_builtin_names()}')
  cls = MODELS[name]
  config = cls.default_config
  fields = [f.name for f in dataclasses.fields(config)]
  unknown = [key for key in overrides if key not in fields]
  if unknown:
    raise ValueError(
        f'unknown config field(s) {", ".join(map(repr, unknown))} for model '
        f'{name!r} ({type(config).__name__}); valid fields: '
        f'{", ".join(fields)}')
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
  hint = (f"expected a built-in model ({_builtin_names()}) or "
          f"'package.module:factory'")
  module_name, sep, attr = spec.partition(':')
  if not sep or not module_name or not attr.isidentifier():
    raise ValueError(f'invalid model spec {spec!r}: {hint}')
  try:
    module = importlib.import_module(module_name)
  except Exception as err:  # Any import-time failure makes the spec unusable.
    raise ValueError(
        f'model spec {spec!r}: cannot import module {module_name!r} '
        f'({type(err).__name__}: {err}); {hint}') from err
  factory = getattr(module, attr, None)
  if factory is None:
    raise ValueError(
        f'model spec {spec!r}: module {module_name!r} has no attribute '
        f'{attr!r}; {hint}')
  if not callable(factory):
    raise ValueError(
        f'model spec {spec!r}: {module_name}.{attr} is not callable; {hint}')
  return factory


def build_model(spec: str, *, rngs: nnx.Rngs, **kwargs: Any) -> nnx.Module:
  """Builds the model of ``spec`` as ``factory(rngs=rngs, **kwargs)``.

  Args:
    spec: a built-in model name or ``"package.module:factory"``.
    rngs: RNG streams for parameter initialisation.
    **kwargs: config overrides (built-in) or the factory's keyword arguments.

  Returns:
    The model.

  Raises:
    ValueError: a bad spec (see :func:`load_model_factory`), a factory that
      cannot be called with these arguments, or one that returns something
      other than an ``nnx.Module``.
  """
  factory = load_model_factory(spec)
  try:
    model = factory(rngs=rngs, **kwargs)
  except TypeError as err:
    # The call's signature does not fit: say which factory, not a traceback
    # from inside it.
    args = ', '.join(['rngs', *kwargs])
    raise ValueError(
        f'model spec {spec!r} is not a model factory: calling it with '
        f'({args}) raised TypeError: {err}') from err
  if not isinstance(model, nnx.Module):
    raise ValueError(
        f'model spec {spec!r} is not a model factory: it returned a '
        f'{type(model).__name__}, not an nnx.Module')
  return model


__all__ = [
    "PAPER_SIZE_KWARGS",
    'MODELS',
    'BertConfig',
    'BertEncoderClassifier',
    'DecoderLM',
    'DecoderLMConfig',
    'ResNet',
    'ResNet18',
    'ResNet50',
    'ResNetConfig',
    'SmallCNN',
    'SmallCNNConfig',
    'VGG16BN',
    'VGGConfig',
    'ViTConfig',
    'ViTTiny',
    'build_model',
    'create_model',
    'load_model_factory',
]
