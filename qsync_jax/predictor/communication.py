"""What one average costs on a link: the bytes moved, latency and the codec.

This module owns the communication side of the predictor:

* :class:`Link`: a link's bandwidth (bytes/s), per-step latency and topology,
  parsed from the launcher's flag strings (``--link=1gbit --latency=1ms
  --topology=per_node``, through :meth:`qsync_jax.launch.links.LinkSpec.parse`)
  or from the record a run keeps of its emulated link (``settings.link``,
  which holds the rate measured before the run);
* the collectives an averager issues, read two ways: as the program asks for
  them (:func:`traced_collectives`: the jaxpr of the averager in a
  ``shard_map`` over an abstract mesh, valid on any platform) and as the
  compiled program moves them (:func:`compiled_collectives`: the optimized
  HLO on real devices). They differ where a backend widens a type before the
  collective: XLA:CPU runs a bfloat16 all-reduce in float32 (float16 stays
  16-bit), so on CPU bf16 moves float32 bytes. :func:`averager_traffic`
  prices an averager's own ``wire_bytes`` times that widening, per platform;
* :func:`~.codec.profile_codec`: the measured encode/decode cost of an
  averager (everything but the wire), fitted as ``a + b n``
  (:class:`~.codec.CodecCost`), from :mod:`.codec` and re-exported here;
* :func:`averaging_time`: wire time + latency terms + codec cost.

Ring model: a ring all-reduce of ``B`` bytes sends ``2 (n-1)/n B`` per worker
in ``2 (n-1)`` steps, an all-gather of ``B`` each ``(n-1) B`` in ``n-1``
steps, a ``ppermute`` its operand in one step. On a ``per_node`` link every
worker sends over its own link, so the wire time is its bytes over the
bandwidth; on a ``shared`` link all workers' traffic crosses one link, so the
time multiplies by the number of workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import functools
import re
from typing import Any

import jax
from jax.sharding import AbstractMesh
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np

from qsync_jax.launch import links
from qsync_jax.parallel.wire import Averager

# Re-exported: the predictor's communication API is this module's.
from qsync_jax.predictor.codec import abstract_args
from qsync_jax.predictor.codec import AXIS
from qsync_jax.predictor.codec import CodecCost
from qsync_jax.predictor.codec import COLLECTIVE_PRIMITIVES
from qsync_jax.predictor.codec import local_program  # noqa: F401
from qsync_jax.predictor.codec import profile_codec  # noqa: F401
from qsync_jax.predictor.codec import shard_body

_HLO_KINDS = {
  "all-reduce": "all_reduce",
  "all-reduce-start": "all_reduce",
  "all-gather": "all_gather",
  "all-gather-start": "all_gather",
  "collective-permute": "permute",
  "collective-permute-start": "permute",
  "reduce-scatter": "reduce_scatter",
  "all-to-all": "all_to_all",
}
# "%name = TYPE op(" where TYPE is one array or a tuple of arrays.
_HLO_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+([a-z\-]+)\(")
_HLO_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_HLO_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
}
# Elements per worker of the small program compiled to find the widening.
_PROBE_ELEMENTS = 1 << 12


@dataclasses.dataclass(frozen=True)
class Link:
  """A network link between workers.

  Attributes:
    bandwidth: bytes per second each worker can send (``per_node``), or all
      of them together (``shared``).
    latency_s: seconds per step of a collective (one hop, worker to worker).
    topology: ``"per_node"`` (a link each) or ``"shared"`` (one link that all
      workers' traffic crosses).
  """

  bandwidth: float
  latency_s: float = 0.0
  topology: str = "per_node"

  def __post_init__(self):
    if not (np.isfinite(self.bandwidth) and self.bandwidth > 0):
      raise ValueError(
        f"link bandwidth must be a positive number of bytes/s, "
        f"got {self.bandwidth!r}"
      )
    if not (np.isfinite(self.latency_s) and self.latency_s >= 0):
      raise ValueError(
        f"link latency must be >= 0 seconds, got {self.latency_s!r}"
      )
    if self.topology not in links.TOPOLOGIES:
      raise ValueError(
        f"link topology must be one of "
        f"{', '.join(links.TOPOLOGIES)}, got {self.topology!r}"
      )

  @classmethod
  def parse(
    cls, rate: str, latency: str = "0", topology: str = "per_node"
  ) -> Link:
    """A link from the launcher's flag strings (``"1gbit"``, ``"1ms"``).

    The launcher's latency is the one-way delay from a process to the
    switch, so one worker-to-worker step costs twice it.

    Raises:
      ValueError: a malformed rate or latency, or an unknown topology.
    """
    spec = links.LinkSpec.parse(rate, latency, topology)
    return cls(spec.rate_bps / 8, 2 * spec.latency_s, spec.topology)

  @classmethod
  def from_record(cls, record: Mapping[str, Any]) -> Link:
    """The link of a run's record (:func:`links.link_info_from_env`).

    Uses the rate measured before the run when the record has one, else the
    configured rate.

    Raises:
      ValueError: the record has neither rate, or a bad topology.
    """
    bps = record.get("measured_bps") or record.get("rate_bps")
    if not bps:
      raise ValueError(f"link record has no rate: {dict(record)}")
    return cls(
      float(bps) / 8,
      2 * float(record.get("latency_s") or 0.0),
      record.get("topology") or "per_node",
    )

  def wire_time(self, bytes_per_worker: float, num_workers: int) -> float:
    """Seconds to send ``bytes_per_worker`` from every worker at once."""
    crossing = num_workers if self.topology == "shared" else 1
    return crossing * bytes_per_worker / self.bandwidth


_HLO_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_HLO_PAIR = re.compile(r"\{(\d+),(\d+)\}")


def permute_kind(pairs) -> str:
  """``"exchange"`` where every worker of ``pairs`` (source, target) sends
  to the worker it receives from, as in a butterfly stage, else
  ``"permute"``.

  The two cost differently over gloo: a stage of Global-QSGD's exponential
  merges (pairwise swaps) costs more than a ring shift of the same bytes.
  """
  pairs = {(int(a), int(b)) for a, b in pairs}
  if pairs and all((b, a) in pairs for a, b in pairs):
    return "exchange"
  return "permute"


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective: its kind and the bytes of one worker's operand.

  ``kind`` is ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
  ``"all_to_all"``, ``"permute"`` or ``"exchange"`` (a permute of pairwise
  swaps, :func:`permute_kind`); ``dtype`` the HLO or numpy type moved.
  """

  kind: str
  operand_bytes: float
  dtype: str


def _kind_bytes_steps(c: Collective, n: int) -> tuple[float, int]:
  """Bytes each worker sends and sequential steps, in a ring of ``n``."""
  if n <= 1:
    return 0.0, 0
  b = c.operand_bytes
  return {
    "all_reduce": (2.0 * (n - 1) / n * b, 2 * (n - 1)),
    "all_gather": ((n - 1) * b, n - 1),
    "reduce_scatter": ((n - 1) / n * b, n - 1),
    "all_to_all": ((n - 1) / n * b, n - 1),
    "permute": (b, 1),
    "exchange": (b, 1),
  }[c.kind]


@dataclasses.dataclass(frozen=True)
class Traffic:
  """What one average puts on the wire, per worker.

  Attributes:
    bytes: bytes each worker sends.
    steps: sequential collective steps (each pays the link's latency).
    widening: bytes the compiled program moves over the bytes the program
      asks for (1 where the platform keeps every type).
  """

  bytes: float
  steps: int
  widening: float = 1.0


def traffic_of(collectives: Sequence[Collective], num_workers: int) -> Traffic:
  """Sums the ring bytes and steps of ``collectives`` over ``num_workers``."""
  total, steps = 0.0, 0
  for c in collectives:
    b, s = _kind_bytes_steps(c, num_workers)
    total += b
    steps += s
  return Traffic(total, steps)


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (list, tuple)) else [value]:
      if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # a ClosedJaxpr
        yield v.jaxpr
      elif hasattr(v, "eqns"):  # a Jaxpr
        yield v


