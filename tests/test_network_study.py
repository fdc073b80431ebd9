"""Tests for experiments.studies.network (the time-to-accuracy study).

The bookkeeping runs anywhere; one short end-to-end run over emulated links
needs root and skips with the reason otherwise.
"""

import json
import os
import subprocess
import sys

import pytest

from experiments.studies import network
from experiments.studies import network_prediction
from qsync_jax.launch import links

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = links.unavailable_reason()
needs_root = pytest.mark.skipif(REASON is not None, reason=str(REASON))
SMALL = {"widths": [8, 16], "hidden": 64}  # the study's CNN, narrow


def _curve(points):
  return [{"step": s, "train_time_s": t, "accuracy": a} for s, t, a in points]


def _run(name, seed, reach_at, final=0.96, steps=100, step_s=0.1):
  points = [(10, 1.0, 0.5), (20, 2.0, 0.8), (30, 3.0, 0.97)]
  if reach_at is not None:
    points = [
      (10, reach_at / 2, 0.5),
      (20, reach_at, 0.96),
      (30, reach_at * 2, 0.9),
    ]
  return {
    "name": name,
    "seed": seed,
    "curve": _curve(points),
    "summary": {
      "final_eval_accuracy": final,
      "comm_bytes": 1e6,
      "sync_rounds": 10,
      "steps": steps,
      "train_time_s": steps * step_s,
    },
  }


def test_time_to_target_is_the_first_eval_at_or_above_it():
  curve = _curve([(5, 1.0, 0.9), (10, 2.0, 0.95), (15, 3.0, 0.97)])
  assert network.time_to_target(curve, 0.95) == (2.0, 10)
  assert network.time_to_target(curve, 0.96) == (3.0, 15)
  assert network.time_to_target(curve, 0.99) == (None, None)


def test_summary_and_ratio_over_seeds():
  runs = [
    _run("dp", 0, 10.0),
    _run("dp", 1, 14.0, final=0.98),
    _run("qsr_gqsgd", 0, 4.0),
    _run("qsr_gqsgd", 1, 2.0),
  ]
  summary = network.summarize(runs, 0.95)
  assert summary["dp"]["time_to_target_mean_s"] == pytest.approx(12.0)
  assert summary["dp"]["final_accuracy_mean"] == pytest.approx(0.97)
  assert summary["qsr_gqsgd"]["reached_target"] == 2
  assert network.ratio(summary, "qsr_gqsgd", "dp") == pytest.approx(3 / 12)
  # A seed that never reached the target: no ratio, rather than a flattering
  # mean over the seeds that did.
  runs.append(_run("qsr_gqsgd", 2, None))
  summary = network.summarize(runs, 0.99)
  assert summary["qsr_gqsgd"]["reached_target"] == 0
  assert network.ratio(summary, "qsr_gqsgd", "dp") is None


def test_each_configuration_becomes_its_launcher_command(tmp_path):
  qsr = network.run_config("qsr_gqsgd", 2)
  assert qsr.sync == "qsr" and qsr.compress == "gqsgd" and qsr.seed == 2
  from experiments import config_lib

  schedule = config_lib.make_schedule(config_lib.parse(qsr))
  rounds = len(schedule.sync_steps(qsr.steps))
  assert 0 < rounds <= 0.15 * qsr.steps  # alpha from the round budget
  cmd = network.command(
    qsr, "qsr_gqsgd", str(tmp_path), link="1gbit", topology="per_node"
  )
  assert "--link=1gbit" in cmd and not any("cpu_quota" in c for c in cmd)
  assert f"--config.alpha={qsr.alpha}" in cmd
  assert "--config.compress=gqsgd" in cmd
  hetero = network.run_config("dynamic_hetero", 0)
  cmd = network.command(
    hetero, "dynamic_hetero", str(tmp_path), link="1gbit", topology="per_node"
  )
  assert f"--cpu_quota={network.HETERO_QUOTA}" in cmd
  assert "--config.batch_mode=dynamic" in cmd
  assert f"--config.cluster={network.HETERO['cluster']}" in cmd


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
  out = tmp_path / "study"
  with pytest.raises(ValueError, match="unknown configuration"):
    network.run(str(out), names=["dp", "nope"])
  with pytest.raises(ValueError, match="target"):
    network.run(str(out), target=1.5)
  assert not out.exists()


