"""The one device table: what each device kind computes, and its figures.

This module owns, per device kind a cluster spec may name, the precisions it
computes natively (what a plan is validated against) and, for GPUs, its
catalog figures (:class:`DeviceSpec`: peak FLOP/s per precision, memory size
and bandwidth, links), which the predictor's roofline
(:mod:`qsync_jax.predictor.roofline`) turns into layer times.

Precisions follow QSync's per-architecture bit lists (QSync's official code,
bytedance/QSync, ``qsync/LpTorch/conf.py: config_ava_bits``: sm70 -> {16, 32},
sm75 -> {8, 16, 32}, sm80 -> {8, 16, 19, 32}) extended with the tensor-core
data types of the newer inference GPUs (NVIDIA's datasheets): BF16 needs
Ampere, FP8 needs Ada or Hopper.
A CPU computes every precision (in software), which is what lets the numerics
of any plan be tested on CPU; it has no catalog figures.

Figures are vendor peaks at boost clock, dense (no 2:4 sparsity); each spec's
``source`` names where they come from, and marks "unchecked" the figures not yet
checked against the official datasheet. A precision without tensor-core support
is given the FP32 vector rate (V100 and T4 INT8/BF16 are not in their precisions
anyway).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import re
from typing import Any

from qsync_jax.numerics.precision import Precision

TFLOPS = 1e12
GBPS = 1e9


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


def _spec(
  kind, fp32, tf32, fp16, bf16, int8, fp8, mem_gb, bw_gbs, link_gbs, source
) -> DeviceSpec:
  peaks = {
    Precision.FP32: fp32,
    Precision.TF32: tf32 or fp32,
    Precision.FP16: fp16,
    Precision.BF16: bf16 or fp32,
    Precision.INT8: int8 or fp32,
    Precision.FP8: fp8 or fp32,
  }
  return DeviceSpec(
    kind,
    {p: v * TFLOPS for p, v in peaks.items()},
    mem_gb * 1e9,
    bw_gbs * GBPS,
    link_gbs * GBPS,
    source,
  )


_P = Precision
_ALL = frozenset(Precision)
_AMPERE = frozenset({_P.FP32, _P.TF32, _P.BF16, _P.FP16, _P.INT8})

#: kind -> (precisions computed natively, catalog figures or None).
_TABLE: dict[str, tuple[frozenset[Precision], DeviceSpec | None]] = {
  "cpu": (_ALL, None),
  # Volta sm_70: FP16 tensor cores only; INT8 via DP4A only, BF16 emulated.
  "v100": (
    frozenset({_P.FP32, _P.FP16}),
    _spec(
      "v100",
      15.7,
      None,
      125,
      None,
      None,
      None,
      32,
      900,
      150,
      "NVIDIA V100 SXM2 datasheet (unchecked); NVLink2 300 GB/s bidirectional",
    ),
  ),
  # Turing sm_75: FP16 and INT8 tensor cores; no BF16, TF32 or FP8.
  "t4": (
    frozenset({_P.FP32, _P.FP16, _P.INT8}),
    _spec(
      "t4",
      8.1,
      None,
      65,
      None,
      130,
      None,
      16,
      320,
      16,
      "NVIDIA T4 datasheet; PCIe Gen3 x16 ~16 GB/s",
    ),
  ),
  # Ampere sm_80 / sm_86: add TF32 and BF16.
  "a10": (
    _AMPERE,
    _spec(
      "a10",
      31.2,
      62.5,
      125,
      125,
      250,
      None,
      24,
      600,
      32,
      "NVIDIA A10 datasheet (tensor figures unchecked); PCIe Gen4 x16",
    ),
  ),
  "a100": (
    _AMPERE,
    _spec(
      "a100",
      19.5,
      156,
      312,
      312,
      624,
      None,
      80,
      2039,
      300,
      "NVIDIA A100 SXM4 80 GB datasheet; NVLink3 600 GB/s bidirectional",
    ),
  ),
  # Ada sm_89 and Hopper sm_90: add FP8 (e4m3 / e5m2).
  "l4": (
    _ALL,
    _spec(
      "l4",
      30.3,
      60,
      121,
      121,
      242,
      242,
      24,
      300,
      32,
      "L4 via fpsbench.com / grokipedia; PCIe Gen4 x16",
    ),
  ),
  "l40s": (
    _ALL,
    _spec(
      "l40s",
      91.6,
      183,
      362,
      362,
      733,
      733,
      48,
      864,
      32,
      "L40S via mullet.se (INT8 unchecked); PCIe Gen4 x16",
    ),
  ),
  "h100": (
    _ALL,
    _spec(
      "h100",
      66.9,
      494.7,
      989.4,
      989.4,
      1979,
      1979,
      80,
      3350,
      450,
      "H100 SXM5 via glennklockwood.com; NVLink4 900 GB/s bidirectional",
    ),
  ),
  "h200": (
    _ALL,
    _spec(
      "h200",
      67,
      494.7,
      989.5,
      989.5,
      1979,
      1979,
      141,
      4800,
      450,
      "NVIDIA H200 SXM datasheet (dense figures, half the sparse ones); "
      "NVLink4 900 GB/s bidirectional",
    ),
  ),
}

#: jax ``device_kind`` regex -> kind of the table, searched in order in the
#: lowercased string; whole words only, so A10 does not match an A100 nor
#: L4 an L40S. A new GPU needs a row here and its figures in ``_TABLE``.
DEVICE_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
  (r"^cpu$", "cpu"),  # jax CPU devices
  (r"\bv100s?\b", "v100"),  # Tesla V100-SXM2-16GB, V100S-PCIE-32GB
  (r"\bt4\b", "t4"),  # Tesla T4
  (r"\ba100\b", "a100"),  # NVIDIA A100-SXM4-80GB, A100-PCIE
  (r"\ba10\b", "a10"),  # NVIDIA A10
  (r"\bl40s\b", "l40s"),  # NVIDIA L40S
  (r"\bl4\b", "l4"),  # NVIDIA L4
  (r"\bh100\b", "h100"),  # NVIDIA H100 80GB HBM3, H100 PCIe
  (r"\bh200\b", "h200"),  # NVIDIA H200
)

#: Precisions each device kind computes natively (tensor cores or SIMD units).
DEVICE_PRECISIONS: Mapping[str, frozenset[Precision]] = {
  kind: precisions for kind, (precisions, _) in _TABLE.items()
}

#: The GPU catalog: the kinds that have figures (every kind but ``cpu``).
DEVICES: dict[str, DeviceSpec] = {
  kind: spec for kind, (_, spec) in _TABLE.items() if spec is not None
}


def device_kinds() -> list[str]:
  """Returns the device kinds the table knows."""
  return sorted(_TABLE)


def supported_precisions(device_kind: str) -> frozenset[Precision]:
  """Returns the precisions ``device_kind`` computes natively.

  Args:
    device_kind: a kind of the table, any case, surrounding spaces ignored.

  Returns:
    The kind's precisions.

  Raises:
    ValueError: the device kind is unknown.

  Example:
    >>> import qsync_jax as qs
    >>> sorted(p.value for p in qs.supported_precisions("T4"))
    ['fp16', 'fp32', 'int8']
    >>> qs.Precision.INT8 in qs.supported_precisions("v100")
    False
  """
  kind = device_kind.strip().lower()
  if kind not in _TABLE:
    raise ValueError(
      f"unknown device kind {device_kind!r}; known kinds: "
      f"{', '.join(device_kinds())}"
    )
  return DEVICE_PRECISIONS[kind]


def device_spec(kind: str) -> DeviceSpec:
  """Returns the catalog figures of a GPU kind.

  Args:
    kind: a kind of :data:`DEVICES` (exact spelling).

  Returns:
    Its :class:`DeviceSpec`.

  Raises:
    ValueError: ``kind`` is not in the catalog (the message lists it).
  """
  try:
    return DEVICES[kind]
  except KeyError:
    raise ValueError(
      f"unknown device kind {kind!r}: the GPU catalog has "
      f"{', '.join(sorted(DEVICES))}"
    ) from None


def device_kind_of(device: Any) -> str:
  """Returns the table's kind of a JAX device or of its ``device_kind``.

  Args:
    device: a ``jax.Device`` (anything with a ``device_kind`` attribute; a
      ``platform`` of ``"cpu"`` is the kind ``cpu`` whatever its
      ``device_kind``) or a ``device_kind`` string such as ``"Tesla T4"``.

  Returns:
    A kind of :func:`device_kinds`, matched by
    :data:`DEVICE_KIND_PATTERNS`.

  Raises:
    ValueError: the device kind matches no pattern (the message lists the
      known kinds and where to add one).
  """
  if getattr(device, "platform", None) == "cpu":
    return "cpu"
  name = (
    device if isinstance(device, str) else getattr(device, "device_kind", None)
  )
  if not isinstance(name, str):
    raise ValueError(
      f"{device!r} is neither a device kind string nor a "
      "device with a device_kind attribute"
    )
  for pattern, kind in DEVICE_KIND_PATTERNS:
    if re.search(pattern, name.strip().lower()):
      return kind
  raise ValueError(
    f"unknown device kind {name!r}; known kinds: "
    f"{', '.join(device_kinds())}; to add one, add its pattern to "
    "DEVICE_KIND_PATTERNS and its figures to _TABLE in "
    "qsync_jax/plan/devices.py"
  )
