"""Tiny NNX models shared by the tests."""

from flax import nnx


class NoLayers(nnx.Module):
  """A model with no layer a precision plan can address (only a norm)."""

  def __init__(self):
    self.norm = nnx.LayerNorm(4, rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.norm(x)
