"""Allocator: per-device precision plans that quantize as little as possible.

QSync's allocator (arXiv 2407.02327, section 5; reference qsync.md section 5).
The training devices of a hybrid cluster keep FP32; every weaker device kind
gets a plan. This module owns :func:`allocate` and its three searches:

* ``"greedy"`` (QSync's): start each weak kind from its fastest plan that fits
  its memory (:func:`fastest_plan`), then recover precision where it removes
  the most indicator, one layer and one precision level at a time, keeping a
  step only if the predicted hybrid step time stays at or below the target
  (the step time the cluster would have if every worker were a training
  device) and memory still fits.
* ``"memory"``: the memory-scarce variant: from FP32, lower the layers whose
  indicator grows least per byte saved until the plan fits
  (:func:`lower_to_fit`).
* ``"ilp"``: the least total indicator under a memory budget, exactly, with
  ``scipy.optimize.milp`` (:func:`min_indicator_plan`); QSync's indicator
  ablation (section 3.5 there).

Where this differs from the reference code (qsync.md section 2.4): the gain
of a recovery step is the indicator it removes, ``score(current) -
score(next)`` (the code subtracts the wrong neighbour); a rejected step leaves
the plan untouched (the code mutates its graph); the memory variant lowers the
layer with the smallest indicator increase per byte first (the code pops the
largest); the fastest plan is exact under the predictor's additive costs (a
multiple-choice knapsack over groups of layers joined by casts) instead of a
per-block search with the budget split in proportion.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from scipy import optimize

from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel.cluster import ClusterSpec, parse_cluster
from qsync_jax.plan.precision import Precision, PrecisionPlan, supported_precisions
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import simulation
from qsync_jax.predictor.profiling import Profile
from qsync_jax.predictor.simulation import Prediction, SimWorker

#: The precision ladder QSync uses on a T4: INT8, FP16, FP32.
DEFAULT_CANDIDATES = (Precision.INT8, Precision.FP16, Precision.FP32)
METHODS = ("greedy", "memory", "ilp")
#: Largest number of precision combinations one cast-joined group may have.
MAX_GROUP_OPTIONS = 4096
_ZERO = (Precision.FP32, Precision.TF32)


class AllocationError(ValueError):
  """No plan satisfies the constraints (the message says which and why)."""


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
    return {"method": self.method, "search_time_s": self.search_time_s,
            "trials": self.trials, "training_kinds": list(self.training_kinds),
            "straggling": self.straggling, "target_s": self.target_s,
            "training_pace_s": self.training_pace_s,
            "step_time_s": self.prediction.step_time_s,
            "quantized_layers": dict(self.quantized_layers),
            "indicator_sum": dict(self.indicator_sum),
            "memory_bytes": dict(self.memory_bytes),
            "memory_limits": dict(self.memory_limits)}


# --------------------------------------------------------------------------
# Scores, ladders and memory per layer.
# --------------------------------------------------------------------------


def score_table(scores: Any) -> Mapping[str, Mapping[str, float]]:
  """``{layer: {precision: score}}`` of an indicator.Scores or a mapping."""
  values = scores if isinstance(scores, Mapping) else getattr(
      scores, "values", None)
  if not isinstance(values, Mapping):
    raise TypeError("scores must be an indicator.Scores or a mapping "
                    "{layer: {precision: score}}")
  return values


def indicator_of(scores: Any, path: str, precision: Precision) -> float:
  """The indicator of computing ``path`` at ``precision`` (FP32 scores 0)."""
  if precision in _ZERO:
    return 0.0
  return float(score_table(scores)[path][precision.value])


def ladders(g: graph_lib.ModelGraph, kind: str, profile: Profile, scores: Any,
            candidates: Sequence[Precision | str] = DEFAULT_CANDIDATES
            ) -> list[list[Precision]]:
  """Each layer's precisions on ``kind``, from fewest bits to most.

  A candidate is dropped for a layer when the kind cannot compute it, the
  layer is floored at 16 bits, or the profile has no cost for it; one
  precision per bit width is kept (the first listed). FP32 is a rung when
  it is a candidate, and the only one of a layer left with none (the head,
  which QSync keeps in FP32, always is).

  Raises:
    AllocationError: ``scores`` lacks a layer of the model, or a precision a
      layer could take.
  """
  table = score_table(scores)
  missing = [p for p in g.paths if p not in table]
  if missing:
    raise AllocationError(f"the indicator scores have no entry for layer(s) "
                          f"{', '.join(missing)}")
  supported = supported_precisions(kind)
  cands = [Precision.parse(c) for c in candidates]
  out = []
  for i, node in enumerate(g.nodes):
    costed = profile.layers.get(node.path, {})
    by_bits: dict[int, Precision] = {}
    for p in cands if i < len(g.nodes) - 1 else ():
      if p in _ZERO or p not in supported or p.value not in costed:
        continue
      if node.floored and p.bits < 16:
        continue
      by_bits.setdefault(p.bits, p)
    rungs = [by_bits[b] for b in sorted(by_bits)]
    for p in rungs:
      if p.value not in table[node.path]:
        raise AllocationError(f"the indicator scores have no {p.value} score "
                              f"for layer {node.path!r}")
    if Precision.FP32 in cands or not rungs:
      if Precision.FP32.value not in costed:
        raise AllocationError(f"the {kind} profile has no FP32 cost for "
                              f"layer {node.path!r}")
      rungs.append(Precision.FP32)
    out.append(rungs)
  return out


def _layer_bytes(profile: Profile, path: str, p: Precision) -> float:
  return (0.0 if p is Precision.FP32
          else float(profile.memory.deltas[path].get(p.value, 0.0)))


def plan_memory(g: graph_lib.ModelGraph, profile: Profile,
                precisions: Sequence[Precision]) -> float:
  """Predicted step bytes of one worker (``precisions`` in node order)."""
  return profile.memory.predict(g.paths, precisions)


def plan_stats(g: graph_lib.ModelGraph, scores: Any,
               precisions: Mapping[str, Mapping[str, Precision]],
               profiles: Mapping[str, Profile]) -> dict[str, dict]:
  """Per kind of ``precisions`` (``{kind: {layer: precision}}``): the plan's
  ``indicator_sum``, ``quantized_layers`` (below FP32) and ``memory_bytes``.
  """
  return {
      "indicator_sum": {k: float(sum(indicator_of(scores, path, v)
                                     for path, v in p.items()))
                        for k, p in precisions.items()},
      "quantized_layers": {k: sum(v not in _ZERO for v in p.values())
                           for k, p in precisions.items()},
      "memory_bytes": {k: plan_memory(g, profiles[k],
                                      [p[path] for path in g.paths])
                       for k, p in precisions.items()}}


def compression_budget(g: graph_lib.ModelGraph, profile: Profile,
                       compression: float) -> float:
  """A memory limit that saves ``compression`` of the FP32 residual bytes.

  QSync's indicator ablation fixes ``M_B = (1 - 0.6) sum_l M_l`` over the
  bytes the layers save for the backward pass (qsync.md section 3.5); here
  the rest of the step (parameters, optimizer state, other activations) is
  added unchanged.
  """
  from qsync_jax.predictor import memory  # local: only budgets need it
  residual = sum(memory.residual_bytes(n, Precision.FP32) for n in g.nodes)
  base = plan_memory(g, profile, [Precision.FP32] * len(g.nodes))
  return base - compression * residual


def _min_memory(g, profile, ladder) -> float:
  return profile.memory.base_bytes + sum(
      min(_layer_bytes(profile, n.path, p) for p in rungs)
      for n, rungs in zip(g.nodes, ladder))


def _infeasible(kind, limit, g, profile, ladder) -> AllocationError:
  low = _min_memory(g, profile, ladder)
  return AllocationError(
      f"memory limit {limit / 2**30:.3f} GiB for {kind} is below the smallest "
      f"memory any plan reaches, {low / 2**30:.3f} GiB ({low:.0f} bytes, "
      "every layer at its lowest precision)")


# --------------------------------------------------------------------------
# Multiple-choice knapsack: one option per group, least value under a limit.
# --------------------------------------------------------------------------


def _choose(values: Sequence[np.ndarray], weights: Sequence[np.ndarray],
            capacity: float | None) -> list[int] | None:
  """The option per group minimizing total value with total weight <= cap.

  Returns None when no choice fits. Exact (``scipy.optimize.milp``) when the
  unconstrained best does not fit.
  """
  best = [int(np.argmin(v)) for v in values]
  if capacity is None or sum(w[b] for w, b in zip(weights, best)) <= capacity:
    return best
  if sum(float(np.min(w)) for w in weights) > capacity:
    return None
  sizes = [len(v) for v in values]
  n = sum(sizes)
  c = np.concatenate(values).astype(np.float64)
  w = np.concatenate(weights).astype(np.float64)
  # Shift weights by each group's smallest so the constraint is well scaled.
  shift = np.concatenate([np.full(s, np.min(wg)) for s, wg in
                          zip(sizes, weights)])
  scale = max(float(np.max(np.abs(w - shift))), 1.0)
  rows = np.zeros((len(sizes), n))
  start = 0
  for gi, s in enumerate(sizes):
    rows[gi, start:start + s] = 1.0
    start += s
  cap = (capacity - float(sum(np.min(wg) for wg in weights))) / scale
  constraints = [optimize.LinearConstraint(rows, 1.0, 1.0),
                 optimize.LinearConstraint(((w - shift) / scale)[None, :],
                                           -np.inf, cap + 1e-9)]
  cscale = max(float(np.max(np.abs(c))), 1e-30)
  res = optimize.milp(c / cscale, constraints=constraints,
                      integrality=np.ones(n), bounds=optimize.Bounds(0, 1))
  if res.x is None:
    return None
  out, start = [], 0
  for s in sizes:
    out.append(int(np.argmax(res.x[start:start + s])))
    start += s
  return out


# --------------------------------------------------------------------------
# Fastest plan under memory.
# --------------------------------------------------------------------------


def cast_groups(g: graph_lib.ModelGraph) -> list[list[int]]:
  """Layers joined by dtype-following operands, in forward order.

  A layer's cost depends on another layer's precision only through an
  operand that follows its producer's dtype (a cast when they differ), so
  the step's compute time is a sum of independent per-group terms.
  """
  parent = list(range(len(g.nodes)))

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for i, node in enumerate(g.nodes):
    for op in node.operands:
      if op.follows:
        for p in op.producers:
          if p != graph_lib.INPUT:
            parent[find(p)] = find(i)
  groups: dict[int, list[int]] = {}
  for i in range(len(g.nodes)):
    groups.setdefault(find(i), []).append(i)
  return sorted(groups.values(), key=lambda m: m[0])


def fastest_plan(g: graph_lib.ModelGraph, profile: Profile,
                 ladder: Sequence[Sequence[Precision]],
                 memory_limit: float | None = None, *,
                 kind: str | None = None) -> list[Precision]:
  """The plan with the least forward + backward time that fits in memory.

  Exhaustive within each :func:`cast_groups` group (QSync's per-block
  search: casts couple only the layers of one group), then one option per
  group under the memory limit (a multiple-choice knapsack, exact with
  ``scipy.optimize.milp``). Groups of the same shape share their costs
  because every option of every group is costed in the same worker
  evaluation.

  Args:
    g: the model graph.
    profile: the device's profile.
    ladder: each layer's candidate precisions (:func:`ladders`).
    memory_limit: the device's step-memory limit in bytes, or None.
    kind: the device kind, for messages.

  Returns:
    One precision per layer, in node order.

  Raises:
    AllocationError: no plan fits ``memory_limit``, or a group has more than
      :data:`MAX_GROUP_OPTIONS` combinations.
  """
  groups = cast_groups(g)
  options = []
  for members in groups:
    count = int(np.prod([len(ladder[i]) for i in members]))
    if count > MAX_GROUP_OPTIONS:
      names = ", ".join(g.nodes[i].path for i in members[:4])
      raise AllocationError(
          f"{len(members)} layers ({names}, ...) exchange dtypes with each "
          f"other: {count} precision combinations exceed "
          f"{MAX_GROUP_OPTIONS}; restrict the candidate precisions")
    options.append(list(itertools.product(*[ladder[i] for i in members])))
  times = [np.zeros(len(o)) for o in options]
  mems = [np.zeros(len(o)) for o in options]
  precs = [rungs[-1] for rungs in ladder]
  for j in range(max(len(o) for o in options)):
    for members, opts in zip(groups, options):
      for i, p in zip(members, opts[min(j, len(opts) - 1)]):
        precs[i] = p
    costs = simulation.worker_costs(g, profile, precs)
    per_layer = costs.fwd + costs.bwd
    for gi, (members, opts) in enumerate(zip(groups, options)):
      if j < len(opts):
        times[gi][j] = per_layer[members].sum()
        mems[gi][j] = sum(_layer_bytes(profile, g.nodes[i].path, p)
                          for i, p in zip(members, opts[j]))
  capacity = (None if memory_limit is None
              else memory_limit - profile.memory.base_bytes)
  pick = _choose(times, mems, capacity)
  if pick is None:
    raise _infeasible(kind or profile.device_kind, memory_limit, g, profile,
                      ladder)
  out = [Precision.FP32] * len(g.nodes)
  for members, opts, j in zip(groups, options, pick):
    for i, p in zip(members, opts[j]):
      out[i] = p
  return out


# --------------------------------------------------------------------------
# The three searches.
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

  def simulate(self, precisions: Mapping[str, Sequence[Precision]],
               profile_of: Mapping[str, Profile] | None = None) -> Prediction:
    workers = []
    for kind, count in self.spec.groups().items():
      prof = (profile_of or self.profiles)[kind]
      eff = dict(zip(self.g.paths, precisions[kind]))
      workers += [SimWorker(f"{kind}[{i}]", prof, eff) for i in range(count)]
    return simulation.simulate(self.g, workers, bucket_bytes=self.bucket_bytes,
                               link=self.link, costs_cache=self.cache)


def _greedy_recovery(cl: _Cluster, start: Mapping[str, list[Precision]],
                    ladder: Mapping[str, Sequence[Sequence[Precision]]],
                    scores: Any, target_s: float,
                    memory_limits: Mapping[str, float | None]
                    ) -> tuple[dict[str, list[Precision]], int]:
  """Raises precision where it removes the most indicator, while it keeps up.

  QSync's greedy (qsync.md section 5.3) with the intended gain: a max-heap
  of ``score(current) - score(next)`` over every (weak kind, layer); a step
  is kept only if the predicted hybrid step time stays at or below
  ``target_s`` and the kind's memory fits, and a rejected step leaves the
  plan as it was.

  Returns:
    (precisions per weak kind, number of trials).
  """
  g = cl.g
  state = {k: list(v) for k, v in start.items()}
  level = {k: [ladder[k][i].index(p) for i, p in enumerate(v)]
           for k, v in state.items()}
  mem = {k: plan_memory(g, cl.profiles[k], v) for k, v in state.items()}
  heap = []

  def push(kind, i):
    rungs = ladder[kind][i]
    lv = level[kind][i]
    if lv + 1 < len(rungs):
      path = g.nodes[i].path
      gain = (indicator_of(scores, path, rungs[lv])
              - indicator_of(scores, path, rungs[lv + 1]))
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
    new_mem = mem[kind] + _layer_bytes(prof, path, new) - _layer_bytes(
        prof, path, old)
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


def _with_training(cl: _Cluster, weak: Mapping[str, Sequence[Precision]]
                   ) -> dict[str, Sequence[Precision]]:
  fp32 = [Precision.FP32] * len(cl.g.nodes)
  return {k: weak.get(k, fp32) for k in cl.spec.groups()}


def lower_to_fit(g: graph_lib.ModelGraph, profile: Profile,
                 ladder: Sequence[Sequence[Precision]], scores: Any,
                 memory_limit: float, *, kind: str | None = None
                 ) -> tuple[list[Precision], int]:
  """The memory-scarce variant: lower layers until the plan fits.

  From every layer at its top rung, repeatedly lowers the layer whose
  indicator grows least per byte saved, ``(score(lower) - score(current)) /
  bytes saved`` (qsync.md section 5.4, intended order), one level at a time.

  Returns:
    (precisions in node order, number of lowering steps).

  Raises:
    AllocationError: even every layer at its lowest rung does not fit.
  """
  if _min_memory(g, profile, ladder) > memory_limit:
    raise _infeasible(kind or profile.device_kind, memory_limit, g, profile,
                      ladder)
  level = [len(r) - 1 for r in ladder]
  precs = [r[-1] for r in ladder]
  total = plan_memory(g, profile, precs)
  heap = []

  def push(i):
    if level[i] == 0:
      return
    path = g.nodes[i].path
    cur, low = ladder[i][level[i]], ladder[i][level[i] - 1]
    saved = _layer_bytes(profile, path, cur) - _layer_bytes(profile, path, low)
    growth = indicator_of(scores, path, low) - indicator_of(scores, path, cur)
    key = growth / saved if saved > 0 else np.inf
    heapq.heappush(heap, (key, i))

  for i in range(len(g.nodes)):
    push(i)
  steps = 0
  while total > memory_limit and heap:
    _, i = heapq.heappop(heap)
    path = g.nodes[i].path
    low = ladder[i][level[i] - 1]
    total += _layer_bytes(profile, path, low) - _layer_bytes(
        profile, path, precs[i])
    precs[i] = low
    level[i] -= 1
    steps += 1
    push(i)
  return precs, steps


def min_indicator_plan(g: graph_lib.ModelGraph, profile: Profile,
                       ladder: Sequence[Sequence[Precision]], scores: Any,
                       memory_limit: float, *, kind: str | None = None
                       ) -> list[Precision]:
  """The plan with the least total indicator under ``memory_limit`` (ILP).

  ``min sum_l sum_b x_lb score_l(b)`` subject to one precision per layer
  and the plan's memory at most the limit (QSync's indicator ablation,
  qsync.md section 3.5), solved exactly with ``scipy.optimize.milp``.

  Raises:
    AllocationError: no plan fits.
  """
  values = [np.array([indicator_of(scores, n.path, p) for p in rungs])
            for n, rungs in zip(g.nodes, ladder)]
  weights = [np.array([_layer_bytes(profile, n.path, p) for p in rungs])
             for n, rungs in zip(g.nodes, ladder)]
  # Among equal indicators prefer more bits: a tiny tie-break toward the top.
  values = [v - 1e-12 * np.arange(len(v)) * max(1.0, float(np.abs(v).max()))
            for v in values]
  pick = _choose(values, weights, memory_limit - profile.memory.base_bytes)
  if pick is None:
    raise _infeasible(kind or profile.device_kind, memory_limit, g, profile,
                      ladder)
  return [rungs[j] for rungs, j in zip(ladder, pick)]


# --------------------------------------------------------------------------
# allocate
# --------------------------------------------------------------------------


def _fp32_compute_s(g, profile) -> float:
  c = simulation.worker_costs(g, profile, [Precision.FP32] * len(g.nodes))
  return float(c.fwd.sum() + c.bwd.sum())


def fp32_speeds(g: graph_lib.ModelGraph, spec: ClusterSpec | str,
                profiles: Mapping[str, Profile]) -> dict[str, float]:
  """``{kind: examples per second}`` of each kind's FP32 forward + backward
  (relative speeds for the dynamic-batch baseline)."""
  spec = parse_cluster(spec)
  return {k: g.input_shape[0] / _fp32_compute_s(g, profiles[k])
          for k in spec.groups()}


def training_kinds_of(g: graph_lib.ModelGraph, spec: ClusterSpec,
                      profiles: Mapping[str, Profile]) -> tuple[str, ...]:
  """The kinds with the fastest FP32 forward + backward (they keep FP32)."""
  times = {k: _fp32_compute_s(g, profiles[k]) for k in spec.groups()}
  best = min(times.values())
  return tuple(k for k, t in times.items() if t <= best * (1 + 1e-9))


def allocate(g: graph_lib.ModelGraph, cluster: ClusterSpec | str,
             scores: Any, profiles: Mapping[str, Profile], *,
             memory_limits: Mapping[str, float] | None = None,
             method: str = "greedy",
             candidates: Sequence[Precision | str] = DEFAULT_CANDIDATES,
             training_kinds: Sequence[str] | None = None,
             bucket_bytes: float | None = simulation.DEFAULT_BUCKET_BYTES,
             link: tuple[float, float] | None = None) -> Allocation:
  """Per-device-kind precision plans for a hybrid cluster.

  Args:
    g: the model graph at the per-worker batch size
      (:func:`qsync_jax.predictor.trace_graph`).
    cluster: e.g. ``"v100:8,t4:8"``.
    scores: the indicator (:func:`qsync_jax.sensitivity.indicator.compute`), or a mapping
      ``{layer: {precision: score}}``.
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
    raise ValueError(f"unknown allocation method {method!r}; valid: "
                     f"{', '.join(METHODS)}")
  spec = parse_cluster(cluster)
  kinds = list(spec.groups())
  missing = [k for k in kinds if k not in profiles]
  if missing:
    raise ValueError(f"no profile for device kind(s) {', '.join(missing)}")
  stray = [k for k in (memory_limits or {}) if k not in kinds]
  if stray:
    raise ValueError(f"memory limits for {', '.join(stray)}, which the "
                     f"cluster {spec} does not have")
  limits = {k: (memory_limits or {}).get(k, profiles[k].memory.capacity_bytes)
            for k in kinds}
  if training_kinds is None:
    training = training_kinds_of(g, spec, profiles)
  else:
    training = tuple(k.lower() for k in training_kinds)
    bad = [k for k in training if k not in kinds]
    if bad:
      raise ValueError(f"training kind(s) {', '.join(bad)} are not in the "
                       f"cluster {spec}")
  weak = [k for k in kinds if k not in training]
  fp32 = [Precision.FP32] * len(g.nodes)
  for k in training:
    need = plan_memory(g, profiles[k], fp32)
    if limits[k] is not None and need > limits[k]:
      raise AllocationError(
          f"training kind {k} needs {need / 2**30:.3f} GiB in FP32, over its "
          f"limit of {limits[k] / 2**30:.3f} GiB; raise the limit or let the "
          "allocator plan it (training_kinds)")
  ladder = {k: ladders(g, k, profiles[k], scores, candidates) for k in weak}
  if link is None:
    link = simulation.cluster_link(spec.kinds)
  cl = _Cluster(g, spec, profiles, bucket_bytes, link)

  target, pace, straggling, trials = None, None, False, 0
  if weak:
    # Every worker as fast as a training device (same link, same ring).
    as_training = {k: profiles[training[0]] for k in kinds}
    pace = cl.simulate(_with_training(cl, {}), as_training).step_time_s
  weak_precs: dict[str, list[Precision]] = {}
  if method == "greedy":
    for k in weak:
      weak_precs[k] = fastest_plan(g, profiles[k], ladder[k], limits[k],
                                   kind=k)
    if weak:
      fastest = cl.simulate(_with_training(cl, weak_precs)).step_time_s
      target = max(pace, fastest)
      straggling = fastest > pace * (1 + 1e-9)
      weak_precs, trials = _greedy_recovery(cl, weak_precs, ladder, scores,
                                            target, limits)
  else:
    for k in weak:
      if limits[k] is None:
        raise AllocationError(f"method {method!r} needs a memory limit for "
                              f"{k} and its profile has no capacity")
      if method == "memory":
        weak_precs[k], steps = lower_to_fit(g, profiles[k], ladder[k], scores,
                                            limits[k], kind=k)
        trials += steps
      else:
        weak_precs[k] = min_indicator_plan(g, profiles[k], ladder[k], scores,
                                           limits[k], kind=k)
  final = _with_training(cl, weak_precs)
  prediction = cl.simulate(final)
  precisions = {k: dict(zip(g.paths, final[k])) for k in kinds}
  plans = {k: PrecisionPlan.from_precisions(precisions[k]) for k in kinds}
  return Allocation(
      plans=plans, precisions=precisions, prediction=prediction,
      target_s=target, training_pace_s=pace, straggling=straggling,
      training_kinds=tuple(training),
      **plan_stats(g, scores, precisions, profiles), memory_limits=limits, search_time_s=time.perf_counter() - start,
      trials=trials, method=method)


