"""Sensitivity scores: the :class:`Scores` table and :func:`compute`.

This module owns the indicator's entry point and its data:
``compute(model, loss_fn, batches, method=..., precisions=...)`` returns
:class:`Scores`: for each addressable layer and each candidate precision, how
much the model suffers when that layer alone computes at that precision
(larger = more sensitive; FP32 and TF32 score 0). The formulas of the methods
live in :mod:`qsync_jax.sensitivity.methods`; this module runs the capture
pass they start from: for ``qsync`` and ``qsync_var``, statistics (activation
scale, norm and size, weight-gradient norm and its FP16 exponent) captured
inside the forward and backward pass in FP32 and averaged over the batches
(the weight gradient accumulated over them, as QSync's profiler does).

Models are scored through the model-call contract of :mod:`qsync_jax.task`:
the loss is any form :func:`qsync_jax.task.as_objective` takes, batches are
any pytrees, the model runs in train mode with RNG streams fixed per batch
(dropout draws one mask per batch, the same in every pass over it), and the
model's own mode is left as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import json
import time
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan import policy
from qsync_jax.sensitivity import depth
from qsync_jax.sensitivity import methods
from qsync_jax.sensitivity.methods import DEFAULT_METHOD
from qsync_jax.sensitivity.methods import METHODS
from qsync_jax.task import calling
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn
from qsync_jax.task.objective import Objective

#: The precisions scored by default.
DEFAULT_PRECISIONS = (Precision.INT8, Precision.FP16, Precision.BF16)


@dataclasses.dataclass
class Scores:
  """Sensitivity per layer and precision.

  Attributes:
    values: ``{layer path: {precision name: score}}``.
    method: the method that produced them.
    time_s: the wall time it took, compilation included.
    per_batch_s: for the gradient-statistics methods, the time per batch
      once compiled (None otherwise).
  """

  values: dict[str, dict[str, float]]
  method: str
  time_s: float = 0.0
  per_batch_s: float | None = None

  def __getitem__(self, path: str) -> dict[str, float]:
    return self.values[path]

  @property
  def layers(self) -> list[str]:
    return list(self.values)

  def pairs(self) -> list[tuple[str, str]]:
    """(layer, precision) pairs with a non-FP32 precision, in order."""
    return [
      (l, p)
      for l, row in self.values.items()
      for p in row
      if Precision(p) not in methods.ZERO_PRECISIONS
    ]

  def vector(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    return np.array([self.values[l][p] for l, p in pairs], np.float64)

  def to_dict(self) -> dict[str, Any]:
    return {
      "method": self.method,
      "time_s": self.time_s,
      "per_batch_s": self.per_batch_s,
      "values": self.values,
    }

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Scores:
    return cls(
      {l: dict(r) for l, r in data["values"].items()},
      data["method"],
      data.get("time_s", 0.0),
      data.get("per_batch_s"),
    )


def compute(
  model: nnx.Module,
  loss_fn: LossFn,
  batches: Sequence[Any],
  method: str = DEFAULT_METHOD,
  precisions: Iterable[Precision | str] = DEFAULT_PRECISIONS,
  *,
  quant: QuantConfig | None = None,
  seed: int = 0,
  hessian_probes: int = 8,
  call: calling.CallFn | None = None,
) -> Scores:
  """Scores every (layer, precision) of ``model`` with ``method``.

  Args:
    model: an NNX model in FP32 (its current plan is ignored: statistics are
      captured in FP32; its mode and state are left unchanged).
    loss_fn: the loss in any form :func:`qsync_jax.task.as_objective` takes:
      None (classification on ``(inputs, labels)``), ``loss_fn(logits,
      labels)``, ``loss_fn(model, batch, rngs)`` or an ``Objective``.
    batches: a few batches (any pytrees the objective takes).
    method: one of :data:`METHODS`; default :data:`DEFAULT_METHOD`
      (``qsync_var``, the best ranking of layers within each precision in
      ``experiments.indicator_study``; ``"qsync"`` is QSync's formula).
    precisions: candidate precisions (FP32 scores 0; embeddings and
      attention matmuls only get 16-bit ones).
    quant: the quantization (rounding mode) the ops use.
    seed: for ``random`` and the Hutchinson probes; batch ``b``'s RNG
      streams (dropout) are seeded with ``seed + b``.
    hessian_probes: Hutchinson probes per batch.
    call: the call hook ``call(model, inputs, *, train, rngs)`` of the
      classification objectives (default
      :func:`qsync_jax.task.call_model`).

  Returns:
    :class:`Scores`; ``time_s`` is the method's wall time.

  Raises:
    ValueError: unknown method, no batches, a model with no addressable
      layer, or batches the model cannot take.
  """
  if method not in METHODS:
    raise ValueError(
      f"unknown indicator method {method!r}; valid: {', '.join(METHODS)}"
    )
  parsed = [Precision.parse(p) for p in precisions]
  quant = quant or QuantConfig()
  objective = as_objective(loss_fn, call=call)
  batches = as_batches(batches)
  layer_list = checked_layers(model, batches, objective)
  start = time.perf_counter()
  steady_s = None
  if method in ("qsync", "qsync_var"):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    capture = _capture_fn(
      graphdef,
      layer_list,
      objective,
      parsed,
      quant.rounding,
      curvature=method == "qsync_var",
    )
    per_batch = []
    for b, batch in enumerate(batches):
      if b == 1:
        steady_start = time.perf_counter()
      per_batch.append(
        jax.block_until_ready(
          capture(params, rest, batch, batch_key(seed, b))[1]
        )
      )
    if len(batches) > 1:
      steady_s = (time.perf_counter() - steady_start) / (len(batches) - 1)
    stats = _mean_stats(per_batch)
    if method == "qsync":
      depths, lookup = depth.forward_structure(
        model, layer_list, forward_probe(objective, batches[0])
      )
      values = methods.qsync_scores(stats, layer_list, parsed, depths, lookup)
    else:
      values = methods.qsync_var_scores(stats, layer_list, parsed)
  elif method == "wvar":
    values = methods.wvar_scores(model, layer_list, parsed, quant)
  elif method == "hessian":
    values = methods.hessian_scores(
      model,
      layer_list,
      objective,
      batches,
      parsed,
      quant,
      hessian_probes,
      seed,
    )
  else:
    values = methods.random_scores(layer_list, parsed, seed)
  for row in values.values():
    for p in methods.ZERO_PRECISIONS:
      row[p.value] = 0.0
  return Scores(values, method, time.perf_counter() - start, steady_s)


def as_batches(batches: Sequence[Any]) -> list[Any]:
  """The batches as a list of pytrees of jax arrays (any pytree works)."""
  return [jax.tree.map(jnp.asarray, batch) for batch in batches]


def batch_key(seed: int, b: int) -> jax.Array:
  """The PRNG key of batch ``b``: its RNG streams (dropout) are derived
  from it, fixed per batch, so every pass over a batch draws one mask."""
  return jax.random.key(seed + b)


def forward_probe(objective: Objective, batch: Any) -> calling.Probe:
  """A Probe of the model's train-mode forward pass on ``batch``'s inputs
  (of the objective's whole loss when it does not know its inputs)."""
  return calling.Probe(
    lambda model, b: objective.forward(model, b, train=True),
    calling.abstract(batch),
  )


def checked_layers(
  model: nnx.Module, batches: Sequence[Any], objective: Objective | None = None
) -> list[policy.Layer]:
  """The layers a plan can address in ``model``, traced on ``batches[0]``.

  The model is traced (abstractly) through the objective's training step on
  the first batch, so no ``input_spec`` is needed; where the trace fails and
  the model has an ``input_spec`` the batch disagrees with, the error says
  so.

  Args:
    model: the NNX model.
    batches: the batches (any pytrees the objective takes).
    objective: the objective (default: classification).

  Raises:
    ValueError: no batches, batches the model cannot take, or a model with
      no addressable layer.
  """
  if not batches:
    raise ValueError("the indicator needs at least one batch")
  objective = objective or as_objective(None)
  batch = calling.abstract(jax.tree.map(jnp.asarray, batches[0]))
  try:
    return policy.model_layers(model, objective.probe(batch))
  except (TypeError, ValueError) as e:
    if "no layer a precision plan can address" in str(e):
      raise
    mismatch = _input_spec_mismatch(model, objective, batch)
    if mismatch:
      raise ValueError(mismatch) from None
    shapes = jax.tree.map(lambda a: tuple(a.shape), batch)
    raise ValueError(
      f"the model cannot run on batches of shape {shapes}: {e}"
    ) from None


def _input_spec_mismatch(
  model: nnx.Module, objective: Objective, batch: Any
) -> str | None:
  """How a batch's single input differs from ``model.input_spec`` (None
  when the model has none, the inputs are unknown or not one array, or they
  agree)."""
  spec = getattr(model, "input_spec", None)
  if not callable(spec) or objective.inputs is None:
    return None
  try:
    inputs = objective.inputs(batch)
  except (TypeError, ValueError, IndexError, KeyError):
    return None
  if not getattr(inputs, "shape", None):
    return None
  want = spec(inputs.shape[0])
  if tuple(inputs.shape) == tuple(getattr(want, "shape", ())):
    return None
  return (
    f"batch input of shape {tuple(inputs.shape)} does not match the "
    f"model's input_spec {tuple(want.shape)}"
  )


# --------------------------------------------------------------------------
# The capture pass: statistics in FP32 (for qsync and qsync_var).
# --------------------------------------------------------------------------


def _bilinear_wrapper(module, base, transform):
  """Wraps ``base``: ``transform(x, w) -> (x', w', post)``, then post(y)."""
  li, ri = policy.operand_positions(module)

  def wrapped(*args, **kwargs):
    args = list(args)
    args[li], args[ri], post = transform(args[li], args[ri])
    return post(base(*args, **kwargs))

  return wrapped


def _capture_fn(
  graphdef,
  layer_list,
  objective: Objective,
  precisions,
  rounding,
  curvature: bool,
):
  """Returns a jitted fn(params, rest, batch, key) -> per-layer statistics.

  ``key`` seeds the Hutchinson probe and the batch's RNG streams (a fresh
  ``nnx.Rngs`` per pass, so the gradient and the Hessian-vector product see
  one dropout mask).

  With ``curvature`` it also estimates the Hessian diagonal (``qsync_var``);
  QSync's own formula needs only the statistics and gradients.
  """
  floors = [
    methods.allowed_precisions(layer, precisions) for layer in layer_list
  ]

  @jax.jit
  def capture(params, rest, batch, key):
    model = nnx.merge(graphdef, params, rest)
    # The wrappers read the perturbations of the current trace from `box`
    # and record each layer's operands and output into it.
    box = {"perturb": None, "stats": {}}

    def make_wrapper(i, layer, base):
      if policy.is_embedding(layer.module):

        def promote(arrays, **kw):
          (table,) = arrays
          table = table + box["perturb"][i]["w"]
          box["stats"][i] = {"w": table}
          return base((table,), **kw)

        return promote

      def transform(xv, wv):
        p = box["perturb"][i]
        xv, wv = xv + p["x"], wv + p["w"]

        def post(out):
          out = out + jnp.asarray(p["y"]).astype(out.dtype)
          box["stats"][i] = {"x": xv, "w": wv, "y": out}
          return out

        return xv, wv, post

      return _bilinear_wrapper(layer.module, base, transform)

    policy.instrument(model, layer_list, make_wrapper)
    # Pure functions of the perturbations from here on; a fresh copy of the
    # BatchNorm statistics per trace (their updates are not needed).
    instrumented, p_state, r_state = nnx.split(model, nnx.Param, ...)

    def run(perturb):
      box["perturb"], box["stats"] = perturb, {}
      m = nnx.merge(instrumented, p_state, jax.tree.map(lambda v: v, r_state))
      loss, _ = objective(
        m, batch, nnx.Rngs(jax.random.fold_in(key, 1)), train=True
      )
      return loss, box["stats"]

    # Zero perturbations shaped like each layer's operands and output: their
    # gradients are dL/dx, dL/dW and dL/dy.
    none = [{"x": 0.0, "w": 0.0, "y": 0.0} for _ in layer_list]
    sds = jax.eval_shape(lambda: run(none)[1])
    zeros = [
      {
        "x": jnp.zeros(()),
        "y": jnp.zeros(()),
        **{
          k: jnp.zeros(sds[i][k].shape, jnp.float32)
          for k in ("x", "w", "y")
          if k in sds[i]
        },
      }
      for i in range(len(layer_list))
    ]
    grad_fn = jax.value_and_grad(run, has_aux=True)
    (loss, stats), grads = grad_fn(zeros)
    if curvature:
      # Hutchinson estimate of each perturbation's Hessian diagonal: one
      # Hessian-vector product with a Rademacher probe over all of them.
      probe = methods.rademacher_probe(key, zeros)
      hvp = jax.jvp(lambda z: grad_fn(z)[1], (zeros,), (probe,))[1]
      diag = jax.tree.map(jnp.multiply, probe, hvp)
    out = {}
    for i, layer in enumerate(layer_list):
      s, g = stats[i], grads[i]
      w, gw = s["w"].astype(jnp.float32), g["w"]
      row = {
        "w_norm": jnp.linalg.norm(w),
        "w_amax": jnp.abs(w).max(),
        "dw": w.size,
      }
      if not curvature:
        # The whole weight gradient: QSync takes the norm and the maximum of
        # the gradient accumulated over the batches, not their per-batch
        # mean (:func:`_mean_stats` averages it before the norm).
        row["gw"] = gw
      if "x" in s:
        xv = s["x"].astype(jnp.float32)
        row.update(
          {
            "x_norm": jnp.linalg.norm(xv),
            "x_amax": jnp.abs(xv).max(),
            "dv": xv.size,
            "dvv": s["y"].size,
          }
        )
      if curvature:
        row["var"] = methods.qsync_var_terms(s, g, diag[i], floors[i], rounding)
      out[layer.path] = row
    return loss, out

  return capture


def _mean_stats(per_batch: list[dict]) -> dict:
  """Averages the statistics over the batches (arrays elementwise)."""

  def mean(*xs):
    if np.ndim(xs[0]):
      return np.mean([np.asarray(v, np.float64) for v in xs], axis=0)
    return float(np.mean([float(v) for v in xs]))

  return jax.tree.map(mean, *per_batch)
