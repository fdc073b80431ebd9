"""The roofline: how long a layer's work takes on a GPU that is not here.

This module owns the modelling choices that turn the device table's peak
figures (:mod:`qsync_jax.plan.devices`) into times: sustained throughput is
the peak times an efficiency, 0.7 for matmuls and convolutions and 0.8 for
memory traffic (sustained GEMM on data-center GPUs is typically 60-80 % of
peak), plus a fixed kernel launch latency (:func:`roofline_time`); and the
network between nodes when a cluster spans several.

These are predictions for GPUs that are not present; the predictor's accuracy
can be checked only on the device at hand.
"""

from __future__ import annotations

from qsync_jax.numerics.precision import Precision
from qsync_jax.plan.devices import DeviceSpec
from qsync_jax.plan.devices import supported_precisions

#: Fraction of peak FLOP/s a large matmul or convolution sustains.
MATMUL_EFFICIENCY = 0.7
#: Fraction of peak memory bandwidth a streaming kernel sustains.
MEMORY_EFFICIENCY = 0.8
#: Per-kernel launch latency (seconds).
KERNEL_LAUNCH_S = 5e-6
#: Default bandwidth between nodes: 100 Gb/s Ethernet (inference-serving
#: clusters typically have 25-100 Gb/s).
NETWORK_BANDWIDTH = 100e9 / 8
#: Default latency of one network hop (seconds).
NETWORK_LATENCY_S = 10e-6


def sustained_flops(spec: DeviceSpec, precision: Precision) -> float:
  """Sustained FLOP/s of a contraction at ``precision`` on ``spec``.

  Args:
    spec: the device.
    precision: the contraction's precision.

  Returns:
    The peak FLOP/s at ``precision`` times :data:`MATMUL_EFFICIENCY`.

  Raises:
    ValueError: the device does not offer ``precision``.
  """
  supported = supported_precisions(spec.kind)
  if precision not in supported:
    raise ValueError(
      f"{spec.kind} does not support {precision.value}; it supports "
      f"{', '.join(sorted(p.value for p in supported))}"
    )
  return spec.peak_flops[precision] * MATMUL_EFFICIENCY


def sustained_bandwidth(spec: DeviceSpec) -> float:
  """Sustained memory bytes/s of ``spec`` (peak times the efficiency)."""
  return spec.memory_bandwidth * MEMORY_EFFICIENCY


def roofline_time(
  flops: float,
  bytes_moved: float,
  precision: Precision,
  spec: DeviceSpec,
  kernels: int = 1,
) -> float:
  """Time of work bound by compute or by memory traffic, plus launches.

  Args:
    flops: FLOPs (OPs for INT8) of the contraction.
    bytes_moved: bytes read and written.
    precision: the precision the FLOPs run at.
    spec: the device.
    kernels: kernels launched.

  Returns:
    ``max(flops / rate, bytes / bandwidth) + kernels * launch`` seconds.
  """
  compute = flops / sustained_flops(spec, precision) if flops else 0.0
  return (
    max(compute, bytes_moved / sustained_bandwidth(spec))
    + kernels * KERNEL_LAUNCH_S
  )
