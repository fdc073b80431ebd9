"""Time to target accuracy over an emulated slow network.

This module owns :func:`run`, the network study: four processes, each
in its own network namespace behind an emulated link
(:mod:`qsync_jax.launch.links`, through ``python -m
qsync_jax.distributed --link``), train the same communication-bound model
under every configuration of :data:`RUNS`, over several seeds, and the study
reports for each the training wall time to a target eval accuracy, the final
accuracy, the bytes each worker sent and the mean step time.

The task is communication-bound by construction: the main job's CNN on
digits with a 10240-wide hidden layer (10.6M parameters, 42 MB of float32)
at 16 examples per worker, so that the parameters, not the activations, set
a step's cost, and a data-parallel step at 1 Gbit/s spends about as long
averaging as computing. Wall time counts training only (the
``train_time_s`` of ``metrics.jsonl``: evaluations and checkpoints are left
out), and an eval every ``eval_every`` steps marks when the target is
reached.

``alpha`` of QSR is not tuned on accuracy: as in
:mod:`experiments.studies.qsr` it is the smallest value whose schedule
synchronizes at most ``rounds_fraction`` of data parallelism's rounds.

The heterogeneous pair (``dp_hetero``, ``dynamic_hetero``) throttles two of
the four processes with the cgroup cpu controller (``--cpu_quota``) and
labels them as a slower kind; dynamic batch sizing (QSync's DB baseline)
splits the global batch in proportion to the quotas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import types
from typing import Any

from absl import logging
from flax import nnx
import jax
import ml_collections
import numpy as np

from experiments import config_lib
from experiments import progress
from experiments.configs import default
from experiments.studies import qsr as qsr_study
from qsync_jax import data as data_lib
from qsync_jax.launch import links

NUM_PROCESSES = 4
#: The model: the main job's CNN, its hidden layer wide enough that the
#: parameters (not the activations) set the step's cost.
MODEL_KWARGS = {"widths": [32, 64], "hidden": 10240}
#: What every run shares (fields of experiments/configs/default.py).
BASE = types.MappingProxyType(
  {
    "model": "cnn",
    "dataset": "digits",
    "cluster": "cpu:4",
    "plan_mode": "manual",
    "batch_size": 16,
    "steps": 150,
    "optimizer": "sgd",
    "momentum": 0.9,
    "learning_rate": 0.05,
    "lr_schedule": "cosine",
    "warmup_steps": 10,
    "h_base": 4,
    "eval_every": 5,
    "log_every": 10,
    "checkpoint_every": 0,
  }
)
#: The slow kind's share of a CPU against the fast kind's, for the
#: heterogeneous pair (two processes each; four processes on two cores).
HETERO_QUOTA = "0.75,0.75,0.25,0.25"
HETERO = types.MappingProxyType(
  {"cluster": "v100:2,t4:2", "speeds": "v100:3,t4:1"}
)


@dataclasses.dataclass(frozen=True)
class NetworkRun:
  """One configuration of the study.

  Attributes:
    description: one line for the report.
    overrides: config fields on top of :data:`BASE`.
    hetero: run on the throttled heterogeneous cluster.
  """

  description: str
  overrides: Mapping[str, Any]
  hetero: bool = False


RUNS: dict[str, NetworkRun] = {
  "dp": NetworkRun("data parallel, float32 gradient mean", {}),
  "dp_gqsgd": NetworkRun(
    "data parallel, Global-QSGD (int8 sums)", {"compress": "gqsgd"}
  ),
  "dp_powersgd": NetworkRun(
    "data parallel, PowerSGD rank 16 with error feedback",
    {
      "compress": "powersgd",
      "compress_kwargs.rank": 16,
      "error_feedback": True,
    },
  ),
  "local": NetworkRun("local SGD, H = h_base", {"sync": "local"}),
  "qsr": NetworkRun("QSR, H = max(h_base, (alpha/lr)^2)", {"sync": "qsr"}),
  "qsr_gqsgd": NetworkRun(
    "QSR, parameters averaged with Global-QSGD",
    {"sync": "qsr", "compress": "gqsgd"},
  ),
  "diloco": NetworkRun(
    "local SGD, H = h_base, DiLoCo outer Nesterov (lr 0.7, mom. 0.9)",
    {"sync": "local", "outer_optimizer": "diloco"},
  ),
  "dp_hetero": NetworkRun(
    "data parallel, two of four processes at 1/3 the CPU, equal batches",
    {},
    hetero=True,
  ),
  "dynamic_hetero": NetworkRun(
    "data parallel, two of four processes at 1/3 the CPU, batches 3:1",
    {"batch_mode": "dynamic"},
    hetero=True,
  ),
}
#: The ratio the study is judged by and its two runs.
KEY_RATIO = ("time_to_target_ratio_qsr_gqsgd_vs_dp", "qsr_gqsgd", "dp")


def run_config(
  name: str,
  seed: int,
  *,
  steps: int | None = None,
  rounds_fraction: float = 0.15,
  model_kwargs: Mapping[str, Any] | None = None,
) -> ml_collections.ConfigDict:
  """The full config of one run (``alpha`` set from the round budget;
  ``model_kwargs`` replace :data:`MODEL_KWARGS`)."""
  spec = RUNS[name]
  config = default.get_config()
  fields = {
    **BASE,
    **(HETERO if spec.hetero else {}),
    **spec.overrides,
    "seed": seed,
  }
  if steps is not None:
    # A shorter run keeps the warmup's share of the steps.
    fields["steps"] = steps
    fields["warmup_steps"] = min(
      BASE["warmup_steps"], steps * BASE["warmup_steps"] // BASE["steps"]
    )
  config.model_kwargs = ml_collections.ConfigDict(
    dict(MODEL_KWARGS if model_kwargs is None else model_kwargs)
  )
  for key, value in fields.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  if config.sync == "qsr":
    budget = max(1, int(rounds_fraction * config.steps))
    config.alpha = qsr_study.alpha_for_rounds(config, config.gamma, budget)
  return config


def num_params(model_kwargs: Mapping[str, Any] | None = None) -> int:
  """The study model's parameter count."""
  config = run_config("dp", 0, model_kwargs=model_kwargs)
  return param_count(
    config_lib.build_model(
      config_lib.parse(config), data_lib.load_dataset(config.dataset)
    )
  )