def _jaxpr_collectives(jaxpr) -> list[Collective]:
  found = []
  for eqn in jaxpr.eqns:
    kind = COLLECTIVE_PRIMITIVES.get(eqn.primitive.name)
    if kind == "permute":
      kind = permute_kind(eqn.params.get("perm", ()))
    if kind is not None:
      for v in eqn.invars:
        aval = v.aval
        found.append(
          Collective(
            kind, float(aval.size * aval.dtype.itemsize), str(aval.dtype)
          )
        )
    for sub in _sub_jaxprs(eqn):
      found.extend(_jaxpr_collectives(sub))
  return found


def traced_collectives(
  averager: Averager, num_elements: int, num_workers: int
) -> list[Collective]:
  """The collectives the averager's program asks for (any platform).

  Traces the averager in a ``shard_map`` over an abstract mesh of
  ``num_workers`` (no devices needed) and reads the collectives of its jaxpr
  with their operands' types.

  Raises:
    ValueError: fewer than 1 element or worker, or the averager cannot run
      on that many workers.
  """
  if num_elements < 1 or num_workers < 1:
    raise ValueError(
      f"need at least one element and one worker, got "
      f"{num_elements} elements, {num_workers} workers"
    )
  mesh = AbstractMesh((num_workers,), (AXIS,))
  fn = jax.shard_map(
    shard_body(averager),
    mesh=mesh,
    in_specs=(P(AXIS), P(AXIS)),
    out_specs=P(AXIS),
  )
  jaxpr = jax.make_jaxpr(fn)(*abstract_args(num_elements, num_workers))
  return _jaxpr_collectives(jaxpr.jaxpr)


