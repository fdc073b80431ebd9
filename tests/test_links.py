"""Tests for qsync_jax.launch.links: parsing, namespaces, the launcher.

Parsing and the no-root refusal run anywhere. The rest builds real network
namespaces, tc qdiscs and cgroups, so it needs root and iproute2 and skips
with the reason otherwise. Every test checks that nothing it made remains.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from qsync_jax.launch import link_probe
from qsync_jax.launch import links
from qsync_jax.launch import local

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = links.unavailable_reason()
needs_root = pytest.mark.skipif(REASON is not None, reason=str(REASON))


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
  )
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # Tiny programs: fast compiles.
  return env


def _launcher(*args):
  return [sys.executable, "-m", "qsync_jax.distributed", *args]


def _tbfs(ns, dev):
  """The tbf qdiscs on ``dev``'s egress in namespace ``ns``, with statistics
  (``tc -s``; the rate in bytes/s)."""
  out = subprocess.run(
    ["tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev", dev],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  return [q for q in json.loads(out) if q["kind"] == "tbf"]


def _tbf(ns, dev, rate_bps):
  """The one tbf on ``dev`` in ``ns``, checked to shape at ``rate_bps``."""
  tbfs = _tbfs(ns, dev)
  assert len(tbfs) == 1, (ns, dev, tbfs)
  assert tbfs[0]["options"]["rate"] == pytest.approx(rate_bps / 8), (ns, dev)
  return tbfs[0]


def _assert_carried(tbf, rate_bps, seconds=0.5):
  """``tbf`` carried a flow measured at ``rate_bps`` over ``seconds`` (its
  payload bytes, at least)."""
  assert tbf["bytes"] >= rate_bps * seconds / 8, tbf


def _assert_shaped(tbf, rate_bps, seconds=0.5):
  """``tbf`` carried the flow and held it back to its rate: the bottleneck."""
  _assert_carried(tbf, rate_bps, seconds)
  assert tbf["overlimits"] + tbf["drops"] > 0, tbf


def _assert_nothing_left(tag):
  assert links.leftovers(tag) == []
  netns = subprocess.run(
    ["ip", "netns", "list"], capture_output=True, text=True, check=True
  ).stdout
  host_links = subprocess.run(
    ["ip", "link"], capture_output=True, text=True, check=True
  ).stdout
  name = f"{links.PREFIX}{tag}"
  assert name not in netns and name not in host_links


def test_parse_rate_and_latency():
  assert links.parse_rate("1gbit") == 1e9
  assert links.parse_rate("100mbit") == 1e8
  assert links.parse_rate(" 10Gbit ") == 1e10
  assert links.parse_rate("2.5kbit") == 2500
  for bad in ("fast", "1gb", "1 gigabit", "-1gbit", "0mbit", "gbit", ""):
    with pytest.raises(ValueError, match="link rate"):
      links.parse_rate(bad)
  assert links.parse_duration("1ms") == pytest.approx(1e-3)
  assert links.parse_duration("250us") == pytest.approx(250e-6)
  assert links.parse_duration("2s") == 2.0
  assert links.parse_duration("0") == 0.0
  for bad in ("1", "ms", "1h", "-1ms", "fast"):
    with pytest.raises(ValueError, match="latency"):
      links.parse_duration(bad)


def test_parse_cpu_quota_and_spec():
  assert links.parse_cpu_quota("1.0,1,0.5,0.5", 4) == (1.0, 1.0, 0.5, 0.5)
  with pytest.raises(ValueError, match="one value per process"):
    links.parse_cpu_quota("1,1", 4)
  with pytest.raises(ValueError, match="positive"):
    links.parse_cpu_quota("1,0", 2)
  with pytest.raises(ValueError, match="numbers of CPUs"):
    links.parse_cpu_quota("1,half", 2)
  spec = links.LinkSpec.parse("1Gbit", "1ms", "shared", "1,0.5", 2)
  assert spec == links.LinkSpec("1gbit", 1e9, 1e-3, "shared", (1.0, 0.5))
  with pytest.raises(ValueError, match="topology"):
    links.LinkSpec.parse("1gbit", topology="ring")
  with pytest.raises(ValueError, match="number of processes"):
    links.LinkSpec.parse("1gbit", cpu_quota="1,1")
  with pytest.raises(ValueError, match="num_processes"):
    links.LinkEmulator(0, spec)
  with pytest.raises(ValueError, match="cpu quota has 2 values"):
    links.LinkEmulator(3, spec)


def test_env_round_trip():
  spec = links.LinkSpec.parse("100mbit", "0", "per_node", "1,0.5", 2)
  emulator = links.LinkEmulator(2, spec, tag=12345)
  assert emulator.namespace(1) == f"{links.PREFIX}12345p1"
  assert emulator.address(0) == "10.77.0.1"
  assert links.link_info_from_env({}) is None
  info = links.link_info_from_env(emulator.env(9.5e7))
  assert info == {
    "link": "100mbit",
    "rate_bps": 1e8,
    "latency_s": 0.0,
    "topology": "per_node",
    "measured_bps": 9.5e7,
    "cpu_quota": [1.0, 0.5],
  }
  assert links.link_info_from_env(emulator.env())["measured_bps"] is None


def test_without_root_one_line_and_non_zero(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  assert "needs root" in links.unavailable_reason()
  with pytest.raises(links.LinkUnavailableError, match="needs root"):
    links.LinkEmulator(2, links.LinkSpec.parse("1gbit")).__enter__()
  monkeypatch.undo()
  # The command, as a user without root (geteuid patched before it runs).
  code = (
    "import os, runpy, sys; os.geteuid = lambda: 1000; "
    "sys.argv = ['qsync_jax.distributed', '--num_processes=2', "
    "'--link=1gbit', '--', 'true']; "
    "runpy.run_module('qsync_jax.distributed', run_name='__main__')"
  )
  p = subprocess.run(
    [sys.executable, "-c", code],
    env=_env(),
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert p.returncode == 1
  assert p.stderr.strip().splitlines() == [
    "error: link emulation needs root (network namespaces and tc)"
  ]


@needs_root
def test_two_namespaces_measured_rate_and_teardown():
  spec = links.LinkSpec.parse("100mbit")
  with links.LinkEmulator(2, spec) as emulator:
    tag = emulator.tag
    assert set(links.leftovers(tag)) >= {
      emulator.namespace(0),
      emulator.bridge_ns,
    }
    # Both ends of every veth shaped at the rate.
    for i in range(2):
      _tbf(emulator.namespace(i), "eth0", 1e8)
      _tbf(emulator.bridge_ns, f"v{i}", 1e8)
    measured = emulator.measure_rate(0.5)
    # The flow from process 0 to 1 went through the tbfs on its path: the
    # sender's egress, which held it to the rate, and the bridge's port to
    # the receiver (which the first already keeps under its rate).
    _assert_shaped(_tbfs(emulator.namespace(0), "eth0")[0], measured)
    _assert_carried(_tbfs(emulator.bridge_ns, "v1")[0], measured)
    # Loose: a loaded host may send slower, never faster.
    assert 0 < measured <= 1.15e8
    # Inside: loopback up, the process's address, the hostname mapped to it.
    out = subprocess.run(
      emulator.wrap(1, ["sh", "-c", "ip -4 addr; cat /etc/hosts"]),
      capture_output=True,
      text=True,
      check=True,
    ).stdout
    assert "inet 127.0.0.1/8" in out and "inet 10.77.0.2/24" in out
    assert "10.77.0.2 " in out
  _assert_nothing_left(tag)


@needs_root
def test_shared_topology_is_one_bottleneck():
  rates, shapers = {}, {}
  for topology in ("shared", "per_node"):
    spec = links.LinkSpec.parse("100mbit", topology=topology)
    with links.LinkEmulator(4, spec) as emulator:
      br = emulator.bridge_ns
      if topology == "shared":
        # One tbf, on the ifb every bridge port's ingress is redirected to;
        # the veths are not rate-limited.
        for i in range(4):
          assert _tbfs(emulator.namespace(i), "eth0") == []
          assert _tbfs(br, f"v{i}") == []
          filters = subprocess.run(
            ["tc", "-n", br, "filter", "show", "dev", f"v{i}", "ingress"],
            capture_output=True,
            text=True,
            check=True,
          ).stdout
          assert "mirred" in filters and "ifb0" in filters, filters
        _tbf(br, "ifb0", 1e8)
      else:
        # Each process's own link: a tbf at the rate on both veth ends.
        for i in range(4):
          _tbf(emulator.namespace(i), "eth0", 1e8)
          _tbf(br, f"v{i}", 1e8)
      # Two flows between disjoint pairs at once.
      rates[topology] = link_probe.measure_rates(
        [
          (
            emulator.namespace(s),
            emulator.namespace(s + 1),
            emulator.address(s + 1),
          )
          for s in (0, 2)
        ]
      )
      if topology == "shared":
        shapers[topology] = [_tbfs(br, "ifb0")[0]]
      else:
        shapers[topology] = [
          _tbfs(emulator.namespace(s), "eth0")[0] for s in (0, 2)
        ]
      tag = emulator.tag
    _assert_nothing_left(tag)
  # Shared: both flows through the one tbf, which held them back; per node:
  # each flow through its sender's own.
  _assert_shaped(shapers["shared"][0], sum(rates["shared"]))
  for tbf, rate in zip(shapers["per_node"], rates["per_node"]):
    _assert_shaped(tbf, rate)
  # Loose: together no faster than the one link (a loaded host may be
  # slower; FIFO tbf is not fair between flows, so only the sum).
  assert 0 < sum(rates["shared"]) <= 1.15e8, rates


@needs_root
def test_cpu_quota_throttles_the_process():
  spec = links.LinkSpec.parse("1gbit", cpu_quota="0.1", num_processes=1)
  busy = (
    "import time; s=time.time()\n"
    "while time.time()-s<1: pass\n"
    "print(time.process_time())"
  )
  with links.LinkEmulator(1, spec) as emulator:
    out = subprocess.run(
      emulator.wrap(0, [sys.executable, "-c", busy]),
      capture_output=True,
      text=True,
      check=True,
    ).stdout
    cgroup = os.path.dirname(emulator._cgroup_procs[0])
    stat = dict(line.split() for line in open(os.path.join(cgroup, "cpu.stat")))
    tag = emulator.tag
  assert float(out) < 0.25  # 0.1 CPU for a second, plus start-up slack.
  assert int(stat["nr_throttled"]) > 0
  _assert_nothing_left(tag)


@needs_root
def test_stale_names_of_a_dead_launcher_are_removed():
  dead = subprocess.Popen(["true"])
  dead.wait()
  spec = links.LinkSpec.parse("1gbit")
  emulator = links.LinkEmulator(1, spec, tag=dead.pid)
  emulator.__enter__()
  emulator._made.clear()  # As if the launcher had died by SIGKILL.
  emulator.teardown()
  assert links.leftovers(dead.pid)
  removed = links.remove_stale()
  assert set(links.leftovers(dead.pid)) == set()
  assert emulator.namespace(0) in removed
  _assert_nothing_left(dead.pid)


@needs_root
def test_launcher_runs_the_bench_over_the_link(tmp_path):
  out = tmp_path / "bench.json"
  p = subprocess.Popen(
    _launcher(
      "--num_processes=2",
      "--link=100mbit",
      "--timeout_s=150",
      "--",
      sys.executable,
      "-m",
      "experiments.compression_bench",
      "--sizes=524288",
      "--repeats=1",
      "--strategies=none,gqsgd",
      f"--out={out}",
    ),
    env=_env(),
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  _stdout, stderr = p.communicate(timeout=180)
  assert p.returncode == 0, stderr[-3000:]
  assert "link: 100mbit per_node, measured" in stderr
  report = json.loads(out.read_text())
  link = report["settings"]["link"]
  assert link["link"] == "100mbit" and link["topology"] == "per_node"
  # Loose (the tests above check the shaping): a loaded host may send
  # slower, never faster.
  assert 0 < link["measured_bps"] <= 1.15e8, link
  assert report["settings"]["num_workers"] == 2
  assert "gqsgd_vs_fp32_time_ratio_16M_per_node_100mbit" in report
  rows = [r for r in report["results"] if r["setting"] == "multiprocess"]
  assert {r["strategy"] for r in rows} == {"none", "gqsgd"}
  assert all("error" not in r and r["num_workers"] == 2 for r in rows)
  # The predictor's times beside the measured one: the compiled program's
  # collectives as timed alone on the link, or its bytes over the measured
  # rate, each plus the codec profiled in the same run. The small ones
  # (Global-QSGD's scales) are timed in the codec, and priced no more.
  for r in rows:
    assert r["predicted_s"] > 0 and r["codec_s"] >= 0
    assert r["predicted_s"] == pytest.approx(r["collectives_s"] + r["codec_s"])
    assert r["predicted_link_s"] == pytest.approx(r["wire_s"] + r["codec_s"])
  mean, gqsgd = sorted(rows, key=lambda r: r["strategy"] != "none")
  assert mean["collectives_in_codec"] == 0
  assert mean["wire_s"] == pytest.approx(
    mean["moved_bytes"] * 8 / link["measured_bps"]
  )
  assert gqsgd["collectives_in_codec"] == 1
  assert 0 < gqsgd["wire_s"] < gqsgd["moved_bytes"] * 8 / link["measured_bps"]
  assert set(rows[0]["collective_fits"]) | set(rows[1]["collective_fits"]) == {
    "all_reduce f32",
    "all_reduce s8",
  }
  # Not measured at the headline size (16M): no error figure yet.
  assert report["predicted_vs_measured_max_rel_error"] is None
  assert report["predicted_link_vs_measured_max_rel_error"] is None
  _assert_nothing_left(p.pid)


@needs_root
def test_a_failing_child_still_tears_down(capsys):
  spec = links.LinkSpec.parse("100mbit", cpu_quota="1,0.5", num_processes=2)
  exit_3_on_1 = (
    "import os, sys; sys.exit(3 if os.environ"
    "['QSYNC_PROCESS_ID'] == '1' else 0)"
  )
  with links.LinkEmulator(2, spec) as emulator:
    code = local.launch(
      [sys.executable, "-c", exit_3_on_1],
      2,
      env={**os.environ, **emulator.env()},
      coordinator_host=emulator.address(0),
      wrap=emulator.wrap,
      timeout_s=60,
    )
    tag = emulator.tag
  assert code == 3
  assert "process 1" in capsys.readouterr().err
  _assert_nothing_left(tag)


@needs_root
def test_sigterm_to_the_launcher_tears_down():
  p = subprocess.Popen(
    _launcher("--num_processes=2", "--link=100mbit", "--", "sleep", "60"),
    env=_env(),
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    # The probe's line comes once the links exist; then the processes start.
    assert "measured" in p.stderr.readline()
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
  finally:
    p.kill()
    p.communicate()
  _assert_nothing_left(p.pid)
