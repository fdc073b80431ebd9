"""Elastic pools measured: a worker reclaimed and returned, and a trace.

This module owns the two studies of :mod:`experiments.elastic_study`. Every
run is the main job (``python -m experiments.train``) under the elastic
localhost launcher (``python -m qsync_jax.distributed --elastic``), started
as a subprocess, so an uninterrupted run and a reclaimed one differ only in
the ``--availability`` file.

- :func:`run_reclaim`: the main job's default config (the CNN on digits,
  its cluster one worker per slot) on ``num_processes`` processes with
  ``--min_processes`` half of them, first uninterrupted, then with the last
  slot reclaimed from a third to two thirds of the uninterrupted run's wall
  time, per seed. It reports both final eval accuracies, whether every step
  was trained, the run's membership entries (the seconds and steps each
  change lost, and where the seconds went), and across seeds the accuracy
  difference against the seed-to-seed spread.
- :func:`run_trace`: an emulated hybrid pool behind ``--link`` with
  ``--cpu_quota`` giving some processes a full CPU and the others a share
  of one (slower device kinds), trained to a target eval accuracy three
  ways: the full-speed processes alone, the pool never reclaimed, and the
  pool whose throttled slots an availability trace reclaims ``fraction`` of
  the time. Root only (network namespaces, tc and cgroups).

The clock is the study's own: a run's metrics rows are stamped with the
seconds since its launcher started when they appear in ``metrics.jsonl``
(polled every :data:`POLL_S`), so a time to target counts everything the
job waited for: start-up, restarts, evaluations and checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from experiments import progress
from experiments.configs import default
from experiments.studies import network
from qsync_jax import files
from qsync_jax.launch import elastic as elastic_launcher
from qsync_jax.launch import links
from qsync_jax.launch import local
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.process import membership

#: How often a running job's ``metrics.jsonl`` is read for new rows.
POLL_S = 0.2
#: The goals the reclaim study is judged by.
GOAL_SECONDS_LOST = 20.0
GOAL_STEPS_LOST = 0
#: A membership entry's breakdown of its seconds, in the order they pass.
BREAKDOWN = (
  "detect_s",
  "checkpoint_s",
  "restart_s",
  "plan_s",
  "restore_s",
  "compile_s",
)

#: The reclaim study: processes in the pool, and the main job's steps. A
#: restart costs about 40 s on a 2-core host (interpreter, JAX and the
#: distributed runtime starting, the programs compiled again) and a job
#: starts for about 60 s (the indicator included), so the run is long
#: enough (about 175 s of training at about 35 ms a step) that a third of
#: its wall time falls in training and the three-process world trains a
#: while before the slot returns.
RECLAIM_PROCESSES = 4
RECLAIM_STEPS = 5000

#: The trace study's pool: each slot's CPU quota (CPUs, the cgroup cpu
#: controller's quota); slots below the largest quota are the throttled
#: ones the trace reclaims.
TRACE_QUOTA = (1.0, 1.0, 0.3, 0.3)
#: Kinds the slots are labelled with: full-speed and throttled.
FAST_KIND, SLOW_KIND = "v100", "t4"
#: The trace study's job: the network study's communication-bound CNN and
#: its schedule (SGD with momentum, cosine learning rate), which spends
#: about 0.8 s a step on this pool at 1 Gbit/s, so that a run to the target
#: lasts minutes rather than the seconds the default CNN takes. No periodic
#: checkpoints: a notice checkpoints the agreed step by itself, and the
#: trace kills no process.
TRACE_FIELDS = {
  **network.BASE,
  "steps": 300,
  "eval_every": 10,
  "log_every": 10,
  "checkpoint_every": 0,
}
TRACE_TARGET = 0.97
TRACE_FRACTION = 0.3
TRACE_INTERVALS = 2
TRACE_LINK = "1gbit"
#: The trace study's runs, in the order they run (the trace is derived from
#: the pool's uninterrupted run, so ``pool`` comes first).
TRACE_RUNS = ("pool", "fast_only", "trace")


@dataclasses.dataclass
class Launched:
  """One job run under the launcher, as the study saw it.

  Attributes:
    command: the launcher's command line.
    code: the launcher's exit status.
    wall_s: seconds from its start to its exit.
    rows: the final ``metrics.jsonl`` rows, each with ``"at_s"``: seconds
      since the start when the row first appeared in the file.
    worlds: the launcher's ``elastic: world ...`` lines, each
      ``{"at_s", "line"}``.
  """

  command: list[str]
  code: int
  wall_s: float
  rows: list[dict[str, Any]]
  worlds: list[dict[str, Any]]

  def first_row_s(self) -> float | None:
    """When the first metrics row appeared: the end of start-up (None
    when the job wrote none)."""
    return min((r["at_s"] for r in self.rows), default=None)

  def time_to_target(self, target: float) -> tuple[float | None, int | None]:
    """Seconds since the start and the step of the first eval at or above
    ``target``; ``(None, None)`` when none reached it."""
    reached = [
      r
      for r in self.rows
      if r.get("eval_accuracy") is not None and r["eval_accuracy"] >= target
    ]
    if not reached:
      return None, None
    first = min(reached, key=lambda r: r["at_s"])
    return first["at_s"], int(first["step"])


def _stamp_rows(path: str, seen: dict[str, float], at: float) -> None:
  """Stamps every line of ``path`` not seen before with ``at``.

  A line is keyed by its text: a resume that rewrites the file keeps the
  rows it had (and their first stamps), and a step trained again after a
  loss writes a row of other text, stamped anew.
  """
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except FileNotFoundError:
    return
  for line in lines:
    if line and line not in seen:
      seen[line] = at


def _final_rows(path: str, seen: Mapping[str, float]) -> list[dict[str, Any]]:
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f.read().splitlines():
      if line:
        rows.append(json.loads(line) | {"at_s": seen[line]})
  return rows


def launch(
  command: Sequence[str], run_dir: str, *, timeout_s: float
) -> Launched:
  """Runs ``command`` (a launcher training into ``run_dir``) to its end.

  Its output goes to ``run_dir + ".log"``; its metrics rows are stamped as
  they appear (:class:`Launched`). It compiles into the launcher's cache of
  its own, not the environment's: a window placed at a share of another
  run's time must not find this run finished early by a warm cache.

  Args:
    command: the launcher's command line.
    run_dir: the run directory the job writes.
    timeout_s: the launcher is sent SIGTERM (it kills every process) after
      this many seconds.

  Returns:
    What happened; the caller judges the exit status.

  Raises:
    SystemExit: status 128 + the signal when this process gets SIGINT or
      SIGTERM, after the launcher, sent SIGTERM, has stopped its processes.
  """
  metrics = os.path.join(run_dir, "metrics.jsonl")
  seen: dict[str, float] = {}
  worlds: list[dict[str, Any]] = []
  start = time.monotonic()
  with open(run_dir + ".log", "w") as log:
    cache = (elastic_launcher.COMPILATION_CACHE_VAR, "JAX_PERSISTENT_CACHE_")
    proc = subprocess.Popen(
      list(command),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={k: v for k, v in os.environ.items() if not k.startswith(cache)},
    )
    stdout = proc.stdout
    assert stdout is not None

    def relay() -> None:
      for line in stdout:
        log.write(line)
        if line.startswith("elastic: world"):
          worlds.append(
            {"at_s": time.monotonic() - start, "line": line.strip()}
          )

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    stopped = False
    # Stopped itself, the study stops its launcher, which stops the job's
    # processes: nothing outlives the study.
    with local.stop_signals() as received:
      while proc.poll() is None:
        now = time.monotonic() - start
        if (now > timeout_s or received) and not stopped:
          proc.terminate()
          stopped = True
        _stamp_rows(metrics, seen, now)
        time.sleep(POLL_S)
    reader.join()
    if received:
      raise SystemExit(128 + received[0])
  wall = time.monotonic() - start
  # Rows written between the last poll and the exit.
  _stamp_rows(metrics, seen, wall)
  return Launched(
    command=list(command),
    code=int(proc.returncode),
    wall_s=wall,
    rows=_final_rows(metrics, seen),
    worlds=worlds,
  )


def _flag_value(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value)


def train_command(
  run_dir: str,
  fields: Mapping[str, Any],
  model_kwargs: Mapping[str, Any] | None,
) -> list[str]:
  """The main job's command line: ``fields`` as ``--config.<key>``
  overrides of experiments/configs/default.py."""
  cmd = [sys.executable, "-m", "experiments.train", f"--out_dir={run_dir}"]
  if model_kwargs is not None:
    cmd.append(f"--model_kwargs={json.dumps(dict(model_kwargs))}")
  cmd += [f"--config.{k}={_flag_value(v)}" for k, v in sorted(fields.items())]
  return cmd


def launcher_command(
  num_processes: int,
  min_processes: int,
  *,
  availability: str | None = None,
  link: str | None = None,
  cpu_quota: Sequence[float] | None = None,
  timeout_s: float | None = None,
) -> list[str]:
  """The elastic launcher's command line, up to ``--``."""
  cmd = [
    sys.executable,
    "-m",
    "qsync_jax.distributed",
    f"--num_processes={num_processes}",
    "--elastic",
    f"--min_processes={min_processes}",
  ]
  if availability is not None:
    cmd.append(f"--availability={availability}")
  if link is not None:
    cmd.append(f"--link={link}")
  if cpu_quota is not None:
    cmd.append(f"--cpu_quota={_flag_value([f'{q:g}' for q in cpu_quota])}")
  if timeout_s is not None:
    cmd.append(f"--timeout_s={timeout_s:g}")
  return [*cmd, "--"]


