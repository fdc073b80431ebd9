"""A training step's memory, checked against this host before anything is
allocated.

This module owns the estimates that refuse a job whose sizes no host holds
before it makes what they size, each against this host's memory
(:func:`qsync_jax.host_memory.limit`: the cgroup's limit where one is set,
else the physical memory), with one sentence naming the value, the estimate
and the limit:

* :func:`step_memory`: one worker's step from shapes alone (the model built
  abstractly, its layer graph at the per-worker batch and the analytic
  memory model, :func:`qsync_jax.predictor.memory.analytic_memory_model`);
* :func:`check_model_memory`: a process's workers, before the model is
  built: on CPU devices their steps, an evaluation batch and the data
  against the host's memory, on a GPU one step against its own;
* :func:`check_fake_devices`: the fake CPU devices a single process makes,
  one a worker;
* :data:`STEP_BYTES`: what a training step costs the host before it runs
  (a sync schedule's table entry).

A measured profile is bounded where it is taken
(:func:`qsync_jax.predictor.profiling.check_fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import math
from typing import Any

from absl import logging
from flax import nnx
import jax

from qsync_jax import host_memory
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory as memory_lib
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn

#: Host bytes one fake CPU device costs (XLA:CPU's per-device state; about
#: 96 KiB each measured with 2048 devices), with some room.
CPU_DEVICE_BYTES = 128 * 2**10
#: Host bytes a training step costs before it runs: the sync schedule's
#: list of sync steps (a pointer and an int object) and the set the
#: trainer's compile reads it into.
STEP_BYTES = 100
#: Examples an evaluation batch holds (the trainer's default).
EVAL_BATCH = 256


def optimizer_state_copies(optimizer: str, momentum: float) -> int:
  """Float32 copies of the parameters an optimizer keeps.

  Args:
    optimizer: ``"adam"`` or ``"sgd"``.
    momentum: SGD's momentum (0: none).

  Returns:
    2 for Adam, 1 for SGD with momentum, 0 for plain SGD.
  """
  if optimizer == "adam":
    return 2
  return 1 if momentum else 0


@dataclasses.dataclass(frozen=True)
class WorkerMemory:
  """One worker's step, estimated from shapes alone.

  Attributes:
    fixed_bytes: parameters, gradients and optimizer state (float32).
    example_bytes: what one example adds (its inputs, the activations the
      backward pass keeps and the layers' outputs); 0 where the model's
      graph could not be traced.
  """

  fixed_bytes: float
  example_bytes: float

  def at(self, batch: int) -> float:
    """The step's bytes at a per-worker batch of ``batch`` examples."""
    return self.fixed_bytes + self.example_bytes * batch


def _sample_at(model: Any, example: Any, batch_size: int, loss_fn: LossFn):
  """What ``model`` is traced on at ``batch_size``: its ``input_spec``, or
  ``example`` resized through the objective of ``loss_fn``."""
  spec = getattr(model, "input_spec", None)
  if callable(spec):
    return spec(batch_size)

  def resize(a):
    if not getattr(a, "shape", None):
      raise ValueError(
        "every array of the sample input needs a leading "
        f"batch axis, got shape {getattr(a, 'shape', ())}"
      )
    return jax.ShapeDtypeStruct((batch_size, *a.shape[1:]), a.dtype)

  return as_objective(loss_fn).probe(jax.tree.map(resize, example))


def step_memory(
  model: Any,
  example: Any,
  batch_size: int,
  loss_fn: LossFn = None,
  optimizer_state_copies: int = 2,
) -> WorkerMemory:
  """The memory of ``model``'s training step, from shapes alone.

  ``model`` (abstract: ``models.without_weights``) is traced at
  ``batch_size`` on abstract inputs (its ``input_spec``, or ``example``
  through the objective of ``loss_fn``); the predictor's analytic memory
  model prices the step. A model that cannot be traced abstractly is
  priced by its parameters alone (it reports its own error where it is
  built).

  Args:
    model: the model, abstract or concrete.
    example: one training batch at any batch size (``(inputs, labels)``
      for classification), for a model without ``input_spec``.
    batch_size: the per-worker batch.
    loss_fn: the loss, in any form :func:`qsync_jax.task.as_objective`
      takes (None: classification).
    optimizer_state_copies: float32 copies of the parameters the
      optimizer keeps (:func:`optimizer_state_copies`).

  Returns:
    The :class:`WorkerMemory`.
  """
  params = sum(
    math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
  )
  fixed = 4.0 * params * (2 + optimizer_state_copies)
  try:
    g = graph_lib.trace_graph(
      model, _sample_at(model, example, batch_size, loss_fn)
    )
  except Exception as e:  # pylint: disable=broad-except
    # The model's own error comes where it is built and traced for real.
    logging.info("memory estimate by parameters alone: %s", e)
    return WorkerMemory(fixed, 0.0)
  step = memory_lib.analytic_memory_model(
    g, 0.0, optimizer_state_copies
  ).base_bytes
  return WorkerMemory(fixed, max(step - fixed, 0.0) / batch_size)


def device_bytes(device: Any) -> float | None:
  """A GPU's memory (jax's ``bytes_limit``), or None if not reported.

  Args:
    device: a jax device.

  Returns:
    Its bytes, or None.
  """
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return None
  limit = stats.get("bytes_limit")
  return float(limit) if limit else None


@dataclasses.dataclass(frozen=True)
class HostJob:
  """What a process's workers share of this host, and how messages name it.

  Attributes:
    what: the sizes, as the user gave them (``"config.model='cnn' at
      config.batch_size=32"``).
    where: the cluster, as the user gave it (``"config.cluster='v100:2'"``).
    data_bytes: the data held in memory (training and test arrays).
    eval_examples: the test examples (an evaluation batch is at most
      :data:`EVAL_BATCH` of them).
  """

  what: str
  where: str
  data_bytes: float
  eval_examples: int


def check_workers(
  job: HostJob,
  here: Sequence[Any],
  worker: WorkerMemory,
  batch: int = 0,
  local_examples: int = 0,
) -> None:
  """Checks that this process's workers' steps fit where they run.

  Args:
    job: the job's data and how messages name it.
    here: this process's workers' devices.
    worker: one worker's step.
    batch: the largest per-worker batch.
    local_examples: the examples this process's workers hold at once.

  Raises:
    ValueError: the CPU workers' steps (``worker``'s fixed part each, its
      per-example part for ``local_examples`` in all), an evaluation batch
      and the data exceed the host's memory, or one worker's step at
      ``batch`` exceeds its GPU's.
  """
  on_cpu = [d for d in here if d.platform == "cpu"]
  if on_cpu:
    n = len(on_cpu)
    examples = min(local_examples, n * batch)
    eval_batch = min(EVAL_BATCH, max(job.eval_examples, 1))
    need = (
      n * worker.fixed_bytes
      + worker.example_bytes * (examples + eval_batch)
      + job.data_bytes
    )
    host_memory.check(
      f"{job.what} on {n} CPU worker(s) ({job.where})",
      need,
      f"{host_memory.gib(worker.at(batch))} per worker's step: parameters, "
      "gradients, optimizer state and activations; plus an evaluation "
      "batch and the dataset",
    )
  for device in here:
    if device.platform == "cpu":
      continue
    capacity = device_bytes(device)
    if capacity is not None and worker.at(batch) > capacity:
      raise ValueError(
        f"{job.what} needs about {host_memory.gib(worker.at(batch))} per "
        f"worker (parameters, gradients, optimizer state and activations),"
        f" more than {device}'s memory, {host_memory.gib(capacity)}"
      )


def check_model_memory(
  job: HostJob,
  cluster: cluster_lib.ClusterSpec,
  batch_size: int,
  model: Callable[[], Any],
  example: Any,
  *,
  loss_fn: LossFn,
  optimizer_state_copies: int,
  dynamic_batch: bool = False,
  deep_params: Callable[[], int | None] | None = None,
  devices: Sequence[jax.Device] | None = None,
) -> None:
  """Checks that this process's workers fit where they run, before the
  model is built.

  Workers on CPU devices share this host's memory with the data: their
  count on this process times one worker's step (:func:`step_memory`), one
  evaluation batch and the data must fit it. A worker on a GPU must fit
  that GPU's memory.

  Args:
    job: the job's data and how messages name it.
    cluster: the workers' kinds.
    batch_size: the per-worker batch.
    model: builds the model with abstract weights
      (``models.without_weights``); called once the deep check passed.
    example: one training batch, as :func:`step_memory` takes it.
    loss_fn: the loss, as :func:`step_memory` takes it.
    optimizer_state_copies: as :func:`step_memory` takes it.
    dynamic_batch: the global batch is split by speed (at most all of it
      on this process, and on one worker all but one example for each
      other worker).
    deep_params: a deep model's parameter count from its shapes without
      building it (:func:`qsync_jax.models.sizes.deep_model_params`), or
      None; its parameters, gradients and optimizer state are checked
      first.
    devices: the devices the workers map onto (default ``jax.devices()``).

  Raises:
    ValueError: naming the sizes, the estimate and the limit.
  """
  assigned = cluster_lib.assign_devices(cluster, devices)
  here = [d for d in assigned if d.process_index == jax.process_index()]
  if not here:
    return
  batch = int(batch_size)
  local_examples = batch * len(here)
  if dynamic_batch:
    # Both batch modes deal batch_size * workers examples a step.
    local_examples = batch * cluster.num_workers
    batch = local_examples - (cluster.num_workers - 1)
  deep = deep_params() if deep_params is not None else None
  if deep is not None:  # its parameters alone, before the deep build
    fixed = 4.0 * deep * (2 + optimizer_state_copies)
    check_workers(job, here, WorkerMemory(fixed, 0))
  step = step_memory(model(), example, batch, loss_fn, optimizer_state_copies)
  check_workers(job, here, step, batch, local_examples)


def check_fake_devices(num_workers: int, where: str) -> None:
  """Checks the fake CPU devices a single process makes, one a worker.

  Args:
    num_workers: the workers.
    where: how the cluster is named in messages
      (``"config.cluster='v100:2'"``).

  Raises:
    ValueError: their count needs more than this host's memory.
  """
  host_memory.check(
    where,
    num_workers * CPU_DEVICE_BYTES,
    f"{num_workers} fake CPU devices, one a worker, "
    f"{CPU_DEVICE_BYTES // 2**10} KiB each",
  )
