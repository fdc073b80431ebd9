"""--config.cluster=auto: jax device kinds to catalog kinds, specs from devices."""

import json
import os
import subprocess
import sys
import types

import jax
import pytest

from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan import devices as devices_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "device_kind, kind",
  [
    ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("Tesla V100-SXM2-32GB", "v100"),
    ("Tesla V100-PCIE-16GB", "v100"),
    ("Tesla V100S-PCIE-32GB", "v100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A10", "a10"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA H200", "h200"),
    ("cpu", "cpu"),
  ],
)
def test_device_kind_strings_map_to_catalog_kinds(device_kind, kind):
  assert devices_lib.device_kind_of(device_kind) == kind


def test_every_mapped_kind_is_in_the_device_table():
  kinds = {kind for _, kind in devices_lib.DEVICE_KIND_PATTERNS}
  assert kinds <= set(devices_lib.device_kinds())


def test_jax_cpu_devices_are_cpu():
  assert {devices_lib.device_kind_of(d) for d in jax.devices()} == {"cpu"}


@pytest.mark.parametrize(
  "name", ["NVIDIA B200", "Tesla K80", "NVIDIA L40", "NVIDIA A10G", ""]
)
def test_unknown_device_kind_is_one_line_listing_the_kinds(name):
  with pytest.raises(ValueError) as info:
    devices_lib.device_kind_of(name)
  message = str(info.value)
  assert "\n" not in message
  assert f"unknown device kind {name!r}" in message
  assert ", ".join(devices_lib.device_kinds()) in message
  assert "DEVICE_KIND_PATTERNS" in message


def test_object_without_device_kind_is_rejected():
  with pytest.raises(ValueError, match="no_kind.*device_kind"):
    devices_lib.device_kind_of(types.SimpleNamespace(name="no_kind"))


def _fake(device_kind, platform="gpu"):
  return types.SimpleNamespace(device_kind=device_kind, platform=platform)


def test_cluster_from_devices_keeps_worker_order():
  devices = [
    _fake("Tesla V100-SXM2-16GB"),
    _fake("Tesla T4"),
    _fake("Tesla V100-SXM2-16GB"),
    _fake("NVIDIA L4"),
  ]
  spec = cluster_lib.cluster_from_devices(devices)
  assert spec.kinds == ("v100", "t4", "v100", "l4")
  # The spec string keeps the order; str() would merge the v100 groups.
  text = cluster_lib.cluster_string(spec)
  assert text == "v100:1,t4:1,v100:1,l4:1"
  assert cluster_lib.parse_cluster(text) == spec


def test_cluster_from_devices_reads_cpu_platform_and_jax_devices():
  assert cluster_lib.cluster_from_devices(
    [_fake("anything", platform="cpu")]
  ).kinds == ("cpu",)
  assert cluster_lib.cluster_from_devices().kinds == ("cpu",) * len(
    jax.devices()
  )


def test_cluster_from_devices_errors():
  with pytest.raises(ValueError, match="empty device list"):
    cluster_lib.cluster_from_devices([])
  with pytest.raises(ValueError, match="unknown device kind 'Tesla K80'"):
    cluster_lib.cluster_from_devices([_fake("Tesla T4"), _fake("Tesla K80")])


def test_resolve_cluster_auto_reads_devices_and_parses_the_rest():
  devices = [_fake("NVIDIA H100 80GB HBM3")] * 2
  assert cluster_lib.resolve_cluster(" AUTO ", devices).kinds == ("h100",) * 2
  assert cluster_lib.resolve_cluster("t4:2", devices).kinds == ("t4",) * 2


def test_main_job_with_cluster_auto_trains_on_the_cpu_devices(tmp_path):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_NUM_CPU_DEVICES"] = "2"  # the devices "auto" finds
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # tiny program: compile fast
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={tmp_path}",
      "--config.cluster=auto",
      "--config.plan_mode=manual",
      "--config.steps=2",
      "--config.batch_size=4",
      "--config.eval_every=0",
      "--config.checkpoint_every=0",
      "--config.log_every=1",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["cluster"] == "cpu:2"
  assert [w["kind"] for w in summary["workers"]] == ["cpu", "cpu"]
  assert summary["steps"] == 2
