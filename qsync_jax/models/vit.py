"""A Vision Transformer (ViT-Tiny by default) for image classification.

This module owns :class:`ViTConfig` and :class:`ViTTiny`: a strided-conv patch
embedding, a learned class token and position embedding, pre-LayerNorm
encoder layers from :mod:`qsync_jax.models.transformer`, a final LayerNorm and
a linear head on the class token.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.models.base import ImageModel
from qsync_jax.models.transformer import EncoderLayer


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Configuration of :class:`ViTTiny` (defaults: ViT-Ti/4 on 32x32 images).

  Attributes:
    image_size: height and width of the (square) input image.
    patch_size: side of each square patch; must divide ``image_size``.
    in_channels: channels of the NHWC input image.
    num_classes: number of output classes.
    hidden: model width.
    num_layers: number of encoder layers.
    num_heads: attention heads per layer.
    mlp_dim: MLP inner width.
    dropout_rate: dropout on each sub-block's output.
  """

  image_size: int = 32
  patch_size: int = 4
  in_channels: int = 3
  num_classes: int = 10
  hidden: int = 192
  num_layers: int = 12
  num_heads: int = 3
  mlp_dim: int = 768
  dropout_rate: float = 0.0

  def __post_init__(self):
    if self.image_size % self.patch_size:
      raise ValueError(
        f"patch_size={self.patch_size} does not divide "
        f"image_size={self.image_size}"
      )


class ViTTiny(ImageModel):
  """Vision Transformer classifying an image from its class token."""

  default_config: ClassVar[ViTConfig] = ViTConfig()

  def __init__(self, config: ViTConfig | None = None, *, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model configuration; ``default_config`` when None.
      rngs: RNG streams for parameter initialisation.
    """
    config = self._set_config(config)
    patch = (config.patch_size, config.patch_size)
    self.patch_embed = nnx.Conv(
      config.in_channels,
      config.hidden,
      patch,
      strides=patch,
      padding="VALID",
      rngs=rngs,
    )
    num_tokens = (config.image_size // config.patch_size) ** 2 + 1
    self.cls_token = nnx.Param(jnp.zeros((1, 1, config.hidden)))
    self.position_embed = nnx.Param(
      nnx.initializers.normal(0.02)(
        rngs.params(), (1, num_tokens, config.hidden)
      )
    )
    self.layers = nnx.List(
      [
        EncoderLayer(
          config.hidden,
          config.num_heads,
          config.mlp_dim,
          pre_norm=True,
          dropout_rate=config.dropout_rate,
          rngs=rngs,
        )
        for _ in range(config.num_layers)
      ]
    )
    self.final_norm = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.head = nnx.Linear(config.hidden, config.num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps (batch, H, W, C) images to float32 (batch, num_classes) logits."""
    batch = x.shape[0]
    # Patches may be lowered; the residual stream stays float32.
    x = self.patch_embed(x).astype(jnp.float32)
    x = x.reshape(batch, -1, self.config.hidden)
    cls = jnp.broadcast_to(self.cls_token[...], (batch, 1, self.config.hidden))
    x = jnp.concatenate([cls, x], axis=1) + self.position_embed[...]
    for layer in self.layers:
      x = layer(x)
    return self.head(self.final_norm(x)[:, 0]).astype(jnp.float32)
