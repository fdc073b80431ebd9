"""Tests of the comm-aware predictor: links, bytes moved, codec cost, sync.

On the 4 fake CPU devices conftest.py gives every test process; the
emulated-link path (the bench under the launcher) is in tests/test_links.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_predictor import _chain
from test_predictor import _profile
from test_predictor import _workers

from qsync_jax.allocation import sync_methods
from qsync_jax.parallel import averagers
from qsync_jax.predictor import communication as comm
from qsync_jax.predictor import simulation

NAMES = ["none", "fp16", "bf16", "gqsgd", "gqsgd_exp", "qsgd", "powersgd"]
SIZE = 1 << 12


def test_link_parses_the_launcher_strings():
  link = comm.Link.parse("1gbit", "1ms", "shared")
  assert link.bandwidth == pytest.approx(1.25e8)
  # The launcher's latency is one way to the switch: a step is twice it.
  assert link.latency_s == pytest.approx(2e-3)
  assert link.topology == "shared"
  with pytest.raises(ValueError, match="topology"):
    comm.Link.parse("1gbit", topology="ring")
  with pytest.raises(ValueError, match="link rate"):
    comm.Link.parse("fast")
  with pytest.raises(ValueError, match="bandwidth"):
    comm.Link(0.0)


def test_link_from_a_record_prefers_the_measured_rate():
  record = {
    "link": "1gbit",
    "rate_bps": 1e9,
    "measured_bps": 9.5e8,
    "latency_s": 0.0,
    "topology": "per_node",
  }
  assert comm.Link.from_record(record).bandwidth == pytest.approx(9.5e8 / 8)
  del record["measured_bps"]
  assert comm.Link.from_record(record).bandwidth == pytest.approx(1.25e8)


def test_a_shared_link_multiplies_the_wire_time_by_the_workers():
  per_node = comm.Link(1e8, topology="per_node")
  shared = comm.Link(1e8, topology="shared")
  assert per_node.wire_time(1e6, 4) == pytest.approx(0.01)
  assert shared.wire_time(1e6, 4) == pytest.approx(0.04)


@pytest.mark.parametrize("name", NAMES)
def test_traced_collectives_match_the_averagers_wire_bytes(name):
  averager = averagers.make_averager(name)
  traffic = comm.traffic_of(comm.traced_collectives(averager, SIZE, 4), 4)
  assert traffic.bytes == pytest.approx(averager.wire_bytes(SIZE, 4))
  assert traffic.steps > 0


def test_cpu_widens_bf16_to_float32_but_keeps_fp16():
  fp32 = averagers.make_averager("none").wire_bytes(SIZE, 4)
  bf16 = comm.averager_traffic(
    averagers.make_averager("bf16"), SIZE, 4, platform="cpu"
  )
  fp16 = comm.averager_traffic(
    averagers.make_averager("fp16"), SIZE, 4, platform="cpu"
  )
  assert bf16.widening == 2.0 and bf16.bytes == pytest.approx(fp32)
  assert fp16.widening == 1.0 and fp16.bytes == pytest.approx(fp32 / 2)
  # On the run's own devices, at the run's size, the same.
  exact = comm.averager_traffic(
    averagers.make_averager("bf16"), SIZE, 4, devices=jax.devices()[:4]
  )
  assert exact.bytes == pytest.approx(fp32)
  # A platform not present keeps its types (NCCL sums bf16 natively).
  gpu = comm.averager_traffic(
    averagers.make_averager("bf16"), SIZE, 4, platform="gpu"
  )
  assert gpu.bytes == pytest.approx(fp32 / 2)


def test_hlo_collectives_count_gathers_and_tuples_per_worker():
  hlo = "\n".join(
    [
      "  %ag = s8[4,128,512]{2,1,0} all-gather(%x), dimensions={0}",
      "  %ar = (f32[8]{0}, s8[16]{0}) all-reduce(%a, %b), to_apply=%sum",
      "  %cp = u8[1,64]{1,0} collective-permute(%c), source_target_pairs={}",
      "  %add = f32[8]{0} add(%a, %a)",
    ]
  )
  found = comm.hlo_collectives(hlo, 4)
  assert [(c.kind, c.operand_bytes, c.dtype) for c in found] == [
    ("all_gather", 128 * 512, "s8"),
    ("all_reduce", 32, "f32"),
    ("all_reduce", 16, "s8"),
    ("permute", 64, "u8"),
  ]
  traffic = comm.traffic_of(found, 4)
  assert traffic.bytes == pytest.approx(3 * 128 * 512 + 1.5 * 48 + 64)
  assert traffic.steps == 3 + 6 + 6 + 1


def test_permutes_of_pairwise_swaps_are_exchanges():
  hlo = "\n".join(
    [
      "  %a = u8[64]{0} collective-permute(%c), "
      "source_target_pairs={{0,1},{1,0},{2,3},{3,2}}",
      "  %b = u8[64]{0} collective-permute(%c), "
      "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
    ]
  )
  assert [c.kind for c in comm.hlo_collectives(hlo, 4)] == [
    "exchange",
    "permute",
  ]
  assert comm.permute_kind([(0, 2), (2, 0)]) == "exchange"
  assert comm.permute_kind([(0, 1)]) == "permute"
  assert comm.permute_kind([]) == "permute"
  # Global-QSGD's exponential merges swap codes between pairs of workers.
  exp = averagers.make_averager("gqsgd_exp")
  traced = comm.traced_collectives(exp, 1 << 12, 4)
  assert [c.kind for c in traced if c.dtype == "uint8"] == ["exchange"] * 2
  compiled = comm.compiled_collectives(exp, 1 << 12, jax.devices()[:4])
  assert [c.kind for c in compiled if c.dtype == "u8"] == ["exchange"] * 2


def test_codec_cost_fit_recovers_a_line():
  cost = comm.CodecCost.fit([1000, 2000, 4000], [0.003, 0.005, 0.009])
  assert cost.a_s == pytest.approx(1e-3) and cost.b_s == pytest.approx(2e-6)
  assert cost(10_000) == pytest.approx(0.021)
  with pytest.raises(ValueError, match="distinct sizes"):
    comm.CodecCost.fit([1000, 1000], [0.1, 0.2])


def test_local_program_has_no_collectives_and_keeps_the_codes():
  averager = averagers.make_averager("gqsgd")
  fn = comm.local_program(averager, SIZE, 4)
  jaxpr = jax.make_jaxpr(fn)(jnp.ones(SIZE), jnp.float32(0.25))
  names = {e.primitive.name for e in jaxpr.jaxpr.eqns}
  assert not names & set(comm.COLLECTIVE_PRIMITIVES)
  # The psum of codes became codes * n: one worker's mean is n x its share.
  x = jnp.asarray(np.random.default_rng(0).standard_normal(SIZE), jnp.float32)
  mean = fn(x, jnp.float32(0.25))
  assert mean.shape == (SIZE,)
  np.testing.assert_allclose(np.asarray(mean), np.asarray(x), atol=0.3)


def test_codec_is_fitted_at_the_size_and_a_quarter_on_the_sample():
  from qsync_jax.predictor import codec

  assert codec.fit_sizes(1 << 24) == [1 << 22, 1 << 24]
  assert codec.fit_sizes(5) == [2, 5]
  sample = np.array([1.0, -2.0, 3.0], np.float32)
  np.testing.assert_array_equal(
    codec.sample_data(sample, 7), [1, -2, 3, 1, -2, 3, 1]
  )
  assert codec.sample_data(None, 1000).std() == pytest.approx(1, abs=0.1)
  with pytest.raises(ValueError, match="empty"):
    codec.sample_data(np.zeros(0), 4)
  cost = comm.profile_codec(
    averagers.make_averager("fp16"),
    4096,
    num_workers=4,
    repeats=1,
    calls=1,
    sample=sample,
  )
  assert cost.sizes == (1024, 4096)
  # The exponential merges' partner codes come from outside the program:
  # were they the worker's own codes, XLA would simplify the merge away.
  exp = comm.local_program(averagers.make_averager("gqsgd_exp"), 1024, 4)
  jaxpr = jax.make_jaxpr(exp)(jnp.ones(1024), jnp.float32(0.25))
  assert "pure_callback" in str(jaxpr)


@pytest.mark.parametrize("name", ["bf16", "gqsgd"])
def test_a_sums_stand_in_keeps_the_passes_on_its_two_sides_apart(name):
  """XLA fuses nothing across an all-reduce: the bfloat16 mean converts
  before it and after it (XLA:CPU sums in float32), Global-QSGD encodes
  before and decodes after. The stand-in is a conditional's branch, which
  XLA keeps apart as well, so the local program has as many passes."""
  fn = comm.local_program(averagers.make_averager(name), 1024, 4)
  x = jnp.asarray(np.random.default_rng(1).standard_normal(1024), jnp.float32)
  hlo = fn.lower(x, jnp.float32(0.25)).compile().as_text()
  entry = hlo[hlo.index("ENTRY") :]
  assert " conditional(" in entry
  # The sum of n workers' equal shares: n x (w x), here x itself.
  np.testing.assert_allclose(
    np.asarray(fn(x, jnp.float32(0.25))),
    np.asarray(x),
    atol=0.3 if name == "gqsgd" else 0.02,
  )


def test_over_the_mesh_the_workers_meet_at_each_collective():
  """Over real workers, each stand-in waits for an all-reduce (a meeting),
  so a worker's time includes waiting for the slowest: of one element where
  the operands are large, of the whole operands where they are small."""
  from jax.sharding import Mesh

  from qsync_jax.predictor import codec

  mesh = Mesh(np.array(jax.devices()[:4]), ("w",))
  size = 1 << 19  # 2 MiB of float32, 512 KiB of int8 codes: both large
  # (averager, one-element meetings, whole-operand ones).
  for name, one, whole in [
    ("none", 1, 0),
    ("gqsgd", 1, 1),
    ("qsgd", 1, 1),
    ("gqsgd_exp", 2, 1),
    ("powersgd", 0, 2),
  ]:
    averager = averagers.make_averager(name)
    fn = codec.local_program(averager, size, 4, mesh)
    x = jnp.asarray(
      np.random.default_rng(2).standard_normal((4, size)), jnp.float32
    )
    w = jnp.full((4,), 0.25, jnp.float32)
    hlo = fn.lower(x, w).compile().as_text()
    found = [
      (c.kind, c.operand_bytes)
      for c in comm.hlo_collectives(hlo, 4)
      if c.kind == "all_reduce"
    ]
    # Only meetings are left, no large sum, and XLA keeps each of them (a
    # flag it could fold would let the workers meet before the encode).
    assert all(b <= codec.SMALL_COLLECTIVE_BYTES for _, b in found), found
    assert sum(b == 4 for _, b in found) == one, (name, found)
    assert sum(b > 4 for _, b in found) == whole, (name, found)
    # No gather; a permute's stand-in is a permute of each worker to itself,
    # which moves nothing over the link.
    assert "all-gather" not in hlo, name
    pairs = re.findall(
      r"collective-permute\(.*source_target_pairs=\{(.*?)\}\}", hlo
    )
    assert len(pairs) == (2 if name == "gqsgd_exp" else 0), (name, pairs)
    assert all(p == "{0,0},{1,1},{2,2},{3,3" for p in pairs), pairs
    # Run small: on fake devices of one process the host callback of the
    # gather's stand-in can deadlock at large sizes (not across processes,
    # one device each, as the bench runs them).
    small = codec.local_program(averager, 1024, 4, mesh)
    assert small(x[:, :1024], w).shape == (4, 1024)
  # Each worker draws its own noise, as in the real run; alone, worker 0's.
  gqsgd = averagers.make_averager("gqsgd")
  x, w = jnp.ones((4, 1024)), jnp.full((4,), 0.25)
  assert "axis_index" in str(
    jax.make_jaxpr(codec.local_program(gqsgd, 1024, 4, mesh))(x, w)
  )
  assert "axis_index" not in str(
    jax.make_jaxpr(codec.local_program(gqsgd, 1024, 4))(x[0], w[0])
  )
  out = codec.local_program(averagers.make_averager("none"), 64, 4, mesh)(
    jnp.ones((4, 64)), jnp.full((4,), 0.25)
  )
  np.testing.assert_allclose(np.asarray(out), 1.0)  # n x (w x) each
  cost = comm.profile_codec(
    averagers.make_averager("gqsgd"), 4096, mesh=mesh, repeats=1, calls=1
  )
  assert cost.sizes == (1024, 4096) and len(cost.seconds) == 2
  with pytest.raises(ValueError, match="a device, a mesh or host devices"):
    comm.profile_codec(
      averagers.make_averager("none"), 4096, jax.devices()[0], mesh=mesh
    )
  with pytest.raises(ValueError, match="mesh of 2 devices"):
    codec.local_program(averagers.make_averager("none"), 64, 2, mesh)


def test_only_collectives_not_timed_in_the_codec_are_priced():
  """A small collective is met in full in the mesh's encode/decode program,
  so the bench prices only the others."""
  from experiments.benches import compression_cases
  from qsync_jax.predictor import codec

  small = comm.Collective("all_reduce", codec.SMALL_COLLECTIVE_BYTES, "f32")
  large = comm.Collective("all_reduce", codec.SMALL_COLLECTIVE_BYTES + 1, "f32")
  assert codec.timed_in_codec(small.operand_bytes)
  assert not codec.timed_in_codec(large.operand_bytes)
  assert compression_cases.priced([small, large, small]) == [large]


def test_workers_sharing_a_host_encode_at_once():
  """With ``host_devices`` each call runs one worker's program on every
  device (the workers of one host contend for its cores), and waits for
  all."""
  from qsync_jax.predictor import codec

  devices = jax.devices()[:2]
  ((fn, args),) = codec.codec_programs(
    averagers.make_averager("none"), [64], host_devices=devices, num_workers=4
  )
  outs = fn(*args)
  assert [o.devices() for o in outs] == [{d} for d in devices]
  for o in outs:  # n x (w x) on each worker
    np.testing.assert_allclose(
      np.asarray(o), np.asarray(codec.sample_data(None, 64)), rtol=1e-6
    )
  cost = comm.profile_codec(
    averagers.make_averager("gqsgd"),
    4096,
    host_devices=devices,
    num_workers=4,
    repeats=1,
    calls=1,
  )
  assert cost.sizes == (1024, 4096) and min(cost.seconds) > 0
  with pytest.raises(ValueError, match="host_devices is empty"):
    codec.codec_programs(averagers.make_averager("none"), [64], host_devices=[])
  with pytest.raises(ValueError, match="not several"):
    codec.codec_programs(
      averagers.make_averager("none"), [64], devices[0], host_devices=devices
    )


def test_profile_codec_times_every_averager():
  for name in ["gqsgd_exp", "qsgd", "powersgd"]:
    cost = comm.profile_codec(
      averagers.make_averager(name),
      [1024, 4096],
      num_workers=4,
      repeats=1,
      calls=1,
    )
    assert cost.sizes == (1024, 4096)
    assert all(t > 0 for t in cost.seconds)
  with pytest.raises(ValueError, match="sizes >= 2"):
    comm.profile_codec(averagers.make_averager("none"), [1, 8])


def test_the_trainers_average_is_profiled_with_its_feedback_and_state():
  """With ``error_feedback`` the program is the trainer's average: it reads
  the residual and the averager's (warm) state and returns both, so their
  passes are timed; without it, the averager's own call."""
  from jax.sharding import Mesh

  from qsync_jax.predictor import codec

  mesh = Mesh(np.array(jax.devices()[:4]), ("w",))
  psgd = averagers.make_averager("powersgd", rank=2)
  x = jnp.asarray(
    np.random.default_rng(3).standard_normal((4, 4096)), jnp.float32
  )
  w = jnp.full((4,), 0.25, jnp.float32)
  state = jnp.ones((4, *averagers.init_state(psgd, 4096).shape))
  mean, residual, new_state = codec.local_program(
    psgd, 4096, 4, mesh, error_feedback=True
  )(x, w, 0.1 * x, state)
  assert mean.shape == residual.shape == (4, 4096)
  assert new_state.shape == state.shape
  # Without feedback there is no residual in or out; the state still is.
  mean, new_state = codec.local_program(
    psgd, 4096, 4, mesh, error_feedback=False
  )(x, w, None, state)
  assert mean.shape == (4, 4096) and new_state.shape == state.shape
  # One worker alone, and a stateless averager: mean and residual.
  alone = codec.local_program(
    averagers.make_averager("gqsgd"), 4096, 4, error_feedback=True
  )(x[0], w[0], x[0], None)
  assert [o.shape for o in alone] == [(4096,), (4096,)]
  for ef in (None, False, True):
    cost = comm.profile_codec(
      psgd, 4096, mesh=mesh, repeats=1, calls=1, error_feedback=ef
    )
    assert cost.sizes == (1024, 4096) and min(cost.seconds) > 0


