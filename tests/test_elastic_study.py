"""Tests for experiments.elastic_study (elastic pools measured).

One tiny reclaim study runs the binary end to end: two processes under the
elastic launcher, uninterrupted and then with slot 1 reclaimed. The trace
study's bookkeeping runs in-process; its runs need root and minutes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments.studies import elastic
from qsync_jax.launch import links

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"widths": [2, 2], "hidden": 4}
STEPS = 20


def test_a_reclaim_study_trains_every_step_and_records_the_change(tmp_path):
  out = tmp_path / "study"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.elastic_study",
      "--study=reclaim",
      f"--out={out}",
      "--seeds=1",
      f"--steps={STEPS}",
      "--num_processes=2",
      f"--model_kwargs={json.dumps(TINY)}",
      "--timeout_s=300",
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=420,
    check=False,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  data = json.loads((out / "reclaim.json").read_text())
  assert data["study"] == "reclaim" and "--study=reclaim" in data["command"]
  assert data["num_processes"] == 2 and data["reclaimed_slot"] == 1
  assert data["config_overrides"]["cluster"] == "v100:1,t4:1"
  (seed,) = data["seeds"]
  base, run = seed["uninterrupted"], seed["reclaimed"]
  # Slot 1 is out from a third to two thirds of the uninterrupted run.
  [[start, end]] = seed["availability"]["1"]
  assert start == pytest.approx(base["wall_s"] / 3, abs=0.1)
  assert end == pytest.approx(2 * base["wall_s"] / 3, abs=0.1)
  assert "--availability=" in run["command"]
  assert "--availability=" not in base["command"]
  for job in (base, run):
    assert job["steps"] == STEPS and job["all_steps_trained"]
    assert 0 <= job["final_eval_accuracy"] <= 1
    assert job["eval_curve"][-1]["step"] == STEPS
  assert base["membership"] == []
  # The reclaim was noticed, checkpointed and resumed: no step lost.
  change = run["membership"][0]
  assert change["cause"] == "reclaimed" and change["steps_lost"] == 0
  assert change["seconds_lost"] > 0
  assert set(change["breakdown"]) == set(elastic.BREAKDOWN)
  assert len(run["worlds"]) >= 2
  summary = data["summary"]
  assert summary["all_steps_trained"] and summary["goal_steps_lost_met"]
  assert summary["changes"] == len(run["membership"])
  assert summary["accuracy_difference_mean"] == pytest.approx(
    run["final_eval_accuracy"] - base["final_eval_accuracy"]
  )
  assert summary["seconds_lost_per_change"][0] == change["seconds_lost"]
  assert summary["goal_seconds_lost_met"] == (
    max(summary["seconds_lost_per_change"]) <= elastic.GOAL_SECONDS_LOST
  )
  lines = result.stdout.splitlines()
  assert any(
    line.startswith("[2/2] reclaim seed 0 reclaimed") for line in lines
  )
  assert any(line.startswith("accuracy difference") for line in lines)


_HOLDS_ON = """\
import os, signal, sys, time
def on_term(signum, frame):
  open(sys.argv[1], "w").close()
  sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(60)
"""

_STUDY = """\
import sys
from experiments.studies import elastic
elastic.launch([sys.executable, sys.argv[1], sys.argv[2]], sys.argv[3],
               timeout_s=60)
"""


def test_a_study_stopped_by_sigterm_stops_its_launcher(tmp_path):
  launcher = tmp_path / "launcher.py"
  launcher.write_text(_HOLDS_ON)
  stopped = tmp_path / "stopped"
  run_dir = tmp_path / "run"
  env = {**os.environ, "PYTHONPATH": REPO_ROOT}
  study = subprocess.Popen(
    [sys.executable, "-c", _STUDY, str(launcher), str(stopped), str(run_dir)],
    env=env,
  )
  try:
    deadline = time.monotonic() + 60
    while not (tmp_path / "stopped.ready").exists():
      assert time.monotonic() < deadline, "the launcher did not start"
      time.sleep(0.1)
    study.send_signal(signal.SIGTERM)
    assert study.wait(timeout=30) == 128 + signal.SIGTERM
    # The launcher was told to stop, and has.
    assert stopped.exists()
  finally:
    study.kill()


def test_trace_intervals_cover_the_fraction_inside_the_window():
  window = elastic.trace_intervals(10.0, 110.0, 0.3, 2)
  assert window == [pytest.approx((27.5, 42.5)), pytest.approx((77.5, 92.5))]
  assert sum(b - a for a, b in window) == pytest.approx(0.3 * 100)
  assert elastic.reclaim_window(90.0) == (30.0, 60.0)


def test_a_row_keeps_the_time_it_first_appeared(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [
    {"step": 10, "loss": 1.0},
    {"step": 20, "eval_accuracy": 0.9},
    {"step": 30, "eval_accuracy": 0.96},
  ]
  seen = {}
  path.write_text(json.dumps(rows[0]) + "\n")
  elastic._stamp_rows(str(path), seen, 1.0)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
  elastic._stamp_rows(str(path), seen, 2.0)
  # A resume rewrites the file: rows it keeps keep their first time.
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  elastic._stamp_rows(str(path), seen, 3.0)
  launched = elastic.Launched(
    [], 0, 4.0, elastic._final_rows(str(path), seen), []
  )
  assert [r["at_s"] for r in launched.rows] == [1.0, 2.0, 3.0]
  assert launched.first_row_s() == 1.0
  assert launched.time_to_target(0.95) == (3.0, 30)
  assert launched.time_to_target(0.9) == (2.0, 20)
  assert launched.time_to_target(0.99) == (None, None)


def test_the_trace_study_refuses_before_anything_runs(tmp_path, monkeypatch):
  out = tmp_path / "study"
  with pytest.raises(ValueError, match="throttles no process"):
    elastic.run_trace(str(out), cpu_quota=(1, 1))
  with pytest.raises(ValueError, match="fraction"):
    elastic.run_trace(str(out), fraction=1.0)
  monkeypatch.setattr(links, "unavailable_reason", lambda: "needs root")
  with pytest.raises(links.LinkUnavailableError, match="needs root"):
    elastic.run_trace(str(out))
  assert not out.exists()
