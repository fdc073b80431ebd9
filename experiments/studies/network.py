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

from collections.abc import Mapping, Sequence
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
from qsync_jax import predictor
from qsync_jax.allocation import pipeline
from qsync_jax.launch import links
from qsync_jax.predictor import calls as calls_lib
from qsync_jax.predictor import codec_processes
from qsync_jax.predictor import timing

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
  return _param_count(
    config_lib.build_model(
      config_lib.parse(config), data_lib.load_dataset(config.dataset)
    )
  )


def _param_count(model) -> int:
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


def predict_steps(
  runs: Sequence[Mapping[str, Any]],
  *,
  repeats: int = 5,
  model_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
  """The predictor's step time of each homogeneous configuration.

  The model's profile is measured here with :data:`NUM_PROCESSES` workers
  sharing this host's cores at once (``host_devices``: fake devices of this
  process). Each averager's encode/decode is profiled by
  :data:`NUM_PROCESSES` launched processes, as the runs have them
  (:func:`qsync_jax.predictor.codec_processes.profile_codecs_in_processes`:
  each with its own XLA thread pool on the same cores; no link, no root),
  as the runs' trainer calls it (with its error feedback and state).
  The link is the one the runs measured. Data parallel is
  :func:`qsync_jax.predictor.predict` with the averager; a local schedule
  is the step without communication plus the run's averages per step times
  one average (:func:`qsync_jax.predictor.averaging_time`), as
  :func:`qsync_jax.allocation.sync_methods.compare_sync` prices them, and
  DiLoCo's outer optimizer step per average (:func:`_outer_step_s`).

  Args:
    runs: the study's runs (seed 0 of each configuration is used).
    repeats: timed rounds per measured piece.
    model_kwargs: the runs' model arguments (default :data:`MODEL_KWARGS`).

  Returns:
    ``{name: predicted seconds per step}``.

  Raises:
    ValueError: fewer than :data:`NUM_PROCESSES` local devices (set
      ``jax_num_cpu_devices`` before jax starts).
  """
  devices = jax.devices()[:NUM_PROCESSES]
  if len(devices) < NUM_PROCESSES:
    raise ValueError(
      f"predicting the study's steps needs {NUM_PROCESSES} "
      f"local devices, got {len(devices)}; set "
      f"jax_num_cpu_devices={NUM_PROCESSES}"
    )
  firsts = {
    r["name"]: r for r in runs if r["seed"] == 0 and not RUNS[r["name"]].hetero
  }
  if not firsts:
    return {}
  config = run_config("dp", 0, model_kwargs=model_kwargs)
  dataset = data_lib.load_dataset(config.dataset)
  job = config_lib.parse(config)
  model = config_lib.build_model(job, dataset)
  batch = (
    dataset.x_train[: config.batch_size],
    dataset.y_train[: config.batch_size],
  )
  graph = predictor.trace_graph(
    model, pipeline.sample_at(model, None, config.batch_size)
  )
  profile = predictor.profile(
    model,
    batch,
    device=devices[0],
    device_kind="cpu",
    precisions=["fp32"],
    tx=config_lib.make_optimizer(job),
    optimizer_name=config.optimizer,
    host_devices=devices,
    repeats=repeats,
    graph=graph,
  )
  profiles = {"cpu": profile}
  link = predictor.Link.from_record(
    next(iter(firsts.values()))["summary"]["link"]
  )
  num_params = _param_count(model)
  compute_s = predictor.predict(
    graph, config.cluster, {}, profiles, link=(0.0, 0.0), shared_host=True
  ).step_time_s
  configs = {
    name: run_config(name, 0, model_kwargs=model_kwargs) for name in firsts
  }

  # Each average as the runs' trainer calls it: with its error feedback
  # and the averager's state.
  def key(c):
    return f"{c.compress}, error feedback {bool(c.error_feedback)}"

  averagers = {
    name: config_lib.make_averager(config_lib.parse(c))
    for name, c in configs.items()
  }
  codecs = codec_processes.profile_codecs_in_processes(
    {key(c): averagers[name] for name, c in configs.items()},
    num_params,
    NUM_PROCESSES,
    repeats=repeats,
    error_feedback={key(c): bool(c.error_feedback) for c in configs.values()},
  )
  out = {}
  for name, r in firsts.items():
    c, averager = configs[name], averagers[name]
    codec = codecs[key(c)]
    if c.sync == "dp":
      out[name] = predictor.predict(
        graph,
        c.cluster,
        {},
        profiles,
        link=link,
        shared_host=True,
        averager=averager,
        codec_cost=codec,
      ).step_time_s
    else:
      per_step = r["summary"]["sync_rounds"] / r["summary"]["steps"]
      out[name] = compute_s + per_step * (
        predictor.averaging_time(
          averager, num_params, NUM_PROCESSES, link, codec, platform="cpu"
        )
        + _outer_step_s(model, c, devices, repeats)
      )
  return out


def _outer_step_s(
  model: nnx.Module,
  config: ml_collections.ConfigDict,
  devices: Sequence[jax.Device],
  repeats: int,
) -> float:
  """Seconds of a sync round's outer optimizer step (DiLoCo's; 0 without
  one), timed as the profile times the inner optimizer's step: the
  trainer's update of all parameters, on every worker's device at once."""
  outer_tx = config_lib.make_outer_optimizer(config_lib.parse(config))
  if outer_tx is None:
    return 0.0
  at_once = calls_lib.concurrency_calls(
    lambda d, _: calls_lib.optimizer_call(model, outer_tx, d), devices
  )
  call = at_once[len(devices)]
  jax.block_until_ready(call())  # Compiles.
  return timing.median_block_seconds(call, (), repeats, 1)


def _add_predictions(
  per_config: dict[str, dict[str, Any]],
  runs: Sequence[Mapping[str, Any]],
  *,
  repeats: int = 5,
  model_kwargs: Mapping[str, Any] | None = None,
) -> None:
  """Adds :func:`predict_steps`' step and its error against the measured
  mean to each homogeneous configuration of ``per_config``."""
  for name, step_s in predict_steps(
    runs, repeats=repeats, model_kwargs=model_kwargs
  ).items():
    measured = per_config[name]["step_time_mean_s"]
    per_config[name]["predicted_step_s"] = step_s
    per_config[name]["predicted_vs_measured_step"] = (
      step_s - measured
    ) / measured


def repredict(out_dir: str, *, repeats: int = 5) -> dict[str, Any]:
  """Prices a finished study's configurations again, without running it.

  The runs' records in ``out_dir/summary.json`` (their link, sync rounds and
  steps) are all :func:`predict_steps` needs, so a changed predictor can be
  checked against the measured steps in minutes rather than the study's
  hour. The summary is rewritten with the new ``predicted_step_s`` and
  ``predicted_vs_measured_step`` and ``"repredicted": true``; its measured
  figures and plots are left as they are.

  Args:
    out_dir: a directory :func:`run` wrote.
    repeats: timed rounds per measured piece.

  Returns:
    The rewritten summary.

  Raises:
    FileNotFoundError: ``out_dir`` holds no ``summary.json``.
    ValueError: the summary has no runs, or names a configuration that is
      not in :data:`RUNS`.
  """
  path = os.path.join(out_dir, "summary.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"no study to re-predict: {path} does not "
      f"exist (run the study into {out_dir} first)"
    )
  with open(path) as f:
    result = json.load(f)
  missing = [
    k for k in ("runs", "link", "configs", "model_kwargs") if k not in result
  ]
  if missing:
    raise ValueError(f"{path} is not a study summary: it lacks {missing}")
  if not result["runs"]:
    raise ValueError(f"{path} holds no runs to price")
  unknown = sorted({r["name"] for r in result["runs"]} - set(RUNS))
  if unknown:
    raise ValueError(
      f"{path} has runs of unknown configurations {unknown}; "
      f"valid: {', '.join(RUNS)}"
    )
  # The summary keeps the link once, at the top; every run used it.
  runs = [
    r | {"summary": r["summary"] | {"link": result["link"]}}
    for r in result["runs"]
  ]
  _add_predictions(
    result["configs"],
    runs,
    repeats=repeats,
    model_kwargs=result["model_kwargs"],
  )
  result["repredicted"] = True
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  return result


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
  predict: bool = True,
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
    predict: add the predictor's step time of each homogeneous
      configuration (:func:`predict_steps`; needs :data:`NUM_PROCESSES`
      local devices).
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
  if predict:
    _add_predictions(per_config, runs, model_kwargs=model_kwargs)
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
      {k: r[k] for k in ("name", "seed", "alpha", "curve")}
      | {
        "summary": {
          k: r["summary"].get(k)
          for k in (
            "final_eval_accuracy",
            "final_eval_loss",
            "steps",
            "train_time_s",
            "wall_time_s",
            "comm_bytes",
            "sync_rounds",
            "compress",
            "sync",
            "workers",
          )
        }
      }
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
