"""Timeline simulation of one synchronous step over hybrid workers.

This module owns :func:`simulate` and :class:`Prediction`. Per worker, from its
profile and plan: the forward pass (layers plus the non-layer rest, with the
casts the plan's dtype changes insert, :func:`.graph.casts`), then the backward
pass in reverse layer order, where each layer's weight gradient joins a gradient
bucket; a bucket is all-reduced once it is full (``bucket_bytes``) and overlaps
the rest of the backward pass. Across workers (as QSync's official code aligns
them, bytedance/QSync, ``Predictor/cross_node_predict.py``) a bucket's
all-reduce starts only when every worker has it ready and after the previous
bucket's, and lasts as long as the slowest worker's link makes it; each worker
then runs its optimizer update, and the step time is the maximum over workers.

All-reduce times follow the alpha-beta model of a ring: ``2 (n-1) alpha + 2
(n-1)/n bytes beta`` (:func:`ring_allreduce_time`), at 4 bytes per element.
Given an averager (and a :class:`~.communication.Link`), a bucket's time is
instead :func:`~.communication.averaging_time`: the bytes that averager's
compiled program moves, its latency steps and its measured encode/decode.

A measured profile also holds the model's whole pass at each uniform
precision; each precision's pieces are scaled so that its uniform plan costs
that pass (:func:`pass_factors`). Workers that share one host (fake devices
of the machine at hand) also share its cores: the factors then come from as
many copies of the pass run at once. The step is then ``max(pass,
hidden) + fixed`` (``host["hidden_host_s"]``, ``host["fixed_step_s"]``:
fitted to the trainer's uniform steps over that many workers,
:func:`.profiling.fit_step_overhead`): the host's work that runs while the
pass computes, and what the step pays besides (dispatches, transfers, the
update program). That is how the predictor is checked against real steps
on this machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from typing import NamedTuple

import numpy as np

from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel.averagers import MeanAverager
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.parallel.wire import Averager
from qsync_jax.plan import rules
from qsync_jax.plan.devices import DEVICE_PRECISIONS
from qsync_jax.plan.devices import device_spec
from qsync_jax.plan.devices import DEVICES
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import roofline
from qsync_jax.predictor.communication import averaging_time
from qsync_jax.predictor.communication import CodecCost
from qsync_jax.predictor.communication import Link
from qsync_jax.predictor.profiling import Profile
from qsync_jax.predictor.profiling import PROFILED_INPUT_DTYPE

#: PyTorch DDP's default bucket size (bytes).
DEFAULT_BUCKET_BYTES = 25 * 2**20
#: Latency of one step of an all-reduce between GPUs of one node (seconds).
INTRA_NODE_LATENCY_S = 5e-6
#: GPUs per node when a cluster spec does not say.
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class SimWorker:
  """One worker to simulate.

  Attributes:
    name: a label such as ``"t4[3]"``.
    profile: the costs of its device kind.
    precisions: ``{layer path: precision}`` (effective, every layer).
    graph: the model graph at this worker's batch size, when it differs from
      the one :func:`simulate` gets (dynamic batch sizing); its profile must
      be for that graph.
  """

  name: str
  profile: Profile
  precisions: Mapping[str, Precision]
  graph: graph_lib.ModelGraph | None = None


@dataclasses.dataclass
class Prediction:
  """A simulated step.

  Attributes:
    step_time_s: the synchronous step time.
    worker_times_s: each worker's step time on its own (forward, backward,
      optimizer; no waiting for others).
    worker_memory_bytes: each worker's predicted step memory.
    compute_s: each worker's forward + backward time, after host sharing.
    comm_s: total all-reduce time (overlapped or not).
    exposed_comm_s: all-reduce time after the slowest backward ended.
    critical_path: what the step time is made of, in order.
    buckets: ``[{"bytes", "ready_s", "start_s", "end_s"}]``.
  """

  step_time_s: float
  worker_times_s: list[float]
  worker_memory_bytes: list[float]
  compute_s: list[float]
  comm_s: float
  exposed_comm_s: float
  critical_path: list[str]
  buckets: list[dict[str, float]]

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def ring_allreduce_time(
  num_bytes: float, num_workers: int, alpha_s: float, seconds_per_byte: float
) -> float:
  """Alpha-beta time of a ring all-reduce of ``num_bytes`` per worker."""
  if num_workers <= 1 or num_bytes <= 0:
    return 0.0
  n = num_workers
  return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * num_bytes * seconds_per_byte


def cluster_link(
  kinds: Sequence[str], gpus_per_node: int = GPUS_PER_NODE
) -> tuple[float, float]:
  """(alpha_s, seconds_per_byte) of a ring over GPUs of these kinds.

  One kind within one node uses that kind's link; otherwise the ring crosses
  nodes and runs at the slower of the network and the slowest link. A kind
  outside the GPU catalog (a measured CPU) has no link figure: its ring is
  taken to cross the network.
  """
  # Unknown kinds still reach device_spec, which names them.
  specs = [
    device_spec(k) for k in kinds if k in DEVICES or k not in DEVICE_PRECISIONS
  ]
  if (
    len(specs) == len(kinds)
    and len(set(kinds)) == 1
    and len(kinds) <= gpus_per_node
  ):
    return INTRA_NODE_LATENCY_S, 1.0 / specs[0].link_bandwidth
  bw = min([roofline.NETWORK_BANDWIDTH] + [s.link_bandwidth for s in specs])
  return roofline.NETWORK_LATENCY_S, 1.0 / bw


@dataclasses.dataclass(frozen=True)
class _Costs:
  """One worker's per-layer times under its plan (node order)."""

  fwd: np.ndarray
  bwd: np.ndarray
  grad_bytes: np.ndarray
  memory: float


