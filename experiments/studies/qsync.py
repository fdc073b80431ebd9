"""QSync's headline comparison at small scale (``experiments/qsync_study.py``).

This module owns :func:`run`: for a CNN and an encoder, train four workers
(``v100:2,t4:2`` on fake CPU devices) under every precision-allocation
configuration of :data:`CONFIGS`, over several seeds, and predict the step
time of each method on a real-size cluster (``v100:8,t4:8``, analytic
profiles) for the paper-size models (ResNet-50 at 224 x 224, BERT-base at
384 tokens). QSync (arXiv 2407.02327) reports +0.27% to +1.03% accuracy over
uniform low precision with no slower steps.

The trained models are small enough for a 2-core CPU; their plans come from
the allocator run on the *deployment twin* of each (the same layers at the
size it would be deployed at, e.g. ResNet-18 on 32 x 32 CIFAR images), and
the paper-size step times from the allocator run on ResNet-50 and BERT-base
with indicator scores from narrow copies of those (same layer paths).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import copy
import json
import os
import time
from typing import Any

from absl import logging
from flax import nnx
import ml_collections
import numpy as np

from experiments import config_lib
from experiments import progress
from experiments import train_lib
from experiments.studies import backend
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import predictor
from qsync_jax.allocation import allocator as allocator_lib
from qsync_jax.allocation import pipeline
from qsync_jax.parallel.cluster import parse_cluster

CLUSTER = "v100:2,t4:2"
PAPER_CLUSTER = "v100:8,t4:8"

#: Each configuration: how the T4 workers get their plan (or batch).
CONFIGS = {
  "fp32": "every worker FP32 (the T4s straggle)",
  "uniform_low": "T4 workers INT8 everywhere the policy allows",
  "qsync": "the allocator's greedy plan, QSync indicator",
  "qsync_var": "the allocator's greedy plan, second-order variance "
  "indicator (qsync_var)",
  "greedy_random": "the allocator's greedy plan, random indicator",
  "dynamic_batch": "FP32, batches split by predicted FP32 speed",
  "ilp_qsync": "ILP at 60% compression, INT8/FP16, QSync indicator",
  "ilp_wvar": "ILP at 60% compression, INT8/FP16, weight-variance indicator",
  "ilp_random": "ILP at 60% compression, INT8/FP16, random indicator",
  "ilp_qsync_var": "ILP at 60% compression, INT8/FP16, second-order "
  "variance indicator (qsync_var)",
}

#: The configurations that train the allocator's greedy plan: the indicator
#: each scores the layers with (named explicitly, not the config default).
GREEDY_INDICATORS = {
  "qsync": "qsync",
  "qsync_var": "qsync_var",
  "greedy_random": "random",
}

#: The two tasks. ``twin``: config overrides for the deployment twin the
#: plans are made for; ``paper``: the paper-size model and the narrow copy
#: of it that the indicator scores.
TASKS: dict[str, dict[str, Any]] = {
  "cnn": {
    "model": "resnet18",
    "model_kwargs": {
      "width": 8,
      "image_size": 8,
      "in_channels": 1,
      "num_classes": 10,
    },
    "dataset": "digits",
    "dataset_kwargs": {},
    "steps": 300,
    "batch_size": 32,
    "learning_rate": 3e-3,
    "twin": {"width": 64, "image_size": 32, "in_channels": 3},
    "twin_batch_size": 128,
    "paper": {
      "model": "resnet50",
      "batch_size": 32,
      "score_kwargs": {
        "width": 8,
        "image_size": 8,
        "in_channels": 1,
        "num_classes": 10,
      },
    },
  },
  "encoder": {
    "model": "bert",
    "model_kwargs": {
      "num_layers": 4,
      "num_heads": 4,
      "hidden": 64,
      "mlp_dim": 256,
      "max_len": 32,
      "vocab_size": 256,
      "num_classes": 5,
    },
    "dataset": "text_classes",
    "dataset_kwargs": {"seq_len": 32, "max_bytes": 2_000_000},
    "steps": 400,
    "batch_size": 32,
    "learning_rate": 1e-3,
    "twin": {
      "num_heads": 12,
      "hidden": 768,
      "mlp_dim": 3072,
      "max_len": 128,
      "vocab_size": 30522,
    },
    "twin_batch_size": 32,
    "paper": {
      "model": "bert",
      "batch_size": 12,
      "score_kwargs": {
        "num_layers": 12,
        "num_heads": 4,
        "hidden": 64,
        "mlp_dim": 256,
        "max_len": 32,
        "vocab_size": 256,
        "num_classes": 5,
      },
    },
  },
}


def task_config(
  base: ml_collections.ConfigDict,
  task: Mapping[str, Any],
  name: str,
  seed: int,
  speeds: Mapping[str, float] | None = None,
) -> ml_collections.ConfigDict:
  """The main job's config for one task, configuration and seed.

  Args:
    base: the main job's config (``experiments/configs/default.py``).
    task: an entry of :data:`TASKS`.
    name: a key of :data:`CONFIGS`.
    seed: model and data seed.
    speeds: ``{kind: relative speed}`` for ``dynamic_batch``.

  Raises:
    ValueError: an unknown configuration name.
  """
  if name not in CONFIGS:
    raise ValueError(
      f"unknown configuration {name!r}; valid: {', '.join(CONFIGS)}"
    )
  c = copy.deepcopy(base)
  c.model = task["model"]
  c.model_kwargs = ml_collections.ConfigDict(task["model_kwargs"])
  c.dataset = task["dataset"]
  c.dataset_kwargs = ml_collections.ConfigDict(task["dataset_kwargs"])
  c.cluster = CLUSTER
  c.steps = task["steps"]
  c.batch_size = task["batch_size"]
  c.learning_rate = task["learning_rate"]
  c.seed = seed
  c.eval_every = 0
  c.checkpoint_every = 0
  c.log_every = max(task["steps"] // 4, 1)
  c.allocator.timing_model_kwargs = ml_collections.ConfigDict(task["twin"])
  c.allocator.timing_batch_size = task["twin_batch_size"]
  if name in ("fp32", "uniform_low", "dynamic_batch"):
    c.plan_mode = "manual"
    if name == "uniform_low":
      c.plans = ml_collections.ConfigDict(
        {"t4": {"rules": [], "default": "int8"}}
      )
    if name == "dynamic_batch":
      c.batch_mode = "dynamic"
      c.speeds = ",".join(f"{k}:{v:.6g}" for k, v in speeds.items())
  elif name in GREEDY_INDICATORS:
    c.allocator.method = "greedy"
    c.allocator.indicator = GREEDY_INDICATORS[name]
  elif name.startswith("ilp_"):
    c.allocator.method = "ilp"
    c.allocator.indicator = name[len("ilp_") :]
    c.allocator.compression = 0.6
    c.allocator.candidates = ("int8", "fp16")
  return c


def twin_speeds(task: Mapping[str, Any]) -> dict[str, float]:
  """Predicted FP32 examples/s of each kind for the task's twin."""
  factory = models_lib.load_model_factory(task["model"])
  twin = factory(rngs=nnx.Rngs(0), **{**task["model_kwargs"], **task["twin"]})
  g = predictor.trace_graph(twin, twin.input_spec(task["twin_batch_size"]))
  spec = parse_cluster(CLUSTER)
  profiles = {k: predictor.analytic_profile(g, k) for k in spec.groups()}
  return allocator_lib.fp32_speeds(g, spec, profiles)


