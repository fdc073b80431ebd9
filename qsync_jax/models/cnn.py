"""A small convolutional classifier for tiny images (8x8x1 digits, 32x32x3).

This module owns :class:`SmallCNNConfig` and :class:`SmallCNN`:
Conv3x3-ReLU-Conv3x3-ReLU-Pool2x2-Linear-ReLU-Linear(head).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.models.base import ImageModel


@dataclasses.dataclass(frozen=True)
class SmallCNNConfig:
  """Configuration of :class:`SmallCNN`.

  Attributes:
    num_classes: number of output classes.
    in_channels: channels of the NHWC input image.
    image_size: height and width of the (square) input image.
    widths: output channels of the two 3x3 convolutions.
    hidden: width of the hidden fully connected layer.
    pool: ``"avg"`` or ``"max"``, the 2x2 stride-2 pooling after the convs.
  """

  num_classes: int = 10
  in_channels: int = 1
  image_size: int = 8
  widths: tuple[int, int] = (16, 32)
  hidden: int = 64
  pool: str = "avg"

  def __post_init__(self):
    # Configs are static model attributes and must stay hashable for jit.
    object.__setattr__(self, "widths", tuple(self.widths))
    if len(self.widths) != 2:
      raise ValueError(f"widths must have 2 entries, got {self.widths}")
    if self.pool not in ("avg", "max"):
      raise ValueError(f"pool must be 'avg' or 'max', got {self.pool!r}")
    if self.image_size < 2:
      raise ValueError(f"image_size must be >= 2, got {self.image_size}")


class SmallCNN(ImageModel):
  """Two-conv, two-linear image classifier."""

  default_config: ClassVar[SmallCNNConfig] = SmallCNNConfig()

  def __init__(self, config: SmallCNNConfig | None = None, *, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model configuration; ``default_config`` when None.
      rngs: RNG streams for parameter initialisation.
    """
    config = self._set_config(config)
    w1, w2 = config.widths
    self.conv1 = nnx.Conv(config.in_channels, w1, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(w1, w2, (3, 3), rngs=rngs)
    pooled = config.image_size // 2
    self.fc = nnx.Linear(pooled * pooled * w2, config.hidden, rngs=rngs)
    self.head = nnx.Linear(config.hidden, config.num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps (batch, H, W, C) images to float32 (batch, num_classes) logits."""
    x = nnx.relu(self.conv1(x))
    x = nnx.relu(self.conv2(x))
    pool = nnx.avg_pool if self.config.pool == "avg" else nnx.max_pool
    x = pool(x, (2, 2), strides=(2, 2))
    x = nnx.relu(self.fc(x.reshape(x.shape[0], -1)))
    return self.head(x).astype(jnp.float32)