def test_launched_processes_profile_the_encode_decode_together():
  """Each averager is profiled by the processes of one launched run, over
  their mesh; a process that fails fails the call with its exit code."""
  from qsync_jax.predictor import codec_processes

  costs = codec_processes.profile_codecs_in_processes(
    {
      "mean": averagers.make_averager("none"),
      "gqsgd": averagers.make_averager("gqsgd"),
    },
    4096,
    2,
    repeats=1,
    calls=1,
    error_feedback={"gqsgd": True},
    timeout_s=300,
  )
  assert set(costs) == {"mean", "gqsgd"}
  for cost in costs.values():
    assert cost.sizes == (1024, 4096)
    assert all(t > 0 for t in cost.seconds)
  # Exponential dithering merges pairwise: three workers cannot run it.
  with pytest.raises(RuntimeError, match="in 3 processes failed"):
    codec_processes.profile_codecs_in_processes(
      {"exp": averagers.make_averager("gqsgd_exp")},
      4096,
      3,
      repeats=1,
      calls=1,
      timeout_s=300,
    )
  with pytest.raises(ValueError, match=">= 2 elements"):
    codec_processes.profile_codecs_in_processes(
      {"mean": averagers.make_averager("none")}, 1, 2
    )
  with pytest.raises(ValueError, match="not profiled"):
    codec_processes.profile_codecs_in_processes(
      {"mean": averagers.make_averager("none")},
      4096,
      2,
      error_feedback={"gqsgd": True},
    )


