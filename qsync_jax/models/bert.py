"""A BERT-style transformer encoder for sequence classification.

This module owns :class:`BertConfig` and :class:`BertEncoderClassifier`: token
and learned position embeddings, a stack of encoder layers from
:mod:`qsync_jax.models.transformer`, and a linear head on the first token.
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
class BertConfig:
  """Configuration of :class:`BertEncoderClassifier` (defaults: a small BERT).

  Attributes:
    vocab_size: number of token ids.
    max_len: sequence length of the input (and of the position table).
    num_layers: number of encoder layers.
    num_heads: attention heads per layer.
    hidden: model width.
    mlp_dim: MLP inner width.
    num_classes: number of output classes.
    pre_norm: pre-LayerNorm layers if True; post-LayerNorm (original BERT)
      otherwise.
    dropout_rate: dropout on each sub-block's output.
  """

  vocab_size: int = 30522
  max_len: int = 128
  num_layers: int = 4
  num_heads: int = 4
  hidden: int = 256
  mlp_dim: int = 1024
  num_classes: int = 2
  pre_norm: bool = False
  dropout_rate: float = 0.0


class BertEncoderClassifier(TokenModel):
  """Transformer encoder that classifies a sequence from its first token."""

  default_config: ClassVar[BertConfig] = BertConfig()

  def __init__(self, config: BertConfig | None = None, *, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model configuration; ``default_config`` when None.
      rngs: RNG streams for parameter initialisation.
    """
    config = self._set_config(config)
    self.token_embed = nnx.Embed(config.vocab_size, config.hidden, rngs=rngs)
    self.position_embed = nnx.Embed(config.max_len, config.hidden, rngs=rngs)
    # Post-LN BERT normalises the embeddings; pre-LN normalises the output of
    # the last layer instead. Either way there is exactly one extra norm.
    self.norm = nnx.LayerNorm(config.hidden, rngs=rngs)
    self.layers = nnx.List(
      [
        EncoderLayer(
          config.hidden,
          config.num_heads,
          config.mlp_dim,
          pre_norm=config.pre_norm,
          dropout_rate=config.dropout_rate,
          rngs=rngs,
        )
        for _ in range(config.num_layers)
      ]
    )
    self.head = nnx.Linear(config.hidden, config.num_classes, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Maps (batch, seq) token ids to float32 (batch, num_classes) logits."""
    positions = jnp.arange(tokens.shape[1])
    # Embeddings may be lowered; the residual stream stays float32.
    x = self.token_embed(tokens).astype(jnp.float32) + self.position_embed(
      positions
    ).astype(jnp.float32)
    if not self.config.pre_norm:
      x = self.norm(x)
    for layer in self.layers:
      x = layer(x)
    if self.config.pre_norm:
      x = self.norm(x)
    return self.head(x[:, 0]).astype(jnp.float32)
