"""Tests of the predictor: graph and cascades, casts, timeline, memory."""

import dataclasses
import json

from flax import nnx
import jax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import optax
import pytest

from qsync_jax.numerics.precision import Precision
from qsync_jax.plan import devices
from qsync_jax.plan import policy
from qsync_jax.plan.layers import MatMul
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import analytic
from qsync_jax.predictor import casting
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory
from qsync_jax.predictor import pieces
from qsync_jax.predictor import profiling as profile_lib
from qsync_jax.predictor import roofline
from qsync_jax.predictor import simulation as simulate
from qsync_jax.predictor import timing
from qsync_jax.task import losses

FP32, FP16, BF16, INT8 = (
  Precision.FP32,
  Precision.FP16,
  Precision.BF16,
  Precision.INT8,
)


class Cascade(nnx.Module):
  """proj (no bias) -> scores (q @ q^T) -> norm -> head.

  ``scores`` takes ``proj``'s output directly, so its dtype follows ``proj``;
  ``head`` sits behind a LayerNorm, which computes in float32.
  """

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.proj = nnx.Linear(8, 8, use_bias=False, rngs=rngs)
    self.scores = MatMul()
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def input_spec(self, batch):
    return jax.ShapeDtypeStruct((batch, 4, 8), jnp.float32)

  def __call__(self, x):
    h = self.proj(x)
    s = self.scores("btd,bsd->bts", h, h)
    return self.head(self.norm(s)).mean(1)


@pytest.fixture(scope="module")
def cascade_graph():
  model = Cascade()
  return model, graph_lib.trace_graph(model, model.input_spec(2))


def test_trace_graph_records_flow_shapes_and_gradients(cascade_graph):
  _, g = cascade_graph
  assert g.paths == ["proj", "scores", "head"]
  proj, scores, head = g.nodes
  assert proj.operands[0].producers == (graph_lib.INPUT,)
  assert not proj.operands[0].needs_grad  # the data has no gradient
  assert proj.weight_shape == (8, 8) and proj.out_shape == (2, 4, 8)
  assert [op.producers for op in scores.operands] == [(0,), (0,)]
  assert all(op.needs_grad for op in scores.operands)
  assert scores.weight_shape == () and scores.floored
  assert head.operands[0].producers == (1,)
  assert proj.flops == 2 * 2 * 4 * 8 * 8
  assert scores.flops == 2 * 2 * 4 * 4 * 8


class _Stateful(nnx.Module):
  """Parameters beside batch statistics and dropout RNG state."""

  def __init__(self, rngs=None):
    rngs = rngs or nnx.Rngs(0)
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def input_spec(self, batch):
    return jax.ShapeDtypeStruct((batch, 6, 6, 1), jnp.float32)

  def __call__(self, x):
    h = self.drop(nnx.relu(self.bn(self.conv(x))))
    return self.head(h.mean((1, 2)))


@pytest.mark.parametrize("make", [Cascade, _Stateful])
def test_an_abstract_model_traces_the_same_graph(make):
  # The allocator traces deployment-sized timing models without their weights.
  concrete = graph_lib.trace_graph(make(), make().input_spec(2))
  abstract_model = nnx.eval_shape(make)
  assert isinstance(
    jax.tree.leaves(nnx.state(abstract_model))[0], jax.ShapeDtypeStruct
  )
  abstract = graph_lib.trace_graph(abstract_model, make().input_spec(2))
  assert abstract.num_params == concrete.num_params
  assert [n.to_dict() for n in abstract.nodes] == [
    n.to_dict() for n in concrete.nodes
  ]
  assert abstract.fingerprint() == concrete.fingerprint()


def test_cascade_follows_producers_unless_a_float32_op_intervenes(
  cascade_graph,
):
  _, g = cascade_graph
  _proj, scores, head = g.nodes
  assert all(op.follows for op in scores.operands)
  assert not head.operands[0].follows  # LayerNorm resets to float32
  dts = graph_lib.input_dtypes(g, [FP16, FP32, FP16])
  assert dts == [["float32"], ["float16", "float16"], ["float32"]]
  dts = graph_lib.input_dtypes(g, [INT8, FP16, FP32])  # int8 emits f32
  assert dts[1] == ["float32", "float32"]


