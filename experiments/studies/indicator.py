"""The indicator study (``experiments/indicator_study.py``).

This module owns :func:`study`: every sensitivity method of
:mod:`qsync_jax.sensitivity` scores the same model on the same batches, and
each is judged by the Spearman correlation of its scores with the measured
ground truth (:func:`qsync_jax.sensitivity.measure`). The time of one
training step (:func:`train_step_time`) is reported next to each method's
cost, as context.
"""

from __future__ import annotations

from collections.abc import Sequence
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
  too. Correlations run over all (layer, precision) pairs with a non-FP32
  precision.

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
    "spearman_vs_measured_loss", "time_s", "per_batch_s", "scores"}}}.
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
    vec = scores.vector(pairs)
    rho = lambda t, vec=vec: float(
      scipy_stats.spearmanr(vec, t.vector(pairs)).statistic
    )
    out["methods"][method] = {
      "spearman_vs_measured": rho(truth["grad"]),
      "spearman_vs_measured_loss": rho(truth["loss"]),
      "time_s": scores.time_s,
      "per_batch_s": scores.per_batch_s,
      "scores": scores.values,
    }
  return out