def shuffled_scores(scores: Any, seed: int = 0) -> dict[str, dict[str, float]]:
  """The same scores given to a random permutation of the layers.

  The "greedy with a shuffled indicator" baseline: the allocator sees the
  indicator's distribution but not which layer it belongs to. Layers with
  the same set of precisions are permuted among themselves.
  """
  table = score_table(scores)
  rng = np.random.default_rng(seed)
  by_keys: dict[tuple, list[str]] = {}
  for path, row in table.items():
    by_keys.setdefault(tuple(sorted(row)), []).append(path)
  out = {}
  for paths in by_keys.values():
    perm = rng.permutation(len(paths))
    for path, j in zip(paths, perm):
      out[path] = dict(table[paths[j]])
  return out


# --------------------------------------------------------------------------
# Baselines.
# --------------------------------------------------------------------------


def uniform_low_plans(spec: ClusterSpec | str,
                      training_kinds: Sequence[str]) -> dict[str, PrecisionPlan]:
  """Uniform low precision on every non-training kind: INT8 where the kind
  has it, else FP16 (embeddings and attention matmuls stay 16-bit and the
  head FP32, as the policy forces)."""
  spec = parse_cluster(spec)
  out = {}
  for k in spec.groups():
    if k in training_kinds:
      continue
    low = (Precision.INT8 if Precision.INT8 in supported_precisions(k)
           else Precision.FP16)
    out[k] = PrecisionPlan.uniform(low)
  return out


