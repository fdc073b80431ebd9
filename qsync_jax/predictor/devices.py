"""The GPU catalog and the roofline that turns it into layer times.

This module owns :class:`DeviceSpec` (peak throughput per precision, memory
size and bandwidth, links), :data:`DEVICES` for the kinds a cluster spec may
name (t4, v100, a10, l4, a100, h100, l40s) and :func:`roofline_time`.

Figures are vendor peaks at boost clock, dense (no 2:4 sparsity), as
collected in reference/peers.md section 6 with the sources named there; each
spec's ``source`` repeats them. Cells marked [R] there are not confirmed
against the official datasheets. Two modelling choices:

* a precision without tensor-core support runs at the FP32 vector rate (V100
  and T4 INT8/BF16 are not offered by :mod:`qsync_jax.plan.precision` anyway);
* sustained throughput is the peak times an efficiency: 0.7 for matmuls and
  convolutions, 0.8 for memory traffic (peers.md section 6: sustained GEMM is
  typically 60-80 % of peak), plus a fixed kernel launch latency.

These are predictions for GPUs that are not present; the predictor's accuracy
is measured only on the device at hand (docs/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from qsync_jax.plan.precision import Precision, supported_precisions

TFLOPS = 1e12
GBPS = 1e9

#: Fraction of peak FLOP/s a large matmul or convolution sustains.
MATMUL_EFFICIENCY = 0.7
#: Fraction of peak memory bandwidth a streaming kernel sustains.
MEMORY_EFFICIENCY = 0.8
#: Per-kernel launch latency (seconds).
KERNEL_LAUNCH_S = 5e-6
#: Default bandwidth between nodes: 100 Gb/s Ethernet (peers.md 6.1: 25-100).
NETWORK_BANDWIDTH = 100e9 / 8
#: Default latency of one network hop (seconds).
NETWORK_LATENCY_S = 10e-6


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Peak figures of one GPU kind.

  Attributes:
    kind: the device kind (as in cluster specs).
    peak_flops: dense peak FLOP/s (OP/s for INT8) per precision.
    memory_bytes: device memory.
    memory_bandwidth: bytes/s.
    link_bandwidth: bytes/s per direction between two GPUs of one node.
    source: where the figures come from.
  """
  kind: str
  peak_flops: Mapping[Precision, float]
  memory_bytes: float
  memory_bandwidth: float
  link_bandwidth: float
  source: str

  def flops_rate(self, precision: Precision) -> float:
    """Sustained FLOP/s of a contraction at ``precision``.

    Raises:
      ValueError: the device does not offer ``precision``.
    """
    if precision not in supported_precisions(self.kind):
      raise ValueError(
          f"{self.kind} does not support {precision.value}; it supports "
          f"{', '.join(sorted(p.value for p in supported_precisions(self.kind)))}")
    return self.peak_flops[precision] * MATMUL_EFFICIENCY

  @property
  def bandwidth(self) -> float:
    """Sustained memory bytes/s."""
    return self.memory_bandwidth * MEMORY_EFFICIENCY


def _spec(kind, fp32, tf32, fp16, bf16, int8, fp8, mem_gb, bw_gbs, link_gbs,
          source) -> DeviceSpec:
  peaks = {Precision.FP32: fp32, Precision.TF32: tf32 or fp32,
           Precision.FP16: fp16, Precision.BF16: bf16 or fp32,
           Precision.INT8: int8 or fp32, Precision.FP8: fp8 or fp32}
  return DeviceSpec(kind, {p: v * TFLOPS for p, v in peaks.items()},
                    mem_gb * 1e9, bw_gbs * GBPS, link_gbs * GBPS, source)


DEVICES: dict[str, DeviceSpec] = {s.kind: s for s in [
    _spec("t4", 8.1, None, 65, None, 130, None, 16, 320, 16,
          "T4 datasheet via geektopia.es / sysrqmts.com (peers.md 6); "
          "PCIe Gen3 x16 ~16 GB/s"),
    _spec("v100", 15.7, None, 125, None, None, None, 32, 900, 150,
          "V100 SXM2 datasheet (peers.md 6, [R]); NVLink2 300 GB/s "
          "bidirectional"),
    _spec("a10", 31.2, 62.5, 125, 125, 250, None, 24, 600, 32,
          "A10 datasheet (peers.md 6, tensor figures [R]); PCIe Gen4 x16"),
    _spec("l4", 30.3, 60, 121, 121, 242, 242, 24, 300, 32,
          "L4 via fpsbench.com / grokipedia (peers.md 6); PCIe Gen4 x16"),
    _spec("a100", 19.5, 156, 312, 312, 624, None, 80, 2039, 300,
          "A100 SXM4 80 GB datasheet via glennklockwood.com (peers.md 6); "
          "NVLink3 600 GB/s bidirectional"),
    _spec("h100", 66.9, 494.7, 989.4, 989.4, 1979, 1979, 80, 3350, 450,
          "H100 SXM5 via glennklockwood.com (peers.md 6); NVLink4 900 GB/s "
          "bidirectional"),
    _spec("l40s", 91.6, 183, 362, 362, 733, 733, 48, 864, 32,
          "L40S via mullet.se (peers.md 6; INT8 [R]); PCIe Gen4 x16"),
]}


def device_spec(kind: str) -> DeviceSpec:
  """Returns the catalog entry of a GPU kind.

  Raises:
    ValueError: ``kind`` is not in the catalog (the message lists it).
  """
  try:
    return DEVICES[kind]
  except KeyError:
    raise ValueError(
        f"unknown device kind {kind!r}: the GPU catalog has "
        f"{', '.join(sorted(DEVICES))}") from None


def roofline_time(flops: float, bytes_moved: float, precision: Precision,
                  spec: DeviceSpec, kernels: int = 1) -> float:
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
  compute = flops / spec.flops_rate(precision) if flops else 0.0
  return max(compute, bytes_moved / spec.bandwidth) + kernels * KERNEL_LAUNCH_S
