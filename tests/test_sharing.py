"""Planning once for several processes: sites, shared profiles, shared plans.

Processes are threads here, sharing an in-memory store with the blocking
``get`` of the coordination service; tests/test_launchers.py runs the same
path across real processes under ``mpirun``.
"""

import dataclasses
import threading
import types

from flax import nnx
import numpy as np
import pytest

from qsync_jax import models
from qsync_jax import predictor
from qsync_jax.allocation import job_plans
from qsync_jax.allocation import sharing
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import coordination


class _Store:
  """The coordination service's key-value store, for threads."""

  def __init__(self):
    self.items, self.cond = {}, threading.Condition()

  def key_value_set(self, key, value):
    with self.cond:
      assert key not in self.items, f"{key} set twice"
      self.items[key] = value
      self.cond.notify_all()

  def blocking_key_value_get(self, key, timeout_ms):
    with self.cond:
      if not self.cond.wait_for(
        lambda: key in self.items, timeout=timeout_ms / 1000
      ):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.items[key]


def _run(n, fn):
  """``fn(process_index)`` on n threads; (results, errors) by index."""
  results, errors = [None] * n, [None] * n

  def body(i):
    try:
      results[i] = fn(i)
    except Exception as e:  # pylint: disable=broad-except
      errors[i] = e

  threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  return results, errors


def _device(kind_name, process, platform="gpu", i=0):
  return types.SimpleNamespace(
    device_kind=kind_name, platform=platform, process_index=process, id=i
  )


def test_sites_measure_each_kind_on_its_first_device_of_that_kind():
  t4a, t4b = _device("Tesla T4", 1, i=2), _device("Tesla T4", 1, i=3)
  v100 = _device("Tesla V100-SXM2-16GB", 0)
  spec = parse_cluster("v100:1,t4:2")
  sites = sharing.profile_sites(spec, [v100, t4a, t4b])
  assert sites == {"v100": v100, "t4": t4a}
  assert sharing.describe_sites(sites)["t4"].startswith("measured on process 1")
  # A spec naming GPUs the run lacks (CPUs run them): the catalog.
  cpus = [_device("cpu", 0, "cpu"), _device("cpu", 1, "cpu")]
  assert sharing.profile_sites(parse_cluster("v100:1,t4:1"), cpus) == {
    "v100": None,
    "t4": None,
  }
  assert sharing.describe_sites({"t4": None}) == {"t4": "analytic"}
  # "measured": on whatever device runs the kind; "analytic": never.
  assert sharing.profile_sites(
    parse_cluster("v100:1,t4:1"), cpus, "measured"
  ) == {"v100": cpus[0], "t4": cpus[1]}
  assert sharing.profile_sites(spec, [v100, t4a, t4b], "analytic") == {
    "v100": None,
    "t4": None,
  }


@pytest.mark.parametrize(
  "cluster,devices,source,message",
  [
    (
      "cpu:1,t4:1",
      [_device("Tesla T4", 0), _device("Tesla T4", 0)],
      "auto",
      "cannot profile cpu: no device of that kind runs in this job, and "
      r"the GPU catalog \(a10, .*\) has no figures for it",
    ),
    (
      "cpu:1,t4:1",
      [_device("cpu", 0, "cpu"), _device("Tesla T4", 0)],
      "analytic",
      "cannot profile cpu: analytic profiles were asked for",
    ),
    (
      "t4:1",
      [_device("Tesla T4", 0)],
      "sometimes",
      "unknown profile source 'sometimes'; valid: auto, measured, analytic",
    ),
    (
      "t4:2",
      [_device("Tesla T4", 0)],
      "auto",
      "cluster t4:2 has 2 workers but 1 devices were given",
    ),
  ],
)
def test_sites_reject_what_cannot_be_profiled(
  cluster, devices, source, message
):
  with pytest.raises(ValueError, match=message):
    sharing.profile_sites(parse_cluster(cluster), devices, source)


@pytest.fixture(scope="module")
def graph():
  model = models.build_model("cnn", rngs=nnx.Rngs(0))
  return predictor.trace_graph(model, model.input_spec(4))


def _fake_measure(graph, calls, process, fail=None):
  """A measured profile: the v100 figures, stamped with the kind measured."""

  def measure(kind, device, local):
    calls.append((process, kind, device.id, len(local)))
    if kind == fail:
      raise RuntimeError("out of memory")
    return dataclasses.replace(
      predictor.analytic_profile(graph, "v100"),
      device_kind=kind,
      source="measured",
    )

  return measure


