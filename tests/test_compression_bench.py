"""Tests for experiments.benches.compression on tiny sizes.

The fake-device runs use the 4 CPU devices conftest.py gives every test
process; the multi-process smoke test starts 2 localhost processes through
the repository's launcher, which kills them all on failure or timeout.
"""

import json
import time

import numpy as np
import pytest

from experiments.benches import compression as cb

SIZE = 4096
FIELDS = {
  "setting",
  "strategy",
  "num_elements",
  "num_workers",
  "time_s",
  "rounds_s",
  "cpu_s",
  "calls_per_round",
  "wire_bytes",
  "rel_error",
  "time_vs_fp32",
}


def by_strategy(report, setting):
  return {
    r["strategy"]: r for r in report["results"] if r["setting"] == setting
  }


def check_measured(results, n):
  for name, r in results.items():
    assert "error" not in r, (name, r["error"])
    assert FIELDS <= set(r), (name, sorted(r))
    assert r["num_elements"] == SIZE and r["num_workers"] == n
    assert r["time_s"] > 0 and len(r["rounds_s"]) == 1
  # The float32 mean is exact up to float32 rounding; quantizers are not.
  assert results["none"]["rel_error"] < 1e-6
  assert 1e-4 < results["gqsgd"]["rel_error"] < 0.5
  assert results["none"]["time_vs_fp32"] == 1.0
  fp32 = results["none"]["wire_bytes"]
  assert fp32 == pytest.approx(2 * (n - 1) / n * 4 * SIZE)
  assert results["gqsgd"]["wire_bytes"] / fp32 == pytest.approx(0.25, rel=1e-2)


def test_fake_devices_report_schema_and_errors():
  report = cb.run([SIZE], repeats=1, settings=["fake_devices"], num_workers=4)
  json.dumps(report)  # JSON-ready
  assert set(report) == {
    "settings",
    "results",
    "gqsgd_vs_fp32_time_ratio_16M_fake_devices",
    "gqsgd_vs_fp32_time_ratio_16M_multiprocess",
  }
  # 16M floats were not measured: no headline ratio.
  assert report["gqsgd_vs_fp32_time_ratio_16M_fake_devices"] is None
  info = report["settings"]
  assert info["sizes"] == [SIZE] and info["repeats"] == 1
  assert info["num_workers"] == 4 and info["jax_version"]
  results = by_strategy(report, "fake_devices")
  assert set(results) == set(cb.STRATEGIES)
  check_measured(results, 4)
  assert results["gqsgd_int16"]["rel_error"] < results["gqsgd"]["rel_error"]
  assert (
    cb.time_ratio(report["results"], "fake_devices", "gqsgd", SIZE)
    == results["gqsgd"]["time_vs_fp32"]
  )


def test_a_failing_strategy_is_recorded_and_the_run_goes_on():
  # Exponential dithering needs a power-of-two number of workers.
  report = cb.run(
    [SIZE],
    repeats=1,
    settings=["fake_devices"],
    num_workers=3,
    strategies=["none", "gqsgd_exp", "gqsgd"],
  )
  results = by_strategy(report, "fake_devices")
  assert "power-of-two" in results["gqsgd_exp"]["error"]
  assert "time_s" not in results["gqsgd_exp"]
  assert results["gqsgd"]["rel_error"] > 0
  assert results["none"]["rel_error"] < 1e-6


def test_donated_inputs_give_the_same_averages():
  names = ["none", "gqsgd"]
  kept = by_strategy(
    cb.run([SIZE], repeats=2, settings=["fake_devices"], strategies=names),
    "fake_devices",
  )
  donated = cb.run(
    [SIZE], repeats=2, settings=["fake_devices"], strategies=names, donate=True
  )
  assert donated["settings"]["donate"] is True
  results = by_strategy(donated, "fake_devices")
  for name in names:
    assert "error" not in results[name], results[name]["error"]
    assert len(results[name]["rounds_s"]) == 2
    # Same data and noise: the donated program computes the same mean.
    assert results[name]["rel_error"] == kept[name]["rel_error"]


def test_a_donating_program_takes_its_input_buffer():
  import jax
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from qsync_jax.parallel import averagers

  mesh = Mesh(np.array(jax.devices()[:2]), (cb.AXIS,))
  sharding = NamedSharding(mesh, P(cb.AXIS))
  x = jax.device_put(np.ones((2, SIZE), np.float32), sharding)
  w = jax.device_put(np.full(2, 0.5, np.float32), sharding)
  averager = averagers.make_averager("none")
  kept = x.copy()
  cb.all_reduce_fn(averager, mesh)(kept, w).block_until_ready()
  assert not kept.is_deleted()
  given = x.copy()
  out = cb.all_reduce_fn(averager, mesh, donate=True)(given, w)
  np.testing.assert_array_equal(np.asarray(out), np.ones((2, SIZE)))
  assert given.is_deleted()


