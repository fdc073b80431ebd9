"""The device report's dry run on the CPU: every section recorded, in time."""

import json
import os
import subprocess
import sys
import time

import pytest

from experiments.benches import device_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_dry_run_records_every_section_within_its_budget(tmp_path):
  start = time.monotonic()
  run = subprocess.run(
    [sys.executable, "-m", "experiments.device_report", f"--out={tmp_path}"]
    + ["--platform=cpu", "--budget_s=20"],
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": ROOT},
    capture_output=True,
    text=True,
    timeout=300,
  )
  took = time.monotonic() - start
  assert run.returncode == 0, run.stderr[-3000:]
  saved = json.loads((tmp_path / "report.json").read_text())
  assert list(saved["sections"]) == list(device_report.SECTIONS)
  md = (tmp_path / "report.md").read_text()
  for name, entry in saved["sections"].items():
    # Cut short where the budget ran out, never lost or failed.
    assert entry["status"] in ("done", "out of time"), (name, entry)
    assert f"## {name}" in md
  sections = saved["sections"]
  tests = sections["gpu_tests"]["result"]
  assert tests["timed_out"] or set(tests["counts"]) == {"skipped"}
  cases = sections["numerics"]["result"]["cases"]
  measured = [c for c in cases if "compiled" in c]
  assert measured and all(c["compiled"]["ok"] for c in measured)
  assert all(
    c.get("status") == "out of time" for c in cases if c not in measured
  )
  for spec, child in sections["predictor"]["result"].items():
    assert child.get("status") != "failed", (spec, child["tail"])
  # The budget holds but for the case under way when it ran out, and the
  # binary's start.
  assert took < 20 + 35


def test_an_unknown_section_or_platform_is_refused(tmp_path):
  with pytest.raises(ValueError, match="sections must be among"):
    device_report.run(str(tmp_path), platform="cpu", sections=["bogus"])
  with pytest.raises(ValueError, match="platform gpu or cpu"):
    device_report.run(str(tmp_path), platform="tpu")
