"""The network study priced by the predictor.

This module owns the predictor's side of :mod:`experiments.studies.network`:
the study's model profiled on this host (:func:`profile_model`, also what
the peer bench's link-aware pick prices), each homogeneous configuration's
predicted step (:func:`predict_steps`), added to a study's summary beside
the measured one (:func:`add_predictions`), or again for a study already
run (:func:`repredict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import os
from typing import Any

from flax import nnx
import jax
import ml_collections

from experiments import config_lib
from experiments.studies import network
from qsync_jax import data as data_lib
from qsync_jax import predictor
from qsync_jax.allocation import pipeline
from qsync_jax.predictor import calls as calls_lib
from qsync_jax.predictor import codec_processes
from qsync_jax.predictor import timing


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """The study's model profiled on this host, as the predictor prices it.

  Attributes:
    config: the run configuration it was built from.
    model: the model.
    graph: its layer graph (:func:`qsync_jax.predictor.trace_graph`).
    profile: its FP32 profile with
      :data:`~experiments.studies.network.NUM_PROCESSES` workers sharing
      this host's cores.
    devices: the :data:`~experiments.studies.network.NUM_PROCESSES` local
      devices the workers ran on.
    num_params: its parameter count (every ``nnx.Param`` element: what an
      average sends).
  """

  config: ml_collections.ConfigDict
  model: nnx.Module
  graph: predictor.ModelGraph
  profile: predictor.Profile
  devices: list[jax.Device]
  num_params: int


def profile_model(
  name: str,
  *,
  steps: int | None = None,
  model_kwargs: Mapping[str, Any] | None = None,
  repeats: int = 5,
) -> ModelProfile:
  """Profiles the model of run ``name`` (seed 0) on this host.

  The profile is measured with
  :data:`~experiments.studies.network.NUM_PROCESSES` workers sharing this
  host's cores at once (``host_devices``: fake devices of this process).

  Args:
    name: a run of :data:`~experiments.studies.network.RUNS` (its optimizer
      and batch are profiled).
    steps: the runs' steps (None: the configuration's).
    model_kwargs: the model's arguments (default
      :data:`~experiments.studies.network.MODEL_KWARGS`).
    repeats: timed rounds per measured piece.

  Returns:
    The :class:`ModelProfile`.

  Raises:
    ValueError: fewer than
      :data:`~experiments.studies.network.NUM_PROCESSES` local devices (set
      ``jax_num_cpu_devices`` before jax starts).
  """
  devices = jax.devices()[: network.NUM_PROCESSES]
  if len(devices) < network.NUM_PROCESSES:
    raise ValueError(
      f"profiling the study's model needs {network.NUM_PROCESSES} "
      f"local devices, got {len(devices)}; set "
      f"jax_num_cpu_devices={network.NUM_PROCESSES}"
    )
  config = network.run_config(name, 0, steps=steps, model_kwargs=model_kwargs)
  dataset = data_lib.load_dataset(config.dataset)
  job = config_lib.parse(config)
  model = config_lib.build_model(job, dataset)
  graph = predictor.trace_graph(
    model, pipeline.sample_at(model, None, config.batch_size)
  )
  profile = predictor.profile(
    model,
    (
      dataset.x_train[: config.batch_size],
      dataset.y_train[: config.batch_size],
    ),
    device=devices[0],
    device_kind="cpu",
    precisions=["fp32"],
    tx=config_lib.make_optimizer(job),
    optimizer_name=config.optimizer,
    host_devices=devices,
    repeats=repeats,
    graph=graph,
  )
  return ModelProfile(
    config, model, graph, profile, list(devices), network.param_count(model)
  )


def predict_steps(
  runs: Sequence[Mapping[str, Any]],
  *,
  repeats: int = 5,
  model_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
  """The predictor's step time of each homogeneous configuration.

  The model's profile is measured here with
  :data:`~experiments.studies.network.NUM_PROCESSES` workers
  sharing this host's cores at once (``host_devices``: fake devices of this
  process). Each averager's encode/decode is profiled by
  :data:`~experiments.studies.network.NUM_PROCESSES` launched processes, as the
  runs have them
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
    model_kwargs: the runs' model arguments (default
      :data:`~experiments.studies.network.MODEL_KWARGS`).

  Returns:
    ``{name: predicted seconds per step}``.

  Raises:
    ValueError: fewer than
      :data:`~experiments.studies.network.NUM_PROCESSES` local devices (set
      ``jax_num_cpu_devices`` before jax starts).
  """
  firsts = {
    r["name"]: r
    for r in runs
    if r["seed"] == 0 and not network.RUNS[r["name"]].hetero
  }
  if not firsts:
    return {}
  study = profile_model("dp", model_kwargs=model_kwargs, repeats=repeats)
  config, model, graph = study.config, study.model, study.graph
  profiles = {"cpu": study.profile}
  link = predictor.Link.from_record(
    next(iter(firsts.values()))["summary"]["link"]
  )
  num_params = study.num_params
  compute_s = predictor.predict(
    graph, config.cluster, {}, profiles, link=(0.0, 0.0), shared_host=True
  ).step_time_s
  configs = {
    name: network.run_config(name, 0, model_kwargs=model_kwargs)
    for name in firsts
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
    network.NUM_PROCESSES,
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
          averager,
          num_params,
          network.NUM_PROCESSES,
          link,
          codec,
          platform="cpu",
        )
        + _outer_step_s(model, c, study.devices, repeats)
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


def add_predictions(
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
      not in :data:`~experiments.studies.network.RUNS`.
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
  unknown = sorted({r["name"] for r in result["runs"]} - set(network.RUNS))
  if unknown:
    raise ValueError(
      f"{path} has runs of unknown configurations {unknown}; "
      f"valid: {', '.join(network.RUNS)}"
    )
  # The summary keeps the link once, at the top; every run used it.
  runs = [
    r | {"summary": r["summary"] | {"link": result["link"]}}
    for r in result["runs"]
  ]
  add_predictions(
    result["configs"],
    runs,
    repeats=repeats,
    model_kwargs=result["model_kwargs"],
  )
  result["repredicted"] = True
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  return result