def run_job(
  command: Sequence[str],
  run_dir: str,
  *,
  steps: int,
  timeout_s: float,
  reuse: bool = True,
) -> tuple[Launched, dict[str, Any], bool]:
  """Runs one job unless ``reuse`` and the same command already finished
  into ``run_dir``; checks that it trained every step.

  Returns:
    The launch, the job's ``summary.json``, and whether they were reused.

  Raises:
    RuntimeError: the job failed, or ended short of ``steps``; the message
      has its log's last lines.
  """
  summary_path = os.path.join(run_dir, "summary.json")
  record = run_dir + ".launch.json"
  if reuse and os.path.exists(summary_path) and os.path.exists(record):
    with open(record) as f:
      saved = json.load(f)
    if saved["command"] == list(command):
      with open(summary_path) as f:
        return Launched(**saved), json.load(f), True
  if os.path.exists(run_dir):
    # A run cut short, or another command's: start again from nothing.
    shutil.rmtree(run_dir)
  os.makedirs(os.path.dirname(run_dir), exist_ok=True)
  launched = launch(command, run_dir, timeout_s=timeout_s)
  summary = None
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  if launched.code != 0 or summary is None or summary["steps"] != steps:
    with open(run_dir + ".log") as f:
      tail = "\n".join(f.read().splitlines()[-8:])
    got = "no summary" if summary is None else f"{summary['steps']} steps"
    raise RuntimeError(
      f"{run_dir} failed (launcher exit {launched.code}, {got} of "
      f"{steps}); log {run_dir}.log:\n{tail}"
    )
  files.write_json(record, dataclasses.asdict(launched), indent=2)
  return launched, summary, False


