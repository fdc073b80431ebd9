"""The main job across membership changes: other workers, elastic worlds.

A run directory resumed onto other workers keeps its global batch and its
data order, plans again (reusing the scores and profiles it cached), and
records each change in ``summary.json``; in an elastic world (the
``QSYNC_ELASTIC_*`` variables) the run trains on its slots' kinds and
resumes by itself. The main job runs in-process on conftest's four fake CPU
devices; one first world is shared by the module (copied per test).
"""

import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys

from absl import logging as absl_logging
import binaries
from flax import nnx
import ml_collections
import numpy as np
import pytest
from test_bad_input_resume import _refused

from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
from qsync_jax import data as data_lib
from qsync_jax import models
from qsync_jax import predictor
from qsync_jax.allocation import job_plans
from qsync_jax.allocation import pipeline
from qsync_jax.process import membership
from qsync_jax.process import membership_record
from qsync_jax.process import preemption
from qsync_jax.process import previous_run
from qsync_jax.process import run_start

_MODEL_KWARGS = {"widths": [2, 2], "hidden": 4}
_POOL = "v100:2,t4:2"


def _config(cluster=_POOL, steps=2, **fields):
  """A tiny CNN on digits, 4 examples a worker, checkpoints every 2 steps;
  plans from the allocator (random indicator, catalog profiles)."""
  config = default_config.get_config()
  config.cluster = cluster
  config.model_kwargs = ml_collections.ConfigDict(dict(_MODEL_KWARGS))
  config.batch_size = 4
  config.steps = steps
  config.eval_every = 0
  config.checkpoint_every = 2
  config.log_every = 1
  config.allocator.indicator = "random"
  config.allocator.profiles = "analytic"
  for name, value in fields.items():
    setattr(config, name, value)
  return config


class _Recorder:
  """What the runs trained on: each step's example indices (sorted, over
  every worker) and per-worker batch sizes, and the indicator's calls."""

  def __init__(self, monkeypatch):
    self.steps = {}
    self.scored = 0
    batcher_of = data_lib.training_batcher
    compute_scores = pipeline.compute_scores

    def training_batcher(source, batch_sizes, seed=0):
      batcher = batcher_of(source, batch_sizes, seed)
      worker_batches = batcher.worker_batches

      def recorded(step, workers):
        indices = batcher.step_indices(step)
        self.steps[step] = (
          sorted(np.concatenate(indices).tolist()),
          [len(i) for i in indices],
        )
        return worker_batches(step, workers)

      batcher.worker_batches = recorded
      return batcher

    def scores(*args, **kwargs):
      self.scored += 1
      return compute_scores(*args, **kwargs)

    monkeypatch.setattr(data_lib, "training_batcher", training_batcher)
    monkeypatch.setattr(pipeline, "compute_scores", scores)


@pytest.fixture(scope="module")
def first_world(tmp_path_factory):
  """v100:2,t4:2 trained to step 2 (checkpointed), and what it trained on."""
  out = tmp_path_factory.mktemp("first") / "run"
  with pytest.MonkeyPatch.context() as mp:
    recorder = _Recorder(mp)
    summary = train_lib.train_and_evaluate(
      config_lib.parse(_config()), str(out)
    )
  assert summary["steps"] == 2 and summary["membership"] == []
  return out, dict(recorder.steps), recorder.scored


