"""A built-in model's size arguments, checked and priced before it is built.

This module owns :func:`check_model_kwargs` (the size arguments of a
built-in model, :data:`qsync_jax.models.MODELS`, are positive integers) and
:func:`deep_model_params` (a deep built-in model's parameter count, from
shallow copies, without building it). A user's factory checks its own
arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import math
import numbers
import typing
from typing import Any

from flax import nnx
import jax

from qsync_jax import models as models_lib

#: A built-in model's config fields that set its depth, and the depth past
#: which its parameters are first extrapolated from shallow copies (an
#: abstract build takes longer the deeper the model).
_DEPTH_FIELDS = ("num_layers", "stage_sizes")
_SHALLOW = 32


def check_model_kwargs(
  model: str, kwargs: Mapping[str, Any], what: str
) -> None:
  """Checks a built-in model's size arguments: positive integers.

  Every field of the model's config typed ``int`` (or a tuple of ints: a
  CNN's widths, a ResNet's stage sizes) must hold integers >= 1; a user's
  factory checks its own.

  Args:
    model: the model's name (or a user's spec, left alone).
    kwargs: its config overrides.
    what: how the arguments are named in messages
      (``"config.model_kwargs"``).

  Raises:
    ValueError: naming the argument and its value.
  """
  if model not in models_lib.MODELS:
    return
  hints = typing.get_type_hints(type(models_lib.MODELS[model].default_config))
  for name, value in kwargs.items():
    hint = hints.get(name)
    if hint is int:
      values = [value]
    elif typing.get_origin(hint) is tuple and set(typing.get_args(hint)) <= {
      int,
      Ellipsis,
    }:
      values = list(value) if isinstance(value, (list, tuple)) else [value]
      if not values:
        raise ValueError(f"{what}.{name} must be integers >= 1, got {value!r}")
    else:
      continue
    if not all(
      isinstance(v, numbers.Integral)
      and not isinstance(v, bool)
      and int(v) >= 1
      for v in values
    ):
      raise ValueError(
        f"{what}.{name} must be "
        f"{'an integer' if hint is int else 'integers'} >= 1, got {value!r}"
      )


def _param_count(build: Callable[[], nnx.Module]) -> int:
  model = models_lib.without_weights(build)
  return sum(
    math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
  )


def deep_model_params(
  model: str,
  kwargs: Mapping[str, Any],
  build: Callable[[Mapping[str, Any]], nnx.Module],
) -> int | None:
  """A deep built-in model's parameter count, from shallow copies.

  Parameters grow linearly in each depth field (``num_layers``, each of
  ``stage_sizes``): copies one block deep, and one block deeper per field,
  give the count at the asked depth without building it.

  Args:
    model: the model's name.
    kwargs: its config overrides.
    build: builds the model with the given overrides instead of
      ``kwargs`` (it is built abstractly, ``models.without_weights``).

  Returns:
    The count, or None for a user's model or one at most ``_SHALLOW``
    blocks deep.
  """
  if model not in models_lib.MODELS:
    return None
  default = models_lib.MODELS[model].default_config
  depths = {
    f: kwargs.get(f, getattr(default, f))
    for f in _DEPTH_FIELDS
    if hasattr(default, f)
  }
  flat = [
    (f, i, int(d))
    for f, v in depths.items()
    for i, d in enumerate(v if isinstance(v, (list, tuple)) else [v])
  ]
  if sum(d for _, _, d in flat) <= _SHALLOW:
    return None

  def count(deeper: tuple[str, int] | None) -> int:
    shallow = dict(kwargs)
    for f, v in depths.items():
      if isinstance(v, (list, tuple)):
        shallow[f] = [1 + (deeper == (f, i)) for i in range(len(v))]
      else:
        shallow[f] = 1 + (deeper == (f, 0))
    return _param_count(lambda: build(shallow))

  base = count(None)
  return base + sum((d - 1) * (count((f, i)) - base) for f, i, d in flat)
