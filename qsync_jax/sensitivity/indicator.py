r"""Layer sensitivity to low precision: QSync's indicator, baselines, ground truth.

``compute(model, loss_fn, batches, method=..., precisions=...)`` returns
:class:`Scores`: for each addressable layer and each candidate precision, how
much the model suffers when that layer alone computes at that precision
(larger = more sensitive; FP32 and TF32 score 0).

Methods:

* ``qsync``: QSync's bi-directional indicator as the reference code computes
  it (reference/qsync.md section 3.3; arXiv 2407.02327): plain (not squared)
  norms, the 1/6 stochastic-rounding variance, k = 9, gamma = 4, and depth
  scaling ``gamma (L - l) fwd + l bwd`` with ``l`` the layer's position in
  forward order. Statistics (activation scale, norm and size, weight-gradient
  norm and its FP16 exponent) are captured inside the forward and backward
  pass in FP32 and averaged over the batches.
* ``qsync_var``: the same idea derived as an expected variance (below).
* ``wvar``: relative change of the weights' L1 mass after
  quantize-dequantize (Zhang et al., CVPR 2020; QSync's WVAR baseline).
* ``hessian``: a Hutchinson estimate of each layer's Hessian trace (one
  Hessian-vector product via ``jvp`` of ``grad`` per probe) times the
  quantization noise variance of its weights (HAWQ-v2, arXiv 1911.03852).
* ``random``: uniform random scores (a floor every indicator must beat).

``measure(...)`` is the ground truth the methods are judged by: switch only
that layer to that precision and measure, averaged over the batches, (a) the
change of the loss and (b) the relative error of the full gradient against
FP32. All (layer, precision) variants run through one compiled program that
selects each layer's precision at run time with ``lax.switch``.

Derivation of ``qsync_var``
---------------------------
QSync's indicator estimates how much a layer's rounding noise perturbs
training. ``qsync_var`` computes the quantity that predicts it best, the
expected squared change of the loss, with no depth heuristics.

Take a layer ``y = f(x, W)`` (dense, conv, einsum). Computing it at precision
``p`` adds independent, zero-mean rounding noise ``e`` to each rounded tensor
``t``. The tensors are the operands ``x`` and ``W``, and also the output ``y``
for FP16 / BF16, whose contraction returns that dtype. The per-element
variance ``s_i^2`` depends on the format:
* INT8 with scale ``S``: ``s^2 = c S^2``, where ``c`` is the rounding mode's
  error variance in units of a step. It is 1/12 for round-to-nearest, 1/6 for
  stochastic rounding (``E[u(1-u)]`` for ``u ~ U[0,1)``), and 1/3 for
  truncation.
* A float with ``m`` mantissa bits: ``s_i^2 = ulp(t_i)^2 / 12``, with
  ``ulp(t) = 2^(floor(log2|t|) - m)``.

Expanding the loss to second order in the noise:

    dL = sum_i g_i e_i + 1/2 sum_ij H_ij e_i e_j,
    E[dL]   = 1/2 sum_i s_i^2 H_ii                (the bias: curvature),
    Var[dL] = sum_i s_i^2 g_i^2 + O(s^4)          (the first-order spread),

where ``g = dL/dt`` and ``H_ii = d^2 L / dt_i^2``. Then

    qsync_var(l, p) = E[dL^2] = (1/2 sum_i s_i^2 H_ii)^2 + sum_i s_i^2 g_i^2.

The first-order terms of many elements mostly cancel, but the curvature term
adds up over every element of the tensor. That is why the bias matters, and
why a first-order-only version ranked layers worse in our study
(docs/RESULTS.md).

The quantities come from one pass per batch. Zero perturbations are added to
each layer's operands and output. Their gradient gives every ``g``. One
Hessian-vector product with a Rademacher probe ``v`` over all perturbations
gives ``v * (H v)``, an unbiased estimate of every ``H_ii`` (Hutchinson), at
the cost of about one more forward and backward pass. The backward-pass
rounding of a low-precision layer (its incoming gradient in FP16) does not
change the loss. It is left out of this score, as it is from the
loss-change ground truth.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from flax import nnx
import jax
from jax import lax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np

from qsync_jax.plan import policy
from qsync_jax.numerics import quant as q
from qsync_jax.plan.layers import MatMul
from qsync_jax.plan.precision import Precision
from qsync_jax.numerics.quant import QuantConfig, Rounding

METHODS = ("qsync", "qsync_var", "wvar", "hessian", "random")
DEFAULT_PRECISIONS = (Precision.INT8, Precision.FP16, Precision.BF16)
_ZERO = (Precision.FP32, Precision.TF32)
_MANTISSA = {Precision.FP16: 10, Precision.BF16: 7, Precision.FP8: 3}
# QSync's FP16 constant ("For FP16, e=5, k=9"); other float formats shift k
# by their mantissa difference to FP16.
_QSYNC_K = {p: 9 - (10 - m) for p, m in _MANTISSA.items()}
_ROUNDING_VARIANCE = {Rounding.NEAREST: 1 / 12, Rounding.STOCHASTIC: 1 / 6,
                      Rounding.TRUNCATE: 1 / 3}


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
    return [(l, p) for l, row in self.values.items() for p in row
            if Precision(p) not in _ZERO]

  def vector(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    return np.array([self.values[l][p] for l, p in pairs], np.float64)

  def to_dict(self) -> dict[str, Any]:
    return {"method": self.method, "time_s": self.time_s,
            "per_batch_s": self.per_batch_s, "values": self.values}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "Scores":
    return cls({l: dict(r) for l, r in data["values"].items()},
               data["method"], data.get("time_s", 0.0),
               data.get("per_batch_s"))


# --------------------------------------------------------------------------
# Layer instrumentation: temporarily replace each layer's op by a callable.
# --------------------------------------------------------------------------


def _bilinear_wrapper(module, base, transform):
  """Wraps ``base``: ``transform(x, w) -> (x', w', post)``, then post(y)."""
  li, ri = policy.operand_positions(module)

  def wrapped(*args, **kwargs):
    args = list(args)
    args[li], args[ri], post = transform(args[li], args[ri])
    return post(base(*args, **kwargs))

  return wrapped


# --------------------------------------------------------------------------
# Statistics captured in FP32 (for qsync and qsync_var).
# --------------------------------------------------------------------------


def _float_noise_var(t: jax.Array, mantissa: int) -> jax.Array:
  """Per-element variance of rounding ``t`` to a float with ``mantissa`` bits."""
  _, e = jnp.frexp(t.astype(jnp.float32))  # |t| in [2^(e-1), 2^e)
  ulp = jnp.ldexp(jnp.ones_like(t, jnp.float32), e - 1 - mantissa)
  return jnp.where(t == 0, 0.0, ulp ** 2 / 12)


def _noise_var(t: jax.Array, precision: Precision, rounding: Rounding
               ) -> jax.Array:
  """Per-element variance of the error of quantizing ``t`` at ``precision``."""
  if precision is Precision.INT8:
    s = q.absmax_scale(t, q.INT8_MAX)
    return jnp.full(t.shape, _ROUNDING_VARIANCE[rounding]) * s ** 2
  if precision is Precision.FP8:
    fq, s = q.quantize_fp8(t)
    return _float_noise_var(fq.astype(jnp.float32), 3) * s ** 2
  return _float_noise_var(t, _MANTISSA[precision])


def _capture_fn(graphdef, layer_list, loss_fn, precisions, rounding,
                curvature: bool):
  """Returns a jitted fn(params, rest, x, y, key) -> per-layer statistics.

  With ``curvature`` it also estimates the Hessian diagonal (``qsync_var``);
  QSync's own formula needs only the statistics and gradients.
  """
  floors = [_allowed(layer, precisions) for layer in layer_list]

  @jax.jit
  def capture(params, rest, x, y, key):
    model = nnx.merge(graphdef, params, rest)
    # The wrappers read the perturbations of the current trace from `box`
    # and record each layer's operands and output into it.
    box = {"perturb": None, "stats": {}}

    def make_wrapper(i, layer, base):
      if isinstance(layer.module, nnx.Embed):
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
      return loss_fn(m(x), y), box["stats"]

    # Zero perturbations shaped like each layer's operands and output: their
    # gradients are dL/dx, dL/dW and dL/dy.
    none = [{"x": 0.0, "w": 0.0, "y": 0.0} for _ in layer_list]
    sds = jax.eval_shape(lambda: run(none)[1])
    zeros = [{"x": jnp.zeros(()), "y": jnp.zeros(()),
              **{k: jnp.zeros(sds[i][k].shape, jnp.float32)
                 for k in ("x", "w", "y") if k in sds[i]}}
             for i in range(len(layer_list))]
    grad_fn = jax.value_and_grad(run, has_aux=True)
    (loss, stats), grads = grad_fn(zeros)
    if curvature:
      # Hutchinson estimate of each perturbation's Hessian diagonal: one
      # Hessian-vector product with a Rademacher probe over all of them.
      leaves, treedef = jax.tree.flatten(zeros)
      probe = jax.tree.unflatten(treedef, [
          jax.random.rademacher(k, z.shape, jnp.float32) if z.ndim else z
          for k, z in zip(jax.random.split(key, len(leaves)), leaves)])
      hvp = jax.jvp(lambda z: grad_fn(z)[1], (zeros,), (probe,))[1]
      diag = jax.tree.map(jnp.multiply, probe, hvp)
    out = {}
    for i, layer in enumerate(layer_list):
      s, g = stats[i], grads[i]
      w, gw = s["w"].astype(jnp.float32), g["w"]
      row = {"w_norm": jnp.linalg.norm(w), "w_amax": jnp.abs(w).max(),
             "dw": w.size, "gw_norm": jnp.linalg.norm(gw),
             "gw_amax": jnp.abs(gw).max()}
      if "x" in s:
        xv, gx = s["x"].astype(jnp.float32), g["x"]
        row.update({"x_norm": jnp.linalg.norm(xv), "x_amax": jnp.abs(xv).max(),
                    "dv": xv.size, "dvv": s["y"].size})
      out[layer.path] = row
      if not curvature:
        continue
      var = {}
      for p in floors[i]:
        # Second-order expansion of the loss in the layer's rounding noise:
        # mean 1/2 sum s^2 H_ii, variance sum s^2 g^2.
        terms = [(w, gw, diag[i]["w"])]
        if "x" in s:
          terms.append((xv, gx, diag[i]["x"]))
          if p in (Precision.FP16, Precision.BF16):  # the output is rounded
            terms.append((s["y"].astype(jnp.float32), g["y"], diag[i]["y"]))
        bias = sum(0.5 * jnp.sum(_noise_var(t, p, rounding) * h)
                   for t, _, h in terms)
        variance = sum(jnp.sum(_noise_var(t, p, rounding) * gt ** 2)
                       for t, gt, _ in terms)
        var[p.value] = {"bias": bias, "variance": variance}
      row["var"] = var
    return loss, out

  return capture


def _allowed(layer, precisions) -> list[Precision]:
  floor16 = isinstance(layer.module, policy.SIXTEEN_BIT_FLOOR)
  return [p for p in precisions if p not in _ZERO
          and not (floor16 and p.bits < 16)]


def _mean_stats(per_batch: list[dict]) -> dict:
  return jax.tree.map(lambda *xs: float(np.mean([float(v) for v in xs])),
                      *per_batch)


def _exponent(value: float) -> int:
  """|binary exponent| of float16(value), capped at 5 (QSync's e_x)."""
  v = float(np.float16(value))
  if v == 0 or not np.isfinite(v):
    return 5
  return min(abs(int(np.frexp(v)[1])), 5)


def _qsync_scores(stats: dict, layer_list, precisions, gamma: float = 4.0
                  ) -> dict[str, dict[str, float]]:
  """QSync's GVAR formula, faithful to the reference code."""
  depth_max = len(layer_list)
  values = {}
  for i, layer in enumerate(layer_list):
    s = stats[layer.path]
    depth = i + 1  # forward-order position stands in for the BFS depth
    row = {}
    for p in _allowed(layer, precisions):
      if "x_norm" not in s:  # embeddings: only the weight terms exist
        sv = dv = x_norm = dvv = 0.0
        e_x = 0
      else:
        sv, dv, x_norm, dvv = (s["x_amax"] / 127, s["dv"], s["x_norm"],
                               s["dvv"])
        e_x = _exponent(np.sqrt(x_norm / dv))
      sw, dw, w_norm, gw = s["w_amax"] / 127, s["dw"], s["w_norm"], s[
          "gw_norm"]
      e_w = _exponent(np.sqrt(w_norm / dw))
      e_g = _exponent(s["gw_amax"])
      if p is Precision.INT8:
        k = 9
        fwd = (w_norm * sv ** 2 * dv + x_norm * sw ** 2 * dw) / 6
        bwd = (gw * sv ** 2 * dv + x_norm * 2.0 ** (2 * e_x)
               * (2.0 ** -k) ** 2 * dvv) / 6
      else:
        k = _QSYNC_K[p]
        c = 2.0 ** (-2 * k) / 6
        fwd = c * (w_norm * dv * e_x + x_norm * dw * e_w)
        bwd = c * (gw * dv * e_x + x_norm * dvv * e_g)
      row[p.value] = float(gamma * (depth_max - depth) * fwd + depth * bwd)
    values[layer.path] = row
  return values


def _qsync_var_scores(stats: dict, layer_list, precisions
                      ) -> dict[str, dict[str, float]]:
  return {layer.path: {p.value: s["var"][p.value]["bias"] ** 2
                       + s["var"][p.value]["variance"]
                       for p in _allowed(layer, precisions)}
          for layer, s in ((l, stats[l.path]) for l in layer_list)}


# --------------------------------------------------------------------------
# Weight-only baselines.
# --------------------------------------------------------------------------


def _layer_weights(model, layer_list) -> dict[str, jax.Array | None]:
  weights = {}
  for layer in layer_list:
    m = layer.module
    if isinstance(m, nnx.Embed):
      weights[layer.path] = m.embedding[...]
    elif isinstance(m, MatMul):
      weights[layer.path] = None
    else:
      weights[layer.path] = m.kernel[...]
  return weights


def _qdq(w: jax.Array, precision: Precision, quant: QuantConfig
         ) -> jax.Array:
  if precision is Precision.INT8:
    qv, s = q.quantize(w, None, quant.rounding)
    return q.dequantize(qv, s)
  if precision is Precision.FP8:
    qv, s = q.quantize_fp8(w)
    return q.dequantize(qv, s)
  dt = {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16}[precision]
  return w.astype(dt).astype(jnp.float32)


def _wvar_scores(model, layer_list, precisions, quant):
  values = {}
  for path, w in _layer_weights(model, layer_list).items():
    layer = next(l for l in layer_list if l.path == path)
    row = {}
    for p in _allowed(layer, precisions):
      if w is None:
        row[p.value] = 0.0
        continue
      l1 = float(jnp.abs(w).sum())
      l1q = float(jnp.abs(_qdq(w, p, quant)).sum())
      row[p.value] = float(np.log2(abs((l1q - l1) / l1) + 1))
    values[path] = row
  return values


def hutchinson_traces(loss: Callable[[Any], jax.Array], params: Any,
                      key: jax.Array, num_probes: int) -> Any:
  """Hutchinson estimates of the Hessian's diagonal blocks' traces.

  With Rademacher probes ``v`` over all parameters, ``E[v_b . (H v)_b] =
  tr(H_bb)`` for every block ``b`` (cross terms vanish in expectation), so one
  Hessian-vector product per probe estimates every leaf's trace at once.

  Args:
    loss: scalar function of ``params``.
    params: the point (a pytree).
    key: PRNG key for the probes.
    num_probes: probes averaged.

  Returns:
    A pytree like ``params`` of scalar trace estimates.
  """
  grad = jax.grad(loss)

  def one(k):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(k, len(leaves))
    v = jax.tree.unflatten(treedef, [
        jax.random.rademacher(kk, x.shape, jnp.float32)
        for kk, x in zip(keys, leaves)])
    hv = jax.jvp(grad, (params,), (v,))[1]
    return jax.tree.map(lambda a, b: jnp.sum(a * b), v, hv)

  per_probe = jax.lax.map(one, jax.random.split(key, num_probes))
  return jax.tree.map(lambda t: t.mean(), per_probe)


def _hessian_scores(model, layer_list, loss_fn, batches, precisions, quant,
                    num_probes, seed):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  weight_of = {}
  for layer in layer_list:
    m = layer.module
    if isinstance(m, MatMul):
      continue
    weight_of[layer.path] = "embedding" if isinstance(m, nnx.Embed) else (
        "kernel")

  @jax.jit
  def traces(params, x, y, key):
    # A fresh copy of the BatchNorm statistics per trace: the model may
    # update them, but every probe sees the same function.
    def loss(p):
      model = nnx.merge(graphdef, p, jax.tree.map(lambda v: v, rest))
      return loss_fn(model(x), y)
    return hutchinson_traces(loss, params, key, num_probes)

  per_batch = [traces(params, jnp.asarray(x), jnp.asarray(y),
                      jax.random.key(seed + b))
               for b, (x, y) in enumerate(batches)]
  mean_trace = jax.tree.map(lambda *t: float(np.mean(t)), *per_batch)
  weights = _layer_weights(model, layer_list)
  values = {}
  for layer in layer_list:
    row = {}
    for p in _allowed(layer, precisions):
      if layer.path not in weight_of:
        row[p.value] = 0.0
        continue
      node = mean_trace
      for part in layer.path.split("/"):
        node = node[int(part) if part.isdigit() else part]
      trace = node[weight_of[layer.path]]
      w = weights[layer.path]
      # E[dW^T H dW] / 2 with i.i.d. noise: tr(H) * mean noise variance / 2.
      noise = float(jnp.mean(_noise_var(w, p, quant.rounding)))
      row[p.value] = float(abs(trace) * noise / 2)
    values[layer.path] = row
  return values


# --------------------------------------------------------------------------
# Ground truth: switch one layer, measure.
# --------------------------------------------------------------------------


def _switch_fn(graphdef, layer_list, loss_fn, choices, quant):
  """A jitted fn(params, rest, x, y, select) -> (loss, flat grad).

  ``select[i]`` indexes ``choices`` for layer i (0 = FP32), so one compiled
  program evaluates every single-layer variant.
  """
  def op_for(module, precision):
    if isinstance(module, nnx.Embed):
      return None
    return policy.op_attribute(module)[1](precision, quant)

  @jax.jit
  def evaluate(params, rest, x, y, select):
    model = nnx.merge(graphdef, params, rest)

    def make_wrapper(i, layer, base):
      module = layer.module
      if isinstance(module, nnx.Embed):
        dtypes = [jnp.float32 if p is Precision.FP32 else
                  {Precision.FP16: jnp.float16,
                   Precision.BF16: jnp.bfloat16}.get(p, jnp.float32)
                  for p in choices]

        def promote(arrays, **kw):
          (table,) = arrays
          branches = [lambda t, d=d: t.astype(d).astype(jnp.float32)
                      for d in dtypes]
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
        return lax.switch(select[i], [branch(f) for f in impls],
                          (args[li], args[ri]))
      return switched

    policy.instrument(model, layer_list, make_wrapper)
    loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(x), y))(model)
    return loss, ravel_pytree(grads)[0]

  return evaluate


