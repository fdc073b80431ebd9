"""Models of every contracting flax layer type, NNX and Linen, for the zoo.

Each takes digits-shaped images ``(batch, 8, 8, 1)`` with pixels in [0, 1]
and returns ``num_classes`` logits, so the train binary can run them on the
``digits`` dataset. Tokens for the embedding are the rounded row means.
Every layer type is called once, and the user-written block computes four
raw contractions (two ``jnp.einsum``, two ``@``), one of two activations.
"""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp

WIDTH = 8
SEQ = 8


def _tokens(x, vocab):
  return jnp.clip(jnp.round(x[..., 0].mean(axis=2) * vocab), 0, vocab - 1)


class RawBlock(nnx.Module):
  """A user's layer: parameters and raw jnp contractions on them."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.w_in = nnx.Param(init(rngs.params(), (WIDTH, WIDTH)))
    self.w_mid = nnx.Param(init(rngs.params(), (WIDTH, WIDTH)))
    self.w_out = nnx.Param(init(rngs.params(), (WIDTH, WIDTH)))

  def __call__(self, x):
    h = jnp.einsum("btd,de->bte", x, self.w_in[...])
    h = jax.nn.relu(h @ self.w_mid)
    scores = jnp.einsum("btd,bsd->bts", h, h) / WIDTH
    h = jax.nn.softmax(scores) @ h
    return h @ self.w_out[...]


class NNXZoo(nnx.Module):
  """Every NNX contracting layer type, and a user's raw block."""

  def __init__(self, num_classes: int, *, rngs: nnx.Rngs):
    w = WIDTH
    self.conv2d = nnx.Conv(1, 4, (3, 3), strides=2, rngs=rngs)
    self.dilated = nnx.Conv(
      4, 4, (3, 3), kernel_dilation=2, padding="CIRCULAR", rngs=rngs
    )
    self.grouped = nnx.Conv(
      4, 4, (3, 3), feature_group_count=2, padding="REFLECT", rngs=rngs
    )
    self.depthwise = nnx.Conv(
      4, 4, (3, 3), feature_group_count=4, padding="VALID", rngs=rngs
    )
    self.transpose = nnx.ConvTranspose(4, 4, (3, 3), strides=2, rngs=rngs)
    self.conv3d = nnx.Conv(2, 2, (2, 2, 2), rngs=rngs)
    self.conv1d = nnx.Conv(8, w, (3,), strides=2, padding="CAUSAL", rngs=rngs)
    self.embed = nnx.Embed(num_classes, w, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=2, in_features=w, qkv_features=w, decode=False, rngs=rngs
    )
    self.split_heads = nnx.LinearGeneral(w, (2, w // 2), rngs=rngs)
    self.merge_heads = nnx.LinearGeneral(
      (2, w // 2), w, axis=(-2, -1), rngs=rngs
    )
    self.einsum = nnx.Einsum("btd,de->bte", (w, w), (w,), rngs=rngs)
    self.raw = RawBlock(rngs)
    self.linear = nnx.Linear(w, w, rngs=rngs)
    self.num_classes = num_classes

  def __call__(self, x):
    b = x.shape[0]
    h = jax.nn.relu(self.conv2d(x))  # (b, 4, 4, 4)
    h = jax.nn.relu(self.dilated(h))
    h = jax.nn.relu(self.grouped(h))
    h = jax.nn.relu(self.depthwise(h))  # (b, 2, 2, 4)
    h = jax.nn.relu(self.transpose(h))  # (b, 4, 4, 4)
    h = self.conv3d(h.reshape(b, 4, 4, 2, 2))  # (b, 4, 4, 2, 2)
    h = self.conv1d(h.reshape(b, 2 * SEQ, 4).repeat(2, axis=-1))
    tokens = _tokens(x, self.num_classes).astype(jnp.int32)
    h = h + self.embed(tokens)  # (b, SEQ, w)
    h = h + self.attention(h)
    h = self.merge_heads(self.split_heads(h))
    h = self.raw(jax.nn.relu(self.einsum(h)))
    h = jax.nn.relu(self.linear(h.mean(axis=1)))
    return self.embed.attend(h)


class LinenRaw(nn.Module):
  """A user's Linen layer with raw jnp contractions."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    w_in = self.param("w_in", init, (WIDTH, WIDTH))
    w_out = self.param("w_out", init, (WIDTH, WIDTH))
    h = jax.nn.relu(jnp.einsum("btd,de->bte", x, w_in))
    scores = jnp.einsum("btd,bsd->bts", h, h) / WIDTH
    h = jax.nn.softmax(scores) @ h
    return h @ w_out


class LinenZoo(nn.Module):
  """Every Linen contracting layer type, and a user's raw block."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    b, w = x.shape[0], WIDTH
    h = nn.relu(nn.Conv(4, (3, 3), strides=2)(x))
    h = nn.relu(nn.Conv(4, (3, 3), kernel_dilation=2, padding="CIRCULAR")(h))
    h = nn.relu(nn.Conv(4, (3, 3), feature_group_count=4, padding="VALID")(h))
    h = nn.relu(nn.ConvTranspose(4, (3, 3), strides=(2, 2))(h))
    h = nn.Conv(2, (2, 2, 2))(h.reshape(b, 4, 4, 2, 2))
    h = nn.Conv(w, (3,), strides=2, padding="CAUSAL")(
      h.reshape(b, 2 * SEQ, 4).repeat(2, axis=-1)
    )
    embed = nn.Embed(self.num_classes, w)
    h = h + embed(_tokens(x, self.num_classes).astype(jnp.int32))
    h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=w)(h)
    h = nn.DenseGeneral((2, w // 2))(h)
    h = nn.DenseGeneral(w, axis=(-2, -1))(h)
    h = nn.relu(nn.Einsum((w, w), "btd,de->bte")(h))
    h = LinenRaw()(h)
    h = nn.relu(nn.Dense(w)(h.mean(axis=1)))
    return embed.attend(h)


def nnx_zoo(*, rngs, num_classes, **unused):
  """The train binary's factory of :class:`NNXZoo`."""
  del unused
  return NNXZoo(num_classes, rngs=rngs)


def linen_zoo(*, rngs, num_classes, **unused):
  """The train binary's factory of :class:`LinenZoo`."""
  del rngs, unused  # Linen modules are initialised by the library's wrapper
  return LinenZoo(num_classes=num_classes)
