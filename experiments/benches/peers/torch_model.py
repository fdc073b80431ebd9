"""The main job's CNN in PyTorch, initialized as flax initializes it.

This module owns :class:`TorchCNN`: the layers of
:class:`qsync_jax.models.cnn.SmallCNN` (Conv3x3-ReLU-Conv3x3-ReLU-Pool2x2-
Linear-ReLU-Linear) on the same NHWC images, flattened in the same
(H, W, C) order, so that a flax kernel copied in (:func:`load_flax_params`)
gives the same logits; and flax's initialization: ``lecun_normal`` kernels
(a normal truncated at two standard deviations, scaled so that the kept
samples have standard deviation ``1/sqrt(fan_in)``) and zero biases. Only
the torch runs import it (it imports torch).
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from typing import Any

import numpy as np
import torch
from torch import nn

from qsync_jax.models.cnn import SmallCNNConfig

#: The standard deviation of a unit normal truncated to [-2, 2]: flax's
#: ``variance_scaling`` divides by it, so the kept samples have the target
#: variance.
TRUNCATED_STD = 0.87962566103423978
LAYERS = ("conv1", "conv2", "fc", "head")


def lecun_std(fan_in: int) -> float:
  """The standard deviation of the normal ``lecun_normal`` truncates at two
  of them (the kept samples' is ``1/sqrt(fan_in)``)."""
  return math.sqrt(1.0 / fan_in) / TRUNCATED_STD


def _init(layer: nn.Conv2d | nn.Linear, fan_in: int) -> None:
  std = lecun_std(fan_in)
  nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
  nn.init.zeros_(layer.bias)


class TorchCNN(nn.Module):
  """Two-conv, two-linear image classifier: NHWC images in, logits out."""

  def __init__(self, config: SmallCNNConfig):
    """Builds and initializes the layers (from torch's global generator).

    Args:
      config: the flax model's configuration.
    """
    super().__init__()
    self.config = config
    w1, w2 = config.widths
    flat = (config.image_size // 2) ** 2 * w2
    self.conv1 = nn.Conv2d(config.in_channels, w1, 3, padding="same")
    self.conv2 = nn.Conv2d(w1, w2, 3, padding="same")
    self.fc = nn.Linear(flat, config.hidden)
    self.head = nn.Linear(config.hidden, config.num_classes)
    _init(self.conv1, config.in_channels * 9)
    _init(self.conv2, w1 * 9)
    _init(self.fc, flat)
    _init(self.head, config.hidden)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """Maps (batch, H, W, C) images to (batch, num_classes) logits."""
    x = x.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW for the convs
    x = torch.relu(self.conv1(x))
    x = torch.relu(self.conv2(x))
    if self.config.pool == "max":
      x = nn.functional.max_pool2d(x, 2, 2)
    else:
      x = nn.functional.avg_pool2d(x, 2, 2)
    # Flattened in flax's (H, W, C) order, so the fc kernels match.
    x = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1)
    x = torch.relu(self.fc(x))
    return self.head(x)


def build(model_kwargs: Mapping[str, Any], seed: int) -> TorchCNN:
  """A :class:`TorchCNN` of the flax model's keyword arguments (digits:
  8x8x1 images, 10 classes), drawn after ``torch.manual_seed(seed)``."""
  torch.manual_seed(seed)
  return TorchCNN(SmallCNNConfig(**dict(model_kwargs)))


def load_flax_params(model: TorchCNN, params: Mapping[str, Any]) -> None:
  """Copies a flax :class:`~qsync_jax.models.cnn.SmallCNN`'s parameters
  (``{layer: {"kernel", "bias"}}`` arrays) into ``model``, transposed to
  torch's layouts."""
  with torch.no_grad():
    for name in LAYERS:
      kernel = np.asarray(params[name]["kernel"])
      # (H, W, in, out) -> (out, in, H, W); (in, out) -> (out, in).
      axes = (3, 2, 0, 1) if kernel.ndim == 4 else (1, 0)
      layer = getattr(model, name)
      layer.weight.copy_(torch.from_numpy(kernel.transpose(axes).copy()))
      layer.bias.copy_(torch.from_numpy(np.array(params[name]["bias"])))
