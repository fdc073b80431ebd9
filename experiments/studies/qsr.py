"""QSR and Global-QSGD at small scale (``experiments/qsr_study.py``).

This module owns :func:`run`: for a CNN and the byte-level LM, four workers
(fake CPU devices) train under every synchronization configuration of
:data:`CONFIGS` over several seeds, and the study reports the final eval
metric, the sync rounds and the bytes each worker sent.

QSR (arXiv 2310.14423) claims that local SGD whose period grows as
``H = max(H_base, floor((alpha / lr) ** 2))`` while the learning rate decays
matches or beats data parallelism with a fraction of its communication;
Global-QSGD (arXiv 2305.18627) that integer all-reduces of globally scaled
stochastic codes train about as well as the float32 mean.

``alpha`` is not tuned on accuracy: it is the smallest value whose schedule
synchronizes at most ``rounds_fraction`` of data parallelism's rounds,
found on the host before training (the sync steps are a function of the
learning-rate schedule). The linear and cubic rules get their own ``alpha``
for the same number of rounds as QSR, and ``local_matched`` is constant-H
local SGD with that many rounds too, so those four compare at equal
communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import copy
import json
import math
import os
import time
import types
from typing import Any, NamedTuple

from absl import logging
import ml_collections
import numpy as np

from experiments import config_lib
from experiments import progress
from experiments import train_lib
from experiments.studies import backend

CLUSTER = "cpu:4"


class StudyConfig(NamedTuple):
  """One configuration of the study.

  Attributes:
    sync: the schedule (``config.sync``).
    gamma: the growth rule's exponent for ``"qsr"``; None otherwise.
    compress: the averaging strategy (``config.compress``).
    description: one line for the report.
    compress_kwargs: the strategy's fields (``config.compress_kwargs``).
  """

  sync: str
  gamma: float | None
  compress: str
  description: str
  compress_kwargs: Mapping[str, Any] = types.MappingProxyType({})


CONFIGS: dict[str, StudyConfig] = {
  "dp": StudyConfig("dp", None, "none", "data parallel, float32 gradient mean"),
  "local": StudyConfig("local", None, "none", "local SGD, constant H = h_base"),
  "local_matched": StudyConfig(
    "local", None, "none", "local SGD, constant H with QSR's sync rounds"
  ),
  "qsr": StudyConfig("qsr", 2.0, "none", "QSR, H = max(h_base, (alpha/lr)^2)"),
  "qsr_linear": StudyConfig(
    "qsr", 1.0, "none", "linear rule, H ~ 1/lr, QSR's rounds"
  ),
  "qsr_cubic": StudyConfig(
    "qsr", 3.0, "none", "cubic rule, H ~ 1/lr^3, QSR's rounds"
  ),
  "dp_gqsgd": StudyConfig(
    "dp", None, "gqsgd", "data parallel, Global-QSGD standard dithering (int8)"
  ),
  "dp_gqsgd_int16": StudyConfig(
    "dp",
    None,
    "gqsgd",
    "data parallel, Global-QSGD standard dithering (int16 wire)",
    {"wire": "int16"},
  ),
  "dp_gqsgd_exp": StudyConfig(
    "dp", None, "gqsgd_exp", "data parallel, Global-QSGD exponential dithering"
  ),
  "qsr_gqsgd": StudyConfig(
    "qsr", 2.0, "gqsgd", "QSR with Global-QSGD on the parameter averages"
  ),
}

#: The two tasks: main-job config fields, plus ``h_base`` and
#: ``rounds_fraction`` (QSR's sync-round budget relative to dp).
TASKS: dict[str, dict[str, Any]] = {
  "cnn": {
    "model": "cnn",
    "model_kwargs": {},
    "dataset": "digits",
    "dataset_kwargs": {},
    "steps": 600,
    "batch_size": 32,
    "learning_rate": 3e-3,
    "h_base": 4,
    "rounds_fraction": 0.15,
  },
  "lm": {
    "model": "lm",
    "model_kwargs": {
      "num_layers": 2,
      "num_heads": 4,
      "hidden": 64,
      "mlp_dim": 256,
      "max_len": 64,
    },
    "dataset": "text",
    "dataset_kwargs": {"seq_len": 64, "max_bytes": 1_000_000},
    "steps": 400,
    "batch_size": 16,
    "learning_rate": 3e-3,
    "h_base": 4,
    "rounds_fraction": 0.15,
  },
}


def _rounds(config: ml_collections.ConfigDict) -> int:
  job = config_lib.parse(config)
  return len(config_lib.make_schedule(job).sync_steps(job.steps))


def alpha_for_rounds(
  config: ml_collections.ConfigDict, gamma: float, max_rounds: int
) -> float:
  """The smallest ``alpha`` whose QSR schedule has ``<= max_rounds`` rounds.

  Bisection in ``log(alpha)``: the number of rounds does not grow with
  ``alpha``.

  Raises:
    ValueError: no ``alpha`` reaches ``max_rounds`` (the cap at the
      remaining steps and ``h_base`` bound how few rounds there can be).
  """
  c = copy.deepcopy(config)
  c.sync, c.gamma = "qsr", gamma

  def rounds(alpha):
    c.alpha = alpha
    return _rounds(c)

  lo, hi = 1e-12, float(config.learning_rate)
  while rounds(hi) > max_rounds:
    hi *= 2
    if hi > 1e6 * config.learning_rate:
      raise ValueError(
        f"no alpha gives <= {max_rounds} sync rounds over {config.steps} steps"
      )
  for _ in range(80):
    mid = math.sqrt(lo * hi)
    if rounds(mid) <= max_rounds:
      hi = mid
    else:
      lo = mid
  return hi


def task_config(
  base: ml_collections.ConfigDict, task: Mapping[str, Any], seed: int
) -> ml_collections.ConfigDict:
  """The main job's config of a task in data-parallel mode."""
  c = copy.deepcopy(base)
  for field in (
    "model",
    "dataset",
    "steps",
    "batch_size",
    "learning_rate",
    "h_base",
  ):
    c[field] = task[field]
  c.model_kwargs = ml_collections.ConfigDict(task["model_kwargs"])
  c.dataset_kwargs = ml_collections.ConfigDict(task["dataset_kwargs"])
  c.cluster = CLUSTER
  c.plan_mode = "manual"  # one kind: every worker FP32
  c.lr_schedule = "cosine"
  c.warmup_steps = 0
  c.seed = seed
  c.sync, c.compress = "dp", "none"
  c.log_every = max(task["steps"] // 20, 1)
  c.eval_every = max(task["steps"] // 10, 1)
  c.checkpoint_every = 0
  return c


def configure(
  config: ml_collections.ConfigDict,
  name: str,
  alphas: Mapping[float, float],
  matched_h: int,
) -> ml_collections.ConfigDict:
  """Applies configuration ``name`` of :data:`CONFIGS` to a task config.

  Raises:
    ValueError: an unknown name.
  """
  if name not in CONFIGS:
    raise ValueError(
      f"unknown configuration {name!r}; valid: {', '.join(CONFIGS)}"
    )
  study = CONFIGS[name]
  c = copy.deepcopy(config)
  c.sync, c.compress = study.sync, study.compress
  c.compress_kwargs = ml_collections.ConfigDict(dict(study.compress_kwargs))
  if study.gamma is not None:
    c.gamma, c.alpha = study.gamma, alphas[study.gamma]
  if name == "local_matched":
    c.h_base = matched_h
  return c


def plan_alphas(
  config: ml_collections.ConfigDict, rounds_fraction: float
) -> tuple[dict[float, float], int, int]:
  """QSR's ``alpha`` for the round budget, and the rules matched to it.

  Returns:
    ``({gamma: alpha}, qsr_rounds, matched_h)``: ``alpha`` per rule (QSR's
    for ``rounds_fraction`` of the dp rounds, the linear and cubic rules'
    for QSR's count), QSR's number of rounds, and the constant period with
    as many rounds.
  """
  qsr_alpha = alpha_for_rounds(config, 2.0, int(rounds_fraction * config.steps))
  c = copy.deepcopy(config)
  c.sync, c.gamma, c.alpha = "qsr", 2.0, qsr_alpha
  qsr_rounds = _rounds(c)
  alphas = {2.0: qsr_alpha}
  for gamma in (1.0, 3.0):
    alphas[gamma] = alpha_for_rounds(config, gamma, qsr_rounds)
  matched_h = max(1, round(config.steps / qsr_rounds))
  return alphas, qsr_rounds, matched_h


def h_curve(config: ml_collections.ConfigDict) -> list[int]:
  """``H`` at every step (the period of the step's round)."""
  schedule = config_lib.make_schedule(config_lib.parse(config))
  return [schedule.round_length(t) for t in range(1, config.steps + 1)]


def _eval_curve(run_dir: str) -> list[tuple[int, float]]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Per configuration: final eval mean and std, rounds and bytes."""
  out = {}
  dp = [r for r in runs if r["name"] == "dp"]
  for name in dict.fromkeys(r["name"] for r in runs):
    rs = [r for r in runs if r["name"] == name]
    acc = np.array([r["final_eval"] for r in rs])
    out[name] = {
      "final_eval_mean": float(acc.mean()),
      "final_eval_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
      "n": len(rs),
      "sync_rounds": rs[0]["sync_rounds"],
      "comm_bytes": rs[0]["comm_bytes"],
    }
    if dp:
      out[name]["rounds_vs_dp"] = rs[0]["sync_rounds"] / dp[0]["sync_rounds"]
      out[name]["bytes_vs_dp"] = rs[0]["comm_bytes"] / dp[0]["comm_bytes"]
      out[name]["eval_minus_dp"] = out[name]["final_eval_mean"] - float(
        np.mean([r["final_eval"] for r in dp])
      )
  return out


def run(
  out_dir: str,
  base: ml_collections.ConfigDict,
  tasks: Sequence[str] = tuple(TASKS),
  configs: Sequence[str] = tuple(CONFIGS),
  seeds: int = 3,
  steps: int | None = None,
  learning_rate: float | None = None,
  h_base: int | None = None,
) -> dict[str, Any]:
  """Runs the study; writes ``study.json``, ``h.png`` and ``eval.png``.

  Args:
    out_dir: output directory (one run directory per task, config, seed).
    base: the main job's config, which every run starts from.
    tasks: names of :data:`TASKS`.
    configs: names of :data:`CONFIGS`.
    seeds: seeds per configuration (0, 1, ...).
    steps: override every task's training steps.
    learning_rate: override every task's peak learning rate (QSR's
      ``alpha`` follows, as it is set from the round budget).
    h_base: override every task's ``H_base`` (the local schedules' period
      floor).

  Returns:
    ``{"cluster", "configs", "runs": [{"task", "name", "sync", "compress",
    "seed", "final_eval", "final_eval_loss", "sync_rounds", "comm_bytes",
    ...}], "tasks": {task: {"alphas", "qsr_rounds", "matched_h",
    "summary", "h_curves", "eval_curves"}}}``; ``final_eval`` is the eval
    accuracy (next-byte accuracy for the LM).

  Raises:
    ValueError: an unknown task or configuration, none of either, fewer
      than 1 seed, a learning rate that is not positive or an ``h_base``
      below 1 (before anything is written).
  """
  backend.check_runs(tasks, configs, seeds, TASKS, CONFIGS)
  if learning_rate is not None and not learning_rate > 0:
    raise ValueError(f"learning_rate must be positive, got {learning_rate}")
  if h_base is not None and h_base < 1:
    raise ValueError(f"h_base must be >= 1, got {h_base}")
  os.makedirs(out_dir, exist_ok=True)
  result = {
    "cluster": CLUSTER,
    "configs": {c: CONFIGS[c].description for c in configs},
    "runs": [],
    "tasks": {},
  }
  path = os.path.join(out_dir, "study.json")
  runs = progress.Progress(len(tasks) * len(configs) * seeds, logging.info)
  for tname in tasks:
    task = copy.deepcopy(TASKS[tname])
    if steps is not None:
      task["steps"] = steps
    if learning_rate is not None:
      task["learning_rate"] = learning_rate
    if h_base is not None:
      task["h_base"] = h_base
    config0 = task_config(base, task, 0)
    alphas, qsr_rounds, matched_h = plan_alphas(
      config0, task["rounds_fraction"]
    )
    entry = {
      "model": task["model"],
      "dataset": task["dataset"],
      "steps": task["steps"],
      "h_base": task["h_base"],
      "learning_rate": task["learning_rate"],
      "alphas": {f"gamma{g:g}": a for g, a in alphas.items()},
      "qsr_rounds": qsr_rounds,
      "matched_h": matched_h,
      "h_curves": {},
      "eval_curves": {},
    }
    result["tasks"][tname] = entry
    logging.info(
      "%s: QSR alpha %.3g (%d rounds), linear %.3g, cubic %.3g, "
      "matched constant H %d",
      tname,
      alphas[2.0],
      qsr_rounds,
      alphas[1.0],
      alphas[3.0],
      matched_h,
    )
    for name in configs:
      entry["h_curves"][name] = h_curve(
        configure(config0, name, alphas, matched_h)
      )
      curves = []
      for seed in range(seeds):
        c = configure(task_config(base, task, seed), name, alphas, matched_h)
        run_dir = os.path.join(out_dir, tname, name, f"seed{seed}")
        start = time.perf_counter()
        summary = train_lib.train_and_evaluate(config_lib.parse(c), run_dir)
        row = {
          "task": tname,
          "name": name,
          "sync": summary["sync"],
          "compress": summary["compress"],
          "seed": seed,
          "h_base": c.h_base,
          "alpha": c.alpha if c.sync == "qsr" else None,
          "gamma": c.gamma if c.sync == "qsr" else None,
          "final_eval": summary["final_eval_accuracy"],
          "final_eval_loss": summary["final_eval_loss"],
          "sync_rounds": summary["sync_rounds"],
          "comm_bytes": summary["comm_bytes"],
          "wall_time_s": time.perf_counter() - start,
        }
        result["runs"].append(row)
        curves.append(_eval_curve(run_dir))
        logging.info(
          "%s %s seed %d: eval %.4f, %d sync rounds",
          tname,
          name,
          seed,
          row["final_eval"],
          row["sync_rounds"],
        )
        runs.done(f"qsr {tname} {name} seed {seed}")
        entry["summary"] = summarize(
          [r for r in result["runs"] if r["task"] == tname]
        )
        with open(path, "w") as f:
          json.dump(result, f, indent=2)
      entry["eval_curves"][name] = {
        "step": [s for s, _ in curves[0]],
        "mean": np.mean([[v for _, v in cv] for cv in curves], 0).tolist(),
      }
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
  plot(result, out_dir)
  return result


def plot(result: Mapping[str, Any], out_dir: str) -> None:
  """Writes ``h.png`` (H over training) and ``eval.png`` (eval metric)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = list(result["tasks"])
  for fname, key, ylabel in (
    ("h.png", "h_curves", "H (steps per round)"),
    ("eval.png", "eval_curves", "eval accuracy"),
  ):
    fig, axes = plt.subplots(
      1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False
    )
    for j, tname in enumerate(tasks):
      ax = axes[0, j]
      for name, curve in result["tasks"][tname][key].items():
        if key == "h_curves":
          if CONFIGS[name].compress != "none" and CONFIGS[name].sync == "dp":
            continue  # same H as dp
          ax.plot(range(1, len(curve) + 1), curve, label=name)
        else:
          ax.plot(curve["step"], curve["mean"], "o-", ms=3, label=name)
      if key == "h_curves":
        ax.set_yscale("log")
      ax.set(title=tname, xlabel="step", ylabel=ylabel)
      ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, fname), dpi=90)
    plt.close(fig)
