"""examples/elastic_loop.py under the elastic launcher: a reclaim and a return.

The pool has two slots; slot 1 is reclaimed 4 s after the job starts and
handed back at 28 s. The reclaim reaches the first world while it starts
(the example holds SIGTERM until its loop can take it), the return the
second world, which trains on slot 0 alone; each ends with the processes
checkpointing the step they agreed on and exiting 75, and the next world
resumes there. Paced at half a second a step, the second world is still
running at 28 s on a fast host (40 steps take it at least 20 s), and the
first has ended by then on a slow one.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40


def _world_lines(stderr):
  return [l for l in stderr.splitlines() if l.startswith("elastic: world")]


def test_a_reclaim_and_a_return_lose_no_step(tmp_path):
  availability = tmp_path / "availability.json"
  availability.write_text(json.dumps({"1": [[4, 28]]}))
  out = tmp_path / "run"
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=2",
      "--elastic",
      "--min_processes=1",
      f"--availability={availability}",
      # One standby per slot is all this reclaim and return use; each
      # imports JAX beside the run (tests/test_standby.py covers more).
      "--standbys_per_slot=1",
      "--timeout_s=400",
      "--",
      sys.executable,
      os.path.join(ROOT, "examples", "elastic_loop.py"),
      f"--out_dir={out}",
      f"--steps={STEPS}",
      "--min_step_s=0.5",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=460,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  worlds = _world_lines(result.stderr)
  assert len(worlds) == 3, worlds
  assert worlds[0] == "elastic: world 1: slots 0,1 (start)"
  assert worlds[1].startswith("elastic: world 2: slots 0 (slot 1 reclaimed at")
  assert worlds[2].startswith("elastic: world 3: slots 0,1 (slot 1 returned at")
  # Every step ran once, in order: each world went on at the step the one
  # before it checkpointed.
  taken = [
    line.split() for line in (out / "steps.log").read_text().splitlines()
  ]
  assert [int(t[3]) for t in taken] == list(range(1, STEPS + 1))
  restarts = [int(t[1]) for t in taken]
  assert sorted(set(restarts)) == [0, 1, 2] and restarts == sorted(restarts)
  # Two workers, then slot 0's alone, then both again.
  rows = [
    json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
  ]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  workers = {0: 2, 1: 1, 2: 2}
  assert [r["num_workers"] for r in rows] == [workers[r] for r in restarts]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == STEPS and summary["workers"] == ["v100", "t4"]
  assert math.isfinite(summary["loss"]) and summary["accuracy"] > 0.5
  params = np.load(out / "params.npy")
  assert params.size > 0 and np.isfinite(params).all()