def _write_availability(
  path: str, intervals: Mapping[int, Sequence[tuple[float, float]]]
) -> dict[str, list[list[float]]]:
  data = {
    str(slot): [[round(a, 1), round(b, 1)] for a, b in pairs]
    for slot, pairs in intervals.items()
  }
  files.write_json(path, data, indent=2)
  return data


def _job_record(
  launched: Launched, summary: Mapping[str, Any], steps: int
) -> dict[str, Any]:
  """What the JSON keeps of one job."""
  return {
    "command": " ".join(launched.command),
    "final_eval_accuracy": summary["final_eval_accuracy"],
    "steps": summary["steps"],
    "all_steps_trained": summary["steps"] == steps,
    "wall_s": launched.wall_s,
    "startup_s": launched.first_row_s(),
    "final_cluster": summary.get("cluster"),
    "membership": summary.get("membership", []),
    "worlds": launched.worlds,
    "eval_curve": [
      {"step": r["step"], "at_s": r["at_s"], "accuracy": r["eval_accuracy"]}
      for r in launched.rows
      if "eval_accuracy" in r
    ],
  }


def _std(values: Sequence[float]) -> float:
  return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def _invocation() -> str:
  """This program's command line as typed: ``python -m <module> ...``
  when it was started as a module."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  program = f"python -m {spec.name}" if spec else sys.argv[0]
  return " ".join([program, *sys.argv[1:]])


def _host() -> dict[str, Any]:
  return {"cpus": os.cpu_count(), "load_average": list(os.getloadavg())}


def reclaim_fields(steps: int, seed: int, num_processes: int) -> dict[str, Any]:
  """The reclaim study's overrides of the default config: the steps, the
  seed, and the cluster, one worker per slot (the default cluster's kinds
  spread over ``num_processes`` in their order: ``v100:2,t4:2`` itself for
  four, ``v100:1,t4:1`` for two)."""
  kinds = cluster_lib.parse_cluster(default.get_config().cluster).kinds
  spread = [
    kinds[i * len(kinds) // num_processes] for i in range(num_processes)
  ]
  return {"steps": steps, "seed": seed, "cluster": _cluster(spread)}


def reclaim_window(uninterrupted_s: float) -> tuple[float, float]:
  """When the slot is out: a third to two thirds of the uninterrupted
  run's wall time, in seconds since the launcher started."""
  return uninterrupted_s / 3, 2 * uninterrupted_s / 3