def hlo_collectives(hlo_text: str, num_workers: int) -> list[Collective]:
  """The collectives of an optimized HLO module's text, per worker operand.

  An all-gather's result holds every worker's operand (divided by
  ``num_workers``); a reduce-scatter's holds one share (multiplied).
  """
  found = []
  for line in hlo_text.splitlines():
    m = _HLO_OP.search(line)
    if not m or m.group(2) not in _HLO_KINDS:
      continue
    kind = _HLO_KINDS[m.group(2)]
    pairs = _HLO_PAIRS.search(line) if kind == "permute" else None
    if pairs:
      kind = permute_kind(_HLO_PAIR.findall(pairs.group(1)))
    for dtype, dims in _HLO_ARRAY.findall(m.group(1)):
      size = float(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      b = size * _HLO_BYTES.get(dtype, 4)
      if kind == "all_gather":
        b /= num_workers
      elif kind == "reduce_scatter":
        b *= num_workers
      found.append(Collective(kind, b, dtype))
  return found


def compiled_collectives(
  averager: Averager, num_elements: int, devices: Sequence[jax.Device]
) -> list[Collective]:
  """The collectives the compiled averager moves over ``devices``.

  Compiles (does not run) the averager in a ``shard_map`` over a mesh of
  ``devices``, one worker each, and reads the optimized HLO.
  """
  devices = list(devices)
  mesh = Mesh(np.array(devices), (AXIS,))
  fn = jax.jit(
    jax.shard_map(
      shard_body(averager),
      mesh=mesh,
      in_specs=(P(AXIS), P(AXIS)),
      out_specs=P(AXIS),
    )
  )
  text = (
    fn.lower(*abstract_args(num_elements, len(devices))).compile().as_text()
  )
  assert text is not None, "the compiled averager has no HLO text"
  return hlo_collectives(text, len(devices))


def _probe_devices(platform: str) -> list[jax.Device]:
  """A power-of-two number (>= 2) of this platform's devices, or none."""
  try:
    devices = jax.devices(platform)
  except RuntimeError:  # the platform is not present
    return []
  k = 1 << (min(len(devices), 8).bit_length() - 1)
  return devices[:k] if k >= 2 else []


@functools.cache
def _widening(averager: Averager, platform: str) -> float:
  devices = _probe_devices(platform)
  if not devices:
    return 1.0
  k = len(devices)
  asked = traffic_of(traced_collectives(averager, _PROBE_ELEMENTS, k), k)
  moved = traffic_of(
    compiled_collectives(averager, _PROBE_ELEMENTS, devices), k
  )
  return moved.bytes / asked.bytes if asked.bytes else 1.0


def widening(averager: Averager, platform: str) -> float:
  """Bytes the ``platform``'s compiled averager moves over those it asks for.

  Compiled on up to 8 of the platform's devices (a small vector: types,
  not sizes, decide it). A platform with fewer than 2 devices here cannot be
  compiled for; it is taken to keep every type (1.0), as NCCL sums float16
  and bfloat16 natively on GPUs.
  """
  return _widening(averager, platform)


def averager_traffic(
  averager: Averager,
  num_elements: int,
  num_workers: int,
  platform: str | None = None,
  devices: Sequence[jax.Device] | None = None,
  compiled: Sequence[Collective] | None = None,
) -> Traffic:
  """The bytes and steps one average of ``num_elements`` floats costs.

  Args:
    averager: the averaging strategy.
    num_elements: float32 elements per worker.
    num_workers: workers in the average.
    platform: ``"cpu"``, ``"gpu"``, ...: whose compiler's widening applies
      (:func:`widening`); None for the bytes the program asks for.
    devices: instead of ``platform``, the very devices of the run
      (``num_workers`` of them): the compiled program's bytes at this size.
    compiled: with ``devices``, that program's collectives when already
      read (:func:`compiled_collectives`), so it is not compiled again.

  Returns:
    :class:`Traffic`: ``averager.wire_bytes`` times the widening, and the
    ring steps of its collectives.

  Raises:
    ValueError: ``devices`` not ``num_workers`` long, or as
      :func:`traced_collectives`.
  """
  if devices is None:
    return _platform_traffic(
      averager, int(num_elements), int(num_workers), platform
    )
  asked = traffic_of(
    traced_collectives(averager, num_elements, num_workers), num_workers
  )
  if len(devices) != num_workers:
    raise ValueError(
      f"devices must be one per worker ({num_workers}), got {len(devices)}"
    )
  if compiled is None:
    compiled = compiled_collectives(averager, num_elements, devices)
  moved = traffic_of(compiled, num_workers)
  factor = moved.bytes / asked.bytes if asked.bytes else 1.0
  wire = float(averager.wire_bytes(num_elements, num_workers))
  return Traffic(wire * factor, asked.steps, factor)


@functools.lru_cache(maxsize=4096)
def _platform_traffic(
  averager: Averager, num_elements: int, num_workers: int, platform: str | None
) -> Traffic:
  """:func:`averager_traffic` without devices (cached: a search prices the
  same buckets many times)."""
  asked = traffic_of(
    traced_collectives(averager, num_elements, num_workers), num_workers
  )
  factor = widening(averager, platform) if platform else 1.0
  wire = float(averager.wire_bytes(num_elements, num_workers))
  return Traffic(wire * factor, asked.steps, factor)


def averaging_time(
  averager: Averager,
  num_elements: int,
  num_workers: int,
  link: Link,
  codec_cost: CodecCost | None = None,
  *,
  platform: str | None = None,
  traffic: Traffic | None = None,
  measured: Any = None,
  collectives: Sequence[Collective] | None = None,
) -> float:
  """Predicted seconds of one average of ``num_elements`` floats.

  ``wire time + steps x latency + codec cost``: the wire time of the bytes
  the compiled program moves (:func:`averager_traffic`, on
  :meth:`Link.wire_time`), one latency per ring step, and the measured
  encode/decode (:func:`profile_codec`; 0 when not given). Encode, wire and
  decode run one after the other (one call's collectives are synchronous).

  Args:
    averager: the averaging strategy.
    num_elements: float32 elements per worker.
    num_workers: workers in the average.
    link: the link.
    codec_cost: the averager's measured local work, or None.
    platform: whose compiler's widening applies (see
      :func:`averager_traffic`).
    traffic: the traffic, when already known (skips :func:`averager_traffic`).
    measured: a :class:`~.collective_cost.CollectiveCost` measured on the
      run's mesh: with ``collectives`` (the averager's compiled ones at
      this size, :func:`compiled_collectives`), their fitted time replaces
      the link's wire and latency terms.
    collectives: see ``measured``.

  Returns:
    Seconds (0 for one worker, whose average moves nothing and is free).

  Raises:
    ValueError: ``measured`` without ``collectives``.
  """
  if num_workers <= 1:
    return 0.0
  if measured is not None:
    if collectives is None:
      raise ValueError(
        "a measured collective cost needs the averager's compiled collectives"
      )
    return measured(collectives) + (
      codec_cost(num_elements) if codec_cost is not None else 0.0
    )
  if traffic is None:
    traffic = averager_traffic(averager, num_elements, num_workers, platform)
  codec = codec_cost(num_elements) if codec_cost is not None else 0.0
  return (
    link.wire_time(traffic.bytes, num_workers)
    + traffic.steps * link.latency_s
    + codec
  )
