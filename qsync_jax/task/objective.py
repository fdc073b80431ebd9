"""What a training step minimises and reports: the :class:`Objective`.

The trainer, the sensitivity indicator and the predictor all score a model on
a batch through one object, so a user's model and loss go everywhere the
built-in ones go. An objective is built from what users already write
(:func:`as_objective`):

* nothing: classification on ``(inputs, labels)`` batches, softmax
  cross-entropy and argmax accuracy (:func:`classification`);
* ``loss_fn(logits, labels) -> scalar``: the same with that loss;
* ``loss_fn(model, batch, rngs) -> (loss, aux)``: the user's own step, where
  ``aux`` is a dict of scalar metrics (or None); a function that returns
  ``(logits, labels)`` instead is scored as classification.

The batch is any pytree whose leaves share the leading (example) axis. The
model is called in train mode for training and in eval mode for evaluation
(:func:`qsync_jax.task.calling.mode`), with ``rngs`` for dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import inspect
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from qsync_jax.task import calling
from qsync_jax.task import losses

#: ``(model, batch, rngs, train) -> (loss, {name: scalar})``.
ScoreFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
#: ``metric(logits, labels) -> scalar`` (a mean over the batch).
MetricFn = Callable[[jax.Array, jax.Array], jax.Array]

DEFAULT_METRICS: Mapping[str, MetricFn] = {"accuracy": losses.accuracy}


@dataclasses.dataclass(frozen=True)
class Objective:
  """How a model is scored on a batch.

  Attributes:
    score: ``score(model, batch, rngs, train) -> (loss, metrics)``: the
      float32 scalar loss (a mean over the batch) and a dict of float32
      scalar metrics (means over the batch).
    inputs: ``inputs(batch)``, the model's inputs in a batch, for callers
      that run the model alone (:meth:`forward`); None when unknown.
    call: the call hook the objective uses (``call(model, inputs, *, train,
      rngs)``).
  """

  score: ScoreFn
  inputs: Callable[[Any], Any] | None = None
  call: calling.CallFn = calling.call_model

  def __call__(
    self,
    model: Any,
    batch: Any,
    rngs: nnx.Rngs | None = None,
    *,
    train: bool = True,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)`` of ``model`` on ``batch``; see :attr:`score`."""
    rngs = calling.trace_rngs() if rngs is None else rngs
    with calling.mode(model, train):
      loss, metrics = self.score(model, batch, rngs, train)
    return jnp.asarray(loss, jnp.float32), metrics

  def forward(
    self,
    model: Any,
    batch: Any,
    rngs: nnx.Rngs | None = None,
    *,
    train: bool = True,
  ) -> Any:
    """Runs the model alone on the batch's inputs (the loss when the
    objective does not know its inputs)."""
    if self.inputs is None:
      return self(model, batch, rngs, train=train)
    rngs = calling.trace_rngs() if rngs is None else rngs
    return self.call(model, self.inputs(batch), train=train, rngs=rngs)

  def probe(self, batch: Any) -> calling.Probe:
    """A :class:`~qsync_jax.task.calling.Probe` that runs a training step's
    forward pass and loss on ``batch`` (arrays or ShapeDtypeStructs)."""
    return calling.Probe(lambda model, b: self(model, b, train=True), batch)


#: A loss in any form :func:`as_objective` takes: None (classification), an
#: :class:`Objective`, ``loss_fn(logits, labels)`` or ``loss_fn(model, batch,
#: rngs)``.
LossFn = Objective | Callable[..., Any] | None


def batch_size(batch: Any) -> int:
  """Examples in ``batch``: the leading dimension of its first array.

  Raises:
    ValueError: the batch holds no array with a leading dimension.
  """
  leaves = jax.tree.leaves(batch)
  if not leaves or not getattr(leaves[0], "shape", ()):
    raise ValueError(
      "a batch must hold arrays whose leading axis is the "
      f"example axis, got {type(batch).__name__}"
    )
  return int(leaves[0].shape[0])


def _first(batch: Any) -> Any:
  if isinstance(batch, (tuple, list)) and len(batch) == 2:
    return batch[0]
  raise ValueError(
    "a classification batch is (inputs, labels), got "
    f"{type(batch).__name__}; pass a loss_fn(model, batch, rngs) for other "
    "batches"
  )


def loss_name(fn: Callable[..., Any]) -> str:
  """How messages name a user's loss: ``'package.module:name'``."""
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
  module = getattr(fn, "__module__", None)
  return repr(f"{module}:{name}" if module and name else fn)


def _scalar_loss(loss: Any, fn: Callable[..., Any]) -> Any:
  """``loss``, checked to be the scalar a gradient needs.

  Raises:
    ValueError: ``loss`` is not a scalar (a per-example loss not reduced
      over the batch), naming ``fn`` and the shape.
  """
  shape = getattr(loss, "shape", None)
  if shape is None and not isinstance(loss, (int, float)):
    raise ValueError(
      f"loss_fn {loss_name(fn)} returned a {type(loss).__name__}, not a "
      "scalar loss"
    )
  if shape:
    raise ValueError(
      f"loss_fn {loss_name(fn)} returned a loss of shape {tuple(shape)}, "
      "not a scalar: reduce it over the batch (e.g. its .mean())"
    )
  dtype = getattr(loss, "dtype", None)
  if isinstance(loss, int) or (
    dtype is not None and not jnp.issubdtype(dtype, jnp.inexact)
  ):
    raise ValueError(
      f"loss_fn {loss_name(fn)} returned a loss of type "
      f"{dtype or type(loss).__name__}, not a float: an integer has no "
      "gradient, so training would not move"
    )
  return loss


