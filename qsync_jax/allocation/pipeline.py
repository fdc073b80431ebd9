"""Planning: from a model, some data and a cluster to per-device plans.

This module owns the pipeline that ``experiments/allocate.py`` and the main
job's ``--plan=auto`` run (QSync, arXiv 2407.02327, section 5):

1. indicator scores from a few training batches (:func:`compute_scores`);
2. the layer graph at the per-worker batch and one analytic profile per
   device kind of the cluster (the GPU catalog; the kinds need not be
   present);
3. the allocator (:func:`qsync_jax.allocation.allocator.allocate`);
4. the baselines it is compared with, predicted the same way: all FP32,
   uniform low precision on the weak kinds, dynamic batch sizing, the
   training devices alone, and the search with a shuffled indicator
   (:mod:`qsync_jax.allocation.baselines`; :func:`plan_cluster`).

The model whose step is predicted (the *timing model*) may be a bigger
version of the one scored and trained, as long as both have the same layer
paths: e.g. plan for ResNet-50 at 224 x 224 on v100:8,t4:8 and train a narrow
ResNet-50 on digits with that plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import functools
import os
from typing import Any

from flax import nnx
import jax
import numpy as np

from qsync_jax import files
from qsync_jax import predictor
from qsync_jax import sensitivity
from qsync_jax.allocation import allocator as allocator_lib
from qsync_jax.allocation import baselines as baselines_lib
from qsync_jax.allocation import search
from qsync_jax.data.base import Dataset
from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import profiling
from qsync_jax.predictor import simulation
from qsync_jax.task import calling
from qsync_jax.task.objective import LossFn


def indicator_batches(
  dataset: Dataset, num_batches: int, batch_size: int
) -> list[tuple[np.ndarray, np.ndarray]]:
  """The first ``num_batches`` training batches of ``dataset``.

  Raises:
    ValueError: the dataset is too small.
  """
  need = num_batches * batch_size
  if len(dataset.x_train) < need:
    raise ValueError(
      f"dataset {dataset.name!r} has {len(dataset.x_train)} "
      f"training examples; {num_batches} batches of "
      f"{batch_size} need {need}"
    )
  return [
    (
      dataset.x_train[i * batch_size : (i + 1) * batch_size],
      dataset.y_train[i * batch_size : (i + 1) * batch_size],
    )
    for i in range(num_batches)
  ]


def compute_scores(
  model: nnx.Module,
  dataset: Dataset,
  method: str = sensitivity.DEFAULT_METHOD,
  *,
  num_batches: int = 4,
  batch_size: int = 32,
  precisions: Sequence[Precision | str] = ("int8", "fp16", "bf16"),
  seed: int = 0,
  loss_fn: LossFn = None,
  call: calling.CallFn | None = None,
) -> sensitivity.Scores:
  """Indicator scores of ``model`` on the first training batches.

  ``method`` (default :data:`qsync_jax.sensitivity.DEFAULT_METHOD`),
  ``loss_fn`` and ``call`` are as in :func:`qsync_jax.sensitivity.compute`
  (default loss: classification on ``(inputs, labels)``).
  """
  return sensitivity.compute(
    model,
    loss_fn,
    indicator_batches(dataset, num_batches, batch_size),
    method,
    precisions,
    seed=seed,
    call=call,
  )


def sample_at(model: Any, sample_input: Any, batch_size: int) -> Any:
  """The model's sample input (or Probe) with its batch axis resized.

  Args:
    model: the model (its ``input_spec(batch_size)`` is the default).
    sample_input: the model's inputs (arrays or ``jax.ShapeDtypeStruct``:
      one, a tuple or a dict), a :class:`qsync_jax.task.Probe`, or None.
    batch_size: the leading (example) dimension wanted.

  Returns:
    Abstract inputs (or a Probe on abstract data) at ``batch_size``.

  Raises:
    ValueError: no sample input and no ``input_spec`` method, or a sample
      whose arrays have no batch axis.
  """
  if sample_input is None:
    spec = getattr(model, "input_spec", None)
    if not callable(spec):
      raise ValueError(
        f"{type(model).__name__} has no input_spec(batch_size): pass "
        "sample_input (the model's inputs, any batch size) to plan it"
      )
    return spec(batch_size)

  def resize(a):
    if not getattr(a, "shape", None):
      raise ValueError(
        "every array of the sample input needs a leading "
        f"batch axis, got shape {getattr(a, 'shape', ())}"
      )
    return jax.ShapeDtypeStruct((batch_size, *a.shape[1:]), a.dtype)

  if isinstance(sample_input, calling.Probe):
    return calling.Probe(
      sample_input.fn, jax.tree.map(resize, sample_input.data)
    )
  return jax.tree.map(resize, calling.abstract(sample_input))


@dataclasses.dataclass
class PlanningResult:
  """An allocation and the baselines it is compared with.

  Attributes:
    allocation: the allocator's
      :class:`~qsync_jax.allocation.allocator.Allocation`.
    graph: the timing model's graph at the per-worker batch.
    profiles: ``{kind: Profile}`` used.
    scores: the indicator scores (``{layer: {precision: score}}``).
    indicator: the indicator's name.
    cluster: the cluster.
    baselines: ``{name: {"step_time_s", "memory_bytes": {kind: bytes},
      "quantized_layers": {kind: n}, "indicator_sum": {kind: x}}}`` for
      ``fp32``, ``uniform_low``, ``dynamic_batch`` (with ``batch_sizes``)
      ``training_only`` (the training kinds alone, no weak workers) and
      ``qsync_shuffled`` (the same search with the scores shuffled among the
      layers).
  """

  allocation: allocator_lib.Allocation
  graph: graph_lib.ModelGraph
  profiles: dict[str, profiling.Profile]
  scores: Mapping[str, Mapping[str, float]]
  indicator: str
  cluster: ClusterSpec
  baselines: dict[str, dict[str, Any]]

  def summary(self) -> dict[str, Any]:
    """``summary.json`` of ``experiments/allocate.py``."""
    a = self.allocation
    steps = {
      "qsync": a.prediction.step_time_s,
      **{k: v["step_time_s"] for k, v in self.baselines.items()},
    }
    memory = {
      "qsync": dict(a.memory_bytes),
      **{k: v["memory_bytes"] for k, v in self.baselines.items()},
    }
    out = a.summary()
    out.pop("step_time_s")
    out.pop("memory_bytes")
    return {
      "cluster": str(self.cluster),
      "indicator": self.indicator,
      **out,
      "predicted_step_time_s": steps,
      "predicted_memory_bytes": memory,
      "baselines": {
        k: {
          kk: vv
          for kk, vv in v.items()
          if kk not in ("step_time_s", "memory_bytes")
        }
        for k, v in self.baselines.items()
      },
      "optimizer_update_s": {
        k: prof.optimizer_s for k, prof in self.profiles.items()
      },
      "profile_sources": {k: prof.source for k, prof in self.profiles.items()},
      "layers": len(self.graph.nodes),
      "batch_shape": list(self.graph.input_shape),
    }

  def table(self) -> str:
    """One line per layer: shape, precision per kind, score, cost."""
    a = self.allocation
    kinds = list(a.precisions)
    weak = [k for k in kinds if k not in a.training_kinds]
    rows = [
      ["layer", "weight shape"]
      + kinds
      + [f"score ({k})" for k in weak]
      + [f"fwd+bwd ms ({k})" for k in weak]
    ]
    for node in self.graph.nodes:
      row = [node.path, "x".join(map(str, node.weight_shape)) or "-"]
      row += [a.precisions[k][node.path].value for k in kinds]
      for k in weak:
        p = a.precisions[k][node.path]
        score = search.indicator_of(self.scores, node.path, p)
        row.append(f"{score:.3g}")
      for k in weak:
        p = a.precisions[k][node.path]
        row.append(f"{self.profiles[k].layer_cost(node.path, p)[1] * 1e3:.3f}")
      rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
      "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows
    )


def plan_cluster(
  timing_model: nnx.Module,
  cluster: ClusterSpec | str,
  scores: search.ScoresLike,
  batch_size: int,
  *,
  indicator_name: str = sensitivity.DEFAULT_METHOD,
  method: str = "greedy",
  memory_limits: Mapping[str, float] | None = None,
  compression: float | None = None,
  candidates: Sequence[Precision | str] = (search.DEFAULT_CANDIDATES),
  baselines: bool = True,
  optimizer_state_copies: int = 2,
  sample_input: Any = None,
  profiles: Mapping[str, profiling.Profile] | None = None,
  graph: graph_lib.ModelGraph | None = None,
) -> PlanningResult:
  """Allocates plans for ``cluster`` and predicts the baselines.

  Args:
    timing_model: the NNX model whose step is predicted.
    cluster: e.g. ``"v100:8,t4:8"``; every kind must be in the GPU catalog.
    scores: indicator scores over the same layer paths.
    batch_size: the per-worker batch.
    indicator_name: the scores' method, for the summary (default
      :data:`qsync_jax.sensitivity.DEFAULT_METHOD`, what
      :func:`compute_scores` uses by default).
    method: the allocator's search (``"greedy"``, ``"memory"``, ``"ilp"``).
    memory_limits: ``{kind: bytes}``.
    compression: instead of limits, give each weak kind the budget that
      saves this fraction of its FP32 residual bytes
      (:func:`qsync_jax.allocation.search.compression_budget`; QSync's
      ablation uses 0.6).
    candidates: precisions the weak kinds may use.
    baselines: also predict the baselines.
    optimizer_state_copies: float32 copies of the parameters the optimizer
      keeps, which set its update time and memory: 2 for Adam(W) (QSync's
      BERT), 1 for SGD with momentum (QSync's CNNs), 0 for plain SGD.
    sample_input: the timing model's inputs at any batch size (arrays or
      ``jax.ShapeDtypeStruct``: one, a tuple or a dict) or a
      :class:`qsync_jax.task.Probe`; resized to each batch traced. Default:
      the model's ``input_spec(batch_size)``.
    profiles: ``{kind: Profile}`` of the timing model at ``batch_size``
      (e.g. measured where each kind runs,
      :func:`qsync_jax.allocation.sharing.gather_profiles`); the kinds not
      given, and every kind at the other batch sizes the dynamic-batch
      baseline traces, use the analytic catalog.
    graph: the timing model's graph at ``batch_size`` when already traced
      (default: traced here).

  Raises:
    ValueError: the scores do not cover the timing model's layers, a kind
      outside the catalog, both memory_limits and compression, or a negative
      optimizer_state_copies.
    qsync_jax.allocation.AllocationError: no plan fits.
  """
  if optimizer_state_copies < 0:
    raise ValueError(
      f"optimizer_state_copies must be >= 0, got {optimizer_state_copies}"
    )
  analytic = functools.partial(
    predictor.analytic_profile, optimizer_state_copies=optimizer_state_copies
  )
  spec = parse_cluster(cluster)
  g = graph or predictor.trace_graph(
    timing_model, sample_at(timing_model, sample_input, batch_size)
  )
  table = search.score_table(scores)
  _check_same_layers(table, g)
  given = dict(profiles or {})
  profiles = {
    k: given[k] if k in given else analytic(g, k) for k in spec.groups()
  }
  training = allocator_lib.training_kinds_of(g, spec, profiles)
  if compression is not None:
    if memory_limits:
      raise ValueError("give memory_limits or compression, not both")
    memory_limits = {
      k: search.compression_budget(g, profiles[k], compression)
      for k in spec.groups()
      if k not in training
    }
  run_allocator = functools.partial(
    allocator_lib.allocate,
    g,
    spec,
    profiles=profiles,
    memory_limits=memory_limits,
    method=method,
    candidates=candidates,
    training_kinds=training,
  )
  alloc = run_allocator(table)
  out: dict[str, dict[str, Any]] = {}
  if baselines:
    out = _baselines(
      g,
      spec,
      table,
      profiles,
      training,
      dynamic_batch=_dynamic_batch_baseline(
        timing_model, sample_input, batch_size, g, spec, profiles, analytic
      ),
      # QSync's indicator ablation: the same search with the scores
      # shuffled among the layers (judged by the true scores).
      shuffled=run_allocator(baselines_lib.shuffled_scores(table)),
    )
  return PlanningResult(
    alloc, g, profiles, dict(table), indicator_name, spec, out
  )


def _check_same_layers(
  table: Mapping[str, Mapping[str, float]], g: graph_lib.ModelGraph
) -> None:
  """Checks that the scores cover exactly the timing model's layers.

  Raises:
    ValueError: they do not, naming some of the differing paths.
  """
  if set(table) != set(g.paths):
    extra = sorted(set(table) - set(g.paths))
    lack = sorted(set(g.paths) - set(table))
    raise ValueError(
      "the indicator scores and the timing model have "
      f"different layers (scores only: {extra[:5]}, timing "
      f"model only: {lack[:5]}); score a model with the same "
      "layer paths"
    )


def _dynamic_batch_baseline(
  timing_model: nnx.Module,
  sample_input: Any,
  batch_size: int,
  g: graph_lib.ModelGraph,
  spec: ClusterSpec,
  profiles: Mapping[str, profiling.Profile],
  analytic: Callable[[graph_lib.ModelGraph, str], profiling.Profile],
) -> dict[str, Any]:
  """The dynamic-batch baseline's summary: FP32, batches by device speed.

  The timing model is traced at each batch size the baseline tries; the
  profiles at ``batch_size`` are ``profiles``, the others ``analytic``.
  """
  graphs = {batch_size: g}

  def graph_at(b):
    if b not in graphs:
      graphs[b] = predictor.trace_graph(
        timing_model, sample_at(timing_model, sample_input, b)
      )
    return graphs[b]

  profile_cache = {(id(g), k): v for k, v in profiles.items()}

  def profile_for(graph, kind):
    key = (id(graph), kind)
    if key not in profile_cache:
      profile_cache[key] = analytic(graph, kind)
    return profile_cache[key]

  db, sizes = baselines_lib.predict_dynamic_batch(
    graph_at, spec, batch_size, profile_for
  )
  return {
    "step_time_s": db.step_time_s,
    "memory_bytes": {
      k: max(m for m, kk in zip(db.worker_memory_bytes, spec.kinds) if kk == k)
      for k in spec.groups()
    },
    "quantized_layers": dict.fromkeys(spec.groups(), 0),
    "indicator_sum": dict.fromkeys(spec.groups(), 0.0),
    "batch_sizes": {
      k: max(b for b, kk in zip(sizes, spec.kinds) if kk == k)
      for k in spec.groups()
    },
  }


def _baselines(
  g: graph_lib.ModelGraph,
  spec: ClusterSpec,
  table: Mapping[str, Mapping[str, float]],
  profiles: Mapping[str, profiling.Profile],
  training: Sequence[str],
  *,
  dynamic_batch: dict[str, Any],
  shuffled: allocator_lib.Allocation,
) -> dict[str, dict[str, Any]]:
  """The baselines' summaries (:attr:`PlanningResult.baselines`).

  All FP32, uniform low precision on the weak kinds, ``dynamic_batch``
  (:func:`_dynamic_batch_baseline`), the training kinds alone, and the
  ``shuffled`` indicator's allocation.
  """
  stats = functools.partial(search.plan_stats, g, table, profiles=profiles)
  link = simulation.cluster_link(spec.kinds)
  fp32 = {k: dict.fromkeys(g.paths, Precision.FP32) for k in spec.groups()}
  low_plans = baselines_lib.uniform_low_plans(spec, training)
  low = {
    k: predictor.resolve_plan(g, low_plans.get(k, PrecisionPlan()), k)
    for k in spec.groups()
  }
  alone = ClusterSpec(tuple(k for k in spec.kinds if k in training))
  return {
    "fp32": {
      "step_time_s": predictor.predict(
        g, spec, {}, profiles, link=link
      ).step_time_s,
      **stats(fp32),
    },
    "uniform_low": {
      "step_time_s": predictor.predict(
        g, spec, low_plans, profiles, link=link
      ).step_time_s,
      **stats(low),
    },
    "dynamic_batch": dynamic_batch,
    "training_only": {
      "step_time_s": predictor.predict(g, alone, {}, profiles).step_time_s,
      **stats({k: fp32[k] for k in training}),
      "cluster": str(alone),
    },
    "qsync_shuffled": {
      "step_time_s": shuffled.prediction.step_time_s,
      **stats(shuffled.precisions),
    },
  }


def write(result: PlanningResult, out_dir: str) -> dict[str, Any]:
  """Writes ``<kind>.json`` per device kind, ``summary.json`` and
  ``scores.json`` to ``out_dir``, each whole or not at all; returns the
  summary.

  Raises:
    OSError: a file could not be written (naming it); it keeps its old
      content.
  """
  os.makedirs(out_dir, exist_ok=True)
  for kind, plan in result.allocation.plans.items():
    files.write_text(os.path.join(out_dir, f"{kind}.json"), plan.to_json())
  summary = result.summary()
  files.write_json(os.path.join(out_dir, "summary.json"), summary, indent=2)
  files.write_json(
    os.path.join(out_dir, "scores.json"),
    {"method": result.indicator, "values": result.scores},
    indent=2,
  )
  return summary