def test_every_process_measures_its_kinds_and_gets_all_profiles(graph):
  spec = parse_cluster("v100:1,t4:2,a100:1")
  devices = [
    _device("Tesla V100-SXM2-16GB", 0, i=0),
    _device("Tesla T4", 1, i=1),
    _device("Tesla T4", 1, i=2),
    _device("cpu", 1, "cpu", i=3),
  ]  # a100 is not present
  sites = sharing.profile_sites(spec, devices)
  store, calls = _Store(), []
  results, errors = _run(
    2,
    lambda p: sharing.gather_profiles(
      graph,
      spec,
      devices,
      sites,
      _fake_measure(graph, calls, p),
      store=store,
      process_index=p,
      timeout_s=30,
    ),
  )
  assert errors == [None, None]
  # Each kind measured once, by its own process, with its local devices.
  assert sorted(calls) == [(0, "v100", 0, 1), (1, "t4", 1, 2)]
  for profiles in results:
    assert list(profiles) == ["v100", "t4", "a100"]
    assert {k: p.source for k, p in profiles.items()} == {
      "v100": "measured",
      "t4": "measured",
      "a100": "analytic",
    }
    assert profiles["t4"].device_kind == "t4"
  assert results[0]["t4"].to_dict() == results[1]["t4"].to_dict()
  # One process: no store, every site local.
  calls.clear()
  alone = sharing.gather_profiles(
    graph,
    spec,
    [_device("Tesla V100-SXM2-16GB", 0)] * 4,
    {"v100": devices[0], "t4": None, "a100": None},
    _fake_measure(graph, calls, 0),
  )
  assert calls == [(0, "v100", 0, 1)] and alone["t4"].source == "analytic"


def test_a_process_that_cannot_profile_ends_every_process(graph):
  spec = parse_cluster("v100:1,t4:1")
  devices = [
    _device("Tesla V100-SXM2-16GB", 0, i=0),
    _device("Tesla T4", 1, i=1),
  ]
  sites = sharing.profile_sites(spec, devices)
  store = _Store()
  _, errors = _run(
    2,
    lambda p: sharing.gather_profiles(
      graph,
      spec,
      devices,
      sites,
      _fake_measure(graph, [], p, fail="t4"),
      store=store,
      process_index=p,
      timeout_s=30,
    ),
  )
  for e in errors:
    assert isinstance(e, coordination.CoordinationError)
    assert str(e).startswith("process 1 could not profile t4 on ")
    assert str(e).endswith("RuntimeError: out of memory")


def test_process_0_allocates_once_and_shares_the_plans():
  plans = {"t4": PrecisionPlan([(r"conv\d", "int8")]), "v100": PrecisionPlan()}
  store, calls = _Store(), []

  def allocate():
    calls.append(1)
    return plans

  results, errors = _run(
    3,
    lambda p: sharing.plan_once(
      allocate, store=store, process_index=p, timeout_s=30
    ),
  )
  assert errors == [None] * 3 and calls == [1]
  digests = {sharing.plans_digest(r) for r in results}
  assert digests == {sharing.plans_digest(plans)}
  assert sharing.plans_digest({"t4": PrecisionPlan()}) not in digests

  def no_plan():
    raise ValueError("no plan fits t4 in 1 GiB")

  failing = _Store()
  _, errors = _run(
    2,
    lambda p: sharing.plan_once(
      no_plan, store=failing, process_index=p, timeout_s=30
    ),
  )
  assert [str(e) for e in errors] == [
    "process 0 could not allocate plans: ValueError: no plan fits t4 in 1 GiB"
  ] * 2
  with pytest.raises(
    coordination.CoordinationError,
    match=r"process 0 did not share its plans within 1 s "
    r"\(process 1 waited\)",
  ):
    sharing.plan_once(allocate, store=_Store(), process_index=1, timeout_s=1)


def test_the_timing_batch_is_what_the_timing_model_takes():
  from qsync_jax import data

  digits = data.load_dataset("digits")
  kwargs = digits.model_kwargs()
  # The CNN as deployed (32 x 32 x 3): random inputs of its spec, the
  # dataset's labels, repeated past the dataset's length.
  wide = models.build_model(
    "cnn",
    rngs=nnx.Rngs(0),
    data_kwargs={**kwargs, "image_size": 32, "in_channels": 3},
  )
  x, y = job_plans.timing_batch(wide, digits, 16)
  assert x.shape == (16, 32, 32, 3) and x.dtype == np.float32
  np.testing.assert_array_equal(y, digits.y_train[:16])
  # The trained twin takes the dataset's examples themselves.
  twin = models.build_model("cnn", rngs=nnx.Rngs(0), data_kwargs=kwargs)
  n = len(digits.x_train)
  x, y = job_plans.timing_batch(twin, digits, n + 3)
  np.testing.assert_array_equal(x[n:], digits.x_train[:3])
  np.testing.assert_array_equal(y[:n], digits.y_train)
