"""End-to-end: the main job's library function and the experiment binary."""

import json
import os
import subprocess
import sys

import pytest

from experiments.configs import default as default_config
from qsync_jax import training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_small_cnn_with_half_its_layers_int8_learns_digits(tmp_path):
  config = default_config.get_config()
  # Half of the four layers INT8 (both convolutions); the rest FP32.
  config.plan = {"rules": [[r"conv\d", "int8"]], "default": "fp32"}
  summary = training.train_and_evaluate(config, str(tmp_path))
  assert summary["precisions"] == {"conv1": "int8", "conv2": "int8",
                                   "fc": "fp32", "head": "fp32"}
  print("digits test accuracy with conv1/conv2 INT8:",
        summary["final_eval_accuracy"])
  assert summary["final_eval_accuracy"] >= 0.93
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["final_eval_accuracy"] == summary["final_eval_accuracy"]
  assert (tmp_path / "plan.json").exists()


def _run_binary(*args):
  return subprocess.run([sys.executable, "-m", "experiments.train", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_binary_writes_summary_and_accepts_overrides(tmp_path):
  plan_file = tmp_path / "plan.json"
  plan_file.write_text('{"rules": [["fc", "bf16"]], "default": "fp32"}')
  out = tmp_path / "out"
  result = _run_binary(f"--out_dir={out}", "--config.steps=20",
                       "--config.device_kind=a100",
                       f"--config.plan_file={plan_file}")
  assert result.returncode == 0, result.stderr[-2000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 20
  assert summary["precisions"]["fc"] == "bf16"


@pytest.mark.parametrize("args, message", [
    (["--config.device_kind=v100"], "'v100' does not support int8"),
    (["--config.plan_file=/nonexistent/plan.json"],
     "plan file '/nonexistent/plan.json' does not exist"),
    (["--config.model=nosuch"], "invalid model spec 'nosuch'"),
])
def test_binary_bad_input_is_one_clear_error(tmp_path, args, message):
  result = _run_binary(f"--out_dir={tmp_path}", *args)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and message in last
  assert "Traceback" not in result.stderr
