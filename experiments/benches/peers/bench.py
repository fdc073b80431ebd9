"""The side-by-side benchmark: qsync_jax, PyTorch DDP and torchft.

This module owns :func:`run`, the benchmark behind
:mod:`experiments.peer_bench`. Every system trains the network study's task
(:mod:`experiments.studies.network`: the 10.6M-parameter CNN on digits,
four processes each behind its own emulated link, 16 examples per worker,
SGD with momentum, the same learning-rate schedule, steps and evaluations)
under ``python -m qsync_jax.distributed --link``, and the bytes each
process sent and received are counted on its link by the launcher
(``--link_stats``: the veth's counters), the same way for every system.

* qsync_jax's configurations are the network study's runs, built by its
  :func:`~experiments.studies.network.run_config` and
  :func:`~experiments.studies.network.command`, plus ``auto``: what the
  allocator's link-aware choice picks (:mod:`.auto`).
* The peers are :mod:`.torch_worker` processes: DDP with a communication
  hook, or a torchft replica each (:mod:`.torchft_side`).
* Each framework's compute floor trains the same steps without averaging:
  ``torch_floor`` (plain per-process torch) and ``qsync_floor`` (local SGD
  whose period is longer than the run: its one average is the schedule's
  last step). A floor's step time is its training seconds up to its last
  evaluation before the final step over that step, which leaves that
  average out.

Summary fields per configuration: ``framework``, ``time_to_target_s`` (per
seed; None where a seed did not reach the target) and its mean,
``step_time_mean_s`` (training seconds over steps), ``floor_step_s`` (the
framework's floor), ``mb_sent_per_worker`` and ``mb_received_per_worker``
(the link's counters, megabytes, mean over processes and seeds: None
without links), ``final_accuracy_mean``. The two ratios:

* ``best_qsync_vs_best_peer``: the mean time to target of qsync_jax's
  fastest configuration over the fastest peer's (among those whose every
  seed reached the target; None when either framework has none);
* ``best_qsync_vs_own_floor``: that qsync_jax configuration's step time
  over the qsync floor's step time: how much slower than computing alone
  its synchronization makes a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from absl import logging
import numpy as np

from experiments import progress
from experiments.benches.peers import auto
from experiments.studies import network
from qsync_jax import files
from qsync_jax.launch import links
from qsync_jax.launch import local

#: The torch worker's module (started as a program, never imported here).
TORCH_WORKER = "experiments.benches.peers.torch_worker"
FLOOR_NAMES = {"torch": "torch_floor", "qsync_jax": "qsync_floor"}
EXTRA = 'pip install -e ".[peers]"'


@dataclasses.dataclass(frozen=True)
class Config:
  """One configuration of the bench.

  Attributes:
    framework: ``qsync_jax`` or ``torch`` (DDP, torchft).
    description: one line for the report.
  """

  framework: str
  description: str


CONFIGS: dict[str, Config] = {
  "ddp_fp32": Config("torch", "PyTorch DDP, float32 all-reduce (gloo)"),
  "ddp_fp16": Config("torch", "PyTorch DDP, fp16_compress_hook"),
  "ddp_powersgd": Config(
    "torch", "PyTorch DDP, PowerSGD rank 16, error feedback, warm start"
  ),
  "torchft_localsgd": Config("torch", "torchft LocalSGD, sync_every=4"),
  "torchft_diloco": Config(
    "torch", "torchft DiLoCo, H=4, outer SGD lr 0.7 mom. 0.9 Nesterov"
  ),
  "torchft_streaming": Config(
    "torch", "torchft Streaming DiLoCo, 2 fragments, H=8, delay 1"
  ),
  "dp": Config("qsync_jax", network.RUNS["dp"].description),
  "dp_gqsgd": Config("qsync_jax", network.RUNS["dp_gqsgd"].description),
  "qsr": Config("qsync_jax", network.RUNS["qsr"].description),
  "qsr_gqsgd": Config("qsync_jax", network.RUNS["qsr_gqsgd"].description),
  "diloco": Config("qsync_jax", network.RUNS["diloco"].description),
  "auto": Config("qsync_jax", "the allocator's link-aware pick"),
  "torch_floor": Config("torch", "torch compute floor: no averaging"),
  "qsync_floor": Config(
    "qsync_jax", "qsync_jax compute floor: local SGD, period > steps"
  ),
}
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c not in FLOOR_NAMES.values())


class MissingExtraError(RuntimeError):
  """torch or torchft is not installed."""


def check_peers_installed() -> None:
  """Raises :class:`MissingExtraError` saying how to install the peers."""
  missing = [m for m in ("torch", "torchft") if _find(m) is None]
  if missing:
    raise MissingExtraError(
      f"the peer bench needs {' and '.join(missing)}: {EXTRA}"
    )


def _find(module: str) -> Any:
  try:
    return importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None


def check_args(
  names: Sequence[str], seeds: int, steps: int | None, repeats: int
) -> None:
  """Raises ``ValueError`` naming a bad configuration or count."""
  unknown = [n for n in names if n not in CONFIGS]
  if unknown or not names:
    raise ValueError(
      f"unknown configuration(s) {unknown or 'none given'}; "
      f"valid: {', '.join(CONFIGS)}"
    )
  for flag, value, least in (
    ("seeds", seeds, 1),
    ("steps", steps, 2),
    ("recovery_repeats", repeats, 0),
  ):
    if value is not None and value < least:
      raise ValueError(f"--{flag} must be >= {least}, got {value}")


@dataclasses.dataclass(frozen=True)
class Setup:
  """What every run of one bench shares."""

  out_dir: str
  steps: int | None
  model_kwargs: Mapping[str, Any] | None
  link: str | None
  topology: str
  num_processes: int
  timeout_s: float


def launcher(setup: Setup, stats: str | None) -> list[str]:
  """``python -m qsync_jax.distributed`` up to ``--``."""
  cmd = [
    sys.executable,
    "-m",
    "qsync_jax.distributed",
    f"--num_processes={setup.num_processes}",
  ]
  if setup.link is not None:
    cmd += [f"--link={setup.link}", f"--topology={setup.topology}"]
    if stats is not None:
      cmd.append(f"--link_stats={stats}")
  return [*cmd, "--"]


def _steps(setup: Setup) -> int:
  return network.run_config("dp", 0, steps=setup.steps).steps


def qsync_command(
  setup: Setup, name: str, seed: int, run_dir: str, stats: str | None
) -> list[str]:
  """A qsync_jax run: the network study's command line of ``name`` (the
  floor: its local SGD with a period longer than the run), launched with
  this bench's processes, link and link statistics."""
  run = "local" if name == FLOOR_NAMES["qsync_jax"] else name
  config = network.run_config(
    run, seed, steps=setup.steps, model_kwargs=setup.model_kwargs
  )
  study = network.command(
    config, run, run_dir, link="unused", topology=setup.topology
  )
  job = study[study.index("--") + 1 :]
  fixed = {"--config.cluster=": f"cpu:{setup.num_processes}"}
  if run != name:
    fixed["--config.h_base="] = str(config.steps + 1)
  for i, arg in enumerate(job):
    for prefix, value in fixed.items():
      if arg.startswith(prefix):
        job[i] = prefix + value
  return launcher(setup, stats) + job