def test_predicted_dtypes_match_what_the_model_computes(cascade_graph):
  model, g = cascade_graph
  for precisions in (
    [FP16, FP32, FP32],
    [BF16, FP16, FP32],
    [INT8, BF16, FP16],
    [FP16, FP16, BF16],
  ):
    plan = PrecisionPlan.from_precisions(dict(zip(g.paths, precisions)))
    seen = {}
    copy = nnx.clone(model)
    policy.apply_plan(copy, plan)

    def make_wrapper(i, layer, base, seen=seen):
      li, ri = policy.operand_positions(layer.module)

      def wrapped(*args, **kwargs):
        seen[layer.path] = [str(args[li].dtype), str(args[ri].dtype)]
        return base(*args, **kwargs)

      return wrapped

    policy.instrument(copy, policy.model_layers(copy), make_wrapper)
    jax.eval_shape(copy, model.input_spec(2))
    predicted = graph_lib.input_dtypes(g, precisions)
    assert predicted[1] == seen["scores"], precisions
    assert predicted[0][0] == seen["proj"][0]


def test_casts_are_inserted_where_dtypes_differ(cascade_graph):
  _, g = cascade_graph
  assert [
    c for c in graph_lib.casts(g, [FP16, FP16, FP32]) if c.layer == 1
  ] == []
  c32 = [c for c in graph_lib.casts(g, [FP16, FP32, FP32]) if c.layer == 1]
  assert [(c.src, c.dst, c.numel, c.backward) for c in c32] == [
    ("float16", "float32", 64, True)
  ] * 2
  cb = [c for c in graph_lib.casts(g, [BF16, FP16, FP32]) if c.layer == 1]
  assert {(c.src, c.dst) for c in cb} == {("bfloat16", "float16")}
  first = graph_lib.casts(g, [FP16, FP32, FP32])[0]
  assert (first.layer, first.src, first.dst, first.backward) == (
    0,
    "float32",
    "float16",
    False,
  )


# --------------------------------------------------------------------------
# Hand-made graphs and profiles for the timeline.
# --------------------------------------------------------------------------


