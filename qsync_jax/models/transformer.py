"""Transformer building blocks shared by the BERT, decoder-LM and ViT models.

This module owns the single implementation of multi-head self-attention, the
GELU MLP and the (pre- or post-LayerNorm, optionally causal) encoder layer, so
that a precision plan sees the same layer names and forward order in every
transformer model.

Precision contract: any projection may return float16/bfloat16 once a plan
lowers it, so softmax and GELU run on float32 inputs and the residual stream is
kept in float32.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.plan.layers import MatMul


def _dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
  """Returns an ``nnx.Dropout`` that only owns an RNG stream when it can drop.

  A disabled dropout (rate 0) then adds no RNG state to the model, so the state
  holds only parameters (and batch statistics).

  Args:
    rate: the drop probability.
    rngs: the model's RNG streams; forked only when ``rate > 0``.

  Returns:
    The dropout layer.
  """
  return nnx.Dropout(rate, rngs=rngs if rate > 0 else None)


class SelfAttention(nnx.Module):
  """Multi-head self-attention with separate q/k/v/out projections.

  The two activation-by-activation products go through :class:`MatMul`
  (``scores`` and ``context``) so a precision plan can lower them.
  """

  def __init__(
    self, hidden: int, num_heads: int, *, causal: bool = False, rngs: nnx.Rngs
  ):
    """Builds the projections.

    Args:
      hidden: model width; must be divisible by ``num_heads``.
      num_heads: number of attention heads.
      causal: if True, position i attends only to positions <= i.
      rngs: RNG streams for parameter initialisation.
    """
    if hidden % num_heads:
      raise ValueError(
        f"hidden={hidden} is not divisible by num_heads={num_heads}"
      )
    self.num_heads = num_heads
    self.head_dim = hidden // num_heads
    self.causal = causal
    self.query = nnx.Linear(hidden, hidden, rngs=rngs)
    self.key = nnx.Linear(hidden, hidden, rngs=rngs)
    self.value = nnx.Linear(hidden, hidden, rngs=rngs)
    self.scores = MatMul()
    self.context = MatMul()
    self.out = nnx.Linear(hidden, hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Attends over the sequence.

    Args:
      x: (batch, seq, hidden) activations.

    Returns:
      (batch, seq, hidden) attention output, possibly in low precision.
    """
    batch, seq, _ = x.shape

    def split_heads(y):
      return y.reshape(batch, seq, self.num_heads, self.head_dim).transpose(
        0, 2, 1, 3
      )

    # Scale q before the product so low-precision scores stay in range.
    q = split_heads(self.query(x)) * (self.head_dim**-0.5)
    k = split_heads(self.key(x))
    v = split_heads(self.value(x))
    scores = self.scores("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    if self.causal:
      mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
      scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    context = self.context("bhqk,bhkd->bhqd", probs, v)
    context = context.transpose(0, 2, 1, 3).reshape(batch, seq, -1)
    return self.out(context)


class Mlp(nnx.Module):
  """Position-wise feed-forward block: Linear -> GELU -> Linear."""

  def __init__(self, hidden: int, mlp_dim: int, *, rngs: nnx.Rngs):
    """Builds the two projections.

    Args:
      hidden: model width.
      mlp_dim: inner width.
      rngs: RNG streams for parameter initialisation.
    """
    self.fc1 = nnx.Linear(hidden, mlp_dim, rngs=rngs)
    self.fc2 = nnx.Linear(mlp_dim, hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the MLP to (..., hidden) activations."""
    # GELU in float32: its erf/tanh loses too much in half precision.
    return self.fc2(jax.nn.gelu(self.fc1(x).astype(jnp.float32)))


class EncoderLayer(nnx.Module):
  """Self-attention + MLP with residuals, in pre- or post-LayerNorm order."""

  def __init__(
    self,
    hidden: int,
    num_heads: int,
    mlp_dim: int,
    *,
    pre_norm: bool = True,
    causal: bool = False,
    dropout_rate: float = 0.0,
    rngs: nnx.Rngs,
  ):
    """Builds the sub-blocks.

    Args:
      hidden: model width.
      num_heads: number of attention heads.
      mlp_dim: MLP inner width.
      pre_norm: LayerNorm before each sub-block (GPT/ViT) if True, after the
        residual add (original BERT) if False.
      causal: whether attention is causal.
      dropout_rate: dropout on each sub-block's output.
      rngs: RNG streams for initialisation (and dropout when enabled).
    """
    self.pre_norm = pre_norm
    self.attention_norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.attention = SelfAttention(hidden, num_heads, causal=causal, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.mlp = Mlp(hidden, mlp_dim, rngs=rngs)
    self.dropout = _dropout(dropout_rate, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps (batch, seq, hidden) to a float32 (batch, seq, hidden)."""
    x = x.astype(jnp.float32)
    if self.pre_norm:
      x = x + self.dropout(self.attention(self.attention_norm(x))).astype(
        jnp.float32
      )
      x = x + self.dropout(self.mlp(self.mlp_norm(x))).astype(jnp.float32)
    else:
      x = self.attention_norm(
        x + self.dropout(self.attention(x)).astype(jnp.float32)
      )
      x = self.mlp_norm(x + self.dropout(self.mlp(x)).astype(jnp.float32))
    return x
