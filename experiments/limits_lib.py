"""The main job's sizes, checked against what this host can hold.

This module owns which config field holds which size; the checks are the
library's (:mod:`qsync_jax.predictor.host_limits`,
:mod:`qsync_jax.data.sizes`, :mod:`qsync_jax.models.sizes`), each refusing a
size with one sentence naming the config field, the estimate and the limit:

* :func:`check_sizes`, from the config alone, before JAX starts: the
  training steps (the sync schedule keeps a table entry a step), a built-in
  dataset's arrays (from its loader's arguments), the global batch against
  the dataset's training examples; a built-in model's size arguments are
  positive integers;
* :func:`check_fake_devices`: the fake CPU devices a single process makes,
  one a worker;
* :func:`check_model_memory`, once the data is in memory and before the
  model is built: the model built abstractly, one worker's step from its
  shapes, times the workers this process runs on its CPU (or against a
  GPU's own memory).

The allocator's measured profiles are bounded where they are taken
(:func:`qsync_jax.predictor.profiling.check_fits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from experiments import config_lib
from qsync_jax import data as data_lib
from qsync_jax import host_memory
from qsync_jax import models as models_lib
from qsync_jax.data import sizes as data_sizes
from qsync_jax.models import sizes as model_sizes
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.predictor import host_limits


def check_sizes(job: config_lib.JobConfig) -> None:
  """Checks the config's sizes before JAX starts or data is loaded.

  Args:
    job: the job's config.

  Raises:
    ValueError: naming the size, what it needs and the limit.
  """
  model_sizes.check_model_kwargs(
    job.model, dict(job.model_kwargs), "config.model_kwargs"
  )
  model_sizes.check_model_kwargs(
    job.model,
    dict(job.allocator.timing_model_kwargs),
    "config.allocator.timing_model_kwargs",
  )
  steps = job.steps
  host_memory.check(
    f"config.steps={steps}",
    steps * host_limits.STEP_BYTES,
    "the sync schedule's table of steps, "
    f"{host_limits.STEP_BYTES} bytes a step",
  )
  kwargs = dict(job.dataset_kwargs)
  size = data_sizes.dataset_size(job.dataset, kwargs, "config.dataset_kwargs")
  if size is not None:
    host_memory.check(
      f"config.dataset={job.dataset!r} with {kwargs or 'its defaults'}",
      size.bytes,
      "its arrays while the loader makes them",
    )
  if size is None or job.cluster.strip().lower() == cluster_lib.AUTO:
    return
  n = cluster_lib.parse_cluster(job.cluster).num_workers
  # Both batch modes deal batch_size * workers examples a step.
  batch = job.batch_size * n
  if batch > size.train:
    raise ValueError(
      f"config.cluster={job.cluster!r} with config.batch_size="
      f"{job.batch_size} needs a global batch of {batch} examples ("
      f"{n} workers x {job.batch_size}), more than the {size.train} "
      f"training examples of dataset {job.dataset!r}"
    )


def check_fake_devices(job: config_lib.JobConfig) -> None:
  """Checks the fake CPU devices a single process makes, one a worker.

  Args:
    job: the job's config.

  Raises:
    ValueError: their count needs more than this host's memory.
  """
  host_limits.check_fake_devices(
    cluster_lib.parse_cluster(job.cluster).num_workers,
    f"config.cluster={job.cluster!r}",
  )


def check_model_memory(
  job: config_lib.JobConfig,
  dataset: data_lib.Dataset,
  devices: Sequence[Any] | None = None,
) -> None:
  """Checks that this process's workers fit where they run, before the
  model is built (:func:`qsync_jax.predictor.host_limits
  .check_model_memory`).

  Args:
    job: the job's config (its cluster resolved).
    dataset: the job's data, in memory.
    devices: the devices the workers map onto (default ``jax.devices()``).

  Raises:
    ValueError: naming the sizes, the estimate and the limit.
  """
  what = f"config.model={job.model!r} at config.batch_size={job.batch_size}"
  model_kwargs = dict(job.model_kwargs)
  if model_kwargs:
    what += f" with model_kwargs {model_kwargs}"
  host_job = host_limits.HostJob(
    what,
    f"config.cluster={job.cluster!r}",
    float(
      sum(
        getattr(a, "nbytes", 0)
        for a in (dataset.x_train, dataset.y_train, dataset.x_test)
      )
    ),
    len(dataset.x_test),
  )

  def build_with(kwargs):
    return config_lib.build_model(job.replace(model_kwargs=kwargs), dataset)

  host_limits.check_model_memory(
    host_job,
    cluster_lib.parse_cluster(job.cluster),
    job.batch_size,
    lambda: models_lib.without_weights(
      lambda: config_lib.build_model(job, dataset)
    ),
    (dataset.x_train[:1], dataset.y_train[:1]),
    loss_fn=config_lib.make_loss_fn(job),
    optimizer_state_copies=host_limits.optimizer_state_copies(
      job.optimizer, job.momentum
    ),
    dynamic_batch=job.batch_mode == "dynamic",
    deep_params=lambda: model_sizes.deep_model_params(
      job.model, model_kwargs, build_with
    ),
    devices=devices,
  )
