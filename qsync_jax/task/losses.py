"""Losses and metrics shared by every trainer.

Losses are computed in float32 whatever the plan: low-precision layers change
the arithmetic, not the objective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy in float32 (labels are integer class ids).

  Works for classification ``(batch, classes)`` and language modelling
  ``(batch, seq, vocab)`` logits alike.
  """
  return optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), labels
  ).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Fraction of positions whose arg-max logit is the label."""
  return (jnp.argmax(logits, -1) == labels).mean()