def test_averaging_time_adds_wire_latency_and_codec():
  link = comm.Link(1e8, latency_s=1e-4)
  averager = averagers.make_averager("gqsgd")
  codec = comm.CodecCost(0.001, 1e-9)
  t = comm.averaging_time(averager, SIZE, 4, link, codec, platform="cpu")
  traffic = comm.averager_traffic(averager, SIZE, 4, platform="cpu")
  assert t == pytest.approx(
    traffic.bytes / 1e8 + traffic.steps * 1e-4 + 0.001 + 1e-9 * SIZE
  )
  assert comm.averaging_time(averager, SIZE, 1, link, codec) == 0.0
  fp32 = comm.averaging_time(
    averagers.make_averager("none"), 1 << 20, 4, comm.Link(1.25e8)
  )
  gq = comm.averaging_time(averager, 1 << 20, 4, comm.Link(1.25e8))
  assert gq == pytest.approx(fp32 / 4, rel=0.01)


def test_simulate_prices_buckets_with_the_averager():
  g = _chain(3, weight=1 << 14)
  prof = _profile(g, [1e-3] * 3, [1e-3] * 3)
  workers = _workers(g, prof, 4)
  tuple_link = (1e-5, 1 / 1.25e8)
  today = simulation.simulate(g, workers, bucket_bytes=None, link=tuple_link)
  # No averager: today's ring model, unchanged.
  assert today.comm_s == pytest.approx(
    simulation.ring_allreduce_time(4 * 3 * (1 << 14), 4, *tuple_link)
  )
  link = comm.Link(1.25e8, latency_s=1e-5)
  fp32 = simulation.simulate(g, workers, bucket_bytes=None, link=link)
  assert fp32.comm_s == pytest.approx(today.comm_s)
  gq = simulation.simulate(
    g,
    workers,
    bucket_bytes=None,
    link=link,
    averager=averagers.make_averager("gqsgd"),
  )
  assert gq.comm_s < 0.3 * fp32.comm_s
  codec = comm.CodecCost(0.05, 0.0)
  slow = simulation.simulate(
    g,
    workers,
    bucket_bytes=None,
    link=link,
    averager=averagers.make_averager("gqsgd"),
    codec_cost=codec,
  )
  assert slow.comm_s == pytest.approx(gq.comm_s + 0.05)