def paper_prediction(
  task: Mapping[str, Any], configs: Sequence[str] = ()
) -> dict[str, Any]:
  """The allocation summary for the paper-size model on v100:8,t4:8.

  Args:
    task: an entry of :data:`TASKS`.
    configs: names of :data:`CONFIGS`; each greedy one other than ``qsync``
      (:data:`GREEDY_INDICATORS`) also gets the step of the greedy plan made
      with its own indicator's scores (each indicator scored once), under
      its name in ``predicted_step_time_s`` and in ``greedy``.

  Returns:
    The summary of the greedy plan with the QSync indicator and its
    baselines (:meth:`~qsync_jax.allocation.pipeline.PlanningResult.summary`),
    its ``plans``, and ``greedy``: ``{config: {"indicator",
    "quantized_layers"}}``.
  """
  paper = task["paper"]
  factory = models_lib.load_model_factory(paper["model"])
  scored = factory(rngs=nnx.Rngs(0), **paper["score_kwargs"])
  dataset = data_lib.load_dataset(task["dataset"], **task["dataset_kwargs"])
  big = factory(
    rngs=nnx.Rngs(0), **models_lib.PAPER_SIZE_KWARGS[paper["model"]]
  )
  scores: dict[str, Any] = {}

  def plan(indicator: str, baselines: bool) -> pipeline.PlanningResult:
    if indicator not in scores:
      scores[indicator] = pipeline.compute_scores(scored, dataset, indicator)
    return pipeline.plan_cluster(
      big,
      PAPER_CLUSTER,
      scores[indicator].values,
      paper["batch_size"],
      indicator_name=indicator,
      baselines=baselines,
    )

  result = plan("qsync", True)
  summary = result.summary()
  greedy = {}
  for name in configs:
    if name not in GREEDY_INDICATORS or name == "qsync":
      continue
    other = plan(GREEDY_INDICATORS[name], False).allocation
    summary["predicted_step_time_s"][name] = other.prediction.step_time_s
    greedy[name] = {
      "indicator": GREEDY_INDICATORS[name],
      "quantized_layers": dict(other.quantized_layers),
    }
  return {
    "model": paper["model"],
    "model_kwargs": models_lib.PAPER_SIZE_KWARGS[paper["model"]],
    "batch_size": paper["batch_size"],
    **summary,
    "plans": {
      k: {p: v.value for p, v in ps.items()}
      for k, ps in result.allocation.precisions.items()
    },
    "greedy": greedy,
  }