@pytest.fixture
def run_dir(first_world, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(first_world[0], out)
  return out


@pytest.fixture
def info_logs(caplog):
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    with caplog.at_level(logging.INFO):
      yield caplog
  finally:
    absl_logging.set_verbosity(verbosity)


def _json(value):
  return json.loads(json.dumps(value))


def _metrics(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_shrink_and_grow_keep_the_global_batch_and_the_data(
  first_world, run_dir, monkeypatch, info_logs
):
  _, first_steps, first_scored = first_world
  recorder = _Recorder(monkeypatch)
  recorder.steps.update(first_steps)
  shrunk = train_lib.train_and_evaluate(
    config_lib.parse(_config("v100:1,t4:1", 4, resume=True)), str(run_dir)
  )
  # The indicator's batches change: its cached scores are stale.
  grown = train_lib.train_and_evaluate(
    config_lib.parse(
      _config(_POOL, 6, resume=True, allocator=_allocator(num_batches=2))
    ),
    str(run_dir),
  )
  # The global batch of 16 is kept: 8 a worker on two, 4 on four.
  assert [w["batch_size"] for w in shrunk["workers"]] == [8, 8]
  assert [w["batch_size"] for w in grown["workers"]] == [4] * 4
  sizes = {s: recorder.steps[s][1] for s in range(6)}
  assert sizes == {0: [4] * 4, 1: [4] * 4, 2: [8, 8], 3: [8, 8]} | {
    4: [4] * 4,
    5: [4] * 4,
  }
  # Every step trained on the examples the run on four workers throughout
  # would have: none repeated, none skipped.
  source = data_lib.open_dataset("digits")
  throughout = data_lib.WorkerBatcher(
    source.x_train, source.y_train, [4] * 4, seed=0
  )
  for step in range(6):
    expected = sorted(np.concatenate(throughout.step_indices(step)).tolist())
    assert recorder.steps[step][0] == expected, step
  assert grown["steps"] == 6
  assert [r["num_workers"] for r in _metrics(run_dir)] == [4, 4, 2, 2, 4, 4]
  entries = grown["membership"]
  assert [
    (e["step"], e["cluster_before"], e["workers_before"]) for e in entries
  ] == [(2, _POOL, 4), (4, "v100:1,t4:1", 2)]
  assert [(e["cluster_after"], e["workers_after"]) for e in entries] == [
    ("v100:1,t4:1", 2),
    (_POOL, 4),
  ]
  for entry in entries:
    assert entry["cause"] == "resume" and entry["steps_lost"] == 0
    assert entry["seconds_lost"] is None
    breakdown = entry["breakdown"]
    assert breakdown["detect_s"] is None and breakdown["restart_s"] is None
    assert all(
      breakdown[k] >= 0 for k in ("plan_s", "restore_s", "compile_s")
    ), breakdown
  # Planned again on each new cluster: the scores of the first world were
  # reused once, then computed anew from the other batches.
  assert first_scored == 1 and recorder.scored == 1
  messages = info_logs.messages
  assert sum("indicator scores: reused from" in m for m in messages) == 1
  assert any("are stale" in m for m in messages), messages
  assert sum(m.startswith("allocator (greedy") for m in messages) == 2
  changes = [m for m in messages if m.startswith("membership change")]
  assert len(changes) == 2
  assert "v100:1,t4:1 (2 workers) -> v100:2,t4:2 (4 workers)" in changes[1]


def _allocator(**fields):
  allocator = _config().allocator
  for name, value in fields.items():
    setattr(allocator, name, value)
  return allocator


def _elastic(monkeypatch, slots, restart=0, change=None, pool_size=4):
  world = membership.ElasticWorld(tuple(slots), pool_size, restart, change)
  for name in membership.ELASTIC_VARS:
    monkeypatch.delenv(name, raising=False)
  for name, value in world.to_env().items():
    monkeypatch.setenv(name, value)


def test_an_elastic_world_trains_its_slots_and_records_a_reclaim(
  tmp_path, monkeypatch
):
  out = tmp_path / "run"
  # World 0: every slot; the notice arrives and step 2 is agreed.
  _elastic(monkeypatch, range(4))
  monkeypatch.setattr(
    preemption.PreemptionWatch, "reached", lambda self, step: step == 2
  )
  job = config_lib.parse(_config(steps=4, plan_mode="manual"))
  assert train_lib.train_and_evaluate(job, str(out)) == {
    "preempted": True,
    "steps": 2,
  }
  notice = json.loads((out / previous_run.PREEMPTED).read_text())
  assert notice["step"] == 2 and notice["checkpoint_s"] >= 0
  monkeypatch.undo()
  # World 1: slot 2 (a T4) reclaimed; the same command, no --resume.
  change = membership.Change(
    cause="reclaimed",
    slots_before=(0, 1, 2, 3),
    slots_after=(0, 1, 3),
    event_time=notice["time"] - 0.25,
    exit_time=notice["time"] + notice["checkpoint_s"] + 0.5,
    start_time=notice["time"] + notice["checkpoint_s"] + 0.75,
    detail="slot 2 reclaimed",
  )
  _elastic(monkeypatch, (0, 1, 3), restart=1, change=change)
  summary = train_lib.train_and_evaluate(job, str(out))
  assert summary["cluster"] == "v100:2,t4:1"
  # The global batch of 16 over three workers: the remainder to the first.
  assert [(w["kind"], w["batch_size"]) for w in summary["workers"]] == [
    ("v100", 6),
    ("v100", 5),
    ("t4", 5),
  ]
  assert summary["steps"] == 4 and summary["steps_this_run"] == 2
  assert not (out / previous_run.PREEMPTED).exists()
  [entry] = summary["membership"]
  fields = ("step", "workers_before", "cluster_before", "workers_after")
  fields += ("cluster_after", "cause", "detail", "steps_lost")
  assert {k: entry[k] for k in fields} == {
    "step": 2,
    "workers_before": 4,
    "cluster_before": _POOL,
    "workers_after": 3,
    "cluster_after": "v100:2,t4:1",
    "cause": "reclaimed",
    "detail": "slot 2 reclaimed",
    "steps_lost": 0,
  }
  breakdown = entry["breakdown"]
  assert breakdown["detect_s"] == pytest.approx(0.25)
  assert breakdown["checkpoint_s"] == notice["checkpoint_s"]
  assert breakdown["restart_s"] > 0
  # The phases follow one another from the event to the first step's end.
  assert math.isclose(
    entry["seconds_lost"], sum(breakdown.values()), abs_tol=1e-6
  )
  assert [r["num_workers"] for r in _metrics(out)] == [4, 4, 3, 3]


def test_a_cluster_that_is_not_the_pool_is_one_line(
  tmp_path, monkeypatch, capsys
):
  _elastic(monkeypatch, (0, 1), pool_size=3)
  last = _refused(_config("v100:1,t4:1"), tmp_path / "run", capsys)
  assert last == (
    "error: the cluster names 2 workers and the elastic pool has 3 slots; "
    "give --cluster one worker per slot (--num_processes), or --cluster=auto"
  )


def test_a_world_drops_the_plans_of_kinds_it_does_not_run():
  job = config_lib.parse(
    _config(
      plan_mode="manual",
      plans={"t4": {"rules": [], "default": "fp16"}},
    )
  )
  world = membership.ElasticWorld((1, 0), 4)
  selected = train_lib.world_job(job, world)
  assert selected.cluster == "v100:2"
  assert dict(selected.plans) == {}
  assert job.cluster == _POOL  # the caller's config is unchanged
  assert list(job.plans) == ["t4"]
  with_t4 = train_lib.world_job(job, membership.ElasticWorld((3, 0), 4))
  assert with_t4.cluster == "t4:1,v100:1"
  assert list(with_t4.plans.keys()) == ["t4"]
  assert with_t4.plans["t4"] == job.plans["t4"]


def test_another_model_on_other_workers_is_one_line(run_dir, capsys):
  last = _refused(
    _config(
      "v100:1,t4:1",
      4,
      resume=True,
      plan_mode="manual",
      model_kwargs=ml_collections.ConfigDict({**_MODEL_KWARGS, "hidden": 8}),
    ),
    run_dir,
    capsys,
  )
  assert last == (
    f"error: checkpoint step 2 in {run_dir}/checkpoints is of another "
    "model: parameter fc.bias is (4,) float32 in the checkpoint and (8,) "
    "float32 in this run; resume with the model it was saved with, or "
    "start a new run directory"
  ), last


def test_a_global_batch_smaller_than_the_workers_is_refused():
  meta = {"step": 6, "kinds": ["v100", "t4"], "batch_sizes": [1, 1]}
  with pytest.raises(ValueError) as refused:
    run_start.resume_batch_sizes(meta, ["v100", "v100", "t4"])
  assert str(refused.value) == (
    "the checkpoint at step 6 was written with a global batch of 2 "
    "examples, fewer than the 3 workers of this run (v100:2,t4:1); resume "
    "on at most 2 workers, or start a new run directory"
  )
  # Dynamic: 16 in proportion to the speeds (v100 1.3, t4 1).
  speeds = _config().speeds
  meta = {"step": 6, "kinds": ["v100", "t4", "t4"], "batch_sizes": [6, 5, 5]}
  two = ["v100", "t4"]
  assert run_start.resume_batch_sizes(meta, two, "dynamic", speeds) == [9, 7]
  # The same workers keep theirs, whatever the run's own batches.
  meta = {"step": 6, "kinds": ["v100", "t4"], "batch_sizes": [9, 7]}
  assert run_start.resume_batch_sizes(meta, two) == [9, 7]
  # A checkpoint from before batch sizes were recorded: the run's own.
  del meta["batch_sizes"]
  assert run_start.resume_batch_sizes(meta, two, "dynamic", speeds) is None


def test_a_cached_profile_is_reused_for_the_same_inputs_only(
  tmp_path, info_logs
):
  model = models.create_model("cnn", rngs=nnx.Rngs(0), **_MODEL_KWARGS)
  graph = predictor.trace_graph(model, model.input_spec(4))
  measured = dataclasses.replace(
    predictor.analytic_profile(graph, "t4"), source="measured"
  )
  calls = []

  def measure():
    calls.append(1)
    return measured

  inputs = {"graph": graph.fingerprint(), "timing_batch_size": 4}
  first = job_plans.PlanCache(str(tmp_path))
  first.expect_profile("t4", inputs)
  assert first.profile("t4", measure) is measured
  first.save_profiles({"t4": measured})
  path = tmp_path / "profiles" / "t4.json"
  assert path.exists()
  again = job_plans.PlanCache(str(tmp_path))
  again.expect_profile("t4", inputs)
  reused = again.profile("t4", measure)
  assert len(calls) == 1
  assert _json(reused.to_dict()) == _json(measured.to_dict())
  # Another timing batch: the cached profile is stale, measured again.
  stale = job_plans.PlanCache(str(tmp_path))
  stale.expect_profile("t4", {**inputs, "timing_batch_size": 8})
  assert stale.profile("t4", measure) is measured
  assert len(calls) == 2
  logged = [m for m in info_logs.messages if m.startswith("profile of t4")]
  assert logged[0].endswith("(none cached)")
  assert logged[1] == f"profile of t4: reused from {path}"
  assert logged[2].endswith(
    f"(the one in {path} is stale (measured from other inputs))"
  )


def test_a_death_loses_the_steps_since_the_checkpoint_and_no_save():
  previous = previous_run.PreviousRun(
    # Left by an earlier world's notice: not this change's.
    preempted={"step": 4, "time": 90.0, "checkpoint_s": 1.0},
    last_logged_step=7,
  )
  died = membership.Change("died", (0, 1), (0,), 100.0, 100.5, 101.0, "x")
  record = membership_record.MembershipRecord(
    membership.ElasticWorld((0,), 2, 2, died)
  )
  earlier = {"step": 4, "cause": "reclaimed"}
  record.mark("plan")
  record.mark("restore")
  meta = {"step": 4, "kinds": ["v100", "t4"], "membership": [earlier]}
  entry = record.resumed(meta, ["v100"], previous)
  record.first_step_done()
  assert record.entries == [earlier, entry]
  assert record.checkpoint_meta() == {"membership": [earlier, entry]}
  assert entry["steps_lost"] == 3 and entry["cluster_after"] == "v100:1"
  breakdown = entry["breakdown"]
  assert breakdown["detect_s"] == 0.5 and breakdown["checkpoint_s"] is None
  assert math.isclose(
    entry["seconds_lost"],
    sum(v for v in breakdown.values() if v is not None),
    abs_tol=1e-6,
  )
  # A notice whose PREEMPTED file is an earlier world's (the world ended
  # with no agreed step): no checkpoint time, detection counted to the last
  # exit and the restart from it, so the breakdown still adds up.
  reclaimed = dataclasses.replace(died, cause="reclaimed")
  record = membership_record.MembershipRecord(
    membership.ElasticWorld((0,), 2, 2, reclaimed)
  )
  record.mark("plan")
  record.mark("restore")
  entry = record.resumed(meta, ["v100"], previous)
  record.first_step_done()
  assert entry["breakdown"]["detect_s"] == 0.5
  assert entry["breakdown"]["checkpoint_s"] is None
  assert entry["breakdown"]["restart_s"] > 0
  assert math.isclose(
    entry["seconds_lost"],
    sum(v for v in entry["breakdown"].values() if v is not None),
    abs_tol=1e-6,
  )
  # The same workers and no change: nothing recorded, the list carried.
  record = membership_record.MembershipRecord()
  record.mark("plan")
  record.mark("restore")
  assert record.resumed({**meta, "kinds": ["v100"]}, ["v100"], previous) is None
  assert record.entries == [earlier]


def test_a_notice_held_during_start_up_is_taken_by_the_watch(tmp_path):
  # SIGTERM to a process still starting: held back, then read at the first
  # step boundary instead of killing the process.
  script = tmp_path / "start.py"
  script.write_text(
    "import os, signal, time\n"
    # As experiments/train.py does in an elastic world, before imports.
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "from qsync_jax.process import preemption\n"
    "os.kill(os.getpid(), signal.SIGTERM)\n"
    "time.sleep(0.2)\n"
    "with preemption.PreemptionWatch() as watch:\n"
    "  print('reached', watch.reached(0))\n"
  )
  out = subprocess.run(
    [sys.executable, str(script)],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "reached True" in out.stdout


def test_the_watch_and_the_binary_tell_the_launcher_how_far_they_got(
  tmp_path, monkeypatch
):
  # The watch: an empty progress file once it holds notices, "stepped"
  # after the first step boundary; a later watch keeps "stepped".
  path = tmp_path / "progress-0-0"
  monkeypatch.setenv(membership.ENV_PROGRESS, str(path))
  with preemption.PreemptionWatch() as watch:
    assert path.read_text() == ""
    assert not watch.reached(5)
    assert path.read_text() == membership.STEPPED
    assert not watch.reached(6)
  with preemption.PreemptionWatch():
    assert path.read_text() == membership.STEPPED
  # The train binary says it holds notices before its imports: the file is
  # there even when the flags are then refused.
  started = tmp_path / "progress-0-1"
  env = dict(os.environ)
  env.update(
    {
      membership.ENV_SLOTS: "0",
      membership.ENV_POOL_SIZE: "1",
      membership.ENV_RESTART: "0",
      membership.ENV_PROGRESS: str(started),
    }
  )
  result = binaries.run(
    "experiments.train", f"--out_dir={tmp_path}/o", "--nosuchflag", env=env
  )
  assert result.returncode == 1 and "nosuchflag" in result.stderr
  assert started.exists() and started.read_text() == ""