def measure(model: nnx.Module, loss_fn, batches: Sequence[tuple[Any, Any]],
            precisions: Sequence[Precision | str] = DEFAULT_PRECISIONS, *,
            quant: QuantConfig | None = None) -> dict[str, Scores]:
  """Measured sensitivity: each layer alone at each precision.

  Returns:
    ``{"loss": Scores, "grad": Scores}``: mean |loss change| and mean
    relative L2 error of the full gradient against FP32, over the batches.
  """
  precisions = [Precision.parse(p) for p in precisions]
  quant = quant or QuantConfig()
  layer_list = _checked_layers(model, batches)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  choices = [Precision.FP32, *[p for p in precisions if p not in _ZERO]]
  evaluate = _switch_fn(graphdef, layer_list, loss_fn, choices, quant)
  start = time.perf_counter()
  n = len(layer_list)
  ref = []
  for x, y in batches:
    ref.append(evaluate(params, rest, x, y, jnp.zeros(n, jnp.int32)))
  loss_values: dict[str, dict[str, float]] = {}
  grad_values: dict[str, dict[str, float]] = {}
  for i, layer in enumerate(layer_list):
    loss_values[layer.path], grad_values[layer.path] = {}, {}
    for p in _allowed(layer, precisions):
      select = jnp.zeros(n, jnp.int32).at[i].set(choices.index(p))
      dl, dg = [], []
      for (x, y), (l0, g0) in zip(batches, ref):
        l1, g1 = evaluate(params, rest, x, y, select)
        dl.append(abs(float(l1 - l0)))
        dg.append(float(jnp.linalg.norm(g1 - g0) / jnp.linalg.norm(g0)))
      loss_values[layer.path][p.value] = float(np.mean(dl))
      grad_values[layer.path][p.value] = float(np.mean(dg))
  elapsed = time.perf_counter() - start
  return {"loss": Scores(loss_values, "measured_loss", elapsed),
          "grad": Scores(grad_values, "measured_grad", elapsed)}


