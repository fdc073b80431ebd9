"""Cluster specs: which device kinds the workers are, and where they run.

A cluster spec such as ``"v100:2,t4:2"`` names a device kind and a count per
group. Workers are mapped in order onto the JAX devices present: on a CPU-only
machine these are fake CPU devices (``jax_num_cpu_devices``), each given the
kind the spec names, so a plan's numerics run for real while timing claims
about the named GPUs come from the predictor.

This module also owns how a global batch is split over the workers
(:func:`split_batch`): as equally as possible, or by the dynamic-batch-sizing
baseline (QSync's "DB", arXiv 2407.02327; QSync's official code,
bytedance/QSync, its ``DynamicBatching/`` sampler): local batches proportional
to device speed with the global batch fixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import os
import re

import jax
import numpy as np

from qsync_jax.plan.devices import device_kind_of
from qsync_jax.plan.devices import supported_precisions

#: The cluster spec that means "the devices JAX sees" (:func:`resolve_cluster`).
AUTO = "auto"
#: The most workers a cluster spec may name. Every worker is a device and an
#: entry of every per-worker table the library builds (its kind here, its
#: batch, its predicted step); no cluster comes near this, and a spec past
#: it is refused before those tables are made. The binaries check smaller
#: counts against what the run can hold.
MAX_WORKERS = 2**20

_FORCE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\S*)")


def cpu_device_count_problem(
  environ: Mapping[str, str] | None = None,
) -> str | None:
  """Why JAX's CPU backend would start with no device, or None.

  ``jax_num_cpu_devices`` (``JAX_NUM_CPU_DEVICES``) below 1, or, with it
  unset, ``XLA_FLAGS``' ``--xla_force_host_platform_device_count`` below 1:
  JAX then fails to start with an unrelated message, or (a negative count)
  starts one device as if the setting were absent.

  Args:
    environ: the environment the settings came from (default os.environ).
  """
  environ = os.environ if environ is None else environ
  n = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined]
  if n == -1:  # unset: XLA_FLAGS decides, else one device
    counts = _FORCE_COUNT.findall(environ.get("XLA_FLAGS", ""))
    if counts and not (counts[-1].isdigit() and int(counts[-1]) >= 1):
      return (
        f"XLA_FLAGS sets --xla_force_host_platform_device_count={counts[-1]}"
        ": JAX's CPU backend needs at least 1 device"
      )
    return None
  if n < 1:
    name = "JAX_NUM_CPU_DEVICES"
    setting = (
      f"{name}={environ[name]}"
      if name in environ
      else f"jax_num_cpu_devices={n}"
    )
    return f"{setting}: JAX's CPU backend needs at least 1 device"
  return None


def devices() -> list[jax.Device]:
  """``jax.devices()``, starting JAX's backends if they have not started.

  Raises:
    ValueError: a setting stops JAX from starting (no CPU device asked for,
      ``JAX_PLATFORMS`` naming a platform this machine lacks), naming it.
  """
  problem = cpu_device_count_problem()
  if problem is not None:
    raise ValueError(problem)
  try:
    return list(jax.devices())
  except RuntimeError as e:
    if "Unable to initialize backend" not in str(e):
      raise
    platforms = os.environ.get("JAX_PLATFORMS", "")
    raise ValueError(
      f"JAX cannot start (JAX_PLATFORMS={platforms!r}): "
      f"{str(e).splitlines()[0]}"
    ) from None


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


def parse_cluster(spec: str | ClusterSpec) -> ClusterSpec:
  """Parses ``"kind:count,kind:count,..."`` into a :class:`ClusterSpec`.

  A :class:`ClusterSpec` is returned as it is.

  Raises:
    ValueError: an empty spec, a malformed group, an unknown kind, a
      count that is not a positive integer, or more than
      :data:`MAX_WORKERS` workers.

  Example:
    >>> import qsync_jax as qs
    >>> cluster = qs.parse_cluster("v100:2,t4:2")
    >>> cluster.kinds
    ('v100', 'v100', 't4', 't4')
    >>> cluster.num_workers, cluster.groups()
    (4, {'v100': 2, 't4': 2})
  """
  if isinstance(spec, ClusterSpec):
    return spec
  if not spec or not spec.strip():
    raise ValueError("empty cluster spec; expected e.g. 'v100:2,t4:2'")
  groups: list[tuple[str, int]] = []
  for group in spec.split(","):
    parts = group.strip().split(":")
    if len(parts) != 2 or not parts[0].strip():
      raise ValueError(
        f"malformed cluster group {group.strip()!r} in "
        f"{spec!r}; expected kind:count, e.g. 'v100:2,t4:2'"
      )
    kind, count = parts[0].strip().lower(), parts[1].strip()
    supported_precisions(kind)  # raises for an unknown kind
    try:
      n = int(count)
    except ValueError:
      raise ValueError(
        f"cluster group {group.strip()!r}: count {count!r} is not an integer"
      ) from None
    if n <= 0:
      raise ValueError(
        f"cluster group {group.strip()!r}: count must be positive, got {n}"
      )
    groups.append((kind, n))
  total = sum(n for _, n in groups)
  if total > MAX_WORKERS:  # before the list of workers is made
    raise ValueError(
      f"cluster {spec!r} names {total} workers, more than the "
      f"{MAX_WORKERS} a cluster spec may name"
    )
  return ClusterSpec(tuple(kind for kind, n in groups for _ in range(n)))


def cluster_from_devices(
  devices: Sequence[jax.Device] | None = None,
) -> ClusterSpec:
  """Builds the :class:`ClusterSpec` of ``devices``, one worker per device.

  ``jax.devices()`` is global in a multi-process run (``jax.distributed``):
  it lists every process's devices in the same order on every process, so
  the default already gathers the whole cluster, and every process builds
  the same spec.

  Args:
    devices: the devices in worker order (default ``jax.devices()``); each a
      ``jax.Device`` or anything with a ``device_kind`` attribute.

  Returns:
    The spec whose i-th worker is the catalog kind of ``devices[i]``
    (:func:`qsync_jax.plan.devices.device_kind_of`).

  Raises:
    ValueError: no devices, or a device kind the table does not know.
  """
  devices = _devices_or_all(devices)
  if not devices:
    raise ValueError("cannot build a cluster spec from an empty device list")
  return ClusterSpec(tuple(device_kind_of(d) for d in devices))


def _devices_or_all(given: Sequence[jax.Device] | None) -> list[jax.Device]:
  return devices() if given is None else list(given)


def resolve_cluster(
  spec: str | ClusterSpec, devices: Sequence[jax.Device] | None = None
) -> ClusterSpec:
  """Parses ``spec``; :data:`AUTO` means the spec of ``devices``.

  With ``"auto"`` the workers are all ``devices`` (default
  ``jax.devices()``). A single process on CPU has as many devices as
  ``jax_num_cpu_devices`` (the ``JAX_NUM_CPU_DEVICES`` variable) says, 1
  by default.

  Args:
    spec: ``"auto"`` (any case), a spec string, or a :class:`ClusterSpec`.
    devices: the devices ``"auto"`` reads.

  Returns:
    The :class:`ClusterSpec`.

  Raises:
    ValueError: a bad spec (see :func:`parse_cluster`) or device kind.
  """
  if isinstance(spec, str) and spec.strip().lower() == AUTO:
    return cluster_from_devices(devices)
  return parse_cluster(spec)


def cluster_string(cluster: ClusterSpec) -> str:
  """Returns the spec string of ``cluster``, worker order kept.

  Unlike ``str(cluster)``, which merges a kind's groups, runs of one kind
  stay apart (``"v100:1,t4:1,v100:1"``), so :func:`parse_cluster` gives
  back the same workers in the same order.

  Args:
    cluster: the spec.

  Returns:
    ``"kind:count,..."``, one group per run of equal kinds.
  """
  runs: list[list] = []
  for kind in cluster.kinds:
    if runs and runs[-1][0] == kind:
      runs[-1][1] += 1
    else:
      runs.append([kind, 1])
  return ",".join(f"{kind}:{n}" for kind, n in runs)


def assign_devices(
  cluster: ClusterSpec, devices: Sequence[jax.Device] | None = None
) -> list[jax.Device]:
  """Returns one distinct JAX device per worker, in worker order.

  Args:
    cluster: the cluster spec.
    devices: the devices to map onto (default ``jax.devices()``, which is
      global in a multi-process run).

  Raises:
    ValueError: the cluster needs more devices than exist.
  """
  devices = _devices_or_all(devices)
  if cluster.num_workers > len(devices):
    raise ValueError(
      f"cluster {cluster} needs {cluster.num_workers} devices but only "
      f"{len(devices)} exist ({devices[0].platform if devices else 'none'});"
      " on CPU, set jax_num_cpu_devices (or XLA_FLAGS="
      "--xla_force_host_platform_device_count) before JAX starts"
    )
  return devices[: cluster.num_workers]


def dynamic_batch_sizes(
  global_batch: int, speeds: Sequence[float]
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
  rates = np.asarray(speeds, dtype=np.float64)
  if rates.size == 0 or np.any(rates <= 0) or not np.all(np.isfinite(rates)):
    raise ValueError(
      f"speeds must be positive and finite, got {rates.tolist()}"
    )
  n = rates.size
  if global_batch < n:
    raise ValueError(
      f"global batch {global_batch} is smaller than the {n} workers"
    )
  # Give each worker one example first so none is left empty.
  share = (global_batch - n) * rates / rates.sum()
  sizes = np.floor(share).astype(int)
  remainder = global_batch - n - sizes.sum()
  order = np.argsort(-(share - sizes), kind="stable")
  sizes[order[:remainder]] += 1
  return (sizes + 1).tolist()


#: How a global batch is split over workers (:func:`split_batch`).
BATCH_MODES = ("equal", "dynamic")


def split_batch(
  global_batch: int,
  kinds: Sequence[str],
  batch_mode: str = "equal",
  speeds: str | Mapping[str, float] | None = None,
) -> list[int]:
  """Splits ``global_batch`` over workers of ``kinds``.

  Args:
    global_batch: the examples of one step, over all workers.
    kinds: the workers' device kinds, in worker order.
    batch_mode: ``"equal"`` (as equal as possible: the remainder one each
      to the first workers) or ``"dynamic"`` (in proportion to ``speeds``,
      :func:`dynamic_batch_sizes`).
    speeds: each kind's relative throughput, ``"v100:1.3,t4:1"`` or a
      mapping (:func:`parse_speeds`); dynamic mode only.

  Returns:
    One batch size per worker, summing to ``global_batch``.

  Raises:
    ValueError: fewer examples than workers, an unknown mode, or (dynamic)
      a kind without a speed.

  Example:
    >>> split_batch(16, ["v100", "v100", "t4"])
    [6, 5, 5]
    >>> split_batch(16, ["v100", "t4"], "dynamic", {"v100": 1.3, "t4": 1.0})
    [9, 7]
  """
  n = len(kinds)
  if global_batch < n:
    raise ValueError(
      f"a global batch of {global_batch} examples cannot be split over "
      f"{n} workers (each needs one)"
    )
  if batch_mode == "equal":
    each, extra = divmod(global_batch, n)
    return [each + 1] * extra + [each] * (n - extra)
  if batch_mode == "dynamic":
    rates = parse_speeds(speeds or {})
    missing = sorted(set(kinds) - set(rates))
    if missing:
      raise ValueError(
        f"dynamic batches need a speed for every kind; none is given for "
        f"{missing}"
      )
    return dynamic_batch_sizes(global_batch, [rates[k] for k in kinds])
  raise ValueError(
    f"unknown batch mode {batch_mode!r}; valid: {', '.join(BATCH_MODES)}"
  )


def parse_speeds(spec: str | Mapping[str, float]) -> dict[str, float]:
  """Parses ``"v100:1.3,t4:1"`` (or a mapping) into {kind: relative speed}.

  Raises:
    ValueError: malformed entries, unknown kinds or non-positive speeds.
  """
  items: list[tuple[str, float | str]]
  if isinstance(spec, Mapping):
    items = list(spec.items())
  else:
    items = []
    for group in spec.split(","):
      parts = group.strip().split(":")
      if len(parts) != 2:
        raise ValueError(
          f"malformed speed {group.strip()!r}; expected "
          "kind:speed, e.g. 'v100:1.3,t4:1'"
        )
      items.append((parts[0].strip().lower(), parts[1].strip()))
  speeds = {}
  for kind, value in items:
    supported_precisions(kind)  # raises for an unknown kind
    try:
      speeds[kind] = float(value)
    except ValueError:
      raise ValueError(
        f"speed of {kind!r} is not a number: {value!r}"
      ) from None
    if not speeds[kind] > 0:
      raise ValueError(f"speed of {kind!r} must be positive, got {value}")
  return speeds