def test_sync_comparison_amortizes_local_steps_and_recommends_the_fastest():
  g = _chain(3, weight=1 << 16)
  prof = _profile(g, [1e-3] * 3, [1e-3] * 3)
  link = comm.Link.parse("100mbit")
  cmp = sync_methods.compare_sync(
    g,
    "v100:4",
    {},
    {"v100": prof},
    link,
    period=8,
    total_steps=64,
    averager_names=["none", "gqsgd"],
  )
  by = {(o.method, o.averager): o for o in cmp.options}
  assert len(by) == 6
  local = by["local", "none"]
  assert local.averages_per_step == pytest.approx(1 / 8)
  compute = simulation.predict(
    g, "v100:4", {}, {"v100": prof}, link=(0.0, 0.0)
  ).step_time_s
  assert local.step_time_s == pytest.approx(compute + local.averaging_s / 8)
  # QSR's periods grow as the learning rate decays: fewer averages.
  assert by["qsr", "none"].averages_per_step < 1 / 8
  assert by["dp", "gqsgd"].step_time_s < by["dp", "none"].step_time_s
  assert cmp.recommended == min(cmp.options, key=lambda o: o.step_time_s)
  assert cmp.recommended.method == "qsr"
  out = cmp.to_dict()
  assert out["recommended"]["method"] == "qsr"
  assert any("accuracy is not modelled" in n for n in out["notes"])
  assert "recommended: qsr" in cmp.table()
  with pytest.raises(ValueError, match="unknown averager"):
    sync_methods.compare_sync(
      g, "v100:4", {}, {"v100": prof}, link, averager_names=["zip"]
    )