def test_without_links_the_binary_says_why_in_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(links, "unavailable_reason", lambda: "needs root")
  with pytest.raises(links.LinkUnavailableError, match="needs root"):
    network.run(str(tmp_path / "study"), names=["dp"])
  assert not (tmp_path / "study").exists()


def test_the_predictor_prices_each_configuration_from_its_runs(tmp_path):
  # dp averages every step, local SGD 5 times and QSR once over 20 steps:
  # the same compute, so a step is longer by the averages it adds. The runs
  # are fake; re-predicting a written study reads each one's sync rounds
  # and steps, and the link once from the summary.
  link = {
    "link": "1gbit",
    "rate_bps": 1e9,
    "latency_s": 0.0,
    "topology": "per_node",
    "measured_bps": 0.95e9,
    "cpu_quota": None,
  }
  runs = [
    {
      "name": name,
      "seed": 0,
      "curve": [],
      "summary": {"sync_rounds": rounds, "steps": 20},
    }
    for name, rounds in (
      ("dp", 20),
      ("qsr", 1),
      ("dp_hetero", 20),
      ("local", 5),
      ("diloco", 5),
    )
  ]
  configs = {
    n: {"step_time_mean_s": 0.1}
    for n in ("dp", "qsr", "dp_hetero", "local", "diloco")
  }
  summary = {
    "link": link,
    "model_kwargs": SMALL,
    "runs": runs,
    "configs": configs,
    "time_to_target_ratio_qsr_gqsgd_vs_dp": 0.3,
  }
  (tmp_path / "summary.json").write_text(json.dumps(summary))
  result = network_prediction.repredict(str(tmp_path), repeats=1)
  assert result == json.loads((tmp_path / "summary.json").read_text())
  assert result["repredicted"] is True
  steps = {n: c.get("predicted_step_s") for n, c in result["configs"].items()}
  assert steps["dp_hetero"] is None  # the throttled runs are not priced
  assert 0 < steps["qsr"] < steps["dp"]
  # DiLoCo's rounds also run its outer optimizer over the parameters.
  assert steps["diloco"] > steps["local"] > steps["qsr"]
  assert result["configs"]["qsr"]["predicted_vs_measured_step"] == (
    pytest.approx(steps["qsr"] / 0.1 - 1)
  )
  # The measured figures stay as they were.
  assert result["time_to_target_ratio_qsr_gqsgd_vs_dp"] == 0.3
  assert all(c["step_time_mean_s"] == 0.1 for c in result["configs"].values())


def test_repredicting_needs_a_written_study(tmp_path):
  with pytest.raises(FileNotFoundError, match="no study to re-predict"):
    network_prediction.repredict(str(tmp_path))
  (tmp_path / "summary.json").write_text(json.dumps({"runs": []}))
  with pytest.raises(ValueError, match="lacks"):
    network_prediction.repredict(str(tmp_path))
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.network_study",
      f"--out={tmp_path / 'none'}",
      "--predict_only",
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 1
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith("error: no study to re-predict")
  )


@needs_root
def test_a_short_study_over_emulated_links(tmp_path):
  out = tmp_path / "study"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.network_study",
      f"--out={out}",
      "--configs=dp,qsr_gqsgd",
      "--seeds=1",
      "--steps=20",
      "--target=0.3",
      f"--model_kwargs={json.dumps(SMALL)}",
      "--nopredict",
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["link"]["measured_bps"] > 0.5e9
  assert summary["num_params"] == network.num_params(SMALL)
  assert summary["model_kwargs"] == SMALL
  dp, qsr = summary["configs"]["dp"], summary["configs"]["qsr_gqsgd"]
  assert dp["sync_rounds"] == 20 and qsr["sync_rounds"] <= 3
  assert qsr["bytes_sent_per_worker"] < dp["bytes_sent_per_worker"] / 4
  run = summary["runs"][0]
  assert [p["step"] for p in run["curve"]] == [5, 10, 15, 20]
  assert (out / "time_to_accuracy.png").stat().st_size > 1000
  assert "time_to_target_ratio_qsr_gqsgd_vs_dp" in result.stdout
  # Nothing of a finished launcher is left (others' may be running).
  assert links.remove_stale() == []
