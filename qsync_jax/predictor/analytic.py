"""Profiles of GPU kinds that are not present, from the device table.

This module owns :func:`analytic_profile`: the same table a measured profile
holds (:class:`~qsync_jax.predictor.profiling.Profile`), derived from a kind's
peak figures (:mod:`qsync_jax.plan.devices`) through the roofline
(:mod:`.roofline`): per layer from its FLOPs and bytes
(:func:`roofline_layer`), the non-layer rest from XLA's byte count of the
stand-in step, an optimizer pass from the parameter bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from qsync_jax.numerics.precision import Precision
from qsync_jax.plan.devices import device_spec
from qsync_jax.plan.devices import DeviceSpec
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.predictor import casting
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory
from qsync_jax.predictor import roofline
from qsync_jax.predictor.profiling import Profile


def analytic_profile(
  g: graph_lib.ModelGraph,
  device_kind: str,
  base: Profile | None = None,
  precisions: Sequence[Precision | str] | None = None,
  optimizer_state_copies: int = 2,
) -> Profile:
  """A profile for a GPU kind that is not present, from the catalog.

  Args:
    g: the model graph (at the batch size to predict).
    device_kind: a kind of :data:`qsync_jax.plan.devices.DEVICES`.
    base: a measured profile of the same graph, whose memory model (from the
      compiled step) and non-layer byte count it reuses; without it both
      come from shapes (:func:`.memory.analytic_memory_model`).
    precisions: precisions to cost (default: every one the kind supports).
    optimizer_state_copies: float32 copies of the parameters the optimizer
      keeps (Adam: 2).

  Raises:
    ValueError: an unknown device kind, or a precision it lacks.
  """
  spec = device_spec(device_kind)
  supported = supported_precisions(device_kind)
  if precisions is None:
    precisions = [p for p in Precision if p in supported]
  parsed = [Precision.parse(p) for p in precisions]
  for p in parsed:
    roofline.sustained_flops(spec, p)  # raises for a precision it lacks
  casts = casting.analytic_cast_model(spec)
  layers = {}
  for node in g.nodes:
    layers[node.path] = {
      p.value: roofline_layer(node, p, spec, casts)
      for p in parsed
      if not (node.floored and p.bits < 16)
    }
  mem = (
    base.memory.for_device(g, spec.memory_bytes)
    if base is not None
    else memory.analytic_memory_model(
      g, spec.memory_bytes, optimizer_state_copies
    )
  )
  bandwidth = roofline.sustained_bandwidth(spec)
  rest = {}
  kernels = 6 * len(g.nodes)  # bias, activation, norm: forward and backward
  for dt in sorted({graph_lib.output_dtype(p) for p in parsed}):
    scale = 1.0 if dt == "float32" else 0.75  # half the bytes up to a cast
    total = (
      mem.rest_bytes_accessed * scale / bandwidth
      + kernels * roofline.KERNEL_LAUNCH_S
    )
    rest[dt] = (total / 3.0, total)  # backward does about twice the forward
  # Adam: read params, grads, two moments; write params and moments.
  opt_bytes = 4.0 * g.num_params * (3 + 2 * optimizer_state_copies)
  optimizer_s = opt_bytes / bandwidth + 4 * roofline.KERNEL_LAUNCH_S
  key = dict(
    base.key
    if base is not None
    else {
      "graph": g.fingerprint(),
      "batch_shape": list(g.input_shape),
      "jax": jax.__version__,
    },
    device_kind=device_kind,
    precisions=[p.value for p in parsed],
  )
  return Profile(
    device_kind, "analytic", key, layers, rest, optimizer_s, casts, mem
  )


_OPERAND_BYTES = {
  Precision.FP32: 4,
  Precision.TF32: 4,
  Precision.BF16: 2,
  Precision.FP16: 2,
  Precision.INT8: 1,
  Precision.FP8: 1,
}


def roofline_layer(
  node: graph_lib.LayerNode,
  p: Precision,
  spec: DeviceSpec,
  casts: casting.CastModel,
) -> tuple[float, float]:
  """Roofline (forward_s, forward_and_backward_s) of one layer at ``p``.

  Forward: operand preparation from float32 (cast, or quantization for INT8
  and FP8, including the master-weight cast), then the contraction at ``p``.
  Backward: one contraction of the forward's size per gradient (input, if
  needed, and weight), in FP16 for INT8 (QSync) and at ``p`` otherwise, plus
  dequantizing the saved codes and casting the input gradient back.

  Args:
    node: the layer.
    p: the precision it computes at.
    spec: the device.
    casts: the device's cast model (operand preparation).

  Returns:
    ``(forward_s, forward_and_backward_s)``.
  """
  act = sum(op.numel for op in node.operands)
  w = node.weight_numel
  low = graph_lib.output_dtype(p)
  quantized = p in (Precision.INT8, Precision.FP8)
  prep_dtype = "int8" if quantized else low
  prep = casts.time("float32", prep_dtype, act) + casts.time(
    "float32", prep_dtype, w
  )
  if node.kind == "Embed":
    return prep, prep + casts.time(low, "float32", w)
  out_bytes = 4 if quantized else _OPERAND_BYTES[p]
  fwd = prep + roofline.roofline_time(
    node.flops,
    _OPERAND_BYTES[p] * (act + w) + out_bytes * node.out_numel,
    p,
    spec,
  )
  bwd_p = Precision.FP16 if p is Precision.INT8 else p
  grads = sum(1 for op in node.operands if op.needs_grad) + (1 if w else 0)
  bwd = grads * roofline.roofline_time(
    node.flops, _OPERAND_BYTES[bwd_p] * (act + w + node.out_numel), bwd_p, spec
  )
  if quantized:
    bwd += casts.time("int8", "float16", act + w)
  bwd += casts.time(graph_lib.output_dtype(bwd_p), "float32", act)
  return fwd, fwd + bwd