# --------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------


def _checked_layers(model, batches):
  if not batches:
    raise ValueError("the indicator needs at least one batch")
  x0 = batches[0][0]
  spec = getattr(model, "input_spec", None)
  if callable(spec):
    want = spec(np.shape(x0)[0])
    if tuple(np.shape(x0)) != tuple(want.shape):
      raise ValueError(f"batch input of shape {tuple(np.shape(x0))} does "
                       f"not match the model's input_spec "
                       f"{tuple(want.shape)}")
  try:
    return policy.model_layers(model, jnp.asarray(x0))
  except (TypeError, ValueError) as e:
    if "no layer a precision plan can address" in str(e):
      raise
    raise ValueError(f"the model cannot run on batches of shape "
                     f"{tuple(np.shape(x0))}: {e}") from None


def compute(model: nnx.Module, loss_fn: Callable[[jax.Array, jax.Array],
                                                 jax.Array],
            batches: Sequence[tuple[Any, Any]], method: str = "qsync",
            precisions: Iterable[Precision | str] = DEFAULT_PRECISIONS, *,
            quant: QuantConfig | None = None, seed: int = 0,
            hessian_probes: int = 8) -> Scores:
  """Scores every (layer, precision) of ``model`` with ``method``.

  Args:
    model: an NNX model in FP32 (its current plan is ignored: statistics are
      captured in FP32).
    loss_fn: ``loss_fn(logits, labels) -> scalar``.
    batches: a few ``(inputs, labels)`` batches.
    method: one of :data:`METHODS`.
    precisions: candidate precisions (FP32 scores 0; embeddings and
      attention matmuls only get 16-bit ones).
    quant: the quantization (rounding mode) the ops use.
    seed: for ``random`` and the Hutchinson probes.
    hessian_probes: Hutchinson probes per batch.

  Returns:
    :class:`Scores`; ``time_s`` is the method's wall time.

  Raises:
    ValueError: unknown method, no batches, a model with no addressable
      layer, or batches the model cannot take.
  """
  if method not in METHODS:
    raise ValueError(f"unknown indicator method {method!r}; valid: "
                     f"{', '.join(METHODS)}")
  precisions = [Precision.parse(p) for p in precisions]
  quant = quant or QuantConfig()
  batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in batches]
  layer_list = _checked_layers(model, batches)
  start = time.perf_counter()
  steady_s = None
  if method in ("qsync", "qsync_var"):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    capture = _capture_fn(graphdef, layer_list, loss_fn, precisions,
                          quant.rounding, curvature=method == "qsync_var")
    per_batch = []
    for b, (x, y) in enumerate(batches):
      if b == 1:
        steady_start = time.perf_counter()
      per_batch.append(jax.block_until_ready(
          capture(params, rest, x, y, jax.random.key(seed + b))[1]))
    if len(batches) > 1:
      steady_s = (time.perf_counter() - steady_start) / (len(batches) - 1)
    stats = _mean_stats(per_batch)
    values = (_qsync_scores(stats, layer_list, precisions)
              if method == "qsync"
              else _qsync_var_scores(stats, layer_list, precisions))
  elif method == "wvar":
    values = _wvar_scores(model, layer_list, precisions, quant)
  elif method == "hessian":
    values = _hessian_scores(model, layer_list, loss_fn, batches, precisions,
                             quant, hessian_probes, seed)
  else:
    rng = np.random.default_rng(seed)
    values = {l.path: {p.value: float(rng.uniform())
                       for p in _allowed(l, precisions)} for l in layer_list}
  for row in values.values():
    for p in _ZERO:
      row[p.value] = 0.0
  return Scores(values, method, time.perf_counter() - start, steady_s)