def _tables(g: graph_lib.ModelGraph):
  cached = getattr(g, "_sim_tables", None)
  if cached is None:
    numel = np.array([n.out_numel for n in g.nodes], np.float64)
    cached = {
      "rest_share": numel / numel.sum(),
      "grad_bytes": np.array([4.0 * n.weight_numel for n in g.nodes]),
      "paths": g.paths,
    }
    object.__setattr__(g, "_sim_tables", cached)
  return cached


def _piece_costs(
  g: graph_lib.ModelGraph, prof: Profile, precisions: Sequence[Precision]
) -> tuple[np.ndarray, np.ndarray]:
  """Per-layer (forward, backward) seconds from the pieces alone: each
  layer's op, its share of the non-layer rest (spread by output size, at the
  dtype the layer emits) and the casts the plan inserts (the difference
  between the dtype that arrives and the float32 the op was timed with)."""
  t = _tables(g)
  n = len(g.nodes)
  fwd = np.empty(n)
  bwd = np.empty(n)
  rest32 = prof.rest["float32"]
  share = t["rest_share"]
  for i, (path, p) in enumerate(zip(t["paths"], precisions)):
    f, b = prof.layer_cost(path, p)
    rf, rfb = prof.rest.get(graph_lib.output_dtype(p), rest32)
    fwd[i] = f + share[i] * rf
    bwd[i] = b + share[i] * (rfb - rf)
  for c in graph_lib.casts(g, precisions):
    base_f = prof.casts.time(PROFILED_INPUT_DTYPE, c.dst, c.numel)
    fwd[c.layer] += prof.casts.time(c.src, c.dst, c.numel) - base_f
    if c.backward:
      base_b = prof.casts.time(c.dst, PROFILED_INPUT_DTYPE, c.numel)
      bwd[c.layer] += prof.casts.time(c.dst, c.src, c.numel) - base_b
  return fwd, bwd


#: The least a pass factor can be, as a share of the pieces' own time.
MIN_PASS_FACTOR = 0.25


def pass_factors(
  g: graph_lib.ModelGraph, prof: Profile, k: int = 1
) -> dict[str, float]:
  """How much to scale the pieces of each precision, with k workers sharing
  the host, so that uniform plans cost what their whole passes measured.

  Isolated pieces miss what XLA does across layer boundaries in a whole pass
  (fusing casts and element-wise work into neighbours, one dispatch), and k
  copies of one piece overstate how k workers share the host's cores. QSync's
  replayer builds a mixed plan on uniform-precision traces of the model (arXiv
  2407.02327; bytedance/QSync, ``Predictor/core.py``); likewise, the layers at
  precision ``p`` are scaled by the factor that makes the uniform plan at ``p``
  add up to ``prof.passes[p]`` (at k copies). Uniform plans keep the forced
  precisions (the head at FP32, 16-bit floors), so precisions are solved from
  the widest down, each with its forced layers at the factors already found. A
  precision the profile has no pass for keeps factor 1.

  Args:
    g: the model graph of the profile.
    prof: the profile; analytic ones have no passes (all factors 1).
    k: co-located workers (host sharing; interpolated between the counts
      measured, :func:`host_value`).

  Returns:
    ``{precision value: factor}``, at least :data:`MIN_PASS_FACTOR`.
  """
  cache = prof.__dict__.setdefault("_pass_factor_cache", {})
  key = (id(g), k, repr(prof.passes))  # passes may be replaced or edited
  if key in cache:
    return cache[key]
  factors: dict[str, float] = {}
  for p in sorted((Precision(v) for v in prof.passes), key=lambda q: -q.bits):
    precs = [
      resolve_plan(g, PrecisionPlan.uniform(p))[path] for path in g.paths
    ]
    fwd, bwd = _piece_costs(g, prof, precs)
    total = fwd + bwd
    own = np.array([q is p for q in precs])
    forced = sum(
      total[i] * factors.get(q.value, 1.0)
      for i, q in enumerate(precs)
      if q is not p
    )
    own_s = float(total[own].sum())
    target = host_value(prof.passes[p.value], k)
    factors[p.value] = (
      max((target - forced) / own_s, MIN_PASS_FACTOR) if own_s > 0 else 1.0
    )
  cache[key] = factors
  return factors


