"""The indicator study (``experiments/indicator_study.py``).

This module owns :func:`study`: every sensitivity method of
:mod:`qsync_jax.sensitivity` scores the same model on the same batches, and
each is judged by the Spearman correlation of its scores with the measured
ground truth (:func:`qsync_jax.sensitivity.measure`): over all (layer,
precision) pairs, and within each precision (:func:`within_precision`). The
allocator decides which layers go to a given precision, so the
within-precision figures are the ones that judge an indicator for it: the
overall figure is dominated by the precisions themselves (scores that put
every INT8 pair above every FP16 pair reach a high overall correlation
whatever their order of the layers). The time of one training step
(:func:`train_step_time`) is reported next to each method's cost, as
context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

from qsync_jax import sensitivity
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.predictor import timing
from qsync_jax.train import step as step_lib

#: The fewest layers a within-precision correlation is computed over.
MIN_LAYERS = 3


def spearman(
  scores: np.ndarray, truth: np.ndarray
) -> tuple[float | None, str | None]:
  """Spearman correlation of two vectors, or None and why it is undefined.

  Returns:
    ``(rho, None)``, or ``(None, reason)`` for fewer than :data:`MIN_LAYERS`
    entries or a constant vector (where the correlation is undefined).
  """
  if len(scores) < MIN_LAYERS:
    return None, f"{len(scores)} layer(s), fewer than {MIN_LAYERS}"
  if np.ptp(scores) == 0:
    return None, "constant scores"
  if np.ptp(truth) == 0:
    return None, "constant measured values"
  return float(scipy_stats.spearmanr(scores, truth).statistic), None


def within_precision(
  scores: sensitivity.Scores,
  truth: Mapping[str, sensitivity.Scores],
  pairs: Sequence[tuple[str, str]],
) -> dict[str, dict[str, Any]]:
  """Spearman correlations over the layers of each precision separately.

  Args:
    scores: a method's scores.
    truth: :func:`qsync_jax.sensitivity.measure`'s ``{"grad", "loss"}``.
    pairs: the (layer, precision) pairs judged, in order.

  Returns:
    ``{precision: {"num_layers", "spearman_vs_measured",
    "spearman_vs_measured_loss", "null_reasons"}}`` (in the order the
    precisions first appear in ``pairs``): the correlations with the measured
    gradient error and loss change over the layers scored at that precision,
    each None where undefined, with its reason in ``null_reasons`` (``{key:
    reason}``, empty when both are defined).
  """
  out: dict[str, dict[str, Any]] = {}
  for prec in dict.fromkeys(p for _, p in pairs):
    sub = [pair for pair in pairs if pair[1] == prec]
    out[prec] = {"num_layers": len(sub), **correlations(scores, truth, sub)}
  return out


def correlations(
  scores: sensitivity.Scores,
  truth: Mapping[str, sensitivity.Scores],
  pairs: Sequence[tuple[str, str]],
) -> dict[str, Any]:
  """Spearman of ``scores`` with both measured truths over ``pairs``.

  Returns:
    ``{"spearman_vs_measured", "spearman_vs_measured_loss",
    "null_reasons"}``: the correlations with the gradient error and the loss
    change (None where undefined), and ``{key: reason}`` for each None.
  """
  row: dict[str, Any] = {"null_reasons": {}}
  for key, kind in (
    ("spearman_vs_measured", "grad"),
    ("spearman_vs_measured_loss", "loss"),
  ):
    row[key], reason = spearman(scores.vector(pairs), truth[kind].vector(pairs))
    if reason is not None:
      row["null_reasons"][key] = reason
  return row


def mean_within(
  within: Mapping[str, Mapping[str, Any]], key: str
) -> float | None:
  """The mean of ``key`` over the precisions where it is defined (or None)."""
  vals = [r[key] for r in within.values() if r[key] is not None]
  return float(np.mean(vals)) if vals else None


def train_step_time(
  model: nnx.Module, loss_fn, batch, repeats: int = 5
) -> float:
  """Median seconds of the trainer's gradient step on ``batch`` (compiled).

  The step is :func:`qsync_jax.train.step.grad_function`, what a worker runs
  (without the optimizer update), timed by
  :func:`qsync_jax.predictor.timing.burst_median`; ``loss_fn`` is any form
  :func:`qsync_jax.task.as_objective` takes and ``batch`` any pytree.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  flat, unravel = ravel_pytree(params)
  grad_fn = step_lib.grad_function(graphdef, unravel, loss_fn)
  args = (
    flat[None],
    rest,
    jnp.ones((1,), jnp.float32),
    jax.tree.map(jnp.asarray, batch),
    np.zeros(2, np.uint32),
  )
  return timing.burst_median(lambda: grad_fn(*args), repeats)


def study(
  model: nnx.Module,
  loss_fn,
  batches: Sequence[tuple[Any, Any]],
  precisions: Sequence[Precision | str] = (sensitivity.DEFAULT_PRECISIONS),
  methods: Sequence[str] = sensitivity.METHODS,
  *,
  seed: int = 0,
  quant: QuantConfig | None = None,
) -> dict[str, Any]:
  """Scores every method and judges it against the measured ground truth.

  The primary ground truth is the relative error of the full gradient (what
  training feels); the Spearman correlation with the loss change is reported
  too. The overall correlations run over all (layer, precision) pairs with a
  non-FP32 precision; the within-precision ones over the layers of each
  precision (:func:`within_precision`), and their mean over the precisions.
  A correlation that is undefined (fewer than :data:`MIN_LAYERS` entries, a
  constant vector) is None, with its reason.

  Args:
    model: an NNX model in FP32.
    loss_fn: the loss in any form :func:`qsync_jax.task.as_objective`
      takes (None: classification).
    batches: a few batches (any pytrees the objective takes), for the
      methods and the truth alike.
    precisions: the candidate precisions.
    methods: the methods judged (:data:`qsync_jax.sensitivity.METHODS`).
    seed: for the random method and the Hutchinson probes.
    quant: the quantization (rounding mode) the ops use.

  Returns:
    {"layers", "precisions", "num_batches", "train_step_s", "measured":
    {"grad", "loss"}, "methods": {name: {"spearman_vs_measured",
    "spearman_vs_measured_loss", "null_reasons", "within_precision",
    "mean_within_vs_measured", "mean_within_vs_measured_loss", "time_s",
    "per_batch_s", "scores"}}}; ``within_precision`` as
    :func:`within_precision` returns it.
  """
  precisions = [Precision.parse(p) for p in precisions]
  truth = sensitivity.measure(model, loss_fn, batches, precisions, quant=quant)
  pairs = truth["grad"].pairs()
  out = {
    "layers": truth["grad"].layers,
    "precisions": [p.value for p in precisions],
    "num_batches": len(batches),
    "train_step_s": train_step_time(model, loss_fn, batches[0]),
    "measured": {k: v.to_dict() for k, v in truth.items()},
    "methods": {},
  }
  for method in methods:
    scores = sensitivity.compute(
      model, loss_fn, batches, method, precisions, quant=quant, seed=seed
    )
    row = correlations(scores, truth, pairs)
    within = within_precision(scores, truth, pairs)
    within = {p: within[p] for p in out["precisions"] if p in within}
    out["methods"][method] = {
      **row,
      "within_precision": within,
      "mean_within_vs_measured": mean_within(within, "spearman_vs_measured"),
      "mean_within_vs_measured_loss": mean_within(
        within, "spearman_vs_measured_loss"
      ),
      "time_s": scores.time_s,
      "per_batch_s": scores.per_batch_s,
      "scores": scores.values,
    }
  return out