def train_step_time(model: nnx.Module, loss_fn, batch, repeats: int = 5
                    ) -> float:
  """Median time of one jitted SGD training step on ``batch`` (compiled)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def step(params, rest, x, y):
    m = nnx.merge(graphdef, params, rest)
    grads = nnx.grad(lambda m: loss_fn(m(x), y))(m)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

  x, y = jnp.asarray(batch[0]), jnp.asarray(batch[1])
  jax.block_until_ready(step(params, rest, x, y))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(step(params, rest, x, y))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def study(model: nnx.Module, loss_fn, batches: Sequence[tuple[Any, Any]],
          precisions: Sequence[Precision | str] = DEFAULT_PRECISIONS,
          methods: Sequence[str] = METHODS, *, seed: int = 0,
          quant: QuantConfig | None = None) -> dict[str, Any]:
  """Scores every method and judges it against the measured ground truth.

  The primary ground truth is the relative error of the full gradient (what
  training feels); the Spearman correlation with the loss change is reported
  too. Correlations run over all (layer, precision) pairs with a non-FP32
  precision.

  Returns:
    {"layers", "precisions", "train_step_s", "measured": {"grad", "loss"},
     "methods": {name: {"spearman_vs_measured", "spearman_vs_measured_loss",
     "time_s", "per_batch_s", "scores"}}}.
  """
  from scipy import stats as scipy_stats  # local: only the study needs it
  precisions = [Precision.parse(p) for p in precisions]
  truth = measure(model, loss_fn, batches, precisions, quant=quant)
  pairs = truth["grad"].pairs()
  out = {"layers": truth["grad"].layers,
         "precisions": [p.value for p in precisions],
         "num_batches": len(batches),
         "train_step_s": train_step_time(model, loss_fn, batches[0]),
         "measured": {k: v.to_dict() for k, v in truth.items()},
         "methods": {}}
  for method in methods:
    scores = compute(model, loss_fn, batches, method, precisions,
                     quant=quant, seed=seed)
    vec = scores.vector(pairs)
    rho = lambda t: float(scipy_stats.spearmanr(vec, t.vector(pairs)
                                                ).statistic)
    out["methods"][method] = {
        "spearman_vs_measured": rho(truth["grad"]),
        "spearman_vs_measured_loss": rho(truth["loss"]),
        "time_s": scores.time_s, "per_batch_s": scores.per_batch_s,
        "scores": scores.values}
  return out