def worker_costs(
  g: graph_lib.ModelGraph,
  prof: Profile,
  precisions: Sequence[Precision],
  shared: int = 1,
) -> _Costs:
  """Per-layer forward and backward seconds of one worker's plan.

  The pieces' costs (:func:`_piece_costs`), each layer's scaled by the
  :func:`pass_factors` of its precision with ``shared`` workers on the
  host.
  """
  fwd, bwd = _piece_costs(g, prof, precisions)
  factors = pass_factors(g, prof, shared)
  slow = np.array([factors.get(p.value, 1.0) for p in precisions])
  t = _tables(g)
  mem = prof.memory.predict(t["paths"], precisions)
  return _Costs(fwd * slow, bwd * slow, t["grad_bytes"], mem)


def host_value(per_k: Mapping[int, float], k: int) -> float:
  """A host measurement at k workers, linear between the measured counts
  and proportional to k beyond the largest."""
  ks = sorted(per_k)
  if k in per_k:
    return per_k[k]
  if k > ks[-1]:
    return per_k[ks[-1]] * k / ks[-1]
  return float(np.interp(k, ks, [per_k[j] for j in ks]))


def _precision_list(g, w: SimWorker) -> list[Precision]:
  g.check_precisions(dict(w.precisions))
  return [w.precisions[p] for p in g.paths]


def _workers_costs(
  g: graph_lib.ModelGraph,
  workers: Sequence[SimWorker],
  shared: int,
  cache: dict | None,
) -> list[_Costs]:
  """Each worker's :func:`worker_costs`, each plan costed once in ``cache``.

  Raises:
    ValueError: a worker's precisions do not name exactly the graph's layers.
  """
  cache = {} if cache is None else cache
  costs = []
  for w in workers:
    precs = _precision_list(g, w)
    wg = w.graph if w.graph is not None else g
    key = (id(w.profile), id(wg), shared, tuple(precs))
    if key not in cache:
      cache[key] = worker_costs(wg, w.profile, precs, shared)
    costs.append(cache[key])
  return costs


@dataclasses.dataclass(frozen=True)
class _Wire:
  """How the workers' averages travel.

  Attributes:
    link: without an averager, the ring's ``(alpha_s, seconds_per_byte)``;
      with one, a :class:`~.communication.Link`, or None for an infinitely
      fast link.
    averager: what each bucket's average runs, or None for a plain ring
      all-reduce.
    platform: the averager's compiled program's platform (``"cpu"`` or
      ``"gpu"``); None without an averager.
    between_processes: the caller's link was a ``Link``: the workers are
      separate processes behind it.
  """

  link: tuple[float, float] | Link | None
  averager: Averager | None
  platform: str | None
  between_processes: bool


def _wire(
  workers: Sequence[SimWorker],
  link: tuple[float, float] | Link | None,
  shared_host: bool,
  host: Mapping,
  averager: Averager | None,
  platform: str | None,
) -> _Wire:
  """The link, averager and platform :func:`simulate` was given, completed.

  A missing link is the host's fitted all-reduce (``shared_host``) or
  :func:`cluster_link` of the workers' kinds; a ``Link`` without an
  averager averages the mean; with an averager an alpha-beta pair becomes
  a ``Link``, and the platform is the workers'.
  """
  between_processes = isinstance(link, Link)
  if link is None:
    if shared_host:
      link = tuple(host.get("allreduce", (0.0, 0.0)))
    else:
      link = cluster_link([w.profile.device_kind for w in workers])
  if isinstance(link, Link) and averager is None:
    averager = MeanAverager()
  if averager is not None:
    if not isinstance(link, Link):  # an alpha-beta pair: a link each
      link = Link(1.0 / link[1], link[0]) if link[1] > 0 else None
    if platform is None:
      platform = (
        "cpu" if all(w.profile.device_kind == "cpu" for w in workers) else "gpu"
      )
  return _Wire(link, averager, platform, between_processes)


