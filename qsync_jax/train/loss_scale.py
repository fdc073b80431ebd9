"""Dynamic loss scaling for FP16 layers.

Same semantics as ``flax.training.dynamic_scale.DynamicScale`` (the jmp
package is unmaintained): the loss is
multiplied by ``scale`` before differentiation; a step whose gradient is not
finite is skipped and halves the scale; ``growth_interval`` finite steps in a
row double it. The state is a pytree of arrays so it lives inside jitted
steps and checkpoints.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossScale(NamedTuple):
  """The state of a dynamic loss scale.

  Attributes:
    scale: the current multiplier (float32).
    good_steps: finite steps since the last change (int32).
    skipped: steps skipped so far because the gradient was not finite.
  """

  scale: jax.Array
  good_steps: jax.Array
  skipped: jax.Array

  @classmethod
  def create(cls, scale: float = 2.0**15) -> LossScale:
    return cls(jnp.float32(scale), jnp.int32(0), jnp.int32(0))

  @classmethod
  def disabled(cls) -> LossScale:
    """A scale of 1 that :func:`update` never changes (``good_steps`` -1)."""
    return cls(jnp.float32(1.0), jnp.int32(-1), jnp.int32(0))


def update(
  state: LossScale,
  finite: jax.Array,
  *,
  growth_interval: int = 2000,
  factor: float = 2.0,
  minimum: float = 1.0,
) -> LossScale:
  """Returns the scale after a step whose gradient was ``finite`` or not.

  A disabled scale (``good_steps < 0``) keeps its scale; non-finite steps
  are counted either way (they are skipped either way).
  """
  enabled = state.good_steps >= 0
  grow = finite & (state.good_steps + 1 >= growth_interval)
  scale = jnp.where(
    finite,
    jnp.where(grow, state.scale * factor, state.scale),
    jnp.maximum(state.scale / factor, minimum),
  )
  good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
  return LossScale(
    jnp.where(enabled, scale, state.scale),
    jnp.where(enabled, good, state.good_steps).astype(jnp.int32),
    state.skipped + (~finite).astype(jnp.int32),
  )
