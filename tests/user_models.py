"""Models written the way flax users write them, with no qsync_jax methods.

The tests (and the train binary, as ``user_models:FACTORY``) use these to
check that the library works on models it did not write: an NNX CNN with
BatchNorm and a Dropout holding its own RNG stream, a Linen ResNet-style
module with a ``train`` flag, a bare ``nnx.Linear`` and a two-input model
whose dropout takes ``rngs`` at call time.
"""

import math

from flax import nnx
import flax.linen as nn
import jax.numpy as jnp


class DropoutCNN(nnx.Module):
  """Conv-BN-ReLU twice, global mean pool, Dropout, Linear head."""

  def __init__(
    self, in_channels: int, num_classes: int, *, rngs: nnx.Rngs, width: int = 8
  ):
    self.conv1 = nnx.Conv(in_channels, width, (3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(width, rngs=rngs)
    self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(2 * width, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(self.bn2(self.conv2(x)))
    return self.head(self.dropout(x.mean(axis=(1, 2))))


def nnx_cnn(*, rngs, in_channels, num_classes, width=8):
  return DropoutCNN(in_channels, num_classes, rngs=rngs, width=width)


class ResidualBlock(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
    y = nn.relu(nn.BatchNorm(use_running_average=not train)(y))
    y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
    y = nn.BatchNorm(use_running_average=not train)(y)
    return nn.relu(x + y)


class LinenResNet(nn.Module):
  """The shape of flax's ImageNet example ResNet, small."""

  num_classes: int = 10
  width: int = 8

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = ResidualBlock(self.width)(x, train)
    x = ResidualBlock(self.width)(x, train)
    x = nn.Dropout(0.1, deterministic=not train)(jnp.mean(x, axis=(1, 2)))
    return nn.Dense(self.num_classes)(x)


def linen_resnet(*, rngs, num_classes, width=8):
  del rngs  # Linen modules are initialised by the library's wrapper
  return LinenResNet(num_classes=num_classes, width=width)


def bare_linear(*, rngs, input_shape, num_classes):
  return nnx.Linear(math.prod(input_shape), num_classes, rngs=rngs)


class TwoInput(nnx.Module):
  """Two inputs, each through its own Linear; dropout rngs at call time."""

  def __init__(
    self, a_features: int, b_features: int, num_classes: int, *, rngs: nnx.Rngs
  ):
    self.a = nnx.Linear(a_features, 32, rngs=rngs)
    self.b = nnx.Linear(b_features, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.head = nnx.Linear(32, num_classes, rngs=rngs)

  def __call__(self, a, b, *, rngs=None):
    h = nnx.relu(self.a(a) + self.b(b))
    return self.head(self.dropout(h, rngs=rngs))


def two_input(*, rngs, input_shape, num_classes):
  n = math.prod(input_shape)
  return TwoInput(n // 2, n - n // 2, num_classes, rngs=rngs)


def split_inputs(x):
  """A flat batch split into the two inputs of :class:`TwoInput`."""
  x = x.reshape(x.shape[0], -1)
  half = x.shape[1] // 2
  return x[:, :half], x[:, half:]


def two_input_loss(model, batch, rngs):
  """The user's loss: ``(logits, labels)``, scored as classification."""
  x, y = batch
  return model(*split_inputs(x), rngs=rngs), y


def tonnx_resnet(*, rngs, num_classes):
  """The Linen ResNet the way flax's bridge docs wrap it."""
  return nnx.bridge.ToNNX(LinenResNet(num_classes=num_classes), rngs=rngs)