def dynamic_batch_split(g: graph_lib.ModelGraph, spec: ClusterSpec | str,
                        profiles: Mapping[str, Profile]) -> list[int]:
  """Per-worker batch sizes of the dynamic-batch baseline (all FP32).

  The global batch (``g``'s batch times the workers) is split in proportion
  to each kind's predicted FP32 throughput, as
  :func:`qsync_jax.parallel.cluster.dynamic_batch_sizes` does for the trainer.
  """
  spec = parse_cluster(spec)
  speed = fp32_speeds(g, spec, profiles)
  return cluster_lib.dynamic_batch_sizes(
      g.input_shape[0] * spec.num_workers, [speed[k] for k in spec.kinds])


def predict_dynamic_batch(graph_at, spec: ClusterSpec | str, batch_size: int,
                          profile_for, *,
                          bucket_bytes: float | None =
                          simulation.DEFAULT_BUCKET_BYTES
                          ) -> tuple[Prediction, list[int]]:
  """Predicts the dynamic-batch baseline: FP32, batches by device speed.

  Args:
    graph_at: ``batch_size -> ModelGraph`` (e.g. a partial of
      :func:`qsync_jax.predictor.trace_graph`).
    spec: the cluster.
    batch_size: the nominal per-worker batch.
    profile_for: ``(graph, kind) -> Profile`` (e.g.
      :func:`qsync_jax.predictor.analytic_profile`).
    bucket_bytes: see :func:`qsync_jax.predictor.simulate`.

  Returns:
    (the prediction, the per-worker batch sizes).
  """
  spec = parse_cluster(spec)
  graphs = {batch_size: graph_at(batch_size)}
  nominal = graphs[batch_size]
  sizes = dynamic_batch_split(
      nominal, spec, {k: profile_for(nominal, k) for k in spec.groups()})
  profs: dict[tuple[int, str], Profile] = {}
  workers = []
  fp32 = {p: Precision.FP32 for p in nominal.paths}
  for i, (kind, b) in enumerate(zip(spec.kinds, sizes)):
    if b not in graphs:
      graphs[b] = graph_at(b)
    if (b, kind) not in profs:
      profs[(b, kind)] = profile_for(graphs[b], kind)
    workers.append(SimWorker(f"{kind}[{i}]", profs[(b, kind)], fp32,
                             graph=graphs[b]))
  prediction = simulation.simulate(nominal, workers, bucket_bytes=bucket_bytes,
                                   link=simulation.cluster_link(spec.kinds))
  return prediction, sizes