def test_bad_arguments():
  with pytest.raises(ValueError, match="settings"):
    cb.run([SIZE], settings=["gpu"])
  with pytest.raises(ValueError, match=r"unknown strategy\(s\) \['int4'\]"):
    cb.run([SIZE], settings=["fake_devices"], strategies=["int4"])
  with pytest.raises(ValueError, match="sizes"):
    cb.run([0], settings=["fake_devices"])
  with pytest.raises(ValueError, match="multiprocess setting only"):
    cb.run([SIZE], settings=["fake_devices"], parts=True)
  with pytest.raises(ValueError, match="include both"):
    cb.run([SIZE], settings=["multiprocess"], strategies=["gqsgd"], parts=True)
  with pytest.raises(ValueError, match="CPU devices"):
    cb.run([SIZE], repeats=1, settings=["fake_devices"], num_workers=64)


def test_data_shares_a_component_and_the_exact_mean_is_float64():
  a, b = cb.worker_data(SIZE, 0), cb.worker_data(SIZE, 1)
  assert a.dtype == np.float32 and not np.array_equal(a, b)
  np.testing.assert_array_equal(a, cb.worker_data(SIZE, 0))
  assert np.corrcoef(a, b)[0, 1] > 0.1
  exact = cb.exact_mean(SIZE, 2)
  assert exact.dtype == np.float64
  np.testing.assert_allclose(exact, (a.astype(np.float64) + b) / 2)
  assert cb.calls_per_round(1 << 20) == 4 and cb.calls_per_round(1 << 24) == 1


def test_multiprocess_smoke():
  start = time.monotonic()
  report = cb.run(
    [SIZE],
    repeats=1,
    settings=["multiprocess"],
    num_workers=2,
    strategies=["none", "gqsgd", "gqsgd_exp"],
    timeout_s=90,
    parts=True,
  )
  elapsed = time.monotonic() - start
  print(f"2-process compression bench took {elapsed:.1f} s")
  results = by_strategy(report, "multiprocess")
  assert set(results) == {"none", "gqsgd", "gqsgd_exp", *cb.PARTS}
  check_measured({k: results[k] for k in ("none", "gqsgd")}, 2)
  assert "error" not in results["gqsgd_exp"]
  assert report["settings"]["wall_s"]["multiprocess"] > 0
  # The parts were timed across both processes, after the strategies.
  for name in cb.PARTS:
    part = results[name]
    assert "error" not in part, (name, part["error"])
    assert part["part"] is True and part["num_workers"] == 2
    assert part["time_s"] > 0 and part["time_vs_fp32"] > 0
  assert report["settings"]["parts"] == list(cb.PARTS)
  (floor,) = report["gqsgd_floor"]
  t = {name: r["time_s"] for name, r in results.items()}
  assert floor["num_elements"] == SIZE
  assert floor["floor_s"] == pytest.approx(
    t["allreduce_int8"] + 2 * t["bucket_absmax"] + t["scale_f32"]
  )
  assert floor["floor_vs_fp32"] == pytest.approx(floor["floor_s"] / t["none"])
  cpu = {name: r["cpu_s"] for name, r in results.items()}
  assert floor["cpu_floor_vs_fp32"] == pytest.approx(
    (cpu["allreduce_int8"] + 2 * cpu["bucket_absmax"] + cpu["scale_f32"])
    / cpu["none"]
  )
  assert floor["parts_sum_vs_whole"] == pytest.approx(
    (t["gqsgd_passes"] + t["allreduce_int8"]) / t["gqsgd"]
  )
  (overlap,) = report["overlap"]
  shorter = min(t["allreduce_int8"], t["compute"])
  for key, together in (
    ("dispatched", "allreduce_int8_then_compute"),
    ("one_program", "allreduce_int8_with_compute"),
    ("threaded", "allreduce_int8_beside_compute"),
  ):
    assert overlap[f"{key}_s"] == t[together]
    assert overlap[f"hidden_{key}"] == pytest.approx(
      (t["allreduce_int8"] + t["compute"] - t[together]) / shorter
    )
  beside = t["gqsgd_beside_compute"]
  assert overlap["gqsgd_threaded_s"] == beside
  assert overlap["gqsgd_threaded_cpu_s"] == cpu["gqsgd_beside_compute"]
  assert overlap["hidden_gqsgd_threaded"] == pytest.approx(
    (t["gqsgd"] + t["compute"] - beside) / min(t["gqsgd"], t["compute"])
  )
