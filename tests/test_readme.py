"""The README's example runs as written, against the public API."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _example() -> str:
  text = (ROOT / "README.md").read_text()
  match = re.search(r"<!-- example -->\n```python\n(.*?)```", text, re.S)
  assert match, "README.md has no <!-- example --> python block"
  return match.group(1)


def test_readme_example_runs(tmp_path):
  script = tmp_path / "example.py"
  script.write_text(_example())
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  result = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert lines[0] == "['conv1', 'conv2', 'fc', 'head']"
  # The last line: sync rounds and the evaluation of the trained workers.
  rounds, metrics = lines[-1].split(" ", 1)
  assert int(rounds) > 0 and "'accuracy'" in metrics
  assert (tmp_path / "runs" / "example").is_dir()  # the checkpoint


def test_readme_example_uses_the_flat_api():
  example = _example()
  for name in (
    "apply_plan",
    "trace_graph",
    "analytic_profile",
    "predict",
    "allocate",
    "plan_cluster",
    "parse_cluster",
    "make_averager",
    "make_schedule",
    "HybridTrainer",
    "Worker",
    "Checkpointer",
  ):
    assert f"qs.{name}(" in example, name
