"""Which sync method and averager is fastest on a given link.

This module owns :func:`compare_sync`: for a cluster, its plans and a
:class:`~qsync_jax.predictor.communication.Link`, the predicted step time
of every sync method (data parallel every step; local SGD and QSR amortized
over their periods, from :mod:`qsync_jax.parallel.schedules`) with every
averager, and the fastest of them. It models time only: how each choice
changes accuracy (compression noise, local drift) is not modelled, so the
recommendation is the fastest option, not the best one.

* ``dp``: gradients averaged every step in buckets that overlap the backward
  pass (:func:`qsync_jax.predictor.simulation.predict` with the averager);
* ``local`` / ``qsr``: every step computes without communication, and the
  parameters are averaged once per round, not overlapped:
  ``step = compute step + (averages / steps) * averaging time``, with the
  number of averages over ``total_steps`` from the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import os
from typing import Any

import optax

from qsync_jax.parallel import averagers as averagers_lib
from qsync_jax.parallel import schedules
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import communication
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import simulation
from qsync_jax.predictor.profiling import Profile

SYNC_METHODS = ("dp", "local", "qsr")
#: Bench name -> (``make_averager`` name, keyword arguments).
AVERAGERS: dict[str, tuple[str, dict[str, Any]]] = {
  "none": ("none", {}),
  "fp16": ("fp16", {}),
  "gqsgd": ("gqsgd", {}),
  "gqsgd_exp": ("gqsgd_exp", {}),
  "qsgd": ("qsgd", {}),
  "powersgd": ("powersgd", {"rank": 4}),
}
ACCURACY_NOTE = (
  "accuracy is not modelled: the recommendation is the "
  "fastest predicted step, whatever the averager's noise or "
  "the local steps' drift do to the loss"
)


@dataclasses.dataclass(frozen=True)
class SyncOption:
  """One sync method with one averager.

  Attributes:
    method: ``dp``, ``local`` or ``qsr``.
    averager: the averager's name.
    step_time_s: the predicted (amortized) step time.
    averages_per_step: averages per step (1 for dp).
    averaging_s: the time of one average of the whole model.
  """

  method: str
  averager: str
  step_time_s: float
  averages_per_step: float
  averaging_s: float


@dataclasses.dataclass
class SyncComparison:
  """Every option, the fastest, and what the figures assume."""

  options: list[SyncOption]
  link: communication.Link
  num_workers: int
  num_parameters: int
  period: int
  total_steps: int
  codec_profiled: bool

  @property
  def recommended(self) -> SyncOption:
    """The option with the smallest predicted step time."""
    return min(self.options, key=lambda o: o.step_time_s)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready: the link, the options, the recommendation and notes."""
    return {
      "link": dataclasses.asdict(self.link),
      "num_workers": self.num_workers,
      "num_parameters": self.num_parameters,
      "period": self.period,
      "total_steps": self.total_steps,
      "options": [dataclasses.asdict(o) for o in self.options],
      "recommended": dataclasses.asdict(self.recommended),
      "notes": [
        ACCURACY_NOTE,
        (
          "encode/decode profiled on this machine's device"
          if self.codec_profiled
          else "encode/decode not modelled: the "
          "cluster's kinds are not on this machine to profile on"
        ),
      ],
    }

  def table(self) -> str:
    """One line per option, fastest first."""
    lines = [
      f"{'method':8s} {'averager':10s} {'step ms':>10s} "
      f"{'avg/step':>9s} {'average ms':>11s}"
    ]
    for o in sorted(self.options, key=lambda o: o.step_time_s):
      lines.append(
        f"{o.method:8s} {o.averager:10s} "
        f"{o.step_time_s * 1e3:10.3f} {o.averages_per_step:9.4f} "
        f"{o.averaging_s * 1e3:11.3f}"
      )
    best = self.recommended
    lines.append(
      f"recommended: {best.method} with {best.averager} "
      f"({best.step_time_s * 1e3:.3f} ms/step); {ACCURACY_NOTE}"
    )
    return "\n".join(lines)


def averages_per_step(
  method: str,
  period: int,
  total_steps: int,
  lr: float = 0.1,
  qsr_alpha: float = 0.2,
) -> float:
  """Averages per step of a sync method over ``total_steps``.

  ``local`` averages every ``period`` steps; ``qsr`` follows the Quadratic
  Synchronization Rule (``H = max(period, (alpha / lr)**2)``) over a cosine
  decay of ``lr`` to 0 (:func:`qsync_jax.parallel.schedules.make_schedule`).

  Raises:
    ValueError: an unknown method, or a bad period or step count.
  """
  if method not in SYNC_METHODS:
    raise ValueError(
      f"unknown sync method {method!r}; valid: {', '.join(SYNC_METHODS)}"
    )
  if method == "dp":
    return 1.0
  schedule = schedules.make_schedule(
    method,
    total_steps=total_steps,
    h_base=period,
    alpha=qsr_alpha,
    lr_schedule=optax.cosine_decay_schedule(lr, total_steps),
  )
  return len(schedule.sync_steps(total_steps)) / total_steps


