"""A GPT-style decoder language model, written as flax's examples write one.

Token and position ``nnx.Embed``, pre-LayerNorm blocks of causal
``nnx.MultiHeadAttention`` and a GELU MLP of ``nnx.Linear``, a final
``nnx.LayerNorm`` and a head tied to the token embedding (``embed.attend``)
or its own ``nnx.Linear``. Nothing in it knows about qsync_jax: the main job
plans every contraction, the attention's score and value matmuls included.

  python -m experiments.train --config.model=examples.gpt:make_gpt \
      --config.dataset=text --dataset_kwargs='{"seq_len": 64}' \
      --plan=auto --cluster=v100:2,t4:2 --out_dir=D

``python -m examples.gpt [seq_len]`` prints the baseline its loss must beat:
the entropy of the training targets' unigram distribution, in nats (the
loss's unit), on the text dataset cut into windows of ``seq_len`` (64).
"""

from __future__ import annotations

import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np


class Block(nnx.Module):
  """One pre-LayerNorm decoder block: causal self-attention, then an MLP."""

  def __init__(
    self,
    emb_dim: int,
    num_heads: int,
    mlp_dim: int,
    dropout_rate: float,
    *,
    rngs: nnx.Rngs,
  ):
    self.attention_norm = nnx.LayerNorm(emb_dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=num_heads,
      in_features=emb_dim,
      dropout_rate=dropout_rate,
      decode=False,
      rngs=rngs,
    )
    self.mlp_norm = nnx.LayerNorm(emb_dim, rngs=rngs)
    self.mlp_in = nnx.Linear(emb_dim, mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, emb_dim, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.dropout(self.attention(self.attention_norm(x), mask=mask))
    h = nnx.gelu(self.mlp_in(self.mlp_norm(x)))
    return x + self.dropout(self.mlp_out(h))


class GPT(nnx.Module):
  """Maps ``(batch, seq)`` token ids to ``(batch, seq, vocab)`` logits."""

  def __init__(
    self,
    *,
    vocab_size: int,
    max_len: int,
    num_layers: int,
    num_heads: int,
    emb_dim: int,
    mlp_dim: int,
    dropout_rate: float,
    tie_embeddings: bool,
    rngs: nnx.Rngs,
  ):
    self.token_embed = nnx.Embed(vocab_size, emb_dim, rngs=rngs)
    self.position_embed = nnx.Embed(max_len, emb_dim, rngs=rngs)
    self.blocks = nnx.List(
      [
        Block(emb_dim, num_heads, mlp_dim, dropout_rate, rngs=rngs)
        for _ in range(num_layers)
      ]
    )
    self.final_norm = nnx.LayerNorm(emb_dim, rngs=rngs)
    self.head = (
      None
      if tie_embeddings
      else nnx.Linear(emb_dim, vocab_size, use_bias=False, rngs=rngs)
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    positions = jnp.arange(tokens.shape[1])
    x = self.token_embed(tokens) + self.position_embed(positions)
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    x = self.final_norm(x)
    if self.head is None:
      return self.token_embed.attend(x)
    return self.head(x)


def make_gpt(
  *,
  rngs: nnx.Rngs,
  vocab_size: int,
  max_len: int = 64,
  num_layers: int = 2,
  num_heads: int = 4,
  emb_dim: int = 64,
  mlp_dim: int = 256,
  dropout_rate: float = 0.0,
  tie_embeddings: bool = True,
) -> GPT:
  """A GPT for ``--config.model=examples.gpt:make_gpt``.

  Args:
    rngs: RNG streams for the parameters (and dropout).
    vocab_size: token ids (the dataset gives it: 256 for bytes).
    max_len: the longest sequence (the dataset gives its window).
    num_layers: decoder blocks.
    num_heads: attention heads per block.
    emb_dim: model width.
    mlp_dim: the MLP's inner width.
    dropout_rate: dropout on each block's attention weights and outputs.
    tie_embeddings: the head is the token embedding's transpose
      (``embed.attend``); False gives it its own ``nnx.Linear``.

  Returns:
    The model.
  """
  return GPT(
    vocab_size=vocab_size,
    max_len=max_len,
    num_layers=num_layers,
    num_heads=num_heads,
    emb_dim=emb_dim,
    mlp_dim=mlp_dim,
    dropout_rate=dropout_rate,
    tie_embeddings=tie_embeddings,
    rngs=rngs,
  )


def unigram_entropy(tokens: np.ndarray) -> float:
  """The entropy, in nats, of the tokens' unigram distribution.

  The cross-entropy of the best model that ignores the context: a language
  model that learns anything from it ends below.

  Args:
    tokens: integer token ids, any shape.

  Returns:
    ``-sum(p * log p)`` over the token frequencies ``p``.
  """
  counts = np.bincount(np.asarray(tokens).ravel())
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


if __name__ == "__main__":
  from qsync_jax import data

  seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 64
  text = data.load_dataset("text", seq_len=seq_len)
  print(
    f"unigram entropy of the training targets: "
    f"{unigram_entropy(text.y_train):.4f} nats"
  )
