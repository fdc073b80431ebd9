"""Data, models and losses that make training go wrong, for
tests/test_training_goes_wrong.py (factories the main job's config names).

The data is a tiny three-class problem (8 features, 64 examples); each
factory spoils it, or the model or the loss, in one way.
"""

from flax import nnx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax


def arrays(split, n=64):
  """``(inputs, labels)``: float32 features whose class shifts the mean."""
  rng = np.random.default_rng(0 if split == "train" else 1)
  y = rng.integers(0, 3, n).astype(np.int32)
  x = np.eye(3, 8, dtype=np.float32)[y] * 2 + rng.normal(size=(n, 8))
  return x.astype(np.float32), y


def nan_targets(split):
  """Regression targets (float labels), one of them NaN: the data checks
  pass float labels through, the loss of that example is NaN."""
  x, y = arrays(split)
  y = y.astype(np.float32)
  if split == "train":
    y[5] = np.nan
  return x, y


def nan_target_stream(split):
  """:func:`nan_targets` as a Grain stream (not read twice)."""
  x, y = nan_targets(split)
  return grain.MapDataset.source(list(zip(x, y))).to_iter_dataset()


def target_loss(logits, labels):
  """Squared error of the first output to a float target."""
  return jnp.mean((logits[:, 0] - labels) ** 2)


def nan_linear(*, rngs, input_shape, num_classes):
  """A linear model whose bias is NaN: its output is NaN from the start."""
  model = nnx.Linear(int(np.prod(input_shape)), num_classes, rngs=rngs)
  model.bias[...] = model.bias[...] * jnp.nan
  return model


def mse_loss(logits, labels):
  """Squared error to the one-hot labels: with SGD its gradient grows with
  the weights, so a learning rate too large makes the loss explode."""
  onehot = jax.nn.one_hot(labels, logits.shape[-1])
  return jnp.mean((logits - onehot) ** 2)


def sqrt_loss(logits, labels):
  """Cross-entropy plus ``0 * sqrt(0)``: the loss is finite, its gradient
  NaN (sqrt's derivative at 0 is infinite), so every step is skipped."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return ce.mean() + 0.0 * jnp.sqrt(jnp.abs(logits - logits)).sum()