def test_profiled_collectives_price_each_kind_and_type():
  from qsync_jax.predictor import collective_cost as cc

  devices = jax.devices()[:4]
  cost = cc.profile_collectives(
    [
      ("all_reduce", "s8"),
      ("all_reduce", "f32"),
      ("permute", "u8"),
      ("exchange", "u8"),
    ],
    devices,
    sizes=(1 << 12, 1 << 16),
    repeats=1,
    calls=1,
  )
  assert set(cost.fits) == {
    ("all_reduce", "s8"),
    ("all_reduce", "f32"),
    ("permute", "u8"),
    ("exchange", "u8"),
  }
  assert all(
    len(f.seconds) == 2 and min(f.seconds) > 0 for f in cost.fits.values()
  )
  gqsgd = averagers.make_averager("gqsgd")
  found = comm.compiled_collectives(gqsgd, 1 << 14, devices)
  assert {(c.kind, c.dtype) for c in found} == {
    ("all_reduce", "f32"),
    ("all_reduce", "s8"),
  }
  expected = sum(cost.fits[(c.kind, c.dtype)](c.operand_bytes) for c in found)
  assert cost(found) == pytest.approx(expected)
  link = comm.Link(1e6)  # Unused: the measured collectives replace it.
  assert comm.averaging_time(
    gqsgd, 1 << 14, 4, link, measured=cost, collectives=found
  ) == pytest.approx(expected)
  with pytest.raises(ValueError, match="no measured cost for a all_gather"):
    cost([comm.Collective("all_gather", 8.0, "s8")])
  with pytest.raises(ValueError, match="needs the averager.s compiled"):
    comm.averaging_time(gqsgd, 1 << 14, 4, link, measured=cost)
  # Floating operands are the sample's w_i x_i in their type; integer
  # codes are ones.
  sample = np.array([4.0, -8.0, 1e-6], np.float32)
  np.testing.assert_array_equal(
    cc._operand(np.dtype(np.float16), 4, sample, 4),
    np.array([1.0, -2.0, 2.5e-7, 1.0], np.float16),
  )
  np.testing.assert_array_equal(
    cc._operand(np.dtype(np.int8), 3, sample, 4), np.ones(3, np.int8)
  )
  with pytest.raises(ValueError, match="valid kinds"):
    cc.profile_collectives([("all_to_all", "f32")], devices)
  with pytest.raises(ValueError, match="two distinct sizes"):
    cc.profile_collectives([("all_reduce", "f32")], devices, sizes=(8, 8))
