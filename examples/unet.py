"""A small U-Net that denoises scikit-learn's digits, with its data and loss.

The model is written as flax's examples write one: an ``nnx.Conv`` down path
(strided convolutions), an ``nnx.ConvTranspose`` up path and skip
connections by concatenation. The data come through the main job's user-data
door (:func:`noisy_digits`: noisy images as inputs, the clean ones as
targets) and the loss through its user-loss hook (:func:`mse_loss`):

  python -m experiments.train --config.model=examples.unet:make_unet \
      --config.dataset=examples.unet:noisy_digits \
      --config.loss_fn=examples.unet:mse_loss --plan=auto \
      --cluster=v100:2,t4:2 --out_dir=D

``python -m examples.unet`` prints the test split's baselines: the MSE of
the noisy input taken as the prediction, and of the untrained model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

#: Digits images 0..1499 train, the rest (297) test.
NUM_TRAIN = 1500


def noisy_digits(
  split: str, size: int = 16, noise: float = 0.3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
  """Noisy digits and their clean originals, for ``--config.dataset``.

  Args:
    split: ``"train"`` (the first 1500 images) or ``"test"`` (the rest).
    size: image side; the 8x8 digits are resized bilinearly.
    noise: standard deviation of the Gaussian noise added to the images
      (pixels are in [0, 1]).
    seed: the noise's seed (the test split draws from ``seed + 1``).

  Returns:
    ``(noisy, clean)``, float32 arrays of shape ``(N, size, size, 1)``.

  Raises:
    ValueError: an unknown split.
  """
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  images = load_digits().images.astype(np.float32) / 16.0
  images = images[:NUM_TRAIN] if split == "train" else images[NUM_TRAIN:]
  clean = np.asarray(
    jax.image.resize(jnp.asarray(images), (len(images), size, size), "linear"),
    dtype=np.float32,
  )[..., None]
  rng = np.random.default_rng(seed + (split == "test"))
  noisy = clean + noise * rng.standard_normal(clean.shape).astype(np.float32)
  return noisy, clean


def mse_loss(
  model: Any, batch: tuple[jax.Array, jax.Array], rngs: nnx.Rngs
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean squared error of the denoised images, for ``--config.loss_fn``.

  Args:
    model: the denoiser.
    batch: ``(noisy, clean)`` images.
    rngs: unused (the model draws no randomness).

  Returns:
    ``(loss, {"mse": loss})``.
  """
  del rngs
  noisy, clean = batch
  mse = jnp.mean((model(noisy).astype(jnp.float32) - clean) ** 2)
  return mse, {"mse": mse}


class ConvBlock(nnx.Module):
  """Two 3x3 convolutions with ReLU; the first may stride to go down."""

  def __init__(
    self, in_features: int, out_features: int, strides: int, *, rngs: nnx.Rngs
  ):
    self.conv_0 = nnx.Conv(
      in_features, out_features, (3, 3), strides=strides, rngs=rngs
    )
    self.conv_1 = nnx.Conv(out_features, out_features, (3, 3), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return nnx.relu(self.conv_1(nnx.relu(self.conv_0(x))))


class UpBlock(nnx.Module):
  """A 2x2 stride-2 transposed convolution, the skip concatenated, a block."""

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
    self.up = nnx.ConvTranspose(
      in_features, out_features, (2, 2), strides=(2, 2), rngs=rngs
    )
    self.block = ConvBlock(2 * out_features, out_features, 1, rngs=rngs)

  def __call__(self, x: jax.Array, skip: jax.Array) -> jax.Array:
    x = nnx.relu(self.up(x))
    return self.block(jnp.concatenate([x, skip], axis=-1))


class UNet(nnx.Module):
  """Maps ``(batch, H, W, C)`` images to images of the same shape.

  ``H`` and ``W`` must be divisible by ``2 ** (len(features) - 1)``.
  """

  def __init__(
    self, in_channels: int, features: Sequence[int], *, rngs: nnx.Rngs
  ):
    widths = [in_channels, *features]
    self.down = nnx.List(
      [
        ConvBlock(widths[i], widths[i + 1], 1 if i == 0 else 2, rngs=rngs)
        for i in range(len(features))
      ]
    )
    self.up = nnx.List(
      [
        UpBlock(features[i], features[i - 1], rngs=rngs)
        for i in range(len(features) - 1, 0, -1)
      ]
    )
    self.out = nnx.Conv(features[0], in_channels, (1, 1), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    skips = []
    for block in self.down:
      x = block(x)
      skips.append(x)
    skips.pop()  # the bottleneck's output is x itself
    for block in self.up:
      x = block(x, skips.pop())
    return self.out(x)


def make_unet(
  *, rngs: nnx.Rngs, in_channels: int, features: Sequence[int] = (16, 32, 64)
) -> UNet:
  """A U-Net for ``--config.model=examples.unet:make_unet``.

  Args:
    rngs: RNG streams for the parameters.
    in_channels: image channels (the dataset gives them).
    features: channels at each resolution, full size first; each next one
      halves the image.

  Returns:
    The model.
  """
  return UNet(in_channels, tuple(features), rngs=rngs)


def baselines(seed: int = 0, **data_kwargs: Any) -> dict[str, float]:
  """The test split's MSE of the noisy input and of the untrained model.

  Args:
    seed: the model's seed (the main job's ``--config.seed``).
    **data_kwargs: :func:`noisy_digits`'s keyword arguments.

  Returns:
    ``{"identity_mse", "untrained_mse"}``.
  """
  noisy, clean = noisy_digits("test", **data_kwargs)
  model = make_unet(rngs=nnx.Rngs(seed), in_channels=noisy.shape[-1])
  untrained, _ = mse_loss(model, (noisy, clean), nnx.Rngs(0))
  return {
    "identity_mse": float(np.mean((noisy - clean) ** 2)),
    "untrained_mse": float(untrained),
  }


if __name__ == "__main__":
  print(baselines())