def param_count(model: nnx.Module) -> int:
  """``model``'s parameter count: every ``nnx.Param`` element, what an
  average sends."""
  return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _flag_value(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value)


def command(
  config: ml_collections.ConfigDict,
  name: str,
  run_dir: str,
  *,
  link: str,
  topology: str,
) -> list[str]:
  """The launcher command line of one run."""
  spec = RUNS[name]
  cmd = [
    sys.executable,
    "-m",
    "qsync_jax.distributed",
    f"--num_processes={NUM_PROCESSES}",
    f"--link={link}",
    f"--topology={topology}",
  ]
  if spec.hetero:
    cmd.append(f"--cpu_quota={HETERO_QUOTA}")
  cmd += [
    "--",
    sys.executable,
    "-m",
    "experiments.train",
    f"--out_dir={run_dir}",
    f"--model_kwargs={json.dumps(config.model_kwargs.to_dict())}",
  ]
  flat = config.to_dict()
  # alpha is set for QSR runs only (unset: the default config's rule).
  alpha = () if config.alpha is None else ("alpha",)
  keys = sorted({*BASE, *HETERO, *spec.overrides, "seed", *alpha})
  for key in keys:
    node = flat
    for part in key.split("."):
      node = node[part]
    cmd.append(f"--config.{key}={_flag_value(node)}")
  return cmd


#: The fields of a run's ``summary.json`` that a study's summary keeps.
RUN_SUMMARY_FIELDS = (
  "final_eval_accuracy",
  "final_eval_loss",
  "steps",
  "train_time_s",
  "wall_time_s",
)


def run_record(
  run: Mapping[str, Any],
  keys: Sequence[str],
  summary_fields: Sequence[str] = RUN_SUMMARY_FIELDS,
) -> dict[str, Any]:
  """What a study's summary keeps of one run.

  Args:
    run: the run as :func:`run` reads it (with its ``summary.json`` under
      ``"summary"``).
    keys: the run's own fields to keep.
    summary_fields: the fields of its ``summary.json`` to keep (None where
      it has none).

  Returns:
    ``{key: run[key] for key in keys}`` with ``"summary"``: those fields.
  """
  return {k: run[k] for k in keys} | {
    "summary": {k: run["summary"].get(k) for k in summary_fields}
  }