def profile_codecs(
  names: Sequence[str], num_elements: int, num_workers: int
) -> dict[str, communication.CodecCost]:
  """Each averager's encode/decode cost on this machine's first device, as
  the trainer averages by default: with the averager's state (PowerSGD's
  warm start), without error feedback (``profile_codec(...,
  error_feedback=False)``)."""
  return {
    name: communication.profile_codec(
      averagers_lib.make_averager(AVERAGERS[name][0], **AVERAGERS[name][1]),
      num_elements,
      num_workers=num_workers,
      error_feedback=False,
    )
    for name in names
  }


def compare_sync(
  g: graph_lib.ModelGraph,
  cluster: ClusterSpec | str,
  plans: Mapping[str, PrecisionPlan],
  profiles: Mapping[str, Profile],
  link: communication.Link,
  *,
  averager_names: Sequence[str] = tuple(AVERAGERS),
  methods: Sequence[str] = SYNC_METHODS,
  period: int = 8,
  total_steps: int = 1000,
  lr: float = 0.1,
  qsr_alpha: float = 0.2,
  codec_costs: Mapping[str, communication.CodecCost] | None = None,
) -> SyncComparison:
  """Predicts every (sync method, averager) step on ``link``.

  Args:
    g: the model graph at the per-worker batch.
    cluster: e.g. ``"v100:4"``.
    plans: ``{kind: PrecisionPlan}`` (see :func:`predict`).
    profiles: ``{kind: Profile}``.
    link: the link between workers.
    averager_names: names from :data:`AVERAGERS`.
    methods: names from :data:`SYNC_METHODS`.
    period: local SGD's period and QSR's smallest one.
    total_steps: the run's steps (QSR's periods depend on them).
    lr: QSR's peak learning rate (cosine decay).
    qsr_alpha: QSR's growth coefficient.
    codec_costs: ``{averager: CodecCost}`` measured for the cluster's
      devices (:func:`profile_codecs`); averagers without one pay none.

  Returns:
    The :class:`SyncComparison`.

  Raises:
    ValueError: an unknown averager or method, or as :func:`predict`.
  """
  unknown = [a for a in averager_names if a not in AVERAGERS]
  if unknown:
    raise ValueError(
      f"unknown averager(s) {unknown}; valid: {', '.join(AVERAGERS)}"
    )
  cluster = parse_cluster(cluster)
  n = cluster.num_workers
  codec_costs = dict(codec_costs or {})
  num_params = int(sum(node.weight_numel for node in g.nodes))
  # Local steps: the same step with a free all-reduce.
  compute_s = simulation.predict(
    g, cluster, plans, profiles, link=(0.0, 0.0)
  ).step_time_s
  platform = "cpu" if all(k == "cpu" for k in cluster.groups()) else "gpu"
  # Each method's averages per step, the same for every averager.
  rates = {
    m: averages_per_step(m, period, total_steps, lr, qsr_alpha) for m in methods
  }
  options = []
  for name in averager_names:
    averager = averagers_lib.make_averager(
      AVERAGERS[name][0], **AVERAGERS[name][1]
    )
    codec = codec_costs.get(name)
    whole = communication.averaging_time(
      averager, max(num_params, 1), n, link, codec, platform=platform
    )
    for method, rate in rates.items():
      if method == "dp":
        step = simulation.predict(
          g,
          cluster,
          plans,
          profiles,
          link=link,
          averager=averager,
          codec_cost=codec,
        ).step_time_s
      else:
        step = compute_s + rate * whole
      options.append(SyncOption(method, name, float(step), rate, float(whole)))
  return SyncComparison(
    options, link, n, num_params, period, total_steps, bool(codec_costs)
  )


def compare_for(
  result,
  link: communication.Link,
  *,
  period: int = 8,
  total_steps: int = 1000,
  out_dir: str | None = None,
) -> SyncComparison:
  """:func:`compare_sync` for a :class:`~.pipeline.PlanningResult`.

  Profiles the averagers' encode/decode here when every kind of the cluster
  is this machine's (``cpu``), and with ``out_dir`` adds the comparison to
  its ``summary.json`` under ``"sync"``.
  """
  cluster = result.cluster
  n = cluster.num_workers
  num_params = int(sum(node.weight_numel for node in result.graph.nodes))
  codecs = (
    profile_codecs(list(AVERAGERS), max(num_params, 2), n)
    if set(cluster.groups()) == {"cpu"}
    else None
  )
  comparison = compare_sync(
    result.graph,
    cluster,
    result.allocation.plans,
    result.profiles,
    link,
    period=period,
    total_steps=total_steps,
    codec_costs=codecs,
  )
  if out_dir is not None:
    path = os.path.join(out_dir, "summary.json")
    with open(path) as f:
      summary = json.load(f)
    summary["sync"] = comparison.to_dict()
    with open(path, "w") as f:
      json.dump(summary, f, indent=2)
  return comparison