def torch_command(
  setup: Setup,
  name: str,
  seed: int,
  run_dir: str,
  stats: str | None,
  extra: Sequence[str] = (),
) -> list[str]:
  """A torch run: :mod:`.torch_worker` under the launcher."""
  cmd = [
    sys.executable,
    "-m",
    TORCH_WORKER,
    f"--out_dir={run_dir}",
    f"--system={name}",
    f"--seed={seed}",
  ]
  if setup.steps is not None:
    cmd.append(f"--steps={setup.steps}")
  if setup.model_kwargs is not None:
    cmd.append(f"--model_kwargs={json.dumps(dict(setup.model_kwargs))}")
  if name.startswith("torchft"):
    cmd.append(f"--lighthouse_port={local.free_port()}")
  return launcher(setup, stats) + cmd + list(extra)


def run_one(setup: Setup, name: str, seed: int) -> dict[str, Any]:
  """Trains one run unless its ``summary.json`` is there; its record."""
  run_dir = os.path.join(setup.out_dir, name, f"seed{seed}")
  stats = run_dir + ".link.json" if setup.link is not None else None
  summary_path = os.path.join(run_dir, "summary.json")
  if not os.path.exists(summary_path):
    if os.path.exists(run_dir):
      shutil.rmtree(run_dir)  # a run cut short: again from nothing
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    make = (
      qsync_command
      if CONFIGS[name].framework == "qsync_jax"
      else (torch_command)
    )
    cmd = make(setup, name, seed, run_dir, stats)
    logging.info("%s seed %d: %s", name, seed, " ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      timeout=setup.timeout_s,
      check=False,
    )
    files.write_text(run_dir + ".log", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not os.path.exists(summary_path):
      tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-5:])
      raise RuntimeError(
        f"run {name} seed {seed} failed (exit {proc.returncode}); "
        f"log {run_dir}.log:\n{tail}"
      )
    logging.info("%s seed %d: %.0f s", name, seed, time.perf_counter() - start)
  with open(summary_path) as f:
    summary = json.load(f)
  link_stats = None
  if stats is not None and os.path.exists(stats):
    with open(stats) as f:
      link_stats = json.load(f)
  return {
    "name": name,
    "seed": seed,
    "summary": summary,
    "curve": network.eval_curve(run_dir),
    "link_stats": link_stats,
  }


