r"""The per-method formulas of the sensitivity indicator.

This module owns what each method of :data:`METHODS` computes from its
inputs, and which precisions a layer is scored at (:func:`allowed_precisions`):

* ``qsync``: QSync's bi-directional indicator (arXiv 2407.02327) as its official
  code computes it (bytedance/QSync, its function
  ``Predictor/indicator.py: gradient_variance_based_indicator``): plain (not
  squared) norms, the 1/6 stochastic-rounding variance, k = 9, gamma = 4, and
  depth scaling ``gamma (L - l) fwd + l bwd`` with ``l`` the layer's BFS depth
  over the forward graph (:mod:`qsync_jax.sensitivity.depth`), the weight
  gradient accumulated over the batches, and an embedding's table scored
  as its input (:func:`qsync_scores`, from the statistics the capture pass
  of :mod:`qsync_jax.sensitivity.scores` averages over the batches).
* ``qsync_var``: the same idea derived as an expected variance (below;
  :func:`qsync_var_terms` inside the capture pass, :func:`qsync_var_scores`).
* ``wvar``: relative change of the weights' L1 mass after
  quantize-dequantize (Zhang et al., CVPR 2020; QSync's WVAR baseline).
* ``hessian``: a Hutchinson estimate of each layer's Hessian trace (one
  Hessian-vector product via ``jvp`` of ``grad`` per probe) times the
  quantization noise variance of its weights (HAWQ-v2, arXiv 1911.03852).
* ``random``: uniform random scores (a floor every indicator must beat).

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
why the score keeps it rather than the first-order term alone.

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

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics import quant as q
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.numerics.quant import Rounding
from qsync_jax.plan import policy

#: The indicator methods :func:`~qsync_jax.sensitivity.compute` takes.
METHODS = ("qsync", "qsync_var", "wvar", "hessian", "random")
#: The method :func:`~qsync_jax.sensitivity.compute` and the allocator use
#: when none is named: the one that ranks layers best within each precision
#: against the measured gradient error (``experiments.indicator_study``,
#: whose figures are on the results page). QSync's own formula stays
#: available as ``"qsync"``.
DEFAULT_METHOD = "qsync_var"
#: Full precision, the reference every score is measured against: scores 0.
ZERO_PRECISIONS = (Precision.FP32, Precision.TF32)
_MANTISSA = {Precision.FP16: 10, Precision.BF16: 7, Precision.FP8: 3}
# QSync's FP16 constant ("For FP16, e=5, k=9"); other float formats shift k
# by their mantissa difference to FP16.
_QSYNC_K = {p: 9 - (10 - m) for p, m in _MANTISSA.items()}
_ROUNDING_VARIANCE = {
  Rounding.NEAREST: 1 / 12,
  Rounding.STOCHASTIC: 1 / 6,
  Rounding.TRUNCATE: 1 / 3,
}


def allowed_precisions(
  layer: policy.Layer, precisions: Sequence[Precision]
) -> list[Precision]:
  """The precisions of ``precisions`` that ``layer`` is scored at.

  FP32 and TF32 are left out (they score 0), and so is every precision
  below 16 bits for the layers the policy floors at 16 bits (embeddings and
  attention matmuls).
  """
  floor16 = policy.is_floored(layer.module)
  return [
    p
    for p in precisions
    if p not in ZERO_PRECISIONS and not (floor16 and p.bits < 16)
  ]


# --------------------------------------------------------------------------
# Rounding noise.
# --------------------------------------------------------------------------


def _float_noise_var(t: jax.Array, mantissa: int) -> jax.Array:
  """Per-element variance of rounding ``t`` to ``mantissa`` bits (a float)."""
  _, e = jnp.frexp(t.astype(jnp.float32))  # |t| in [2^(e-1), 2^e)
  ulp = jnp.ldexp(jnp.ones_like(t, jnp.float32), e - 1 - mantissa)
  return jnp.where(t == 0, 0.0, ulp**2 / 12)


def noise_variance(
  t: jax.Array, precision: Precision, rounding: Rounding
) -> jax.Array:
  """Per-element variance of the error of quantizing ``t`` at ``precision``."""
  if precision is Precision.INT8:
    s = q.absmax_scale(t, q.INT8_MAX)
    return jnp.full(t.shape, _ROUNDING_VARIANCE[rounding]) * s**2
  if precision is Precision.FP8:
    fq, s = q.quantize_fp8(t)
    return _float_noise_var(fq.astype(jnp.float32), 3) * s**2
  return _float_noise_var(t, _MANTISSA[precision])


# --------------------------------------------------------------------------
# qsync and qsync_var: from the statistics of the capture pass.
# --------------------------------------------------------------------------


def qsync_var_terms(
  stats: dict,
  grads: dict,
  diag: dict,
  precisions: Sequence[Precision],
  rounding: Rounding,
) -> dict[str, dict[str, jax.Array]]:
  """One layer's ``bias`` and ``variance`` of the loss change per precision.

  Traced inside the capture pass: ``stats`` holds the layer's FP32 operands
  and output (``"w"``, and ``"x"`` and ``"y"`` unless it is an embedding),
  ``grads`` and ``diag`` the loss's gradient and Hutchinson Hessian diagonal
  with respect to each of them.

  Returns:
    ``{precision name: {"bias", "variance"}}`` for ``precisions``.
  """
  w, gw = stats["w"].astype(jnp.float32), grads["w"]
  var = {}
  for p in precisions:
    # Second-order expansion of the loss in the layer's rounding noise:
    # mean 1/2 sum s^2 H_ii, variance sum s^2 g^2.
    terms = [(w, gw, diag["w"])]
    if "x" in stats:
      terms.append((stats["x"].astype(jnp.float32), grads["x"], diag["x"]))
      if p in (Precision.FP16, Precision.BF16):  # the output is rounded
        terms.append((stats["y"].astype(jnp.float32), grads["y"], diag["y"]))
    bias = sum(
      (0.5 * jnp.sum(noise_variance(t, p, rounding) * h) for t, _, h in terms),
      start=jnp.float32(0),
    )
    variance = sum(
      (jnp.sum(noise_variance(t, p, rounding) * gt**2) for t, gt, _ in terms),
      start=jnp.float32(0),
    )
    var[p.value] = {"bias": bias, "variance": variance}
  return var


def _exponent(value: float) -> int:
  """|binary exponent| of float16(value), capped at 5 (QSync's e_x)."""
  v = float(np.float16(value))
  if v == 0 or not np.isfinite(v):
    return 5
  return min(abs(int(np.frexp(v)[1])), 5)


def qsync_scores(
  stats: dict,
  layer_list: Sequence[policy.Layer],
  precisions: Sequence[Precision],
  depths: Sequence[int],
  lookup_numel: Sequence[int | None],
  gamma: float = 4.0,
) -> dict[str, dict[str, float]]:
  """QSync's GVAR formula, faithful to QSync's official code.

  As that code's ``gradient_variance_based_indicator`` and its profiler
  (bytedance/QSync, ``Predictor/indicator.py`` and
  ``Predictor/indicator_profiler.py: profile_stas``):
  * ``||grad W||`` and ``e_g`` come from the weight gradient accumulated
    over the batches (``stats[path]["gw"]``, their mean);
  * an embedding's table is its input (``profile_stas_emb``): ``Sv``,
    ``Dv`` and ``||x||`` are the table's, ``Dvv`` the lookup's size, and
    ``Sw = Dw = ||W|| = 1``;
  * ``l`` is the BFS depth over the forward graph and ``L`` its maximum
    over the scored layers.

  Args:
    stats: ``{layer path: statistics}`` averaged over the batches by the
      capture pass.
    layer_list: the model's layers in forward order.
    precisions: the candidate precisions.
    depths: each layer's BFS depth (:func:`.depth.forward_structure`).
    lookup_numel: each embedding's lookup output size (None for others).
    gamma: the forward term's weight.

  Returns:
    ``{layer path: {precision name: score}}``.
  """
  depth_max = max(depths)
  values = {}
  for layer, depth, lookup in zip(layer_list, depths, lookup_numel):
    s = stats[layer.path]
    gw = np.asarray(s["gw"], np.float64)
    gw_norm, e_g = float(np.linalg.norm(gw)), _exponent(np.abs(gw).max())
    if "x_norm" in s:
      sv, dv, x_norm, dvv = (s["x_amax"] / 127, s["dv"], s["x_norm"], s["dvv"])
      sw, dw, w_norm = s["w_amax"] / 127, s["dw"], s["w_norm"]
    else:  # an embedding: the table stands as the input, the weight as 1
      sv, dv, x_norm, dvv = (s["w_amax"] / 127, s["dw"], s["w_norm"], lookup)
      sw = dw = w_norm = 1.0
    e_x = _exponent(np.sqrt(x_norm / dv))
    e_w = _exponent(np.sqrt(w_norm / dw))
    row = {}
    for p in allowed_precisions(layer, precisions):
      if p is Precision.INT8:
        k = 9
        fwd = (w_norm * sv**2 * dv + x_norm * sw**2 * dw) / 6
        bwd = (
          gw_norm * sv**2 * dv
          + x_norm * 2.0 ** (2 * e_x) * (2.0**-k) ** 2 * dvv
        ) / 6
      else:
        k = _QSYNC_K[p]
        c = 2.0 ** (-2 * k) / 6
        fwd = c * (w_norm * dv * e_x + x_norm * dw * e_w)
        bwd = c * (gw_norm * dv * e_x + x_norm * dvv * e_g)
      row[p.value] = float(gamma * (depth_max - depth) * fwd + depth * bwd)
    values[layer.path] = row
  return values


def qsync_var_scores(
  stats: dict,
  layer_list: Sequence[policy.Layer],
  precisions: Sequence[Precision],
) -> dict[str, dict[str, float]]:
  """``bias ** 2 + variance`` of each layer and precision (the expected
  squared loss change; the terms come from :func:`qsync_var_terms`)."""
  return {
    layer.path: {
      p.value: s["var"][p.value]["bias"] ** 2 + s["var"][p.value]["variance"]
      for p in allowed_precisions(layer, precisions)
    }
    for layer, s in ((l, stats[l.path]) for l in layer_list)
  }


# --------------------------------------------------------------------------
# Weight-only methods: wvar, hessian, random.
# --------------------------------------------------------------------------


def _layer_weights(model, layer_list) -> dict[str, jax.Array | None]:
  weights = {}
  for layer in layer_list:
    m = layer.module
    var = policy.weight_variable(m)
    weights[layer.path] = None if var is None else var[...]
  return weights


def _qdq(w: jax.Array, precision: Precision, quant: QuantConfig) -> jax.Array:
  if precision is Precision.INT8:
    qv, s = q.quantize(w, None, quant.rounding)
    return q.dequantize(qv, s)
  if precision is Precision.FP8:
    qv, s = q.quantize_fp8(w)
    return q.dequantize(qv, s)
  dt = {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16}[precision]
  return w.astype(dt).astype(jnp.float32)


def wvar_scores(
  model: nnx.Module,
  layer_list: Sequence[policy.Layer],
  precisions: Sequence[Precision],
  quant: QuantConfig,
) -> dict[str, dict[str, float]]:
  """log2(1 + relative change of each weight's L1 mass after
  quantize-dequantize); layers without weights (matmuls) score 0."""
  values = {}
  for path, w in _layer_weights(model, layer_list).items():
    layer = next(l for l in layer_list if l.path == path)
    row = {}
    for p in allowed_precisions(layer, precisions):
      if w is None:
        row[p.value] = 0.0
        continue
      l1 = float(jnp.abs(w).sum())
      l1q = float(jnp.abs(_qdq(w, p, quant)).sum())
      row[p.value] = float(np.log2(abs((l1q - l1) / l1) + 1))
    values[path] = row
  return values


def rademacher_probe(key: jax.Array, tree: Any) -> Any:
  """A float32 Rademacher (+-1) probe shaped like ``tree``'s array leaves.

  One draw covers every leaf, split and reshaped: a draw per leaf puts one
  random-bit generator per leaf in the program, and on CPU XLA's compile
  time grows with each (several seconds for a small CNN's capture pass).
  Scalar leaves are placeholders and are returned unchanged.

  Args:
    key: PRNG key.
    tree: a pytree of arrays.

  Returns:
    A pytree like ``tree``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  sizes = [int(np.prod(x.shape)) for x in leaves if np.ndim(x)]
  flat = jax.random.rademacher(key, (sum(sizes),), jnp.float32)
  parts = iter(jnp.split(flat, np.cumsum(sizes)[:-1]))
  return jax.tree.unflatten(
    treedef,
    [next(parts).reshape(x.shape) if np.ndim(x) else x for x in leaves],
  )


def hutchinson_traces(
  loss: Callable[[Any], jax.Array], params: Any, key: jax.Array, num_probes: int
) -> Any:
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
    v = rademacher_probe(k, params)
    hv = jax.jvp(grad, (params,), (v,))[1]
    return jax.tree.map(lambda a, b: jnp.sum(a * b), v, hv)

  per_probe = jax.lax.map(one, jax.random.split(key, num_probes))
  return jax.tree.map(lambda t: t.mean(), per_probe)


def hessian_scores(
  model: nnx.Module,
  layer_list: Sequence[policy.Layer],
  objective: Callable[..., tuple[jax.Array, Any]],
  batches: Sequence[Any],
  precisions: Sequence[Precision],
  quant: QuantConfig,
  num_probes: int,
  seed: int,
) -> dict[str, dict[str, float]]:
  """Each weight's Hessian trace (:func:`hutchinson_traces`, averaged over
  the batches) times its mean quantization noise variance, halved.

  ``objective(model, batch, rngs, train=True) -> (loss, metrics)`` is a
  :class:`qsync_jax.task.Objective`; batch ``b``'s RNG streams (dropout)
  come from ``key(seed + b)``, the same for every probe.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  # The state path of each layer's weight (a Linen layer's is inside the
  # LinenModel's variables, not under its proxy); None: no weight.
  weight_path = policy.weight_paths(model, list(layer_list))

  @jax.jit
  def traces(params, batch, key):
    # A fresh copy of the BatchNorm statistics (and RNG counts) per trace:
    # the model may update them, but every probe sees the same function.
    def loss(p):
      model = nnx.merge(graphdef, p, jax.tree.map(lambda v: v, rest))
      return objective(
        model, batch, nnx.Rngs(jax.random.fold_in(key, 1)), train=True
      )[0]

    return hutchinson_traces(loss, params, key, num_probes)

  per_batch = [
    traces(params, batch, jax.random.key(seed + b))
    for b, batch in enumerate(batches)
  ]
  mean_trace = jax.tree.map(lambda *t: float(np.mean(t)), *per_batch)
  weights = _layer_weights(model, layer_list)
  values = {}
  for layer in layer_list:
    row = {}
    for p in allowed_precisions(layer, precisions):
      path = weight_path[layer.path]
      if path is None:
        row[p.value] = 0.0
        continue
      trace = mean_trace
      for part in path:
        trace = trace[part]
      w = weights[layer.path]
      assert w is not None  # a layer with a weight path has a weight
      # E[dW^T H dW] / 2 with i.i.d. noise: tr(H) * mean noise variance / 2.
      noise = float(jnp.mean(noise_variance(w, p, quant.rounding)))
      row[p.value] = float(abs(trace) * noise / 2)
    values[layer.path] = row
  return values


def random_scores(
  layer_list: Sequence[policy.Layer], precisions: Sequence[Precision], seed: int
) -> dict[str, dict[str, float]]:
  """Uniform random scores: the floor every indicator must beat."""
  rng = np.random.default_rng(seed)
  return {
    l.path: {
      p.value: float(rng.uniform()) for p in allowed_precisions(l, precisions)
    }
    for l in layer_list
  }