def _logit_metrics(
  logits: jax.Array, labels: jax.Array, metrics: Mapping[str, MetricFn]
) -> dict[str, jax.Array]:
  return {
    name: jnp.asarray(fn(logits, labels), jnp.float32)
    for name, fn in metrics.items()
  }


def classification(
  call: calling.CallFn = calling.call_model,
  *,
  loss: Callable[[jax.Array, jax.Array], jax.Array] = losses.cross_entropy,
  metrics: Mapping[str, MetricFn] | None = None,
) -> Objective:
  """Classification (or language modelling) on ``(inputs, labels)`` batches.

  Args:
    call: how the model is called (default
      :func:`~qsync_jax.task.calling.call_model`).
    loss: ``loss(logits, labels) -> scalar`` (default softmax cross-entropy
      in float32).
    metrics: ``{name: metric(logits, labels)}``; default argmax accuracy.

  Returns:
    The objective. Calling it raises ``ValueError`` (naming ``loss``) where
    ``loss`` returns something other than a float scalar.
  """
  metrics = dict(DEFAULT_METRICS if metrics is None else metrics)

  def score(model, batch, rngs, train):
    inputs, labels = _first(batch), batch[1]
    logits = call(model, inputs, train=train, rngs=rngs)
    return (
      _scalar_loss(loss(logits, labels), loss),
      _logit_metrics(logits, labels, metrics),
    )

  return Objective(score, _first, call)


def _scalar_metrics(aux: Any, fn: Callable[..., Any]) -> dict[str, jax.Array]:
  if aux is None:
    return {}
  if not isinstance(aux, Mapping):
    raise ValueError(
      f"loss_fn {loss_name(fn)} must return (loss, aux) with aux a dict "
      f"of scalar metrics or None, got aux of type {type(aux).__name__}"
    )
  # Metrics are scalars; other auxiliary outputs (logits, ...) are the
  # user's own and not averaged.
  return {
    str(k): jnp.asarray(v, jnp.float32)
    for k, v in aux.items()
    if jnp.ndim(v) == 0
  }


def from_loss_fn(
  loss_fn: Callable[[Any, Any, nnx.Rngs], Any],
  *,
  inputs: Callable[[Any], Any] | None = None,
  metrics: Mapping[str, MetricFn] | None = None,
) -> Objective:
  """The objective of a user's ``loss_fn(model, batch, rngs)``.

  Args:
    loss_fn: returns ``(loss, aux)`` with a scalar ``loss`` and ``aux`` a
      dict of metrics (scalars kept) or None; or ``(logits, labels)``, scored
      with softmax cross-entropy and ``metrics``. It calls the model itself;
      the model is in train or eval mode already (NNX attributes).
    inputs: ``inputs(batch)``, the model's inputs (optional; lets BatchNorm
      statistics be re-estimated by running the model alone).
    metrics: the classification metrics for a ``(logits, labels)`` return.

  Returns:
    The objective. Calling it raises ``ValueError`` (naming ``loss_fn``)
    where ``loss_fn`` returns another form, a loss that is not a scalar, or
    an integer loss.
  """
  metrics = dict(DEFAULT_METRICS if metrics is None else metrics)

  def score(model, batch, rngs, train):
    del train  # the model's mode attributes say it
    out = loss_fn(model, batch, rngs)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise ValueError(
        f"loss_fn {loss_name(loss_fn)} must return (loss, aux) or (logits, "
        f"labels), got {_described(out)}"
      )
    first, second = out
    if second is None or isinstance(second, Mapping):
      # (loss, aux): the loss must be a scalar.
      return _scalar_loss(first, loss_fn), _scalar_metrics(second, loss_fn)
    if jnp.ndim(first) == 0:
      return first, _scalar_metrics(second, loss_fn)
    return (
      losses.cross_entropy(first, second),
      _logit_metrics(first, second, metrics),
    )

  return Objective(score, inputs)


def _described(value: Any) -> str:
  """A user's return value in words: its type, and its shape or length."""
  if hasattr(value, "shape"):
    return f"an array of shape {tuple(value.shape)}"
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  return f"a {type(value).__name__}"


def _required_positional(fn: Callable[..., Any]) -> int | None:
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return None
  return sum(
    1
    for p in params
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    and p.default is p.empty
  )


def as_objective(
  loss_fn: LossFn = None, *, call: calling.CallFn | None = None
) -> Objective:
  """The :class:`Objective` of whatever the user passed as a loss.

  Args:
    loss_fn: None (classification), an :class:`Objective`, a
      ``loss_fn(logits, labels)`` or a ``loss_fn(model, batch, rngs)`` (see
      the module docstring).
    call: the call hook ``call(model, inputs, *, train, rngs)`` for the
      classification objectives (default
      :func:`~qsync_jax.task.calling.call_model`).

  Returns:
    The objective.

  Raises:
    TypeError: ``loss_fn`` has none of these forms.
  """
  if isinstance(loss_fn, Objective):
    return loss_fn
  call = call or calling.call_model
  if loss_fn is None:
    return classification(call)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
  arity = _required_positional(loss_fn)
  if arity == 2:
    return classification(call, loss=loss_fn)
  if arity == 3:
    return from_loss_fn(loss_fn)
  raise TypeError(
    f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} takes {arity} "
    "required positional arguments; expected loss_fn(logits, labels) or "
    "loss_fn(model, batch, rngs)"
  )
