"""The configuration the allocator's link-aware choice picks for the bench.

This module owns :func:`pick`: the network study's model, cluster and
link priced by :func:`qsync_jax.allocation.sync_methods.compare_sync`
(what ``python -m experiments.allocate --link`` reports), every sync method
with every averager, the averagers' encode/decode profiled here
(:func:`~qsync_jax.allocation.sync_methods.profile_codecs`), and the
fastest option turned into network-study config overrides, registered as
the study's run :data:`NAME` so that the bench runs it as any other. The
choice is kept in the bench directory, so a resumed bench runs what it
picked first.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import os
from typing import Any

from experiments import config_lib
from experiments.studies import network
from qsync_jax import data as data_lib
from qsync_jax import files
from qsync_jax import predictor
from qsync_jax.allocation import pipeline
from qsync_jax.allocation import sync_methods
from qsync_jax.predictor import communication

NAME = "auto"
FILE = "auto_choice.json"


def overrides(method: str, averager: str) -> dict[str, Any]:
  """The network-study config fields of a sync method and an averager of
  :data:`qsync_jax.allocation.sync_methods.AVERAGERS`."""
  compress, kwargs = sync_methods.AVERAGERS[averager]
  out: dict[str, Any] = {"sync": method, "compress": compress}
  out |= {f"compress_kwargs.{k}": v for k, v in kwargs.items()}
  return out


def register(choice: Mapping[str, Any]) -> None:
  """Adds the choice to the network study's runs as :data:`NAME`."""
  network.RUNS[NAME] = network.NetworkRun(
    f"the allocator's pick on the link: {choice['method']} with "
    f"{choice['averager']}",
    dict(choice["overrides"]),
  )


def pick(
  out_dir: str,
  *,
  steps: int | None,
  model_kwargs: Mapping[str, Any] | None,
  link: str,
  topology: str,
) -> dict[str, Any]:
  """The fastest predicted (sync method, averager) on ``link``, registered.

  Needs :data:`experiments.studies.network.NUM_PROCESSES` local devices
  (the profile runs the workers at once, sharing this host's cores).

  Returns:
    ``{"method", "averager", "overrides", "predicted_step_s",
    "comparison"}``, also written to ``out_dir/auto_choice.json``.
  """
  import jax  # pylint: disable=g-import-not-at-top

  path = os.path.join(out_dir, FILE)
  if os.path.exists(path):
    with open(path) as f:
      choice = json.load(f)
    register(choice)
    return choice
  config = network.run_config("qsr", 0, steps=steps, model_kwargs=model_kwargs)
  job = config_lib.parse(config)
  dataset = data_lib.load_dataset(config.dataset)
  model = config_lib.build_model(job, dataset)
  devices = jax.devices()[: network.NUM_PROCESSES]
  graph = predictor.trace_graph(
    model, pipeline.sample_at(model, None, config.batch_size)
  )
  batch = (
    dataset.x_train[: config.batch_size],
    dataset.y_train[: config.batch_size],
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
    graph=graph,
  )
  num_params = int(sum(n.weight_numel for n in graph.nodes))
  comparison = sync_methods.compare_sync(
    graph,
    config.cluster,
    {},
    {"cpu": profile},
    communication.Link.parse(link, "0ms", topology),
    period=config.h_base,
    total_steps=config.steps,
    lr=config.learning_rate,
    qsr_alpha=float(config.alpha),
    codec_costs=sync_methods.profile_codecs(
      list(sync_methods.AVERAGERS), num_params, network.NUM_PROCESSES
    ),
  )
  best = comparison.recommended
  choice = {
    "method": best.method,
    "averager": best.averager,
    "overrides": overrides(best.method, best.averager),
    "predicted_step_s": best.step_time_s,
    "comparison": comparison.to_dict(),
  }
  files.write_json(path, choice, indent=2)
  register(choice)
  return choice
