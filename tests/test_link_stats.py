"""Tests for the bytes counted on emulated links (``--link_stats``).

The delta arithmetic and the flag's need of ``--link`` run anywhere. The
rest builds real network namespaces, so it needs root and iproute2 and
skips with the reason otherwise.
"""

import json
import os
import subprocess
import sys

import pytest

from qsync_jax.launch import links

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = links.unavailable_reason()
needs_root = pytest.mark.skipif(REASON is not None, reason=str(REASON))

#: Sends 3 MB from process 1 to process 0 over the emulated link.
_SEND = r"""
import os, socket, time
pid = int(os.environ["QSYNC_PROCESS_ID"])
host, port = os.environ["QSYNC_COORDINATOR_ADDRESS"].rsplit(":", 1)
port = int(port) + 1
if pid == 0:
  s = socket.create_server(("", port))
  c, _ = s.accept()
  n = 0
  while True:
    b = c.recv(1 << 16)
    if not b:
      break
    n += len(b)
  assert n == 3_000_000, n
else:
  for _ in range(100):
    try:
      c = socket.create_connection((host, port))
      break
    except OSError:
      time.sleep(0.1)
  c.sendall(b"x" * 3_000_000)
  c.close()
"""


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
  )
  return env


def test_byte_delta():
  before = [{"sent_bytes": 10, "received_bytes": 5}]
  after = [{"sent_bytes": 25, "received_bytes": 7}]
  assert links.byte_delta(before, after) == [
    {"sent_bytes": 15, "received_bytes": 2}
  ]
  with pytest.raises(ValueError):
    links.byte_delta(before, after * 2)


def test_link_stats_needs_link(tmp_path):
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=1",
      f"--link_stats={tmp_path / 'stats.json'}",
      "--",
      sys.executable,
      "-c",
      "pass",
    ],
    capture_output=True,
    text=True,
    env=_env(),
  )
  assert p.returncode != 0
  assert "--link_stats" in p.stderr and "--link" in p.stderr
  assert not (tmp_path / "stats.json").exists()


@needs_root
def test_counts_what_each_process_sent(tmp_path):
  stats = tmp_path / "stats.json"
  p = subprocess.run(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=2",
      "--link=1gbit",
      "--link_probe_s=0.2",
      f"--link_stats={stats}",
      "--",
      sys.executable,
      "-c",
      _SEND,
    ],
    capture_output=True,
    text=True,
    env=_env(),
    timeout=120,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  record = json.loads(stats.read_text())
  assert record["link"] == "1gbit" and record["topology"] == "per_node"
  p0, p1 = record["processes"]
  assert (p0["address"], p1["address"]) == ("10.77.0.1", "10.77.0.2")
  # The payload and its TCP/IP headers; the rate probe's traffic is not
  # counted (it moved far more than this).
  assert 3_000_000 <= p1["sent_bytes"] < 3_300_000
  assert 3_000_000 <= p0["received_bytes"] < 3_300_000
  # The other way: acknowledgements only.
  assert p0["sent_bytes"] < 300_000
  assert p1["received_bytes"] < 300_000
