"""The per-kind plan searches and the quantities they trade.

This module owns what the allocator (:mod:`qsync_jax.allocation.allocator`)
searches over for one device kind: each layer's precision ladder
(:func:`ladders`), a plan's indicator and memory (:func:`indicator_of`,
:func:`plan_memory`, :func:`plan_stats`, :func:`compression_budget`), and
the three searches of one kind's plan:

* :func:`fastest_plan`: the least forward + backward time under a memory
  limit, exact under the predictor's additive costs (a multiple-choice
  knapsack over :func:`cast_groups`, solved with ``scipy.optimize.milp``);
  the greedy search starts from it;
* :func:`lower_to_fit`: the memory-scarce variant: from FP32, lower the
  layers whose indicator grows least per byte saved until the plan fits;
* :func:`min_indicator_plan`: the least total indicator under a memory
  budget, exactly (QSync's indicator ablation, section 3.5 there).

:class:`AllocationError`, which every search raises when no plan fits, is
defined here for that reason; callers reach it as
``qsync_jax.allocation.AllocationError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import heapq
import itertools

import numpy as np

from qsync_jax.numerics.precision import Precision
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory
from qsync_jax.predictor import simulation
from qsync_jax.predictor.profiling import Profile
from qsync_jax.sensitivity.scores import Scores

#: Indicator scores: a :class:`~qsync_jax.sensitivity.scores.Scores` or the
#: ``{layer path: {precision name: score}}`` mapping it holds.
ScoresLike = Scores | Mapping[str, Mapping[str, float]]
#: The precision ladder QSync uses on a T4: INT8, FP16, FP32.
DEFAULT_CANDIDATES = (Precision.INT8, Precision.FP16, Precision.FP32)
#: Largest number of precision combinations one cast-joined group may have.
MAX_GROUP_OPTIONS = 4096
_ZERO = (Precision.FP32, Precision.TF32)


class AllocationError(ValueError):
  """No plan satisfies the constraints (the message says which and why)."""


# --------------------------------------------------------------------------
# Scores, ladders and memory per layer.
# --------------------------------------------------------------------------


def score_table(scores: ScoresLike) -> Mapping[str, Mapping[str, float]]:
  """``{layer: {precision: score}}`` of a sensitivity.Scores or a mapping."""
  values = (
    scores if isinstance(scores, Mapping) else getattr(scores, "values", None)
  )
  if not isinstance(values, Mapping):
    raise TypeError(
      "scores must be a sensitivity.Scores or a mapping "
      "{layer: {precision: score}}"
    )
  return values


def indicator_of(scores: ScoresLike, path: str, precision: Precision) -> float:
  """The indicator of computing ``path`` at ``precision`` (FP32 scores 0)."""
  if precision in _ZERO:
    return 0.0
  return float(score_table(scores)[path][precision.value])


def ladders(
  g: graph_lib.ModelGraph,
  kind: str,
  profile: Profile,
  scores: ScoresLike,
  candidates: Sequence[Precision | str] = DEFAULT_CANDIDATES,
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
    raise AllocationError(
      f"the indicator scores have no entry for layer(s) {', '.join(missing)}"
    )
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
        raise AllocationError(
          f"the indicator scores have no {p.value} score "
          f"for layer {node.path!r}"
        )
    if Precision.FP32 in cands or not rungs:
      if Precision.FP32.value not in costed:
        raise AllocationError(
          f"the {kind} profile has no FP32 cost for layer {node.path!r}"
        )
      rungs.append(Precision.FP32)
    out.append(rungs)
  return out


def layer_bytes(profile: Profile, path: str, p: Precision) -> float:
  """Bytes ``path`` at ``p`` adds to the step over FP32 (negative: saves)."""
  return (
    0.0
    if p is Precision.FP32
    else float(profile.memory.deltas[path].get(p.value, 0.0))
  )


def plan_memory(
  g: graph_lib.ModelGraph, profile: Profile, precisions: Sequence[Precision]
) -> float:
  """Predicted step bytes of one worker (``precisions`` in node order)."""
  return profile.memory.predict(g.paths, precisions)


def plan_stats(
  g: graph_lib.ModelGraph,
  scores: ScoresLike,
  precisions: Mapping[str, Mapping[str, Precision]],
  profiles: Mapping[str, Profile],
) -> dict[str, dict]:
  """Per kind of ``precisions`` (``{kind: {layer: precision}}``): the plan's
  ``indicator_sum``, ``quantized_layers`` (below FP32) and ``memory_bytes``.
  """
  return {
    "indicator_sum": {
      k: float(sum(indicator_of(scores, path, v) for path, v in p.items()))
      for k, p in precisions.items()
    },
    "quantized_layers": {
      k: sum(v not in _ZERO for v in p.values()) for k, p in precisions.items()
    },
    "memory_bytes": {
      k: plan_memory(g, profiles[k], [p[path] for path in g.paths])
      for k, p in precisions.items()
    },
  }


def compression_budget(
  g: graph_lib.ModelGraph, profile: Profile, compression: float
) -> float:
  """A memory limit that saves ``compression`` of the FP32 residual bytes.

  QSync's indicator ablation fixes ``M_B = (1 - 0.6) sum_l M_l`` over the bytes
  the layers save for the backward pass (QSync's official code, bytedance/QSync,
  ``Syncer/mem_ilp.py``); here the rest of the step (parameters, optimizer
  state, other activations) is added unchanged.
  """
  residual = sum(memory.residual_bytes(n, Precision.FP32) for n in g.nodes)
  base = plan_memory(g, profile, [Precision.FP32] * len(g.nodes))
  return base - compression * residual


def _min_memory(g, profile, ladder) -> float:
  return profile.memory.base_bytes + sum(
    min(layer_bytes(profile, n.path, p) for p in rungs)
    for n, rungs in zip(g.nodes, ladder)
  )


def _infeasible(kind, limit, g, profile, ladder) -> AllocationError:
  low = _min_memory(g, profile, ladder)
  return AllocationError(
    f"memory limit {limit / 2**30:.3f} GiB for {kind} is below the smallest "
    f"memory any plan reaches, {low / 2**30:.3f} GiB ({low:.0f} bytes, "
    "every layer at its lowest precision)"
  )


# --------------------------------------------------------------------------
# Multiple-choice knapsack: one option per group, least value under a limit.
# --------------------------------------------------------------------------


def _choose(
  values: Sequence[np.ndarray],
  weights: Sequence[np.ndarray],
  capacity: float | None,
) -> list[int] | None:
  """The option per group minimizing total value with total weight <= cap.

  Returns None when no choice fits. Exact (``scipy.optimize.milp``) when the
  unconstrained best does not fit.
  """
  best = [int(np.argmin(v)) for v in values]
  if capacity is None or sum(w[b] for w, b in zip(weights, best)) <= capacity:
    return best
  if sum(float(np.min(w)) for w in weights) > capacity:
    return None
  from scipy import optimize  # local: 0.4 s to import, needed only here

  sizes = [len(v) for v in values]
  n = sum(sizes)
  c = np.concatenate(values).astype(np.float64)
  w = np.concatenate(weights).astype(np.float64)
  # Shift weights by each group's smallest so the constraint is well scaled.
  shift = np.concatenate(
    [np.full(s, np.min(wg)) for s, wg in zip(sizes, weights)]
  )
  scale = max(float(np.max(np.abs(w - shift))), 1.0)
  rows = np.zeros((len(sizes), n))
  start = 0
  for gi, s in enumerate(sizes):
    rows[gi, start : start + s] = 1.0
    start += s
  cap = (capacity - float(sum(np.min(wg) for wg in weights))) / scale
  constraints = [
    optimize.LinearConstraint(rows, 1.0, 1.0),
    optimize.LinearConstraint(
      ((w - shift) / scale)[None, :], -np.inf, cap + 1e-9
    ),
  ]
  cscale = max(float(np.max(np.abs(c))), 1e-30)
  res = optimize.milp(
    c / cscale,
    constraints=constraints,
    integrality=np.ones(n),
    bounds=optimize.Bounds(0, 1),
  )
  if res.x is None:
    return None
  out, start = [], 0
  for s in sizes:
    out.append(int(np.argmax(res.x[start : start + s])))
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


def fastest_plan(
  g: graph_lib.ModelGraph,
  profile: Profile,
  ladder: Sequence[Sequence[Precision]],
  memory_limit: float | None = None,
  *,
  kind: str | None = None,
) -> list[Precision]:
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
        f"{MAX_GROUP_OPTIONS}; restrict the candidate precisions"
      )
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
        mems[gi][j] = sum(
          layer_bytes(profile, g.nodes[i].path, p)
          for i, p in zip(members, opts[j])
        )
  capacity = (
    None if memory_limit is None else memory_limit - profile.memory.base_bytes
  )
  pick = _choose(times, mems, capacity)
  if pick is None:
    raise _infeasible(
      kind or profile.device_kind, memory_limit, g, profile, ladder
    )
  out = [Precision.FP32] * len(g.nodes)
  for members, opts, j in zip(groups, options, pick):
    for i, p in zip(members, opts[j]):
      out[i] = p
  return out


# --------------------------------------------------------------------------
# Fewest bits under memory.
# --------------------------------------------------------------------------


def lower_to_fit(
  g: graph_lib.ModelGraph,
  profile: Profile,
  ladder: Sequence[Sequence[Precision]],
  scores: ScoresLike,
  memory_limit: float,
  *,
  kind: str | None = None,
) -> tuple[list[Precision], int]:
  """The memory-scarce variant: lower layers until the plan fits.

  From every layer at its top rung, repeatedly lowers the layer whose
  indicator grows least per byte saved, ``(score(lower) - score(current)) /
  bytes saved``, one level at a time: the order QSync's official code
  (bytedance/QSync, ``greedy_mem_requirement_single_node``) intends, where it
  pops the largest indicator first.

  Returns:
    (precisions in node order, number of lowering steps).

  Raises:
    AllocationError: even every layer at its lowest rung does not fit.
  """
  if _min_memory(g, profile, ladder) > memory_limit:
    raise _infeasible(
      kind or profile.device_kind, memory_limit, g, profile, ladder
    )
  level = [len(r) - 1 for r in ladder]
  precs = [r[-1] for r in ladder]
  total = plan_memory(g, profile, precs)
  heap: list[tuple[float, int]] = []

  def push(i):
    if level[i] == 0:
      return
    path = g.nodes[i].path
    cur, low = ladder[i][level[i]], ladder[i][level[i] - 1]
    saved = layer_bytes(profile, path, cur) - layer_bytes(profile, path, low)
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
    total += layer_bytes(profile, path, low) - layer_bytes(
      profile, path, precs[i]
    )
    precs[i] = low
    level[i] -= 1
    steps += 1
    push(i)
  return precs, steps


def min_indicator_plan(
  g: graph_lib.ModelGraph,
  profile: Profile,
  ladder: Sequence[Sequence[Precision]],
  scores: ScoresLike,
  memory_limit: float,
  *,
  kind: str | None = None,
) -> list[Precision]:
  """The plan with the least total indicator under ``memory_limit`` (ILP).

  ``min sum_l sum_b x_lb score_l(b)`` subject to one precision per layer
  and the plan's memory at most the limit (QSync's indicator ablation, as
  QSync's official code, bytedance/QSync, ``Syncer/mem_ilp.py``, poses it),
  solved exactly with ``scipy.optimize.milp``.

  Raises:
    AllocationError: no plan fits.
  """
  values = [
    np.array([indicator_of(scores, n.path, p) for p in rungs])
    for n, rungs in zip(g.nodes, ladder)
  ]
  weights = [
    np.array([layer_bytes(profile, n.path, p) for p in rungs])
    for n, rungs in zip(g.nodes, ladder)
  ]
  # Among equal indicators prefer more bits: a tiny tie-break toward the top.
  values = [
    v - 1e-12 * np.arange(len(v)) * max(1.0, float(np.abs(v).max()))
    for v in values
  ]
  pick = _choose(values, weights, memory_limit - profile.memory.base_bytes)
  if pick is None:
    raise _infeasible(
      kind or profile.device_kind, memory_limit, g, profile, ladder
    )
  return [rungs[j] for rungs, j in zip(ladder, pick)]