class _Bucket(NamedTuple):
  """A gradient bucket: its last layer's position in backward order, bytes."""

  last: int
  nbytes: float


def _buckets(
  grad_bytes: np.ndarray, bucket_bytes: float | None
) -> list[_Bucket]:
  """The buckets of gradients of these sizes (in backward order).

  A bucket closes once it holds ``bucket_bytes``; the rest make the last
  one, which also stands alone when ``bucket_bytes`` is None.
  """
  buckets = []
  acc = 0.0
  for pos, nbytes in enumerate(grad_bytes):
    acc += nbytes
    if bucket_bytes is not None and acc >= bucket_bytes:
      buckets.append(_Bucket(pos, acc))
      acc = 0.0
  if acc > 0 or not buckets:
    buckets.append(_Bucket(len(grad_bytes) - 1, acc))
  return buckets


class _Timeline(NamedTuple):
  """When each worker's passes end and its buckets are ready (seconds).

  Attributes:
    fwd_end: per worker, the end of its forward pass.
    bwd_end: per worker, the end of its backward pass.
    ready: ``[bucket, worker]``, when the bucket's last gradient is ready.
  """

  fwd_end: np.ndarray
  bwd_end: np.ndarray
  ready: np.ndarray


def _timelines(
  costs: Sequence[_Costs], order: np.ndarray, positions: Sequence[int]
) -> _Timeline:
  """Each worker's passes, with the backward pass in ``order``.

  ``positions`` are the buckets' last layers' positions in ``order``.
  """
  n = len(costs)
  ready = np.zeros((len(positions), n))
  bwd_end = np.zeros(n)
  fwd_end = np.zeros(n)
  timelines: dict[int, tuple] = {}  # workers with one plan share a timeline
  for j, c in enumerate(costs):
    if id(c) not in timelines:
      f = c.fwd.sum()
      bwd_cum = f + np.cumsum(c.bwd[order])
      timelines[id(c)] = (f, bwd_cum[-1], bwd_cum[list(positions)])
    fwd_end[j], bwd_end[j], ready[:, j] = timelines[id(c)]
  return _Timeline(fwd_end, bwd_end, ready)


