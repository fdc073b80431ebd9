"""What every built-in model shares: its config, its task, its input.

This module owns the small base classes of the model zoo. A built-in model is
built as ``cls(config, rngs=rngs)`` from a frozen dataclass config
(``cls.default_config`` when omitted), names its ``task`` and describes the
batch its ``__call__`` takes (``input_spec``), which is how the plan, the
sensitivity indicator and the predictor trace it without data.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from flax import nnx
import jax
import jax.numpy as jnp


class Model(nnx.Module):
  """A built-in model: a frozen config, a task and an input spec.

  Subclasses set :attr:`default_config` and call :meth:`_set_config` first
  in ``__init__`` (before creating layers, so parameter initialisation order
  is the subclass's own).
  """

  #: ``"classification"`` (logits per example) or ``"lm"`` (per token).
  task: ClassVar[str] = "classification"
  #: The config used when ``__init__`` gets none.
  default_config: ClassVar[Any]

  def _set_config(self, config: Any | None) -> Any:
    """Stores ``config`` (``default_config`` when None) and returns it."""
    self.config = self.default_config if config is None else config
    return self.config

  def input_spec(self, batch_size: int) -> jax.ShapeDtypeStruct:
    """Returns the batch that ``__call__`` takes."""
    raise NotImplementedError


class ModelClass(Protocol):
  """A built-in model's class: ``cls(config, rngs=rngs)`` builds one."""

  @property
  def default_config(self) -> Any:
    """The config used when the constructor gets none."""
    ...

  def __call__(self, config: Any = None, *, rngs: nnx.Rngs) -> Model: ...


class ImageModel(Model):
  """A model of square NHWC images (config: ``image_size``, ``in_channels``)."""

  def input_spec(self, batch_size: int) -> jax.ShapeDtypeStruct:
    """Returns the NHWC float32 image batch that ``__call__`` takes."""
    c = self.config
    return jax.ShapeDtypeStruct(
      (batch_size, c.image_size, c.image_size, c.in_channels), jnp.float32
    )


class TokenModel(Model):
  """A model of token sequences (config: ``max_len``)."""

  def input_spec(self, batch_size: int) -> jax.ShapeDtypeStruct:
    """Returns the int32 (batch, max_len) token batch ``__call__`` takes."""
    return jax.ShapeDtypeStruct((batch_size, self.config.max_len), jnp.int32)
