"""The baselines the allocator is compared with.

This module owns the plans and predictions QSync's evaluation sets against
:func:`qsync_jax.allocation.allocate` (and that
:func:`qsync_jax.allocation.plan_cluster` predicts next to it):

* :func:`shuffled_scores`: the same search with the indicator given to a
  random permutation of the layers (QSync's indicator ablation);
* :func:`uniform_low_plans`: uniform low precision on every weak kind;
* :func:`dynamic_batch_split` and :func:`predict_dynamic_batch`: all FP32,
  with per-worker batches sized by each kind's speed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from qsync_jax.allocation import allocator
from qsync_jax.allocation import search
from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import simulation
from qsync_jax.predictor.profiling import Profile
from qsync_jax.predictor.simulation import Prediction
from qsync_jax.predictor.simulation import SimWorker


def shuffled_scores(
  scores: search.ScoresLike, seed: int = 0
) -> dict[str, dict[str, float]]:
  """The same scores given to a random permutation of the layers.

  The "greedy with a shuffled indicator" baseline: the allocator sees the
  indicator's distribution but not which layer it belongs to. Layers with
  the same set of precisions are permuted among themselves.
  """
  table = search.score_table(scores)
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


def uniform_low_plans(
  spec: ClusterSpec | str, training_kinds: Sequence[str]
) -> dict[str, PrecisionPlan]:
  """Uniform low precision on every non-training kind: INT8 where the kind
  has it, else FP16 (embeddings and attention matmuls stay 16-bit and the
  head FP32, as the policy forces)."""
  spec = parse_cluster(spec)
  out = {}
  for k in spec.groups():
    if k in training_kinds:
      continue
    low = (
      Precision.INT8
      if Precision.INT8 in supported_precisions(k)
      else Precision.FP16
    )
    out[k] = PrecisionPlan.uniform(low)
  return out


def dynamic_batch_split(
  g: graph_lib.ModelGraph,
  spec: ClusterSpec | str,
  profiles: Mapping[str, Profile],
) -> list[int]:
  """Per-worker batch sizes of the dynamic-batch baseline (all FP32).

  The global batch (``g``'s batch times the workers) is split in proportion
  to each kind's predicted FP32 throughput, as
  :func:`qsync_jax.parallel.cluster.dynamic_batch_sizes` does for the trainer.
  """
  spec = parse_cluster(spec)
  speed = allocator.fp32_speeds(g, spec, profiles)
  return cluster_lib.dynamic_batch_sizes(
    g.input_shape[0] * spec.num_workers, [speed[k] for k in spec.kinds]
  )


def predict_dynamic_batch(
  graph_at: Callable[[int], graph_lib.ModelGraph],
  spec: ClusterSpec | str,
  batch_size: int,
  profile_for: Callable[[graph_lib.ModelGraph, str], Profile],
  *,
  bucket_bytes: float | None = simulation.DEFAULT_BUCKET_BYTES,
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
    nominal, spec, {k: profile_for(nominal, k) for k in spec.groups()}
  )
  profs: dict[tuple[int, str], Profile] = {}
  workers = []
  fp32 = dict.fromkeys(nominal.paths, Precision.FP32)
  for i, (kind, b) in enumerate(zip(spec.kinds, sizes)):
    if b not in graphs:
      graphs[b] = graph_at(b)
    if (b, kind) not in profs:
      profs[(b, kind)] = profile_for(graphs[b], kind)
    workers.append(
      SimWorker(f"{kind}[{i}]", profs[(b, kind)], fp32, graph=graphs[b])
    )
  prediction = simulation.simulate(
    nominal,
    workers,
    bucket_bytes=bucket_bytes,
    link=simulation.cluster_link(spec.kinds),
  )
  return prediction, sizes
