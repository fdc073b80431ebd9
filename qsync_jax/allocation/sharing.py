"""Planning once for a run of several processes.

This module owns how the processes of one run come to the same plans
(QSync, arXiv 2407.02327, section 5, run on a real cluster):

1. :func:`profile_sites`: which device measures each device kind's profile.
   A kind is measured on the first worker device of that kind (in worker
   order), so on the process that holds it; a kind no device of the run is
   (a spec naming GPUs the run does not have) uses the analytic catalog.
2. :func:`gather_profiles`: each process measures the kinds sited on it, at
   once, and puts them in the ``jax.distributed`` coordination store; then
   every process reads the others'. A process that fails to measure shares
   its error, so every process ends with the same line.
3. :func:`plan_once`: process 0 runs the allocator (indicator and search)
   and shares the plans; the others wait for them.
4. :func:`check_plans`: what every process compares (:func:`plan_facts`,
   through :func:`qsync_jax.process.agreement.check`) before training, so a
   process that loaded another plan (a plan file that differs per node) is
   caught before the first collective.

In a single process the same calls run with no store: every site is local.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.plan import devices as devices_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import analytic
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor.profiling import Profile
from qsync_jax.process import agreement
from qsync_jax.process import coordination

#: Where profiles come from: ``auto`` measures a kind where a device of that
#: kind (by its jax ``device_kind``) runs it and uses the catalog otherwise;
#: ``measured`` measures every kind on the device its first worker runs on,
#: whatever that device is (a CPU or another GPU standing in for it);
#: ``analytic`` uses the catalog for every kind.
SOURCES = ("auto", "measured", "analytic")

#: ``measure(kind, device, local_devices) -> Profile``: the kind's profile on
#: ``device``; ``local_devices`` are this process's devices of that kind.
MeasureFn = Callable[[str, Any, Sequence[Any]], Profile]


def profile_sites(
  cluster: ClusterSpec, devices: Sequence[Any], source: str = "auto"
) -> dict[str, Any]:
  """The device that measures each kind's profile, or None (analytic).

  Args:
    cluster: the workers' kinds, in worker order.
    devices: the workers' devices, in the same order (``jax.Device`` or
      anything with ``device_kind``, ``platform`` and ``process_index``).
    source: one of :data:`SOURCES`.

  Returns:
    ``{kind: device or None}`` in the order of ``cluster.groups()``.

  Raises:
    ValueError: an unknown ``source``, fewer devices than workers, or a kind
      left to the catalog that the catalog lacks.
  """
  if source not in SOURCES:
    raise ValueError(
      f"unknown profile source {source!r}; valid: {', '.join(SOURCES)}"
    )
  if len(devices) < cluster.num_workers:
    raise ValueError(
      f"cluster {cluster} has {cluster.num_workers} workers "
      f"but {len(devices)} devices were given"
    )
  sites: dict[str, Any] = dict.fromkeys(cluster.groups())
  seen = set()
  for kind, device in zip(cluster.kinds, devices):
    if kind in seen:
      continue
    seen.add(kind)
    if source == "measured" or (
      source == "auto" and devices_lib.device_kind_of(device) == kind
    ):
      sites[kind] = device
  outside = [
    k for k, d in sites.items() if d is None and k not in devices_lib.DEVICES
  ]
  if outside:
    why = (
      "analytic profiles were asked for"
      if source == "analytic"
      else "no device of that kind runs in this job"
    )
    raise ValueError(
      f"cannot profile {', '.join(outside)}: {why}, and the GPU catalog "
      f"({', '.join(sorted(devices_lib.DEVICES))}) has no figures for it; "
      "run it on such a device, set the profile source to 'measured', or "
      "give plans by hand"
    )
  return sites


def describe_sites(sites: Mapping[str, Any]) -> dict[str, str]:
  """``{kind: "measured on process P (device)" or "analytic"}``."""
  return {
    k: "analytic"
    if d is None
    else f"measured on process {getattr(d, 'process_index', 0)} ({d})"
    for k, d in sites.items()
  }


def _local_devices(
  cluster: ClusterSpec, devices: Sequence[Any], kind: str, process_index: int
) -> list[Any]:
  return [
    d
    for k, d in zip(cluster.kinds, devices)
    if k == kind and getattr(d, "process_index", 0) == process_index
  ]


def gather_profiles(
  graph: graph_lib.ModelGraph,
  cluster: ClusterSpec,
  devices: Sequence[Any],
  sites: Mapping[str, Any],
  measure: MeasureFn,
  *,
  store: Any = None,
  process_index: int = 0,
  timeout_s: float = 900,
  optimizer_state_copies: int = 2,
) -> dict[str, Profile]:
  """Every kind's profile, measured where its site is, on every process.

  Args:
    graph: the timing model's graph at the per-worker batch (for the
      analytic kinds).
    cluster: the workers' kinds.
    devices: the workers' devices (worker order).
    sites: :func:`profile_sites`.
    measure: measures one kind on a device of this process.
    store: the coordination store (:func:`qsync_jax.process.coordination
      .client`); None in a single-process run.
    process_index: this process's index.
    timeout_s: the longest wait for another process's profile (profiling a
      large model can take minutes).
    optimizer_state_copies: as in
      :func:`qsync_jax.predictor.analytic_profile`.

  Returns:
    ``{kind: Profile}`` in the order of ``cluster.groups()``, the same on
    every process.

  Raises:
    qsync_jax.process.coordination.CoordinationError: a process failed to
      measure its kind (its error is the message) or did not share it in
      time.
  """
  here = lambda d: getattr(d, "process_index", 0) == process_index
  measured: dict[str, Profile] = {}
  # First every process measures its own kinds, then reads the others', so
  # the kinds are measured in parallel.
  for kind, device in sites.items():
    if device is None or not here(device):
      continue
    local = _local_devices(cluster, devices, kind, process_index)
    if store is None:
      measured[kind] = measure(kind, device, local)
      continue
    try:
      prof = measure(kind, device, local)
    except Exception as e:  # pylint: disable=broad-except
      coordination.share(
        store,
        f"qsync_profiles/{kind}",
        source=process_index,
        process_index=process_index,
        error=f"process {process_index} could not profile {kind} on "
        f"{device}: {type(e).__name__}: {e}",
      )
    coordination.share(
      store,
      f"qsync_profiles/{kind}",
      prof.to_dict(),
      source=process_index,
      process_index=process_index,
    )
    measured[kind] = prof
  out = {}
  for kind, device in sites.items():
    if device is None:
      out[kind] = analytic.analytic_profile(
        graph, kind, optimizer_state_copies=optimizer_state_copies
      )
    elif kind in measured:
      out[kind] = measured[kind]
    else:
      out[kind] = Profile.from_dict(
        coordination.share(
          store,
          f"qsync_profiles/{kind}",
          source=getattr(device, "process_index", 0),
          process_index=process_index,
          timeout_s=timeout_s,
          what=f"the {kind} profile",
        )
      )
  return out


def plan_once(
  allocate: Callable[[], Mapping[str, PrecisionPlan]],
  *,
  store: Any = None,
  process_index: int = 0,
  timeout_s: float = 900,
) -> dict[str, PrecisionPlan]:
  """Process 0's plans, on every process; only process 0 calls ``allocate``.

  Args:
    allocate: computes ``{kind: PrecisionPlan}`` (the indicator and the
      allocator's search).
    store: the coordination store; None in a single-process run.
    process_index: this process's index.
    timeout_s: the longest wait for process 0.

  Returns:
    ``{kind: PrecisionPlan}``, the same on every process.

  Raises:
    qsync_jax.process.coordination.CoordinationError: process 0 failed
      (its error is the message) or did not share its plans in time.
    Exception: in a single-process run, what ``allocate`` raises.
  """
  if store is None:
    return dict(allocate())
  text = None
  if process_index == 0:
    try:
      text = {k: p.to_json() for k, p in allocate().items()}
    except Exception as e:  # pylint: disable=broad-except
      coordination.share(
        store,
        "qsync_plans",
        source=0,
        process_index=0,
        error=f"process 0 could not allocate plans: {type(e).__name__}: {e}",
      )
  text = coordination.share(
    store,
    "qsync_plans",
    text,
    source=0,
    process_index=process_index,
    timeout_s=timeout_s,
    what="its plans",
  )
  return {k: PrecisionPlan.from_json(t) for k, t in text.items()}


def plans_digest(plans: Mapping[str, PrecisionPlan]) -> str:
  """SHA-256 of ``{kind: plan JSON}``, what every process compares."""
  return agreement.json_digest({k: p.to_json() for k, p in plans.items()})


def plan_facts(plans: Mapping[str, PrecisionPlan]) -> dict[str, str]:
  """What processes compare of their plans.

  Args:
    plans: ``{kind: PrecisionPlan}`` this process trains with.

  Returns:
    The digest (:func:`plans_digest`) and the plans' settings as
    :func:`qsync_jax.process.agreement.details`, so that a mismatch names
    the kind and the rule or default that differ.
  """
  return {
    "plans": plans_digest(plans),
    **agreement.details(
      "plans", {kind: plan.to_dict() for kind, plan in plans.items()}
    ),
  }


def check_plans(plans: Mapping[str, PrecisionPlan]) -> str:
  """Checks that every process trains with ``plans``; returns their digest.

  Before the first collective, so that a process that read another plan (a
  plan file that differs per node) stops the run with one line. A no-op but
  for the digest in a single-process run.

  Args:
    plans: ``{kind: PrecisionPlan}`` this process trains with.

  Returns:
    Their digest (:func:`plans_digest`).

  Raises:
    qsync_jax.process.agreement.AgreementError: a process has other plans
      (the message names it), or did not report in time.
  """
  facts = plan_facts(plans)
  agreement.check(facts)
  return facts["plans"]
