"""BatchNorm ResNets: the generic :class:`ResNet` and ResNet-18/50 presets.

This module owns :class:`ResNetConfig`, the residual blocks
(:class:`BasicBlock`, :class:`Bottleneck`) and the models :class:`ResNet`,
:class:`ResNet18` (BasicBlock, [2, 2, 2, 2]) and :class:`ResNet50`
(Bottleneck, [3, 4, 6, 3]). Both presets default to the CIFAR stem (3x3 conv,
stride 1, no max-pool); ``cifar_stem=False`` selects the ImageNet stem (7x7
conv, stride 2, 3x3 max-pool).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.models.base import ImageModel


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """Configuration of :class:`ResNet`; the defaults are ResNet-18 for CIFAR-10.

  Attributes:
    num_classes: number of output classes.
    in_channels: channels of the NHWC input image.
    image_size: height and width of the (square) input image.
    width: channels of the stem and first stage; stage i has ``width * 2**i``
      (times 4 at a bottleneck's output).
    stage_sizes: number of blocks in each stage.
    block: ``"basic"`` (two 3x3 convs) or ``"bottleneck"`` (1x1-3x3-1x1).
    cifar_stem: 3x3 stride-1 stem without max-pool if True, else the ImageNet
      7x7 stride-2 stem with a 3x3 stride-2 max-pool.
    bn_momentum: BatchNorm running-statistics momentum.
  """

  num_classes: int = 10
  in_channels: int = 3
  image_size: int = 32
  width: int = 64
  stage_sizes: tuple[int, ...] = (2, 2, 2, 2)
  block: str = "basic"
  cifar_stem: bool = True
  bn_momentum: float = 0.9

  def __post_init__(self):
    # Configs are static model attributes and must stay hashable for jit.
    object.__setattr__(self, "stage_sizes", tuple(self.stage_sizes))
    if self.block not in ("basic", "bottleneck"):
      raise ValueError(
        f"block must be 'basic' or 'bottleneck', got {self.block!r}"
      )


def _conv(
  in_features: int, features: int, kernel: int, strides: int, rngs: nnx.Rngs
) -> nnx.Conv:
  # No bias: the BatchNorm that follows every conv has its own.
  return nnx.Conv(
    in_features,
    features,
    (kernel, kernel),
    (strides, strides),
    use_bias=False,
    rngs=rngs,
  )


def _norm(features: int, config: ResNetConfig, rngs: nnx.Rngs) -> nnx.BatchNorm:
  return nnx.BatchNorm(features, momentum=config.bn_momentum, rngs=rngs)


class _Block(nnx.Module):
  """Shared residual plumbing: a projection shortcut when the shape changes."""

  expansion: ClassVar[int] = 1

  def _init_shortcut(
    self,
    in_features: int,
    out_features: int,
    strides: int,
    config: ResNetConfig,
    rngs: nnx.Rngs,
  ):
    self.proj: nnx.Conv | None
    self.proj_norm: nnx.BatchNorm | None
    if strides != 1 or in_features != out_features:
      self.proj = _conv(in_features, out_features, 1, strides, rngs)
      self.proj_norm = _norm(out_features, config, rngs)
    else:
      self.proj = self.proj_norm = None

  def _residual(self, x: jax.Array, y: jax.Array) -> jax.Array:
    if self.proj is None or self.proj_norm is None:
      shortcut = x
    else:
      shortcut = self.proj_norm(self.proj(x))
    # Add in float32: either branch may come back in low precision.
    return nnx.relu(y.astype(jnp.float32) + shortcut.astype(jnp.float32))


class BasicBlock(_Block):
  """Two 3x3 conv-BN layers with a residual connection (ResNet-18/34)."""

  expansion: ClassVar[int] = 1

  def __init__(
    self,
    in_features: int,
    features: int,
    strides: int,
    config: ResNetConfig,
    *,
    rngs: nnx.Rngs,
  ):
    """Builds the block.

    Args:
      in_features: input channels.
      features: output channels.
      strides: stride of the first conv (and of the shortcut projection).
      config: the model configuration (BatchNorm settings).
      rngs: RNG streams for parameter initialisation.
    """
    self.conv1 = _conv(in_features, features, 3, strides, rngs)
    self.norm1 = _norm(features, config, rngs)
    self.conv2 = _conv(features, features, 3, 1, rngs)
    self.norm2 = _norm(features, config, rngs)
    self._init_shortcut(in_features, features, strides, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the block to NHWC activations."""
    y = nnx.relu(self.norm1(self.conv1(x)))
    y = self.norm2(self.conv2(y))
    return self._residual(x, y)


class Bottleneck(_Block):
  """1x1 reduce, 3x3 (strided, as in ResNet v1.5), 1x1 expand by 4."""

  expansion: ClassVar[int] = 4

  def __init__(
    self,
    in_features: int,
    features: int,
    strides: int,
    config: ResNetConfig,
    *,
    rngs: nnx.Rngs,
  ):
    """Builds the block.

    Args:
      in_features: input channels.
      features: inner channels; the output has ``4 * features``.
      strides: stride of the 3x3 conv (and of the shortcut projection).
      config: the model configuration (BatchNorm settings).
      rngs: RNG streams for parameter initialisation.
    """
    out_features = features * self.expansion
    self.conv1 = _conv(in_features, features, 1, 1, rngs)
    self.norm1 = _norm(features, config, rngs)
    self.conv2 = _conv(features, features, 3, strides, rngs)
    self.norm2 = _norm(features, config, rngs)
    self.conv3 = _conv(features, out_features, 1, 1, rngs)
    self.norm3 = _norm(out_features, config, rngs)
    self._init_shortcut(in_features, out_features, strides, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the block to NHWC activations."""
    y = nnx.relu(self.norm1(self.conv1(x)))
    y = nnx.relu(self.norm2(self.conv2(y)))
    y = self.norm3(self.conv3(y))
    return self._residual(x, y)


_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(ImageModel):
  """A BatchNorm ResNet: stem, residual stages, global average pool, head."""

  default_config: ClassVar[ResNetConfig] = ResNetConfig()

  def __init__(self, config: ResNetConfig | None = None, *, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model configuration; ``default_config`` when None.
      rngs: RNG streams for parameter initialisation.
    """
    config = self._set_config(config)
    block_cls = _BLOCKS[config.block]
    if config.cifar_stem:
      self.stem = _conv(config.in_channels, config.width, 3, 1, rngs)
    else:
      self.stem = _conv(config.in_channels, config.width, 7, 2, rngs)
    self.stem_norm = _norm(config.width, config, rngs)
    blocks = []
    in_features = config.width
    for stage, num_blocks in enumerate(config.stage_sizes):
      features = config.width * 2**stage
      for index in range(num_blocks):
        strides = 2 if stage > 0 and index == 0 else 1
        blocks.append(
          block_cls(in_features, features, strides, config, rngs=rngs)
        )
        in_features = features * block_cls.expansion
    self.blocks = nnx.List(blocks)
    self.head = nnx.Linear(in_features, config.num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps (batch, H, W, C) images to float32 (batch, num_classes) logits."""
    x = nnx.relu(self.stem_norm(self.stem(x)))
    if not self.config.cifar_stem:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for block in self.blocks:
      x = block(x)
    x = x.astype(jnp.float32).mean(axis=(1, 2))
    return self.head(x).astype(jnp.float32)


class ResNet18(ResNet):
  """ResNet-18: BasicBlock, stages [2, 2, 2, 2], CIFAR stem by default."""

  default_config: ClassVar[ResNetConfig] = ResNetConfig(
    block="basic", stage_sizes=(2, 2, 2, 2)
  )


class ResNet50(ResNet):
  """ResNet-50: Bottleneck, stages [3, 4, 6, 3], CIFAR stem by default."""

  default_config: ClassVar[ResNetConfig] = ResNetConfig(
    block="bottleneck", stage_sizes=(3, 4, 6, 3)
  )