def _average_time(
  nbytes: float, n: int, wire: _Wire, codec_cost: CodecCost | None
) -> float:
  """Seconds of one average of ``nbytes`` (FP32) over ``n`` workers."""
  if wire.averager is None:
    # Without an averager the link stays an alpha-beta pair.
    assert wire.link is not None and not isinstance(wire.link, Link)
    return ring_allreduce_time(nbytes, n, *wire.link)
  if wire.link is None or nbytes <= 0:  # an infinitely fast link
    return 0.0
  assert isinstance(wire.link, Link)  # _wire made one for the averager
  return averaging_time(
    wire.averager,
    max(int(nbytes // 4), 1),
    n,
    wire.link,
    codec_cost,
    platform=wire.platform,
  )


class _Comm(NamedTuple):
  """The step's averages.

  Attributes:
    buckets: ``[{"bytes", "ready_s", "start_s", "end_s"}]``.
    end_s: when the last average ends.
    total_s: the averages' time, summed.
    host_wait_s: host work still running when the passes are done.
  """

  buckets: list[dict[str, float]]
  end_s: float
  total_s: float
  host_wait_s: float = 0.0


def _all_reduce(
  buckets: Sequence[_Bucket],
  ready: np.ndarray,
  n: int,
  wire: _Wire,
  codec_cost: CodecCost | None,
) -> _Comm:
  """The buckets' averages, one after another, each once all have it."""
  out, prev_end, total = [], 0.0, 0.0
  for bucket, bucket_ready in zip(buckets, ready):
    r = float(bucket_ready.max())
    start = max(r, prev_end)
    dur = _average_time(bucket.nbytes, n, wire, codec_cost)
    prev_end = start + dur
    total += dur
    out.append(
      {
        "bytes": float(bucket.nbytes),
        "ready_s": r,
        "start_s": start,
        "end_s": prev_end,
      }
    )
  return _Comm(out, prev_end, total)


def _fixed_step_comm(
  comm: _Comm,
  bwd_end: np.ndarray,
  host: Mapping,
  wire: _Wire,
  grad_bytes: np.ndarray,
  codec_cost: CodecCost | None,
) -> _Comm:
  """The averages where the host's fixed step part was measured.

  The step's fixed part (host work, dispatches and the update program:
  all-reduce and optimizer on every worker) was measured in the trainer's
  own step on this host: it replaces both models, and is added once by
  :func:`simulate`. The update starts when the passes are done and the host
  has prepared it, whichever comes last.
  """
  n = len(bwd_end)
  hidden = host_value(host.get("hidden_host_s") or {n: 0.0}, n)
  host_wait = max(hidden - float(bwd_end.max()), 0.0)
  end = float(bwd_end.max()) + host_wait
  total = 0.0
  if wire.between_processes and n > 1:
    # Processes sharing the host's cores (the profile's contention) whose
    # average also crosses the link: once, whole, after the backward pass,
    # as the trainer's update program runs it.
    assert wire.averager is not None and isinstance(wire.link, Link)
    total = averaging_time(
      wire.averager,
      max(int(sum(grad_bytes) // 4), 1),
      n,
      wire.link,
      codec_cost,
      platform=wire.platform,
    )
  buckets = [dict(comm.buckets[-1], start_s=end, end_s=end + total)]
  return _Comm(buckets, end + total, total, host_wait)


def _critical_path(
  workers: Sequence[SimWorker],
  times: _Timeline,
  ends: np.ndarray,
  opt: np.ndarray,
  comm: _Comm,
  exposed: float,
  overhead: float,
) -> list[str]:
  """What the step time is made of, in order, as lines."""
  slow = int(np.argmax(times.bwd_end))
  last = int(np.argmax(ends))
  name = workers[slow].name
  path = [
    f"{name}: forward {times.fwd_end[slow] * 1e3:.3f} ms",
    f"{name}: backward "
    f"{(times.bwd_end[slow] - times.fwd_end[slow]) * 1e3:.3f} ms",
  ]
  if comm.host_wait_s:
    path.append(
      f"host work that outlasts the pass: {comm.host_wait_s * 1e3:.3f} ms"
    )
  if exposed > 0:
    path.append(
      f"all-reduce after the backward pass: {exposed * 1e3:.3f} ms "
      f"({len(comm.buckets)} bucket(s))"
    )
  if overhead:
    path.append(
      f"the step's fixed part (host work, dispatches, update "
      f"program): {overhead * 1e3:.3f} ms"
    )
  else:
    path.append(f"{workers[last].name}: optimizer {opt[last] * 1e3:.3f} ms")
  return path


def simulate(
  g: graph_lib.ModelGraph,
  workers: Sequence[SimWorker],
  *,
  bucket_bytes: float | None = DEFAULT_BUCKET_BYTES,
  link: tuple[float, float] | Link | None = None,
  shared_host: bool = False,
  costs_cache: dict | None = None,
  averager: Averager | None = None,
  codec_cost: CodecCost | None = None,
  platform: str | None = None,
) -> Prediction:
  """Simulates one synchronous data-parallel step.

  Args:
    g: the model graph.
    workers: the workers, each with its profile and effective precisions.
    bucket_bytes: gradient bucket size; ``None`` for one bucket after the
      backward pass (what :class:`qsync_jax.HybridTrainer` does).
    link: ``(alpha_s, seconds_per_byte)`` of the all-reduce ring, or a
      :class:`~.communication.Link`; by default :func:`cluster_link` of the
      workers' kinds, or the host's fitted model when ``shared_host``.
    shared_host: the workers share one host's cores (see the module
      docstring): fake devices of one process, or, with a ``Link``,
      processes of one host whose average crosses that link (added whole,
      after the backward pass, to the measured update program).
    costs_cache: a dict kept across calls that simulate the same graph and
      profiles (the allocator's search): each worker plan is costed once.

  Returns:
    The :class:`Prediction`.

  Raises:
    ValueError: no workers, or a worker's precisions do not name exactly the
      graph's layers.
    KeyError: a profile lacks a layer or precision.
  """
  if not workers:
    raise ValueError("simulate needs at least one worker")
  n = len(workers)
  costs = _workers_costs(g, workers, n if shared_host else 1, costs_cache)
  host = workers[0].profile.host if shared_host else {}
  wire = _wire(workers, link, shared_host, host, averager, platform)
  # Gradients become ready in reverse layer order.
  order = np.arange(len(g.nodes))[::-1]
  buckets = _buckets(costs[0].grad_bytes[order], bucket_bytes)
  times = _timelines(costs, order, [b.last for b in buckets])
  comm = _all_reduce(buckets, times.ready, n, wire, codec_cost)
  opt = np.array([w.profile.optimizer_s for w in workers])
  fixed = host.get("fixed_step_s", {})
  if shared_host and fixed:
    comm = _fixed_step_comm(
      comm, times.bwd_end, host, wire, costs[0].grad_bytes, codec_cost
    )
    opt = np.zeros(n)
  elif shared_host and n > 1:
    opt = opt * n  # optimizer passes share the host's memory bandwidth
  overhead = host_value(fixed, n) if shared_host and fixed else 0.0
  ends = np.maximum(times.bwd_end, comm.end_s) + opt
  exposed = max(comm.end_s - times.bwd_end.max() - comm.host_wait_s, 0.0)
  return Prediction(
    step_time_s=float(ends.max()) + overhead,
    worker_times_s=[
      float(c.fwd.sum() + c.bwd.sum() + o) for c, o in zip(costs, opt)
    ],
    worker_memory_bytes=[c.memory for c in costs],
    compute_s=[float(v) for v in times.bwd_end],
    comm_s=float(comm.total_s),
    exposed_comm_s=float(exposed),
    critical_path=_critical_path(
      workers, times, ends, opt, comm, exposed, overhead
    ),
    buckets=comm.buckets,
  )


def resolve_plan(
  g: graph_lib.ModelGraph, plan: PrecisionPlan, device_kind: str | None = None
) -> dict[str, Precision]:
  """A plan's effective precision per layer of ``g`` (forced ones applied).

  Raises:
    qsync_jax.PlanError: a rule matches no layer of the model, a rule puts a
      16-bit-floored layer below 16 bits, or ``device_kind`` lacks one of the
      precisions.
  """
  floored = {n.path for n in g.nodes if n.floored}
  effective = rules.resolve_with_forced(g.paths, floored, plan)
  if device_kind is not None:
    PrecisionPlan.from_precisions(effective).validate_for(device_kind, g.paths)
  return effective


def predict(
  g: graph_lib.ModelGraph,
  cluster: ClusterSpec | str,
  plans: Mapping[str, PrecisionPlan],
  profiles: Mapping[str, Profile],
  *,
  bucket_bytes: float | None = DEFAULT_BUCKET_BYTES,
  link: tuple[float, float] | Link | None = None,
  shared_host: bool = False,
  averager: Averager | None = None,
  codec_cost: CodecCost | None = None,
) -> Prediction:
  """Predicts a cluster's step from one plan and one profile per kind.

  Args:
    g: the model graph at the per-worker batch size.
    cluster: e.g. ``"v100:8,t4:8"``.
    plans: ``{kind: PrecisionPlan}``; a kind without a plan runs FP32.
    profiles: ``{kind: Profile}`` (measured or :func:`analytic_profile`).
    bucket_bytes, link, shared_host, averager, codec_cost: see
      :func:`simulate`.

  Raises:
    ValueError: a malformed cluster, a kind without a profile, or a plan for
      a kind the cluster does not have.
    qsync_jax.PlanError: a plan names a layer the model lacks, or a
      precision its device kind lacks.
  """
  cluster = parse_cluster(cluster)
  kinds = cluster.groups()
  stray = [k for k in plans if k not in kinds]
  if stray:
    raise ValueError(
      f"plans for {', '.join(stray)}, which the cluster {cluster} does not have"
    )
  missing = [k for k in kinds if k not in profiles]
  if missing:
    raise ValueError(
      f"no profile for device kind(s) {', '.join(missing)}; "
      "measure one (profile) or derive one (analytic_profile)"
    )
  effective = {
    k: resolve_plan(g, plans.get(k, PrecisionPlan()), k) for k in kinds
  }
  workers = []
  for kind, count in kinds.items():
    workers += [
      SimWorker(f"{kind}[{i}]", profiles[kind], effective[kind])
      for i in range(count)
    ]
  return simulate(
    g,
    workers,
    bucket_bytes=bucket_bytes,
    link=link,
    shared_host=shared_host,
    averager=averager,
    codec_cost=codec_cost,
  )