def summarize_reclaim(seeds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Across seeds: the accuracy difference (reclaimed minus uninterrupted)
  against the seed-to-seed spread, and the goals on every change."""
  base = [s["uninterrupted"]["final_eval_accuracy"] for s in seeds]
  elastic = [s["reclaimed"]["final_eval_accuracy"] for s in seeds]
  diffs = [e - b for e, b in zip(elastic, base)]
  changes = [c for s in seeds for c in s["reclaimed"]["membership"]]
  lost_s = [c["seconds_lost"] for c in changes if c["seconds_lost"] is not None]
  notice = [c for c in changes if c["cause"] in membership.NOTICE_CAUSES]
  phases = {}
  for name in BREAKDOWN:
    values = [
      c["breakdown"][name]
      for c in changes
      if c["breakdown"].get(name) is not None
    ]
    phases[name] = float(np.mean(values)) if values else None
  spread = _std(base)
  mean_diff = float(np.mean(diffs))
  return {
    "accuracy_uninterrupted_mean": float(np.mean(base)),
    "accuracy_reclaimed_mean": float(np.mean(elastic)),
    "accuracy_difference_per_seed": diffs,
    "accuracy_difference_mean": mean_diff,
    "accuracy_difference_std": _std(diffs),
    # The seed-to-seed standard deviation of the uninterrupted runs.
    "seed_spread_uninterrupted_std": spread,
    "seed_spread_reclaimed_std": _std(elastic),
    "difference_within_seed_spread": abs(mean_diff) <= spread,
    "all_steps_trained": all(
      s["uninterrupted"]["all_steps_trained"]
      and s["reclaimed"]["all_steps_trained"]
      for s in seeds
    ),
    "changes": len(changes),
    "changes_by_cause": {
      cause: sum(c["cause"] == cause for c in changes)
      for cause in membership.CAUSES
    },
    "seconds_lost_per_change": lost_s,
    "seconds_lost_mean": float(np.mean(lost_s)) if lost_s else None,
    "seconds_lost_max": max(lost_s) if lost_s else None,
    "breakdown_mean_s": phases,
    "steps_lost_per_change": [c["steps_lost"] for c in changes],
    "goal_seconds_lost_per_change_s": GOAL_SECONDS_LOST,
    "goal_seconds_lost_met": bool(lost_s)
    and len(lost_s) == len(changes)
    and max(lost_s) <= GOAL_SECONDS_LOST,
    "goal_steps_lost_on_notice": GOAL_STEPS_LOST,
    "goal_steps_lost_met": bool(notice)
    and all(c["steps_lost"] <= GOAL_STEPS_LOST for c in notice),
  }


def _check_seeds(seeds: int) -> None:
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f"--seeds must be >= 1, got {seeds}")


def run_reclaim(
  out_dir: str,
  *,
  seeds: int = 3,
  steps: int = RECLAIM_STEPS,
  num_processes: int = RECLAIM_PROCESSES,
  model_kwargs: Mapping[str, Any] | None = None,
  timeout_s: float = 1800.0,
) -> dict[str, Any]:
  """The reclaim study; writes ``out_dir/reclaim.json``.

  Per seed, the main job runs uninterrupted, then with the pool's last slot
  reclaimed over :func:`reclaim_window` of the uninterrupted run's wall
  time; both under the elastic launcher with ``--min_processes`` half the
  pool. Finished jobs (the same command, a ``summary.json``) are reused.

  Args:
    out_dir: one ``seed<k>/{uninterrupted,reclaimed}`` run directory each
      (with ``.log`` and ``.launch.json`` beside it) and ``reclaim.json``.
    seeds: seeds 0, 1, ...
    steps: the main job's steps.
    num_processes: the pool's slots (at least 2).
    model_kwargs: the model's arguments instead of the default config's.
    timeout_s: the longest one job may take.

  Returns:
    What ``reclaim.json`` holds: ``{"summary", "seeds": [...], "config",
    "host", ...}``.

  Raises:
    ValueError: fewer than 1 seed or 2 processes, or fewer than 1 step.
    RuntimeError: a job failed or ended short of its steps.
  """
  _check_seeds(seeds)
  if num_processes < 2:
    raise ValueError(
      f"--num_processes must be >= 2 to reclaim one, got {num_processes}"
    )
  if steps < 1:
    raise ValueError(f"--steps must be >= 1, got {steps}")
  os.makedirs(out_dir, exist_ok=True)
  min_processes = max(1, num_processes // 2)
  slot = num_processes - 1
  host_before = _host()
  bar = progress.Progress(2 * seeds)
  per_seed = []
  for seed in range(seeds):
    seed_dir = os.path.join(out_dir, f"seed{seed}")
    job = reclaim_fields(steps, seed, num_processes)
    base_dir = os.path.join(seed_dir, "uninterrupted")
    base, base_summary, reused = run_job(
      launcher_command(num_processes, min_processes, timeout_s=timeout_s)
      + train_command(base_dir, job, model_kwargs),
      base_dir,
      steps=steps,
      timeout_s=timeout_s + 60,
    )
    bar.done(f"reclaim seed {seed} uninterrupted")
    start, end = reclaim_window(base.wall_s)
    availability_path = os.path.join(seed_dir, "availability.json")
    availability = _write_availability(
      availability_path, {slot: [(start, end)]}
    )
    run_dir = os.path.join(seed_dir, "reclaimed")
    elastic, elastic_summary, _ = run_job(
      launcher_command(
        num_processes,
        min_processes,
        availability=availability_path,
        timeout_s=timeout_s,
      )
      + train_command(run_dir, job, model_kwargs),
      run_dir,
      steps=steps,
      timeout_s=timeout_s + 60,
      # Its availability comes from the run above: a new one, a new trace.
      reuse=reused,
    )
    bar.done(f"reclaim seed {seed} reclaimed")
    per_seed.append(
      {
        "seed": seed,
        "availability": availability,
        "uninterrupted": _job_record(base, base_summary, steps),
        "reclaimed": _job_record(elastic, elastic_summary, steps),
        "accuracy_difference": elastic_summary["final_eval_accuracy"]
        - base_summary["final_eval_accuracy"],
      }
    )
  result = {
    "study": "reclaim",
    "command": _invocation(),
    "summary": summarize_reclaim(per_seed),
    "seeds": per_seed,
    "num_processes": num_processes,
    "min_processes": min_processes,
    "reclaimed_slot": slot,
    "steps": steps,
    "config_overrides": reclaim_fields(steps, 0, num_processes),
    "model_kwargs": None if model_kwargs is None else dict(model_kwargs),
    "host_before": host_before,
    "host_after": _host(),
  }
  files.write_json(os.path.join(out_dir, "reclaim.json"), result, indent=2)
  return result


def trace_intervals(
  start: float, end: float, fraction: float, count: int
) -> list[tuple[float, float]]:
  """``count`` intervals that together cover ``fraction`` of
  ``[start, end]``: the window cut into ``count`` equal parts, each with an
  interval of ``fraction`` of it in its middle."""
  part = (end - start) / count
  out_s = fraction * part
  return [
    (
      start + i * part + (part - out_s) / 2,
      start + i * part + (part + out_s) / 2,
    )
    for i in range(count)
  ]


def _trace_pool(
  cpu_quota: Sequence[float],
) -> tuple[list[int], list[int], list[str]]:
  """The full-speed slots, the throttled ones and every slot's kind."""
  top = max(cpu_quota)
  fast = [i for i, q in enumerate(cpu_quota) if q == top]
  slow = [i for i, q in enumerate(cpu_quota) if q != top]
  if not slow:
    raise ValueError(
      f"--cpu_quota {','.join(f'{q:g}' for q in cpu_quota)} throttles no "
      "process: give the reclaimed ones a smaller quota, as 1,1,0.3,0.3"
    )
  kinds = [FAST_KIND if q == top else SLOW_KIND for q in cpu_quota]
  return fast, slow, kinds


def _cluster(kinds: Sequence[str]) -> str:
  return cluster_lib.cluster_string(cluster_lib.ClusterSpec(tuple(kinds)))


def summarize_trace(
  seeds: Sequence[Mapping[str, Any]], target: float
) -> dict[str, Any]:
  """Per run: the time to target over the seeds (None where a seed did not
  reach it), the final accuracy, and the trace's restart seconds."""
  out: dict[str, Any] = {}
  for name in TRACE_RUNS:
    runs = [s["runs"][name] for s in seeds]
    times = [r["time_to_target_s"] for r in runs]
    out[name] = {
      "time_to_target_s": times,
      "time_to_target_mean_s": (
        None if None in times else float(np.mean(times))
      ),
      "final_eval_accuracy_mean": float(
        np.mean([r["final_eval_accuracy"] for r in runs])
      ),
      "wall_s_mean": float(np.mean([r["wall_s"] for r in runs])),
      "startup_s_mean": float(np.mean([r["startup_s"] for r in runs])),
    }
  changes = [c for s in seeds for c in s["runs"]["trace"]["membership"]]
  lost = [c["seconds_lost"] for c in changes if c["seconds_lost"] is not None]
  out["trace"]["changes"] = len(changes)
  out["trace"]["seconds_lost_total_mean"] = (
    float(np.sum(lost)) / len(seeds) if lost else 0.0
  )
  trace_t = out["trace"]["time_to_target_mean_s"]
  for name in ("pool", "fast_only"):
    other = out[name]["time_to_target_mean_s"]
    out[f"time_to_target_ratio_trace_vs_{name}"] = (
      None if trace_t is None or other is None else trace_t / other
    )
  out["target"] = target
  return out


def run_trace(
  out_dir: str,
  *,
  seeds: int = 3,
  target: float = TRACE_TARGET,
  steps: int | None = None,
  link: str = TRACE_LINK,
  cpu_quota: Sequence[float] = TRACE_QUOTA,
  fraction: float = TRACE_FRACTION,
  intervals: int = TRACE_INTERVALS,
  model_kwargs: Mapping[str, Any] | None = None,
  timeout_s: float = 2400.0,
) -> dict[str, Any]:
  """The trace study; writes ``out_dir/trace.json``.

  Per seed, three jobs behind ``--link`` with ``--cpu_quota``, each timed
  to the first eval at or above ``target`` (seconds since its launcher
  started: start-up and restarts count):

  - ``pool``: every slot, never reclaimed;
  - ``fast_only``: the full-speed slots alone;
  - ``trace``: every slot, the throttled ones reclaimed ``fraction`` of
    ``pool``'s training time (from its first metrics row to its end) in
    ``intervals`` intervals (:func:`trace_intervals`), all at once;
    ``--min_processes`` the full-speed slots.

  Args:
    out_dir: one ``seed<k>/<run>`` run directory each and ``trace.json``.
    seeds: seeds 0, 1, ...
    target: the eval accuracy that times a run.
    steps: the main job's steps (default ``TRACE_FIELDS["steps"]``).
    link: each process's emulated link rate.
    cpu_quota: CPUs per slot; the slots below the largest are throttled.
    fraction: the share of the time the throttled slots are out.
    intervals: how many intervals the trace has.
    model_kwargs: the CNN's arguments instead of the network study's
      :data:`experiments.studies.network.MODEL_KWARGS`.
    timeout_s: the longest one job may take.

  Returns:
    What ``trace.json`` holds.

  Raises:
    ValueError: a bad seed count, target, fraction, interval count or
      quota.
    qsync_jax.launch.links.LinkUnavailableError: links cannot be emulated
      here (not root, no ``ip``/``tc``, no cgroup cpu controller); nothing
      is run or written.
    RuntimeError: a job failed or ended short of its steps.
  """
  _check_seeds(seeds)
  if not 0 < target <= 1:
    raise ValueError(f"--target must be an accuracy in (0, 1], got {target}")
  if not 0 < fraction < 1:
    raise ValueError(f"--fraction must be in (0, 1), got {fraction}")
  if intervals < 1:
    raise ValueError(f"--intervals must be >= 1, got {intervals}")
  cpu_quota = links.parse_cpu_quota(
    ",".join(map(str, cpu_quota)), len(cpu_quota)
  )
  fast, slow, kinds = _trace_pool(cpu_quota)
  reason = links.unavailable_reason()
  if reason is not None:
    raise links.LinkUnavailableError(
      f"the trace study needs emulated links: {reason}"
    )
  steps = TRACE_FIELDS["steps"] if steps is None else steps
  if steps < 1:
    raise ValueError(f"--steps must be >= 1, got {steps}")
  model = dict(network.MODEL_KWARGS if model_kwargs is None else model_kwargs)
  os.makedirs(out_dir, exist_ok=True)
  host_before = _host()
  bar = progress.Progress(len(TRACE_RUNS) * seeds)
  per_seed = []
  for seed in range(seeds):
    seed_dir = os.path.join(out_dir, f"seed{seed}")
    base = {**TRACE_FIELDS, "steps": steps, "seed": seed}
    if base["warmup_steps"] > steps // 10:
      base["warmup_steps"] = steps // 10
    jobs: dict[str, tuple[Launched, dict[str, Any]]] = {}
    availability, pool_reused = None, True
    for name in TRACE_RUNS:
      run_dir = os.path.join(seed_dir, name)
      slots = fast if name == "fast_only" else list(range(len(cpu_quota)))
      path = None
      if name == "trace":
        pool, _ = jobs["pool"]
        begin = pool.first_row_s() or 0.0
        path = os.path.join(seed_dir, "availability.json")
        window = trace_intervals(begin, pool.wall_s, fraction, intervals)
        availability = _write_availability(path, dict.fromkeys(slow, window))
      cmd = launcher_command(
        len(slots),
        len(fast),
        availability=path,
        link=link,
        cpu_quota=[cpu_quota[s] for s in slots],
        timeout_s=timeout_s,
      ) + train_command(
        run_dir,
        {**base, "cluster": _cluster([kinds[s] for s in slots])},
        model,
      )
      launched, summary, reused = run_job(
        cmd,
        run_dir,
        steps=steps,
        timeout_s=timeout_s + 60,
        # The trace comes from the pool's run: a new one, a new trace.
        reuse=pool_reused or name != "trace",
      )
      if name == "pool":
        pool_reused = reused
      jobs[name] = launched, summary
      bar.done(f"trace seed {seed} {name}")
    runs = {}
    for name, (launched, summary) in jobs.items():
      reached_s, reached_step = launched.time_to_target(target)
      runs[name] = _job_record(launched, summary, steps) | {
        "time_to_target_s": reached_s,
        "target_step": reached_step,
        "link": summary.get("link"),
      }
    per_seed.append({"seed": seed, "availability": availability, "runs": runs})
  result = {
    "study": "trace",
    "command": _invocation(),
    "summary": summarize_trace(per_seed, target),
    "seeds": per_seed,
    "target": target,
    "time_to_target": (
      "wall seconds from the launcher's start to the first metrics.jsonl "
      "row whose eval accuracy is at or above the target (start-up, "
      "restarts, evaluations and checkpoints included)"
    ),
    "link": link,
    "cpu_quota": list(cpu_quota),
    "fast_slots": fast,
    "throttled_slots": slow,
    "fraction": fraction,
    "intervals": intervals,
    "steps": steps,
    "config_overrides": {**TRACE_FIELDS, "steps": steps},
    "model_kwargs": model,
    "host_before": host_before,
    "host_after": _host(),
  }
  files.write_json(os.path.join(out_dir, "trace.json"), result, indent=2)
  return result