def layer_counts(precisions: Mapping[str, str]) -> dict[str, int]:
  """``{precision: number of layers}`` of one worker's plan."""
  counts: dict[str, int] = {}
  for p in precisions.values():
    counts[p] = counts.get(p, 0) + 1
  return dict(sorted(counts.items()))


def twin_allocation(run_dir: str) -> dict[str, Any]:
  """The allocator's prediction for a run's plans on the deployment twin.

  Returns:
    ``{"indicator", "twin_step_time_s", "twin_target_s"}`` from the run's
    ``allocation/summary.json`` (the allocator's indicator, the predicted
    step of its plans and the training devices' pace it aimed at), or
    ``{}`` for a run whose plans did not come from the allocator.
  """
  path = os.path.join(run_dir, "allocation", "summary.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    summary = json.load(f)
  return {
    "indicator": summary["indicator"],
    "twin_step_time_s": summary["predicted_step_time_s"]["qsync"],
    "twin_target_s": summary["target_s"],
  }


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Mean and standard deviation of the final accuracy per configuration."""
  out = {}
  for name in dict.fromkeys(r["config"] for r in runs):
    acc = np.array(
      [r["final_eval_accuracy"] for r in runs if r["config"] == name]
    )
    out[name] = {
      "mean": float(acc.mean()),
      "std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
      "n": len(acc),
    }
  return out


def run(
  out_dir: str,
  base: ml_collections.ConfigDict,
  tasks: Sequence[str] = tuple(TASKS),
  configs: Sequence[str] = tuple(CONFIGS),
  seeds: int = 3,
  steps: int | None = None,
  predict: bool = True,
) -> dict[str, Any]:
  """Runs the study and writes ``study.json`` and ``study.png``.

  Args:
    out_dir: output directory (one run directory per task, config, seed).
    base: the main job's config, which every run starts from.
    tasks: names of :data:`TASKS`.
    configs: names of :data:`CONFIGS`.
    seeds: seeds per configuration (0, 1, ...).
    steps: override every task's training steps.
    predict: also predict the paper-size step times.

  Returns:
    ``{"cluster", "paper_cluster", "configs", "tasks": {task: {"runs",
    "accuracy": {config: {"mean", "std", "n"}}, "paper"}}}``.

  Raises:
    ValueError: an unknown task or configuration, none of either, or
      fewer than 1 seed.
  """
  backend.check_runs(tasks, configs, seeds, TASKS, CONFIGS)
  os.makedirs(out_dir, exist_ok=True)
  result = {
    "cluster": CLUSTER,
    "paper_cluster": PAPER_CLUSTER,
    "configs": {c: CONFIGS[c] for c in configs},
    "tasks": {},
  }
  path = os.path.join(out_dir, "study.json")
  runs = progress.Progress(len(tasks) * len(configs) * seeds, logging.info)
  for tname in tasks:
    task = copy.deepcopy(TASKS[tname])
    if steps is not None:
      task["steps"] = steps
    speeds = twin_speeds(task)
    entry = {
      "model": task["model"],
      "model_kwargs": task["model_kwargs"],
      "dataset": task["dataset"],
      "steps": task["steps"],
      "twin_fp32_speeds": speeds,
      "runs": [],
    }
    result["tasks"][tname] = entry
    for name in configs:
      for seed in range(seeds):
        run_dir = os.path.join(out_dir, tname, name, f"seed{seed}")
        start = time.perf_counter()
        summary = train_lib.train_and_evaluate(
          config_lib.parse(task_config(base, task, name, seed, speeds)),
          run_dir,
        )
        row = {
          "config": name,
          "seed": seed,
          "final_eval_accuracy": summary["final_eval_accuracy"],
          "final_eval_loss": summary["final_eval_loss"],
          "t4_precisions": summary["precisions"][-1],
          "batch_sizes": [w["batch_size"] for w in summary["workers"]],
          "wall_time_s": time.perf_counter() - start,
          "t4_layers": layer_counts(summary["precisions"][-1]),
          **twin_allocation(run_dir),
        }
        entry["runs"].append(row)
        logging.info(
          "%s %s seed %d: accuracy %.4f",
          tname,
          name,
          seed,
          row["final_eval_accuracy"],
        )
        runs.done(f"qsync {tname} {name} seed {seed}")
        entry["accuracy"] = summarize(entry["runs"])
        with open(path, "w") as f:
          json.dump(result, f, indent=2)
    if predict:
      entry["paper"] = paper_prediction(task, configs)
    with open(path, "w") as f:
      json.dump(result, f, indent=2)
  plot(result, os.path.join(out_dir, "study.png"))
  return result


def plot(result: Mapping[str, Any], png_path: str) -> None:
  """Accuracy (mean +- std) per configuration and paper-size step times."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = list(result["tasks"])
  fig, axes = plt.subplots(
    2, len(tasks), figsize=(6 * len(tasks), 7), squeeze=False
  )
  for j, tname in enumerate(tasks):
    entry = result["tasks"][tname]
    acc = entry.get("accuracy", {})
    names = list(acc)
    ax = axes[0, j]
    ax.bar(
      names,
      [acc[n]["mean"] for n in names],
      yerr=[acc[n]["std"] for n in names],
      capsize=3,
    )
    lo = min(acc[n]["mean"] - acc[n]["std"] for n in names) if names else 0
    ax.set_ylim(max(0.0, lo - 0.05), 1.0)
    ax.set_title(f"{tname}: final accuracy ({result['cluster']})")
    ax.tick_params(axis="x", rotation=45, labelsize=8)
    ax = axes[1, j]
    paper = entry.get("paper")
    if paper:
      steps = paper["predicted_step_time_s"]
      ax.bar(list(steps), [v * 1e3 for v in steps.values()])
      ax.set_ylabel("ms")
      ax.set_title(
        f"{paper['model']} predicted step ({result['paper_cluster']})"
      )
      ax.tick_params(axis="x", rotation=45, labelsize=8)
  fig.tight_layout()
  fig.savefig(png_path, dpi=90)
  plt.close(fig)
