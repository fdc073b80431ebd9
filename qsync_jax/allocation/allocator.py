"""Allocator: per-device precision plans that quantize as little as possible.

QSync's allocator (arXiv 2407.02327; QSync's official code, bytedance/QSync,
``qsync/Syncer/algos.py``).
The training devices of a hybrid cluster keep FP32; every weaker device kind
gets a plan. This module owns :func:`allocate`, its result
:class:`Allocation`, and which kinds keep FP32 (:func:`training_kinds_of`).
Its three methods:

* ``"greedy"`` (QSync's): start each weak kind from its fastest plan that fits
  its memory (:func:`qsync_jax.allocation.search.fastest_plan`), then recover
  precision where it removes the most indicator, one layer and one precision
  level at a time, keeping a step only if the predicted hybrid step time
  stays at or below the target (the step time the cluster would have if
  every worker were a training device) and memory still fits.
* ``"memory"``: the memory-scarce variant: from FP32, lower the layers whose
  indicator grows least per byte saved until the plan fits
  (:func:`qsync_jax.allocation.search.lower_to_fit`).
* ``"ilp"``: the least total indicator under a memory budget, exactly, with
  ``scipy.optimize.milp``
  (:func:`qsync_jax.allocation.search.min_indicator_plan`); QSync's
  indicator ablation (``Syncer/mem_ilp.py`` there).

Where this differs from QSync's official code: the gain of a recovery step is
the indicator it removes, ``score(current) - score(next)`` (the code subtracts
the wrong neighbour); a rejected step leaves the plan untouched (the code
mutates its graph); the memory variant lowers the layer with the smallest
indicator increase per byte first (the code pops the largest); the fastest plan
is exact under the predictor's additive costs (a multiple-choice knapsack over
groups of layers joined by casts) instead of a per-block search with the budget
split in proportion.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
import dataclasses
import heapq
import time
from typing import Any

from qsync_jax.allocation import search
from qsync_jax.allocation.search import AllocationError
from qsync_jax.allocation.search import DEFAULT_CANDIDATES
from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import simulation
from qsync_jax.predictor.profiling import Profile
from qsync_jax.predictor.simulation import Prediction
from qsync_jax.predictor.simulation import SimWorker

#: The searches :func:`~qsync_jax.allocation.allocate` runs (``method=``).
METHODS = ("greedy", "memory", "ilp")


@dataclasses.dataclass(frozen=True)
class Allocation(Mapping[str, PrecisionPlan]):
  """The allocator's result: a mapping ``{device kind: PrecisionPlan}``.

  Attributes:
    plans: the plan of every kind of the cluster (training kinds: FP32).
    precisions: ``{kind: {layer: Precision}}``, every layer.
    prediction: the predicted hybrid step of these plans.
    target_s: the step time the search kept to (``"greedy"`` only).
    training_pace_s: the step time if every worker were a training device
      (same cluster, same links); None without weak kinds.
    straggling: the weak kinds still set the step time even at their fastest
      plans (the target then is that time, above the training pace).
    training_kinds: the kinds that keep FP32.
    indicator_sum: ``{kind: total indicator of its plan}``.
    quantized_layers: ``{kind: layers below FP32}``.
    memory_bytes: ``{kind: predicted step memory}``.
    memory_limits: ``{kind: bytes}`` that applied (None: no limit).
    search_time_s: wall time of the search.
    trials: recovery or lowering steps tried.
    method: the search used.
  """

  plans: dict[str, PrecisionPlan]
  precisions: dict[str, dict[str, Precision]]
  prediction: Prediction
  target_s: float | None
  training_pace_s: float | None
  straggling: bool
  training_kinds: tuple[str, ...]
  indicator_sum: dict[str, float]
  quantized_layers: dict[str, int]
  memory_bytes: dict[str, float]
  memory_limits: dict[str, float | None]
  search_time_s: float
  trials: int
  method: str

  def __getitem__(self, kind: str) -> PrecisionPlan:
    return self.plans[kind]

  def __iter__(self) -> Iterator[str]:
    return iter(self.plans)

  def __len__(self) -> int:
    return len(self.plans)

  def summary(self) -> dict[str, Any]:
    """A JSON-ready summary (no per-layer data)."""
    return {
      "method": self.method,
      "search_time_s": self.search_time_s,
      "trials": self.trials,
      "training_kinds": list(self.training_kinds),
      "straggling": self.straggling,
      "target_s": self.target_s,
      "training_pace_s": self.training_pace_s,
      "step_time_s": self.prediction.step_time_s,
      "quantized_layers": dict(self.quantized_layers),
      "indicator_sum": dict(self.indicator_sum),
      "memory_bytes": dict(self.memory_bytes),
      "memory_limits": dict(self.memory_limits),
    }


# --------------------------------------------------------------------------
# allocate, and which kinds keep FP32.
# --------------------------------------------------------------------------


def _fp32_compute_s(g, profile) -> float:
  c = simulation.worker_costs(g, profile, [Precision.FP32] * len(g.nodes))
  return float(c.fwd.sum() + c.bwd.sum())


def fp32_speeds(
  g: graph_lib.ModelGraph,
  spec: ClusterSpec | str,
  profiles: Mapping[str, Profile],
) -> dict[str, float]:
  """``{kind: examples per second}`` of each kind's FP32 forward + backward
  (relative speeds for the dynamic-batch baseline)."""
  spec = parse_cluster(spec)
  return {
    k: g.input_shape[0] / _fp32_compute_s(g, profiles[k]) for k in spec.groups()
  }


def training_kinds_of(
  g: graph_lib.ModelGraph, spec: ClusterSpec, profiles: Mapping[str, Profile]
) -> tuple[str, ...]:
  """The kinds with the fastest FP32 forward + backward (they keep FP32)."""
  times = {k: _fp32_compute_s(g, profiles[k]) for k in spec.groups()}
  best = min(times.values())
  return tuple(k for k, t in times.items() if t <= best * (1 + 1e-9))


def allocate(
  g: graph_lib.ModelGraph,
  cluster: ClusterSpec | str,
  scores: search.ScoresLike,
  profiles: Mapping[str, Profile],
  *,
  memory_limits: Mapping[str, float] | None = None,
  method: str = "greedy",
  candidates: Sequence[Precision | str] = DEFAULT_CANDIDATES,
  training_kinds: Sequence[str] | None = None,
  bucket_bytes: float | None = simulation.DEFAULT_BUCKET_BYTES,
  link: tuple[float, float] | None = None,
) -> Allocation:
  """Per-device-kind precision plans for a hybrid cluster.

  Args:
    g: the model graph at the per-worker batch size
      (:func:`qsync_jax.predictor.trace_graph`).
    cluster: e.g. ``"v100:8,t4:8"``.
    scores: the indicator (:func:`qsync_jax.sensitivity.compute`), or a
      mapping ``{layer: {precision: score}}``.
    profiles: ``{kind: Profile}`` for every kind of the cluster (measured or
      :func:`qsync_jax.predictor.analytic_profile`).
    memory_limits: ``{kind: bytes}``; a kind not named is limited by its
      profile's device capacity when known.
    method: ``"greedy"``, ``"memory"`` or ``"ilp"`` (module docstring).
    candidates: the precisions a weak kind may use (each kind keeps those
      it supports; without FP32 only the head stays FP32, as in QSync's
      8/16-bit ILP).
    training_kinds: the kinds that keep FP32; default: the kinds with the
      fastest FP32 step.
    bucket_bytes, link: passed to :func:`qsync_jax.predictor.simulate`.

  Returns:
    An :class:`Allocation` (a mapping ``{kind: PrecisionPlan}``).

  Raises:
    ValueError: an unknown method, a malformed cluster, or a profile or
      memory limit for a kind the cluster lacks.
    AllocationError: no plan fits a memory limit (the message names the
      smallest memory any plan reaches), a training kind does not fit in
      FP32, or the scores miss a layer.
  """
  start = time.perf_counter()
  if method not in METHODS:
    raise ValueError(
      f"unknown allocation method {method!r}; valid: {', '.join(METHODS)}"
    )
  spec = parse_cluster(cluster)
  kinds = list(spec.groups())
  missing = [k for k in kinds if k not in profiles]
  if missing:
    raise ValueError(f"no profile for device kind(s) {', '.join(missing)}")
  stray = [k for k in (memory_limits or {}) if k not in kinds]
  if stray:
    raise ValueError(
      f"memory limits for {', '.join(stray)}, which the "
      f"cluster {spec} does not have"
    )
  limits = {
    k: (memory_limits or {}).get(k, profiles[k].memory.capacity_bytes)
    for k in kinds
  }
  if training_kinds is None:
    training = training_kinds_of(g, spec, profiles)
  else:
    training = tuple(k.lower() for k in training_kinds)
    bad = [k for k in training if k not in kinds]
    if bad:
      raise ValueError(
        f"training kind(s) {', '.join(bad)} are not in the cluster {spec}"
      )
  weak = [k for k in kinds if k not in training]
  fp32 = [Precision.FP32] * len(g.nodes)
  for k in training:
    need = search.plan_memory(g, profiles[k], fp32)
    limit = limits[k]
    if limit is not None and need > limit:
      raise AllocationError(
        f"training kind {k} needs {need / 2**30:.3f} GiB in FP32, over its "
        f"limit of {limit / 2**30:.3f} GiB; raise the limit or let the "
        "allocator plan it (training_kinds)"
      )
  ladder = {
    k: search.ladders(g, k, profiles[k], scores, candidates) for k in weak
  }
  if link is None:
    link = simulation.cluster_link(spec.kinds)
  cl = _Cluster(g, spec, profiles, bucket_bytes, link)

  target, pace, straggling, trials = None, None, False, 0
  if weak:
    # Every worker as fast as a training device (same link, same ring).
    as_training = dict.fromkeys(kinds, profiles[training[0]])
    pace = cl.simulate(_with_training(cl, {}), as_training).step_time_s
  weak_precs: dict[str, list[Precision]] = {}
  if method == "greedy":
    for k in weak:
      weak_precs[k] = search.fastest_plan(
        g, profiles[k], ladder[k], limits[k], kind=k
      )
    if weak:
      assert pace is not None  # set above when there are weak kinds
      fastest = cl.simulate(_with_training(cl, weak_precs)).step_time_s
      target = max(pace, fastest)
      straggling = fastest > pace * (1 + 1e-9)
      weak_precs, trials = _greedy_recovery(
        cl, weak_precs, ladder, scores, target, limits
      )
  else:
    for k in weak:
      limit = limits[k]
      if limit is None:
        raise AllocationError(
          f"method {method!r} needs a memory limit for "
          f"{k} and its profile has no capacity"
        )
      if method == "memory":
        weak_precs[k], steps = search.lower_to_fit(
          g, profiles[k], ladder[k], scores, limit, kind=k
        )
        trials += steps
      else:
        weak_precs[k] = search.min_indicator_plan(
          g, profiles[k], ladder[k], scores, limit, kind=k
        )
  final = _with_training(cl, weak_precs)
  prediction = cl.simulate(final)
  precisions = {k: dict(zip(g.paths, final[k])) for k in kinds}
  plans = {k: PrecisionPlan.from_precisions(precisions[k]) for k in kinds}
  return Allocation(
    plans=plans,
    precisions=precisions,
    prediction=prediction,
    target_s=target,
    training_pace_s=pace,
    straggling=straggling,
    training_kinds=tuple(training),
    **search.plan_stats(g, scores, precisions, profiles),
    memory_limits=limits,
    search_time_s=time.perf_counter() - start,
    trials=trials,
    method=method,
  )


# --------------------------------------------------------------------------
# The greedy recovery.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Cluster:
  """What the searches need about the cluster, built once."""

  g: graph_lib.ModelGraph
  spec: ClusterSpec
  profiles: Mapping[str, Profile]
  bucket_bytes: float | None
  link: tuple[float, float]
  cache: dict = dataclasses.field(default_factory=dict)

  def simulate(
    self,
    precisions: Mapping[str, Sequence[Precision]],
    profile_of: Mapping[str, Profile] | None = None,
  ) -> Prediction:
    workers = []
    for kind, count in self.spec.groups().items():
      prof = (profile_of or self.profiles)[kind]
      eff = dict(zip(self.g.paths, precisions[kind]))
      workers += [SimWorker(f"{kind}[{i}]", prof, eff) for i in range(count)]
    return simulation.simulate(
      self.g,
      workers,
      bucket_bytes=self.bucket_bytes,
      link=self.link,
      costs_cache=self.cache,
    )


def _greedy_recovery(
  cl: _Cluster,
  start: Mapping[str, list[Precision]],
  ladder: Mapping[str, Sequence[Sequence[Precision]]],
  scores: search.ScoresLike,
  target_s: float,
  memory_limits: Mapping[str, float | None],
) -> tuple[dict[str, list[Precision]], int]:
  """Raises precision where it removes the most indicator, while it keeps up.

  QSync's greedy (bytedance/QSync, ``Syncer/algos.py: greedy``) with the
  intended gain: a max-heap of ``score(current) - score(next)`` over every (weak
  kind, layer); a step is kept only if the predicted hybrid step time stays at
  or below ``target_s`` and the kind's memory fits, and a rejected step leaves
  the plan as it was.

  Returns:
    (precisions per weak kind, number of trials).
  """
  g = cl.g
  state = {k: list(v) for k, v in start.items()}
  level = {
    k: [ladder[k][i].index(p) for i, p in enumerate(v)]
    for k, v in state.items()
  }
  mem = {k: search.plan_memory(g, cl.profiles[k], v) for k, v in state.items()}
  heap: list[tuple[float, int, str]] = []

  def push(kind, i):
    rungs = ladder[kind][i]
    lv = level[kind][i]
    if lv + 1 < len(rungs):
      path = g.nodes[i].path
      gain = search.indicator_of(scores, path, rungs[lv]) - search.indicator_of(
        scores, path, rungs[lv + 1]
      )
      heapq.heappush(heap, (-gain, i, kind))

  for kind in state:
    for i in range(len(g.nodes)):
      push(kind, i)
  trials = 0
  limit_s = target_s * (1 + 1e-9)
  while heap:
    _, i, kind = heapq.heappop(heap)
    path = g.nodes[i].path
    old = state[kind][i]
    new = ladder[kind][i][level[kind][i] + 1]
    trials += 1
    prof = cl.profiles[kind]
    new_mem = (
      mem[kind]
      + search.layer_bytes(prof, path, new)
      - (search.layer_bytes(prof, path, old))
    )
    limit = memory_limits.get(kind)
    if limit is not None and new_mem > limit:
      continue
    state[kind][i] = new
    if cl.simulate(_with_training(cl, state)).step_time_s > limit_s:
      state[kind][i] = old
      continue
    level[kind][i] += 1
    mem[kind] = new_mem
    push(kind, i)
  return state, trials


def _with_training(
  cl: _Cluster, weak: Mapping[str, Sequence[Precision]]
) -> dict[str, Sequence[Precision]]:
  fp32 = [Precision.FP32] * len(cl.g.nodes)
  return {k: weak.get(k, fp32) for k in cl.spec.groups()}
