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

from experiments.studies import network
from experiments.studies import network_prediction
from qsync_jax import files
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
  path = os.path.join(out_dir, FILE)
  if os.path.exists(path):
    with open(path) as f:
      choice = json.load(f)
    register(choice)
    return choice
  study = network_prediction.profile_model(
    "qsr", steps=steps, model_kwargs=model_kwargs
  )
  config = study.config
  comparison = sync_methods.compare_sync(
    study.graph,
    config.cluster,
    {},
    {"cpu": study.profile},
    communication.Link.parse(link, "0ms", topology),
    period=config.h_base,
    total_steps=config.steps,
    lr=config.learning_rate,
    qsr_alpha=float(config.alpha),
    codec_costs=sync_methods.profile_codecs(
      list(sync_methods.AVERAGERS), study.num_params, network.NUM_PROCESSES
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
