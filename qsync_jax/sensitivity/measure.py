"""The ground truth of sensitivity: switch one layer, measure.

This module owns :func:`measure`, what the indicator's methods are judged
by: switch only that layer to that precision and measure, averaged over the
batches, (a) the change of the loss and (b) the relative error of the full
gradient against FP32. All (layer, precision) variants run through one
compiled program that selects each layer's precision at run time with
``lax.switch``, so the cost is one compilation, not one per variant.
"""

from __future__ import annotations

from collections.abc import Sequence
import time
from typing import Any

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics import flatten
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan import policy
from qsync_jax.sensitivity import methods
from qsync_jax.sensitivity.scores import as_batches
from qsync_jax.sensitivity.scores import batch_key
from qsync_jax.sensitivity.scores import checked_layers
from qsync_jax.sensitivity.scores import DEFAULT_PRECISIONS
from qsync_jax.sensitivity.scores import Scores
from qsync_jax.task import calling
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn


def measure(
  model: nnx.Module,
  loss_fn: LossFn,
  batches: Sequence[Any],
  precisions: Sequence[Precision | str] = DEFAULT_PRECISIONS,
  *,
  quant: QuantConfig | None = None,
  seed: int = 0,
  call: calling.CallFn | None = None,
) -> dict[str, Scores]:
  """Measured sensitivity: each layer alone at each precision.

  Args:
    model: an NNX model in FP32 (left unchanged, its mode included).
    loss_fn: the loss in any form :func:`qsync_jax.task.as_objective` takes
      (None: classification on ``(inputs, labels)`` batches).
    batches: a few batches (any pytrees the objective takes).
    precisions: the precisions each layer is switched to.
    quant: the quantization (rounding mode) the ops use.
    seed: batch ``b``'s RNG streams (dropout) come from ``seed + b``, the
      same for every variant, as in :func:`qsync_jax.sensitivity.compute`.
    call: the call hook of the classification objectives.

  Returns:
    ``{"loss": Scores, "grad": Scores}``: mean ``|loss change|`` and mean
    relative L2 error of the full gradient against FP32, over the batches.

  Raises:
    ValueError: no batches, batches the model cannot take, or a model with
      no addressable layer.
  """
  parsed = [Precision.parse(p) for p in precisions]
  quant = quant or QuantConfig()
  objective = as_objective(loss_fn, call=call)
  batches = as_batches(batches)
  keys = [batch_key(seed, b) for b in range(len(batches))]
  layer_list = checked_layers(model, batches, objective)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  choices = [
    Precision.FP32,
    *[p for p in parsed if p not in methods.ZERO_PRECISIONS],
  ]
  evaluate = _switch_fn(graphdef, layer_list, objective, choices, quant)
  start = time.perf_counter()
  n = len(layer_list)
  ref = []
  for batch, key in zip(batches, keys):
    ref.append(evaluate(params, rest, batch, key, jnp.zeros(n, jnp.int32)))
  loss_values: dict[str, dict[str, float]] = {}
  grad_values: dict[str, dict[str, float]] = {}
  for i, layer in enumerate(layer_list):
    loss_values[layer.path], grad_values[layer.path] = {}, {}
    for p in methods.allowed_precisions(layer, parsed):
      select = jnp.zeros(n, jnp.int32).at[i].set(choices.index(p))
      dl, dg = [], []
      for batch, key, (l0, g0) in zip(batches, keys, ref):
        l1, g1 = evaluate(params, rest, batch, key, select)
        dl.append(abs(float(l1 - l0)))
        dg.append(float(jnp.linalg.norm(g1 - g0) / jnp.linalg.norm(g0)))
      loss_values[layer.path][p.value] = float(np.mean(dl))
      grad_values[layer.path][p.value] = float(np.mean(dg))
  elapsed = time.perf_counter() - start
  return {
    "loss": Scores(loss_values, "measured_loss", elapsed),
    "grad": Scores(grad_values, "measured_grad", elapsed),
  }


def _switch_fn(graphdef, layer_list, objective, choices, quant):
  """A jitted fn(params, rest, batch, key, select) -> (loss, flat grad).

  ``select[i]`` indexes ``choices`` for layer i (0 = FP32), so one compiled
  program evaluates every single-layer variant.
  """

  def op_for(module, precision):
    if policy.is_embedding(module):
      return None
    return policy.op_attribute(module)[1](precision, quant)

  @jax.jit
  def evaluate(params, rest, batch, key, select):
    model = nnx.merge(graphdef, params, rest)

    def make_wrapper(i, layer, base):
      module = layer.module
      if policy.is_embedding(module):
        dtypes = [
          jnp.float32
          if p is Precision.FP32
          else {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16}.get(
            p, jnp.float32
          )
          for p in choices
        ]

        def promote(arrays, **kw):
          (table,) = arrays
          branches = [
            lambda t, d=d: t.astype(d).astype(jnp.float32) for d in dtypes
          ]
          return base((lax.switch(select[i], branches, table),), **kw)

        return promote
      impls = [op_for(module, p) for p in choices]
      li, ri = policy.operand_positions(module)

      def switched(*args, **kwargs):
        def branch(f):
          def run_branch(operands):
            a = list(args)
            a[li], a[ri] = operands
            return f(*a, **kwargs).astype(jnp.float32)

          return run_branch

        return lax.switch(
          select[i], [branch(f) for f in impls], (args[li], args[ri])
        )

      return switched

    policy.instrument(model, layer_list, make_wrapper)
    # The batch's RNG streams are rebuilt from its key in every variant:
    # one dropout mask per batch (scores' capture pass derives them alike).
    loss, grads = nnx.value_and_grad(
      lambda m: objective(
        m, batch, nnx.Rngs(jax.random.fold_in(key, 1)), train=True
      )[0]
    )(model)
    return loss, flatten.ravel(grads)

  return evaluate
