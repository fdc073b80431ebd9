"""A byte-level causal decoder language model.

This module owns :class:`DecoderLMConfig` and :class:`DecoderLM`: token and
learned position embeddings, pre-LayerNorm causal layers from
:mod:`qsync_jax.models.transformer`, a final LayerNorm and a linear head to the
vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.models.base import TokenModel
from qsync_jax.models.transformer import EncoderLayer


@dataclasses.dataclass(frozen=True)
class DecoderLMConfig:
  """Configuration of :class:`DecoderLM`.

  Attributes:
    vocab_size: number of token ids (256 for bytes).
    max_len: longest sequence; ``input_spec`` uses this length.
    num_layers: number of decoder layers.
    num_heads: attention heads per layer.
    hidden: model width.
    mlp_dim: MLP inner width.
    dropout_rate: dropout on each sub-block's output.
  """

  vocab_size: int = 256
  max_len: int = 256
  num_layers: int = 4
  num_heads: int = 4
  hidden: int = 256
  mlp_dim: int = 1024
  dropout_rate: float = 0.0


class DecoderLM(TokenModel):
  """GPT-style decoder: predicts token t+1 from tokens <= t."""

  task: ClassVar[str] = "lm"
  default_config: ClassVar[DecoderLMConfig] = DecoderLMConfig()

  def __init__(self, config: DecoderLMConfig | None = None, *, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model configuration; ``default_config`` when None.
      rngs: RNG streams for parameter initialisation.
    """
    config = self._set_config(config)
    self.token_embed = nnx.Embed(config.vocab_size, config.hidden, rngs=rngs)
    self.position_embed = nnx.Embed(config.max_len, config.hidden, rngs=rngs)
    self.layers = nnx.List(
      [
        EncoderLayer(
          config.hidden,
          config.num_heads,
          config.mlp_dim,
          pre_norm=True,
          causal=True,
          dropout_rate=config.dropout_rate,
          rngs=rngs,
        )
        for _ in range(config.num_layers)
      ]
    )
    self.final_norm = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.head = nnx.Linear(config.hidden, config.vocab_size, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Maps (batch, seq) token ids to float32 (batch, seq, vocab) logits."""
    positions = jnp.arange(tokens.shape[1])
    # Embeddings may be lowered; the residual stream stays float32.
    x = self.token_embed(tokens).astype(jnp.float32) + self.position_embed(
      positions
    ).astype(jnp.float32)
    for layer in self.layers:
      x = layer(x)
    return self.head(self.final_norm(x)).astype(jnp.float32)