def eval_curve(run_dir: str) -> list[dict[str, float]]:
  """``[{step, train_time_s, accuracy}]`` at every eval of a run."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [
    {
      "step": r["step"],
      "train_time_s": r["train_time_s"],
      "accuracy": r["eval_accuracy"],
    }
    for r in rows
    if "eval_accuracy" in r
  ]


def time_to_target(
  curve: Sequence[Mapping[str, float]], target: float
) -> tuple[float | None, int | None]:
  """Training seconds and steps to the first eval at ``target`` or above
  (``(None, None)`` if no eval reaches it)."""
  for point in curve:
    if point["accuracy"] >= target:
      return point["train_time_s"], point["step"]
  return None, None


def _run_one(
  name: str,
  seed: int,
  run_dir: str,
  *,
  link: str,
  topology: str,
  steps: int | None,
  rounds_fraction: float,
  timeout_s: float,
  model_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
  """Trains one run (unless its summary is there) and reads its results."""
  config = run_config(
    name,
    seed,
    steps=steps,
    rounds_fraction=rounds_fraction,
    model_kwargs=model_kwargs,
  )
  summary_path = os.path.join(run_dir, "summary.json")
  if not os.path.exists(summary_path):
    if os.path.exists(run_dir):
      # A run cut short: start it again from nothing.
      shutil.rmtree(run_dir)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    cmd = command(config, name, run_dir, link=link, topology=topology)
    logging.info("%s seed %d: %s", name, seed, " ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.run(
      cmd, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    with open(run_dir + ".log", "w") as f:
      f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
      tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-5:])
      raise RuntimeError(
        f"run {name} seed {seed} failed (exit "
        f"{proc.returncode}); log {run_dir}.log:\n{tail}"
      )
    logging.info("%s seed %d: %.0f s", name, seed, time.perf_counter() - start)
  with open(summary_path) as f:
    summary = json.load(f)
  return {
    "name": name,
    "seed": seed,
    "run_dir": run_dir,
    "alpha": None if config.alpha is None else float(config.alpha),
    "summary": summary,
    "curve": eval_curve(run_dir),
  }


def summarize(
  runs: Sequence[Mapping[str, Any]], target: float
) -> dict[str, Any]:
  """Per configuration: time to target, final accuracy, bytes, step time."""
  out = {}
  for name in dict.fromkeys(r["name"] for r in runs):
    rs = [r for r in runs if r["name"] == name]
    times = [time_to_target(r["curve"], target)[0] for r in rs]
    reached = [t for t in times if t is not None]
    final = np.array([r["summary"]["final_eval_accuracy"] for r in rs])
    step_s = np.array(
      [r["summary"]["train_time_s"] / r["summary"]["steps"] for r in rs]
    )
    out[name] = {
      "description": RUNS[name].description,
      "seeds": len(rs),
      "reached_target": len(reached),
      "time_to_target_s": times,
      # Over the seeds that reached the target; None if none did.
      "time_to_target_mean_s": (float(np.mean(reached)) if reached else None),
      "final_accuracy_mean": float(final.mean()),
      "final_accuracy_std": (
        float(final.std(ddof=1)) if len(final) > 1 else 0.0
      ),
      "bytes_sent_per_worker": float(
        np.mean([r["summary"]["comm_bytes"] for r in rs])
      ),
      "sync_rounds": int(rs[0]["summary"]["sync_rounds"]),
      "step_time_mean_s": float(step_s.mean()),
      "train_time_mean_s": float(
        np.mean([r["summary"]["train_time_s"] for r in rs])
      ),
    }
  return out


def ratio(summary: Mapping[str, Any], name: str, baseline: str) -> float | None:
  """Mean time to target of ``name`` over ``baseline``'s (None when either
  is missing, or a seed of either did not reach the target)."""
  a, b = summary.get(name), summary.get(baseline)
  if (
    not a
    or not b
    or a["reached_target"] < a["seeds"]
    or (b["reached_target"] < b["seeds"])
  ):
    return None
  return a["time_to_target_mean_s"] / b["time_to_target_mean_s"]


def plot(
  runs: Sequence[Mapping[str, Any]],
  names: Sequence[str],
  target: float,
  path: str,
  title: str,
  linestyles: Mapping[str, str] | None = None,
) -> None:
  """Eval accuracy against training wall time, one line per seed.

  ``linestyles`` maps a name to a matplotlib line style (default solid);
  past ten names the colours come from a 20-colour map, so that no two
  names share one.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(8, 5))
  colors = (
    plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(names) <= 10
    else list(plt.get_cmap("tab20").colors)
  )
  for i, name in enumerate(names):
    for r in (r for r in runs if r["name"] == name):
      ax.plot(
        [p["train_time_s"] for p in r["curve"]],
        [p["accuracy"] for p in r["curve"]],
        color=colors[i % len(colors)],
        ls=(linestyles or {}).get(name, "-"),
        alpha=0.8,
        lw=1.2,
        label=name if r["seed"] == 0 else None,
      )
  ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target}")
  ax.set_xlabel("training wall time (s)")
  ax.set_ylabel("eval accuracy")
  ax.set_ylim(max(0.0, target - 0.35), 1.0)
  ax.set_title(title)
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(
  out_dir: str,
  *,
  names: Sequence[str] = tuple(RUNS),
  seeds: int = 3,
  target: float = 0.95,
  link: str = "1gbit",
  topology: str = "per_node",
  steps: int | None = None,
  rounds_fraction: float = 0.15,
  timeout_s: float = 1200.0,
  predictions: Callable[[dict[str, Any], list[dict[str, Any]]], None]
  | None = None,
  model_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Runs the study (reusing finished runs) and writes its outputs.

  Args:
    out_dir: one ``<name>/seed<k>`` run directory each, ``summary.json``,
      ``time_to_accuracy.png`` and ``time_to_accuracy_hetero.png``.
    names: names of :data:`RUNS`.
    seeds: seeds per configuration (0, 1, ...).
    target: the eval accuracy whose first crossing times a run.
    link: each process's emulated link rate (``--link``).
    topology: ``per_node`` or ``shared``.
    steps: override :data:`BASE`'s training steps.
    rounds_fraction: QSR's sync-round budget as a fraction of dp's.
    timeout_s: the longest one run may take.
    predictions: called with the per-configuration summaries and the runs
      before the summary is written, to add to them (the binary passes
      :func:`experiments.studies.network_prediction.add_predictions`: the
      predictor's step of each homogeneous configuration); None: none.
    model_kwargs: the CNN's arguments instead of :data:`MODEL_KWARGS`
      (e.g. a small one for a quick check).

  Returns:
    The summary written to ``summary.json``.

  Raises:
    ValueError: an unknown configuration, fewer than one seed or a target
      outside (0, 1].
    RuntimeError: a run failed (its log's last lines).
    qsync_jax.launch.links.LinkUnavailableError: links cannot be emulated
      here (not root, no ``ip``/``tc``); nothing is written.
  """
  unknown = [n for n in names if n not in RUNS]
  if unknown or not names:
    raise ValueError(
      f"unknown configuration(s) {unknown or 'none given'}; "
      f"valid: {', '.join(RUNS)}"
    )
  if seeds < 1:
    raise ValueError(f"seeds must be >= 1, got {seeds}")
  if not 0 < target <= 1:
    raise ValueError(f"target must be an accuracy in (0, 1], got {target}")
  reason = links.unavailable_reason()
  if reason is not None:
    raise links.LinkUnavailableError(
      f"the network study needs emulated links: {reason}"
    )
  os.makedirs(out_dir, exist_ok=True)
  bar = progress.Progress(len(names) * seeds, logging.info)
  runs = []
  for seed in range(seeds):  # seed-major: a partial study covers every run
    for name in names:
      runs.append(
        _run_one(
          name,
          seed,
          os.path.join(out_dir, name, f"seed{seed}"),
          link=link,
          topology=topology,
          steps=steps,
          rounds_fraction=rounds_fraction,
          timeout_s=timeout_s,
          model_kwargs=model_kwargs,
        )
      )
      bar.done(f"network {name} seed {seed}")
  per_config = summarize(runs, target)
  if predictions is not None:
    predictions(per_config, runs)
  key, num, den = KEY_RATIO
  result = {
    key: ratio(per_config, num, den),
    "final_accuracy_gap_qsr_gqsgd_vs_dp_points": (
      100
      * (
        per_config[num]["final_accuracy_mean"]
        - per_config[den]["final_accuracy_mean"]
      )
      if num in per_config and den in per_config
      else None
    ),
    "time_to_target_ratio_dynamic_vs_dp_hetero": ratio(
      per_config, "dynamic_hetero", "dp_hetero"
    ),
    "time_to_target_ratio_vs_dp": {
      n: ratio(per_config, n, "dp") for n in per_config if not RUNS[n].hetero
    },
    "target_accuracy": target,
    "link": runs[0]["summary"]["link"],
    "hetero_cpu_quota": HETERO_QUOTA,
    "num_processes": NUM_PROCESSES,
    "base_config": dict(BASE),
    "model_kwargs": dict(
      MODEL_KWARGS if model_kwargs is None else model_kwargs
    ),
    "num_params": num_params(model_kwargs),
    "configs": per_config,
    "runs": [
      run_record(
        r,
        ("name", "seed", "alpha", "curve"),
        RUN_SUMMARY_FIELDS
        + ("comm_bytes", "sync_rounds", "compress", "sync", "workers"),
      )
      for r in runs
    ],
  }
  homogeneous = [n for n in names if not RUNS[n].hetero]
  hetero = [n for n in names if RUNS[n].hetero]
  if homogeneous:
    plot(
      runs,
      homogeneous,
      target,
      os.path.join(out_dir, "time_to_accuracy.png"),
      f"{NUM_PROCESSES} processes, {link} {topology}",
    )
  if hetero:
    plot(
      runs,
      hetero,
      target,
      os.path.join(out_dir, "time_to_accuracy_hetero.png"),
      f"{NUM_PROCESSES} processes, {link}, CPU quota {HETERO_QUOTA}",
    )
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result
