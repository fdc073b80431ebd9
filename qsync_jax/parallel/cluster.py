"""Cluster specs: which device kinds the workers are, and where they run.

A cluster spec such as ``"v100:2,t4:2"`` names a device kind and a count per
group. Workers are mapped in order onto the JAX devices present: on a CPU-only
machine these are fake CPU devices (``jax_num_cpu_devices``), each given the
kind the spec names, so a plan's numerics run for real while timing claims
about the named GPUs come from the predictor.

This module also owns the dynamic-batch-sizing baseline's batch split (QSync's
"DB", reference/qsync.md section 7.4): local batches proportional to device
speed with the global batch fixed.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import numpy as np

from qsync_jax.plan.devices import supported_precisions


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """An ordered list of worker device kinds.

  Attributes:
    kinds: one device kind per worker, in worker order.
  """
  kinds: tuple[str, ...]

  @property
  def num_workers(self) -> int:
    return len(self.kinds)

  def groups(self) -> dict[str, int]:
    """Returns {kind: count} in first-appearance order."""
    counts: dict[str, int] = {}
    for k in self.kinds:
      counts[k] = counts.get(k, 0) + 1
    return counts

  def __str__(self) -> str:
    return ",".join(f"{k}:{n}" for k, n in self.groups().items())


def parse_cluster(spec: "str | ClusterSpec") -> ClusterSpec:
  """Parses ``"kind:count,kind:count,..."`` into a :class:`ClusterSpec`.

  A :class:`ClusterSpec` is returned as it is.

  Raises:
    ValueError: an empty spec, a malformed group, an unknown kind, or a
      count that is not a positive integer.
  """
  if isinstance(spec, ClusterSpec):
    return spec
  if not spec or not spec.strip():
    raise ValueError("empty cluster spec; expected e.g. 'v100:2,t4:2'")
  kinds: list[str] = []
  for group in spec.split(","):
    parts = group.strip().split(":")
    if len(parts) != 2 or not parts[0].strip():
      raise ValueError(f"malformed cluster group {group.strip()!r} in "
                       f"{spec!r}; expected kind:count, e.g. 'v100:2,t4:2'")
    kind, count = parts[0].strip().lower(), parts[1].strip()
    supported_precisions(kind)  # raises for an unknown kind
    try:
      n = int(count)
    except ValueError:
      raise ValueError(f"cluster group {group.strip()!r}: count {count!r} "
                       "is not an integer") from None
    if n <= 0:
      raise ValueError(f"cluster group {group.strip()!r}: count must be "
                       f"positive, got {n}")
    kinds.extend([kind] * n)
  return ClusterSpec(tuple(kinds))


def assign_devices(cluster: ClusterSpec,
                   devices: Sequence[jax.Device] | None = None
                   ) -> list[jax.Device]:
  """Returns one distinct JAX device per worker, in worker order.

  Args:
    cluster: the cluster spec.
    devices: the devices to map onto (default ``jax.devices()``, which is
      global in a multi-process run).

  Raises:
    ValueError: the cluster needs more devices than exist.
  """
  devices = list(jax.devices() if devices is None else devices)
  if cluster.num_workers > len(devices):
    raise ValueError(
        f"cluster {cluster} needs {cluster.num_workers} devices but only "
        f"{len(devices)} exist ({devices[0].platform if devices else 'none'});"
        " on CPU, set jax_num_cpu_devices (or XLA_FLAGS="
        "--xla_force_host_platform_device_count) before JAX starts")
  return devices[:cluster.num_workers]


def dynamic_batch_sizes(global_batch: int, speeds: Sequence[float]
                        ) -> list[int]:
  """Splits ``global_batch`` across workers in proportion to their speeds.

  Largest-remainder rounding keeps the sum exactly ``global_batch``; every
  worker gets at least one example.

  Args:
    global_batch: the fixed global batch size.
    speeds: one positive relative throughput per worker.

  Raises:
    ValueError: a non-positive speed, or fewer examples than workers.
  """
  speeds = np.asarray(speeds, dtype=np.float64)
  if speeds.size == 0 or np.any(speeds <= 0) or not np.all(
      np.isfinite(speeds)):
    raise ValueError(f"speeds must be positive and finite, got "
                     f"{speeds.tolist()}")
  n = speeds.size
  if global_batch < n:
    raise ValueError(f"global batch {global_batch} is smaller than the "
                     f"{n} workers")
  # Give each worker one example first so none is left empty.
  share = (global_batch - n) * speeds / speeds.sum()
  sizes = np.floor(share).astype(int)
  remainder = global_batch - n - sizes.sum()
  order = np.argsort(-(share - sizes), kind="stable")
  sizes[order[:remainder]] += 1
  return (sizes + 1).tolist()


def parse_speeds(spec: str | Mapping[str, float]) -> dict[str, float]:
  """Parses ``"v100:1.3,t4:1"`` (or a mapping) into {kind: relative speed}.

  Raises:
    ValueError: malformed entries, unknown kinds or non-positive speeds.
  """
  if isinstance(spec, Mapping):
    items = list(spec.items())
  else:
    items = []
    for group in spec.split(","):
      parts = group.strip().split(":")
      if len(parts) != 2:
        raise ValueError(f"malformed speed {group.strip()!r}; expected "
                         "kind:speed, e.g. 'v100:1.3,t4:1'")
      items.append((parts[0].strip().lower(), parts[1].strip()))
  speeds = {}
  for kind, value in items:
    supported_precisions(kind)  # raises for an unknown kind
    try:
      speeds[kind] = float(value)
    except ValueError:
      raise ValueError(f"speed of {kind!r} is not a number: {value!r}"
                       ) from None
    if not speeds[kind] > 0:
      raise ValueError(f"speed of {kind!r} must be positive, got {value}")
  return speeds