def _chain(n_layers: int, weight: int = 256) -> graph_lib.ModelGraph:
  nodes = []
  for i in range(n_layers):
    nodes.append(
      graph_lib.LayerNode(
        path=f"l{i}",
        kind="Linear",
        operands=(graph_lib.Operand((4, 16), (i - 1,), False, i > 0),),
        weight_shape=(weight // 16, 16),
        out_shape=(4, 16),
        flops=1.0,
        floored=False,
      )
    )
  return graph_lib.ModelGraph(tuple(nodes), n_layers * weight, (4, 16))


def _profile(
  g, fwd, bwd, kind="v100", optimizer=0.0, rest=(0.0, 0.0), host=None
):
  layers = {
    n.path: {
      "fp32": (fwd[i], fwd[i] + bwd[i]),
      "fp16": (fwd[i] / 2, (fwd[i] + bwd[i]) / 2),
    }
    for i, n in enumerate(g.nodes)
  }
  zero = casting.CastModel(
    {f"{s}->{d}": (0.0, 0.0) for s, d in casting.cast_pairs()}
  )
  mem = memory.MemoryModel(1000.0, memory.analytic_deltas(g))
  return profile_lib.Profile(
    kind,
    "analytic",
    {},
    layers,
    {"float32": rest, "float16": rest},
    optimizer,
    zero,
    mem,
    host or {},
  )


def _workers(g, prof, n, precision=FP32, name="w"):
  return [
    simulate.SimWorker(f"{name}[{i}]", prof, dict.fromkeys(g.paths, precision))
    for i in range(n)
  ]


def test_buckets_overlap_the_rest_of_the_backward_pass():
  # Three layers, 1 KiB of gradient each; backward runs l2, l1, l0 for 3 s
  # each after a 3 s forward. Buckets of 2 KiB: {l2, l1} ready at t=9,
  # {l0} ready at t=12. Each all-reduce takes 1 + bytes * 0.001 s.
  g = _chain(3)
  prof = _profile(g, [1.0] * 3, [3.0] * 3, optimizer=0.5)
  link = (0.5, 0.001)  # n = 2: time = 2 * alpha + bytes * beta
  pred = simulate.simulate(
    g, _workers(g, prof, 2), bucket_bytes=2048, link=link
  )
  b0, b1 = pred.buckets
  assert b0["bytes"] == 2048 and b0["ready_s"] == pytest.approx(9.0)
  assert b0["start_s"] == pytest.approx(9.0)
  assert b0["end_s"] == pytest.approx(9.0 + 1.0 + 2.048)
  assert b1["ready_s"] == pytest.approx(12.0)
  # The first all-reduce ended (12.048) after the second bucket was ready.
  assert b1["start_s"] == pytest.approx(12.048)
  assert b1["end_s"] == pytest.approx(12.048 + 1.0 + 1.024)
  assert pred.step_time_s == pytest.approx(14.072 + 0.5)
  assert pred.exposed_comm_s == pytest.approx(2.072)
  # One bucket after the backward pass (the trainer's way) overlaps nothing.
  single = simulate.simulate(
    g, _workers(g, prof, 2), bucket_bytes=None, link=link
  )
  assert single.step_time_s == pytest.approx(12.0 + 1.0 + 3.072 + 0.5)
  assert single.step_time_s > pred.step_time_s


def test_hybrid_buckets_wait_for_the_slowest_worker():
  g = _chain(2, weight=512)  # 2 KiB of gradient per layer
  fast = _profile(g, [1.0, 1.0], [1.0, 1.0], optimizer=0.1)
  slow = _profile(g, [2.0, 2.0], [3.0, 3.0], kind="t4", optimizer=0.2)
  workers = _workers(g, fast, 2, name="v100") + _workers(g, slow, 2, name="t4")
  link = (0.0, 0.001)
  pred = simulate.simulate(g, workers, bucket_bytes=2048, link=link)
  # Bucket 0 (l1) is ready at 2+1=3 on v100 and 4+3=7 on t4: starts at 7.
  assert pred.buckets[0]["ready_s"] == pytest.approx(7.0)
  assert pred.buckets[0]["start_s"] == pytest.approx(7.0)
  dur = simulate.ring_allreduce_time(2048, 4, *link)
  assert pred.buckets[1]["start_s"] == pytest.approx(max(7 + dur, 10.0))
  assert pred.step_time_s == pytest.approx(pred.buckets[1]["end_s"] + 0.2)
  assert pred.critical_path[0].startswith("t4[")
  assert pred.worker_times_s[0] == pytest.approx(4.0 + 0.1)
  # Each worker alone would take less than the synchronous step.
  assert max(pred.worker_times_s) < pred.step_time_s


def test_mixed_precision_plan_costs_what_its_layers_cost():
  g = _chain(2)
  prof = _profile(g, [1.0, 2.0], [2.0, 4.0])
  mixed = [simulate.SimWorker("w", prof, {"l0": FP16, "l1": FP32})]
  pred = simulate.simulate(g, mixed, bucket_bytes=None, link=(0, 0))
  assert pred.step_time_s == pytest.approx(1.5 + 6.0)


def _host(fixed=None, hidden=None):
  return {
    "allreduce": [0.0, 0.0],
    **({"fixed_step_s": fixed} if fixed else {}),
    **({"hidden_host_s": hidden} if hidden else {}),
  }


def test_pieces_are_scaled_to_the_measured_uniform_passes():
  # l0, l1 and the head l2 (forced FP32): 3 s each at FP32, 1.5 s at FP16.
  g = _chain(3)
  prof = _profile(g, [1.0] * 3, [2.0] * 3, optimizer=0.3, host=_host())
  # Whole passes: FP32 alone 4.5 s, two at once 6 s; FP16 (head at FP32)
  # 3 s and 4.5 s.
  prof.passes = {"fp32": {1: 4.5, 2: 6.0}, "fp16": {1: 3.0, 2: 4.5}}
  assert simulate.pass_factors(g, prof, 1) == pytest.approx(
    {"fp32": 0.5, "fp16": 0.5}
  )
  # FP16 at k = 2: the head's 3 s at the FP32 factor 2/3 leave 2.5 s for
  # the two FP16 layers' 3 s.
  assert simulate.pass_factors(g, prof, 2) == pytest.approx(
    {"fp32": 2 / 3, "fp16": 2.5 / 3}
  )

  def step(plan, n, shared_host):
    workers = [simulate.SimWorker(f"w{i}", prof, plan) for i in range(n)]
    return simulate.simulate(
      g, workers, bucket_bytes=None, link=(0, 0), shared_host=shared_host
    ).step_time_s

  fp16 = {"l0": FP16, "l1": FP16, "l2": FP32}
  assert step(dict.fromkeys(g.paths, FP32), 1, False) == pytest.approx(4.8)
  assert step(fp16, 1, False) == pytest.approx(3.0 + 0.3)
  mixed = {"l0": FP32, "l1": FP16, "l2": FP32}
  assert step(mixed, 1, False) == pytest.approx(
    3 * 0.5 + 1.5 * 0.5 + 3 * 0.5 + 0.3
  )
  # Two workers on one host: the k = 2 factors, two optimizer passes sharing
  # the memory bandwidth.
  assert step(mixed, 2, True) == pytest.approx(
    3 * 2 / 3 + 1.5 * 2.5 / 3 + 3 * 2 / 3 + 0.6
  )
  # Without passes (analytic profiles) the pieces count as they are.
  prof = dataclasses.replace(prof, passes={})
  assert step(mixed, 1, False) == pytest.approx(3 + 1.5 + 3 + 0.3)
  assert host_interp() == pytest.approx(1.5)


def host_interp():
  return simulate.host_value({1: 1.0, 2: 2.0}, 3) / 2  # beyond: linear


def test_shared_host_adds_the_timed_fixed_step_once():
  g = _chain(1)
  prof = _profile(
    g, [1.0], [2.0], optimizer=9.0, host=_host(fixed={1: 0.25, 2: 0.5})
  )
  two = simulate.simulate(
    g, _workers(g, prof, 2), bucket_bytes=None, shared_host=True
  )
  # The step without its pass (dispatches, host work, the update program)
  # was timed whole: it replaces the all-reduce and the optimizer, once.
  assert two.step_time_s == pytest.approx(3.0 + 0.5)
  assert "fixed part" in two.critical_path[-1]
  assert simulate.host_value({1: 1.0, 4: 4.0}, 2) == pytest.approx(2.0)


def test_a_pass_shorter_than_the_hidden_host_work_costs_the_step_nothing():
  g = _chain(1)
  # One worker's pass takes 3 s; the host prepares the update for 5 s
  # meanwhile, so the update waits for the host, not for the pass.
  prof = _profile(g, [1.0], [2.0], host=_host(fixed={1: 0.25}, hidden={1: 5.0}))
  one = simulate.simulate(
    g, _workers(g, prof, 1), bucket_bytes=None, shared_host=True
  )
  assert one.step_time_s == pytest.approx(5.0 + 0.25)
  assert any(
    "outlasts the pass: 2000.000 ms" in line for line in one.critical_path
  )
  assert one.exposed_comm_s == 0.0
  # A longer pass shows whole: 2 s of hidden work is under its 3 s.
  prof.host["hidden_host_s"] = {1: 2.0}
  longer = simulate.simulate(
    g, _workers(g, prof, 1), bucket_bytes=None, shared_host=True
  )
  assert longer.step_time_s == pytest.approx(3.0 + 0.25)
  assert not any("outlasts" in line for line in longer.critical_path)


def test_step_overhead_fit_finds_the_host_work_a_pass_hides():
  fit = profile_lib.fit_step_overhead
  # step = 1 + max(pass, 2): passes of 1 and 1.5 hide under the host work.
  passes = [1.0, 1.5, 3.0, 4.0]
  steps = [1.0 + max(p, 2.0) for p in passes]
  fixed, hidden = fit(passes, steps)
  assert fixed == pytest.approx(1.0, abs=0.01)
  assert hidden == pytest.approx(2.0, abs=0.01)
  # Every pass longer than any host work: nothing hidden, the fixed part is
  # what each step pays beyond its pass.
  assert fit([3.0, 4.0], [3.5, 4.5]) == pytest.approx((0.5, 0.0))
  # One step and its pass: the step less the pass.
  assert fit([0.8], [2.0]) == pytest.approx((1.2, 0.0))
  # A step faster than its pass (noise) keeps both parts non-negative.
  assert fit([2.0], [1.5]) == pytest.approx((0.0, 0.0))
  with pytest.raises(ValueError, match="as many steps as passes"):
    fit([1.0, 2.0], [1.0])


def test_step_overhead_fit_keeps_the_hidden_work_under_its_bound():
  fit = profile_lib.fit_step_overhead
  # Passes alike in length, steps that do not follow them: unbounded, the
  # fit hides every pass under host work as long as the longest.
  passes, steps = [18.0, 20.0, 22.0], [27.0, 21.7, 24.0]
  assert fit(passes, steps)[1] == pytest.approx(22.0)
  # A step without compute of 3 caps it: no pass hides, the fixed part is
  # the mean excess.
  assert fit(passes, steps, max_hidden=3.0) == pytest.approx(
    (np.mean(np.subtract(steps, passes)), 0.0)
  )
  # Flat steps over short passes: the host work hides them all, up to the
  # bound (a compute-free step shorter than the steps' host work does not
  # pull it down).
  passes = [0.7, 0.7, 0.75, 1.4]
  steps = [2.05, 2.2, 2.05, 2.1]
  fixed, hidden = fit(passes, steps, max_hidden=1.3)
  assert hidden == pytest.approx(1.3, abs=0.01)
  assert fixed + max(1.4, hidden) == pytest.approx(2.17, abs=0.01)
  with pytest.raises(ValueError, match="max_hidden must be non-negative"):
    fit([1.0], [2.0], max_hidden=-1.0)


def test_ring_allreduce_time_follows_alpha_beta():
  assert simulate.ring_allreduce_time(1000, 1, 1.0, 1.0) == 0.0
  assert simulate.ring_allreduce_time(1000, 4, 1e-3, 1e-6) == (
    pytest.approx(6e-3 + 1.5e-3)
  )


def test_cluster_link_uses_the_network_across_kinds():
  _, beta = simulate.cluster_link(["v100"] * 4)
  assert beta == pytest.approx(1 / devices.DEVICES["v100"].link_bandwidth)
  _, beta = simulate.cluster_link(["v100", "t4"])
  assert beta == pytest.approx(
    1 / min(roofline.NETWORK_BANDWIDTH, devices.DEVICES["t4"].link_bandwidth)
  )


# --------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------


def test_unknown_device_kind_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown device kind 'p100'.*a100"):
    devices.device_spec("p100")
  with pytest.raises(ValueError, match="unknown device kind"):
    simulate.cluster_link(["v100", "p100"])
  with pytest.raises(ValueError, match="v100 does not support int8"):
    roofline.sustained_flops(devices.DEVICES["v100"], INT8)


def test_plan_naming_a_missing_layer_is_a_clear_error(cascade_graph):
  _, g = cascade_graph
  prof = _profile(g, [1.0] * 3, [1.0] * 3)
  plan = PrecisionPlan([("conv9", "fp16")])
  with pytest.raises(PlanError, match="conv9"):
    simulate.predict(g, "v100:2", {"v100": plan}, {"v100": prof})
  with pytest.raises(PlanError, match="t4"):
    simulate.predict(
      g, "t4:1", {"t4": PrecisionPlan(default="bf16")}, {"t4": prof}
    )
  with pytest.raises(ValueError, match="no profile for device kind"):
    simulate.predict(g, "v100:1,t4:1", {}, {"v100": prof})
  with pytest.raises(ValueError, match="unknown layer.*nope"):
    simulate.simulate(
      g,
      [
        simulate.SimWorker(
          "w", prof, {"proj": FP32, "scores": FP32, "nope": FP32}
        )
      ],
    )


def test_predict_resolves_forced_precisions(cascade_graph):
  _, g = cascade_graph
  eff = simulate.resolve_plan(g, PrecisionPlan(default="int8"), "t4")
  assert eff == {"proj": INT8, "scores": FP16, "head": FP32}


# --------------------------------------------------------------------------
# Memory, casts and measured profiles (small, on this CPU).
# --------------------------------------------------------------------------


def test_residual_bytes_scale_with_precision(cascade_graph):
  _, g = cascade_graph
  proj = g.nodes[0]
  assert memory.residual_bytes(proj, FP32) == 4 * 64
  assert memory.residual_bytes(proj, FP16) == 2 * (64 + 64)
  assert memory.residual_bytes(proj, INT8) == 64 + 64


def test_analytic_profile_prefers_faster_precisions_on_a_gpu():
  model = qs_models().create_model("cnn", rngs=nnx.Rngs(0))
  g = graph_lib.trace_graph(model, model.input_spec(256))
  t4 = analytic.analytic_profile(g, "t4")
  f32 = sum(t4.layer_cost("conv2", FP32))
  f16 = sum(t4.layer_cost("conv2", FP16))
  assert f16 < f32
  with pytest.raises(ValueError, match="does not support bf16"):
    analytic.analytic_profile(g, "t4", precisions=["bf16"])
  pred = simulate.predict(
    g,
    "v100:2,t4:2",
    {"t4": PrecisionPlan(default="fp16")},
    {"v100": analytic.analytic_profile(g, "v100"), "t4": t4},
  )
  assert len(pred.worker_memory_bytes) == 4 and pred.step_time_s > 0


def qs_models():
  from qsync_jax import models

  return models


@pytest.fixture(scope="module")
def measured_cnn():
  model = qs_models().create_model("cnn", rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).standard_normal((8, 8, 8, 1)).astype(np.float32)
  y = np.zeros((8,), np.int32)
  prof = profile_lib.profile(
    model,
    (x, y),
    precisions=["fp32", "int8"],
    host_devices=jax.devices()[:2],
    repeats=2,
  )
  return model, (x, y), prof


def test_measured_profile_covers_every_piece(measured_cnn, tmp_path):
  _model, _batch, prof = measured_cnn
  assert set(prof.layers) == {"conv1", "conv2", "fc", "head"}
  for per in prof.layers.values():
    assert set(per) == {"fp32", "int8"}
    for f, fb in per.values():
      assert 0 <= f <= fb
  assert set(prof.rest) == {"float32"} and prof.optimizer_s > 0
  assert set(prof.passes) == {"fp32", "int8"}
  for per_k in prof.passes.values():
    assert set(per_k) == {1, 2} and min(per_k.values()) > 0
  assert set(prof.host) == {
    "allreduce",
    "uniform_steps_s",
    "compute_free_pass_s",
    "fixed_step_s",
    "hidden_host_s",
  }
  free = profile_lib.FREE
  assert set(prof.host["uniform_steps_s"]) == {"fp32", "int8", free}
  for k in (1, 2):
    steps = [prof.host["uniform_steps_s"][p][k] for p in ("fp32", "int8")]
    passes = [prof.passes[p][k] for p in ("fp32", "int8")]
    free_step = prof.host["uniform_steps_s"][free][k]
    assert min(steps) > 0 and free_step > 0
    # Zero gradients cost less than the real pass.
    assert prof.host["compute_free_pass_s"][k] < passes[0]
    # The fit reproduces what the profile holds, its hidden work bounded by
    # the compute-free step.
    assert (prof.host["fixed_step_s"][k], prof.host["hidden_host_s"][k]) == (
      pytest.approx(
        profile_lib.fit_step_overhead(passes, steps, max_hidden=free_step)
      )
    )
    assert prof.host["hidden_host_s"][k] <= free_step
  path = str(tmp_path / "p.json")
  prof.save(path)
  again = profile_lib.Profile.load(path)
  assert _plain(again.to_dict()) == _plain(prof.to_dict())


def test_profiles_are_cached(measured_cnn, tmp_path, monkeypatch):
  model, batch, _ = measured_cnn
  first = profile_lib.profile(
    model, batch, precisions=["fp32"], repeats=1, cache_dir=str(tmp_path)
  )
  monkeypatch.setattr(timing, "interleaved", lambda *a, **k: 1 / 0)
  second = profile_lib.profile(
    model, batch, precisions=["fp32"], cache_dir=str(tmp_path)
  )
  assert _plain(second.to_dict()) == _plain(first.to_dict())


def _plain(d):
  return json.loads(json.dumps(d))


def test_predicted_memory_is_close_to_the_compiled_step(measured_cnn):
  model, batch, prof = measured_cnn
  g = graph_lib.trace_graph(model, model.input_spec(8))
  for precisions in (
    {"conv1": INT8, "conv2": FP32, "fc": INT8, "head": FP32},
    {"conv1": FP32, "conv2": INT8, "fc": FP32, "head": FP32},
  ):
    predicted = prof.memory.predict(g.paths, [precisions[p] for p in g.paths])
    measured = memory.compiled_step_bytes(model, precisions, batch)
    assert abs(predicted - measured) / measured < 0.10


def test_cast_model_fit_is_linear_and_positive():
  model = casting.fit_cast_model(
    sizes=(2**12, 2**16, 2**18), pairs=[("float32", "float16")]
  )
  a, _b = model.coefficients["float32->float16"]
  assert a > 0
  assert model.time("float32", "float16", 2**20) > model.time(
    "float32", "float16", 2**12
  )
  assert model.time("float32", "float32", 10**6) == 0.0
  gpu = casting.analytic_cast_model(devices.DEVICES["t4"])
  assert gpu.time("float32", "float16", 1e6) == pytest.approx(
    6e6 / roofline.sustained_bandwidth(devices.DEVICES["t4"])
    + roofline.KERNEL_LAUNCH_S
  )


def test_layer_functions_keep_the_forward_and_differentiate_the_weight(
  cascade_graph,
):
  _, g = cascade_graph
  proj = g.nodes[0]
  fwd, fb = pieces.layer_functions(proj, INT8)
  x = jnp.ones((2, 4, 8))
  w = jnp.ones((8, 8))
  out, grads = fb(x, w, jnp.ones((2, 4, 8)))
  assert out.shape == (2, 4, 8) and len(grads) == 1  # only the weight
  assert grads[0].shape == (8, 8)
  jaxpr = str(jax.make_jaxpr(fwd)(x, w))
  assert "i8" in jaxpr


def test_stand_in_step_has_no_contraction(measured_cnn):
  model, batch, _ = measured_cnn
  g = graph_lib.trace_graph(model, model.input_spec(8))
  _, grad_fn, flat, rest = pieces.stand_in_step_functions(
    model, g, losses.cross_entropy, "float32"
  )
  text = grad_fn.lower(
    flat[None], rest, jnp.ones((1,)), batch, np.zeros(2, np.uint32)
  ).as_text()
  assert "convolution" not in text and "dot_general" not in text


def test_accuracy_check_writes_every_case(tmp_path):
  from experiments.studies import predictor_accuracy as accuracy

  result = accuracy.evaluate(
    ["cnn"],
    model_kwargs={"cnn": {"widths": [4, 8], "hidden": 16}},
    batch_sizes={"cnn": 4},
    workers=(1, 2),
    rounds=1,
    burst=1,
    precisions=("fp32", "fp16", "int8"),
    plan_names=("fp32", "int8/fp16 alternating"),
    log=lambda m: None,
  )
  assert [(c["plan"], c["workers"]) for c in result["cases"]] == [
    ("fp32", 1),
    ("fp32", 2),
    ("int8/fp16 alternating", 1),
    ("int8/fp16 alternating", 2),
  ]
  for c in result["cases"]:
    assert c["predicted_s"] > 0 and c["measured_s"] > 0
    assert c["rel_error"] == pytest.approx(
      (c["predicted_s"] - c["measured_s"]) / c["measured_s"]
    )
  assert result["max_abs_rel_error"] >= result["mean_abs_rel_error"]
  # One phase per worker count, each with its own profile.
  assert set(result["profiles"]["cnn"]) == {"1", "2"}
  assert set(result["profiles"]["cnn"]["2"]["passes"]["fp32"]) == {"1", "2"}
  assert set(result["profiles"]["cnn"]["1"]["passes"]["fp32"]) == {"1"}
  accuracy.plot(result, str(tmp_path / "scatter.png"))
  assert (tmp_path / "scatter.png").stat().st_size > 0


def test_accuracy_check_rejects_an_empty_phase():
  from experiments.studies import predictor_accuracy as accuracy

  with pytest.raises(ValueError, match="plans_per_phase"):
    accuracy.evaluate(["cnn"], workers=(1,), plans_per_phase=0)


class Repeated(nnx.Module):
  """fc1 (on the data) -> fc2 -> fc3, where fc2 and fc3 are the same piece."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.fc1 = nnx.Linear(8, 8, rngs=rngs)
    self.fc2 = nnx.Linear(8, 8, rngs=rngs)
    self.fc3 = nnx.Linear(8, 8, rngs=rngs)
    self.task = "classification"

  def input_spec(self, batch):
    return jax.ShapeDtypeStruct((batch, 8), jnp.float32)

  def __call__(self, x):
    return self.fc3(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(x)))))


def test_uniform_pass_computes_at_its_precision_on_a_copy():
  model = Repeated()
  g = graph_lib.trace_graph(model, model.input_spec(4))
  grad_fn, flat, rest = pieces.pass_function(
    model, g, losses.cross_entropy, INT8
  )
  x = jnp.ones((4, 8), jnp.float32)
  y = jnp.zeros((4,), jnp.int32)
  found = contractions_of(
    grad_fn, flat[None], rest, jnp.ones((1,)), (x, y), np.zeros(2, np.uint32)
  )
  forward = [ops for _, ops, _ in found if ops == ("int8", "int8")]
  # fc1 and fc2 run on int8 operands; the head fc3 keeps FP32.
  assert len(forward) == 2
  assert ("float32", "float32") in [ops for _, ops, _ in found]
  # The model itself still computes at FP32.
  assert set(
    policy.effective_precisions(
      model, PrecisionPlan(), model.input_spec(4)
    ).values()
  ) == {FP32}
  assert all(
    ops != ("int8", "int8")
    for _, ops, _ in contractions_of(lambda v: model(v), x)
  )


def test_layers_with_equal_pieces_are_timed_once():
  model = Repeated()
  g = graph_lib.trace_graph(model, model.input_spec(4))
  fc1, fc2, fc3 = g.nodes
  sig = pieces.piece_signature
  assert sig(fc2) == sig(fc3)
  assert sig(fc1) != sig(fc2)  # fc1's input needs no gradient
  batch = (np.ones((4, 8), np.float32), np.zeros((4,), np.int32))
  job = profile_lib.profile_job(
    model,
    batch,
    g,
    {},
    device=jax.devices()[0],
    device_kind="cpu",
    precisions=[FP32, INT8],
    loss_fn=losses.cross_entropy,
    tx=optax.sgd(0.1),
    host_devices=jax.devices()[:2],
  )
  timed = {k[1] for k in job.calls if k[0] == "layer"}
  assert timed == {"fc1", "fc2"}
  raw = {k: 1e-3 * (i + 1) for i, k in enumerate(job.calls)}
  prof = job.finish(raw)
  assert prof.layers["fc3"] == prof.layers["fc2"] != prof.layers["fc1"]


def _fake_proc_stat(path, ticks):
  user = ticks["total"] - ticks["steal"]
  path.write_text(
    f"cpu  {user} 0 0 0 0 0 0 {ticks['steal']} 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n"
  )


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
  """A fake /proc/stat; ``tick(steal)`` advances it by 10 ticks."""
  stat = tmp_path / "stat"
  ticks = {"total": 0, "steal": 0}
  _fake_proc_stat(stat, ticks)
  monkeypatch.setattr(timing.StealMeter, "PATH", str(stat))

  def tick(steal):
    ticks["total"] += 10
    ticks["steal"] += steal
    _fake_proc_stat(stat, ticks)

  return tick


def test_interleaved_repeats_a_burst_the_hypervisor_stole_from(fake_cpu):
  import time

  calls = []

  def fn():
    calls.append(1)
    if len(calls) == 3:  # the first timed burst loses half the CPU
      time.sleep(0.5)  # far above any clean call, even on a loaded host
    fake_cpu(5 if len(calls) == 3 else 0)
    return jnp.zeros(())

  meter = timing.StealMeter()
  assert meter.available
  t = timing.interleaved(
    {"a": fn},
    rounds=1,
    burst=1,
    retries=3,
    subtract_overhead=False,
    meter=meter,
  )
  assert len(calls) == 4  # two warm-up calls, the stolen burst, its retry
  assert t["a"] < 0.25  # the clean attempt counts, not the stolen one
  assert meter.overall_fraction == pytest.approx(5 / 20)


def test_interleaved_gives_up_on_retries_when_steal_persists(fake_cpu):
  calls = []

  def fn():
    calls.append(1)
    fake_cpu(5)
    return jnp.zeros(())

  t = timing.interleaved(
    {"a": fn}, rounds=2, burst=1, retries=2, subtract_overhead=False
  )
  assert len(calls) == 2 + 2 * 3 and t["a"] >= 0


def test_steal_meter_without_proc_stat_counts_nothing(monkeypatch):
  monkeypatch.setattr(timing.StealMeter, "PATH", "/nonexistent/stat")
  meter = timing.StealMeter()
  assert not meter.available
  assert meter.fraction_since(meter.mark()) == 0.0


def test_steal_meter_needs_the_steal_column(tmp_path, monkeypatch):
  stat = tmp_path / "stat"
  stat.write_text("cpu  1 2 3 4\n")  # an old kernel: no steal column
  monkeypatch.setattr(timing.StealMeter, "PATH", str(stat))
  assert not timing.StealMeter().available


class _ReadsItsWeights(nnx.Module):
  """A model whose constructor needs its weights' values."""

  def __init__(self):
    self.fc = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.scale = float(jnp.abs(self.fc.kernel[...]).max())


def test_without_weights_is_abstract_unless_the_model_needs_values():
  from qsync_jax import models

  abstract = models.without_weights(Cascade)
  assert isinstance(
    jax.tree.leaves(nnx.state(abstract))[0], jax.ShapeDtypeStruct
  )
  built = models.without_weights(_ReadsItsWeights)
  assert isinstance(built.fc.kernel[...], jax.Array) and built.scale > 0


def test_placeholder_weights_build_a_model_that_reads_them_for_real():
  from qsync_jax import models

  model = models.placeholder_weights(_ReadsItsWeights)
  assert model.scale > 0 and np.any(np.asarray(model.fc.kernel[...]))
