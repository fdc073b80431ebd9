"""VGG-16 with BatchNorm (13 conv-BN-ReLU layers, 5 max-pools, 3 linear layers).

This module owns :class:`VGGConfig` and :class:`VGG16BN`. The conv widths scale
with ``width_multiplier`` and the classifier width is ``classifier_hidden`` so
tests can build tiny variants; the defaults are the CIFAR-10 VGG-16-BN.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.models.base import ImageModel

# (output channels, number of 3x3 convs) per stage; a 2x2 max-pool ends each.
_VGG16_STAGES = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))


@dataclasses.dataclass(frozen=True)
class VGGConfig:
  """Configuration of :class:`VGG16BN`.

  Attributes:
    num_classes: number of output classes.
    in_channels: channels of the NHWC input image.
    image_size: height and width of the (square) input; at least 32 because
      of the five stride-2 pools.
    width_multiplier: scales every conv's channel count (1.0 is VGG-16).
    classifier_hidden: width of the two hidden classifier layers.
    dropout_rate: dropout after each hidden classifier layer.
    bn_momentum: BatchNorm running-statistics momentum.
  """

  num_classes: int = 10
  in_channels: int = 3
  image_size: int = 32
  width_multiplier: float = 1.0
  classifier_hidden: int = 512
  dropout_rate: float = 0.0
  bn_momentum: float = 0.9

  def __post_init__(self):
    if self.image_size < 32:
      raise ValueError(
        f"image_size must be >= 32 for five 2x2 pools, got {self.image_size}"
      )


class ConvBN(nnx.Module):
  """3x3 conv -> BatchNorm -> ReLU."""

  def __init__(
    self, in_features: int, features: int, config: VGGConfig, *, rngs: nnx.Rngs
  ):
    """Builds the layer.

    Args:
      in_features: input channels.
      features: output channels.
      config: the model configuration (BatchNorm settings).
      rngs: RNG streams for parameter initialisation.
    """
    # No conv bias: BatchNorm has its own.
    self.conv = nnx.Conv(
      in_features, features, (3, 3), use_bias=False, rngs=rngs
    )
    self.norm = nnx.BatchNorm(features, momentum=config.bn_momentum, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer to NHWC activations."""
    return nnx.relu(self.norm(self.conv(x)))


class VGG16BN(ImageModel):
  """VGG-16 with BatchNorm after every conv and a 3-layer classifier."""

  default_config: ClassVar[VGGConfig] = VGGConfig()

  def __init__(self, config: VGGConfig | None = None, *, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model configuration; ``default_config`` when None.
      rngs: RNG streams for parameter initialisation.
    """
    config = self._set_config(config)
    stages = []
    in_features = config.in_channels
    for channels, depth in _VGG16_STAGES:
      features = max(1, round(channels * config.width_multiplier))
      layers = []
      for _ in range(depth):
        layers.append(ConvBN(in_features, features, config, rngs=rngs))
        in_features = features
      stages.append(nnx.List(layers))
    self.stages = nnx.List(stages)
    spatial = config.image_size // 2 ** len(_VGG16_STAGES)
    hidden = config.classifier_hidden
    self.fc1 = nnx.Linear(spatial * spatial * in_features, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, config.num_classes, rngs=rngs)
    # Only an active dropout owns an RNG stream, so rate 0 adds no RNG state.
    self.dropout = nnx.Dropout(
      config.dropout_rate, rngs=rngs if config.dropout_rate > 0 else None
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps (batch, H, W, C) images to float32 (batch, num_classes) logits."""
    for stage in self.stages:
      for layer in stage:
        x = layer(x)
      x = nnx.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout(nnx.relu(self.fc1(x)))
    x = self.dropout(nnx.relu(self.fc2(x)))
    return self.head(x).astype(jnp.float32)