def _mb(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
  per_run = [
    np.mean([p[key] for p in r["link_stats"]["processes"]]) / 1e6
    for r in runs
    if r["link_stats"]
  ]
  return float(np.mean(per_run)) if per_run else None


def floor_step_s(run: Mapping[str, Any]) -> float:
  """A floor's seconds per step up to its last evaluation before its final
  step (all of its steps when it evaluated only at the end)."""
  steps = run["summary"]["steps"]
  before = [p for p in run["curve"] if 0 < p["step"] < steps]
  if before:
    return before[-1]["train_time_s"] / before[-1]["step"]
  return run["summary"]["train_time_s"] / steps


def summarize(
  runs: Sequence[Mapping[str, Any]], target: float
) -> dict[str, dict[str, Any]]:
  """Per configuration: time to target, step time, link bytes, accuracy."""
  out: dict[str, dict[str, Any]] = {}
  floors = {}
  for framework, floor in FLOOR_NAMES.items():
    rs = [r for r in runs if r["name"] == floor]
    if rs:
      floors[framework] = float(np.mean([floor_step_s(r) for r in rs]))
  for name in dict.fromkeys(r["name"] for r in runs):
    rs = [r for r in runs if r["name"] == name]
    times = [network.time_to_target(r["curve"], target)[0] for r in rs]
    reached = [t for t in times if t is not None]
    final = [r["summary"]["final_eval_accuracy"] for r in rs]
    framework = CONFIGS[name].framework
    out[name] = {
      "framework": framework,
      "description": CONFIGS[name].description,
      "seeds": len(rs),
      "reached_target": len(reached),
      "time_to_target_s": times,
      "time_to_target_mean_s": float(np.mean(reached)) if reached else None,
      "step_time_mean_s": float(
        np.mean(
          [r["summary"]["train_time_s"] / r["summary"]["steps"] for r in rs]
        )
      ),
      "floor_step_s": floors.get(framework),
      "mb_sent_per_worker": _mb(rs, "sent_bytes"),
      "mb_received_per_worker": _mb(rs, "received_bytes"),
      "final_accuracy_mean": float(np.mean(final)),
      "final_accuracy_std": float(np.std(final, ddof=1))
      if len(rs) > 1
      else 0.0,
    }
  return out


def best(
  per_config: Mapping[str, Mapping[str, Any]], framework: str
) -> str | None:
  """The framework's configuration (floors aside) with the smallest mean
  time to target among those whose every seed reached it."""
  done = {
    n: c["time_to_target_mean_s"]
    for n, c in per_config.items()
    if c["framework"] == framework
    and n not in FLOOR_NAMES.values()
    and c["reached_target"] == c["seeds"]
  }
  return min(done, key=done.__getitem__) if done else None


def ratios(per_config: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
  """``best_qsync_vs_best_peer`` and ``best_qsync_vs_own_floor`` (see the
  module docstring) and the configurations they compare."""
  q, p = best(per_config, "qsync_jax"), best(per_config, "torch")
  out: dict[str, Any] = {"best_qsync": q, "best_peer": p}
  out["best_qsync_vs_best_peer"] = (
    per_config[q]["time_to_target_mean_s"]
    / per_config[p]["time_to_target_mean_s"]
    if q and p
    else None
  )
  floor = per_config[q]["floor_step_s"] if q else None
  out["best_qsync_vs_own_floor"] = (
    per_config[q]["step_time_mean_s"] / floor if q and floor else None
  )
  return out


def recovery(setup: Setup, repeats: int) -> dict[str, Any]:
  """The recovery section: ``repeats`` torchft and qsync_jax recoveries
  (:mod:`.recovery`), each reused when its record is there."""
  from experiments.benches.peers import recovery as rec  # pylint: disable=g-import-not-at-top

  steps = _steps(setup)
  spec = (
    None
    if setup.link is None
    else links.LinkSpec.parse(setup.link, topology=setup.topology)
  )
  out: dict[str, list[dict[str, Any]]] = {"torchft": [], "qsync_jax": []}
  for k in range(repeats):
    base = os.path.join(setup.out_dir, "recovery")
    tdir = os.path.join(base, "torchft_localsgd", f"repeat{k}")
    record = os.path.join(tdir, "recovery.json")
    if not os.path.exists(record):
      worker = torch_command(
        setup,
        "torchft_localsgd",
        k,
        tdir,
        None,
        extra=[
          f"--recovery_log={os.path.join(tdir, 'steps.jsonl')}",
          f"--min_replicas={max(1, setup.num_processes - 1)}",
        ],
      )
      job = worker[worker.index("--") + 1 :]
      port = next(
        int(a.split("=")[1]) for a in job if a.startswith("--lighthouse_port=")
      )
      rec.torchft_repeat(
        job,
        tdir,
        num_processes=setup.num_processes,
        steps=steps,
        lighthouse_port=port,
        link=spec,
        timeout_s=setup.timeout_s,
      )
    with open(record) as f:
      out["torchft"].append(json.load(f))
    qdir = os.path.join(base, "qsync_dp", f"repeat{k}")
    record = qdir + ".recovery.json"
    if not os.path.exists(record):
      job = qsync_command(setup, "dp", k, qdir, None)
      rec.qsync_repeat(
        job[job.index("--") + 1 :],
        qdir,
        num_processes=setup.num_processes,
        steps=steps,
        link=setup.link,
        timeout_s=setup.timeout_s,
      )
    with open(record) as f:
      out["qsync_jax"].append(json.load(f))
  return {
    "kill_after_step": rec.kill_step(steps),
    "torchft": {"config": "torchft_localsgd"} | rec.summarize(out["torchft"]),
    "qsync_jax": {
      "config": "dp, elastic launcher, checkpoint every "
      f"{rec.CHECKPOINT_EVERY} steps"
    }
    | rec.summarize(out["qsync_jax"]),
  }


def run(
  out_dir: str,
  *,
  names: Sequence[str] = DEFAULT_CONFIGS,
  seeds: int = 3,
  target: float = 0.95,
  link: str | None = "1gbit",
  topology: str = "per_node",
  steps: int | None = None,
  model_kwargs: Mapping[str, Any] | None = None,
  num_processes: int = network.NUM_PROCESSES,
  recovery_repeats: int = 3,
  floors: bool = True,
  timeout_s: float = 1800.0,
) -> dict[str, Any]:
  """Runs the bench (reusing finished runs) and writes its outputs.

  Args:
    out_dir: ``<config>/seed<k>`` per run, ``summary.json``,
      ``time_to_accuracy.png``.
    names: names of :data:`CONFIGS`; each framework's floor is added.
    seeds: seeds per configuration.
    target: the eval accuracy whose first crossing times a run.
    link: each process's emulated link (None: no emulation, no bytes).
    topology: ``per_node`` or ``shared``.
    steps: the training steps instead of the study's.
    model_kwargs: the CNN's arguments instead of the study's.
    num_processes: processes per run (the study's four by default).
    recovery_repeats: recoveries per framework (0: none).
    floors: add each framework's compute floor to ``names``.
    timeout_s: the longest one run may take.

  Returns:
    The summary written to ``summary.json``.

  Raises:
    ValueError: a bad configuration name or count.
    MissingExtraError: a torch configuration without torch and torchft.
    qsync_jax.launch.links.LinkUnavailableError: a link here cannot be
      emulated; nothing is written.
    RuntimeError: a run failed (its log's last lines).
  """
  check_args(names, seeds, steps, recovery_repeats)
  names = list(dict.fromkeys(names))
  frameworks = {CONFIGS[n].framework for n in names}
  if "torch" in frameworks or recovery_repeats:
    check_peers_installed()
  if link is not None:
    reason = links.unavailable_reason()
    if reason is not None:
      raise links.LinkUnavailableError(
        f"the peer bench needs emulated links: {reason}"
      )
  if floors:
    names += [
      FLOOR_NAMES[f] for f in sorted(frameworks) if FLOOR_NAMES[f] not in names
    ]
  setup = Setup(
    out_dir, steps, model_kwargs, link, topology, num_processes, timeout_s
  )
  os.makedirs(out_dir, exist_ok=True)
  choice = None
  if "auto" in names:
    choice = auto.pick(
      out_dir,
      steps=steps,
      model_kwargs=model_kwargs,
      link=link or "1gbit",
      topology=topology,
    )
  bar = progress.Progress(len(names) * seeds, logging.info)
  runs = []
  for seed in range(seeds):
    for name in names:
      runs.append(run_one(setup, name, seed))
      bar.done(f"peers {name} seed {seed}")
  per_config = summarize(runs, target)
  result: dict[str, Any] = {
    **ratios(per_config),
    "date": datetime.datetime.now(datetime.UTC).isoformat(),
    "link": link,
    "topology": topology,
    "host_cores": os.cpu_count(),
    "num_processes": num_processes,
    "target_accuracy": target,
    "steps": _steps(setup),
    "model_kwargs": dict(model_kwargs or network.MODEL_KWARGS),
    "auto_choice": None
    if choice is None
    else {
      k: choice[k]
      for k in ("method", "averager", "overrides", "predicted_step_s")
    },
    "configs": per_config,
    "recovery": recovery(setup, recovery_repeats) if recovery_repeats else None,
    "runs": [
      network.run_record(r, ("name", "seed", "curve", "link_stats"))
      for r in runs
    ],
  }
  plot(runs, names, target, out_dir, num_processes, link)
  files.write_json(os.path.join(out_dir, "summary.json"), result, indent=2)
  return result


def plot(
  runs: Sequence[Mapping[str, Any]],
  names: Sequence[str],
  target: float,
  out_dir: str,
  num_processes: int,
  link: str | None,
) -> None:
  """``out_dir/time_to_accuracy.png``: every system but the floors, the
  peers dashed."""
  shown = [n for n in names if n not in FLOOR_NAMES.values()]
  network.plot(
    runs,
    shown,
    target,
    os.path.join(out_dir, "time_to_accuracy.png"),
    f"qsync_jax (solid), PyTorch DDP and torchft (dashed): {num_processes} "
    f"processes, {link or 'no emulated link'}",
    linestyles={n: "--" for n in shown if CONFIGS[n].framework == "torch"},
  )


def table(result: Mapping[str, Any]) -> str:
  """The summary as printed lines: one per configuration, the ratios and
  the recovery."""
  lines = []
  for name, c in result["configs"].items():
    t = c["time_to_target_mean_s"]
    mb = c["mb_sent_per_worker"]
    lines.append(
      f"{name:18s} {c['framework']:9s} to {result['target_accuracy']}: "
      f"{'not reached' if t is None else f'{t:7.1f} s'} "
      f"({c['reached_target']}/{c['seeds']})  final "
      f"{c['final_accuracy_mean']:.4f}  step "
      f"{c['step_time_mean_s'] * 1e3:7.1f} ms  sent "
      + ("   n/a" if mb is None else f"{mb:8.1f} MB")
    )
  for key in (
    "best_qsync",
    "best_peer",
    "best_qsync_vs_best_peer",
    "best_qsync_vs_own_floor",
  ):
    lines.append(f"{key}: {result[key]}")
  if result.get("auto_choice"):
    a = result["auto_choice"]
    lines.append(f"auto: {a['method']} with {a['averager']}")
  rec = result.get("recovery")
  if rec:
    for fw in ("torchft", "qsync_jax"):
      lines.append(
        f"recovery {fw}: seconds lost {rec[fw]['seconds_lost_mean']}, "
        f"steps lost {rec[fw]['steps_lost_mean']}"
      )
  return "\n".join(lines)
