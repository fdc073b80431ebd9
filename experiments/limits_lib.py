"""The main job's sizes, checked against what this host can hold.

Every size a user gives the main job is checked here before the job
allocates what it sizes, each against this host's memory
(:func:`qsync_jax.host_memory.limit`: the cgroup's limit where one is set,
else the physical memory), and refused with one sentence naming the value,
the estimate and the limit:

* :func:`check_sizes`, from the config alone, before JAX starts: the
  training steps (the sync schedule keeps a table entry a step), a built-in
  dataset's arrays (:func:`dataset_size`, from its loader's arguments), the
  global batch against the dataset's training examples; the fake CPU
  devices a single process makes, one a worker (:func:`check_fake_devices`);
  a built-in model's size arguments are positive integers;
* :func:`check_model_memory`, once the data is in memory and before the
  model is built: the model built abstractly (``nnx.eval_shape`` of its
  factory), its layer graph at the per-worker batch and the predictor's
  analytic memory model of one worker's step
  (:func:`qsync_jax.predictor.memory.analytic_memory_model`), times the
  workers this process runs on its CPU (or against a GPU's own memory).

The allocator's measured profiles are bounded where they are taken
(:func:`qsync_jax.predictor.profiling.profile`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import math
import numbers
import typing
from typing import Any

from absl import logging
from flax import nnx
import jax
import ml_collections

from experiments import config_lib
from qsync_jax import data as data_lib
from qsync_jax import host_memory
from qsync_jax import models as models_lib
from qsync_jax import predictor
from qsync_jax import task
from qsync_jax.allocation import pipeline
from qsync_jax.data import text as text_lib
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.predictor import memory as memory_lib

#: Host bytes one fake CPU device costs (XLA:CPU's per-device state; about
#: 96 KiB each measured with 2048 devices), with some room.
CPU_DEVICE_BYTES = 128 * 2**10
#: Host bytes a training step costs before it runs: the sync schedule's
#: list of sync steps (a pointer and an int object) and the set the
#: trainer's compile reads it into.
STEP_BYTES = 100
#: Examples an evaluation batch holds (the trainer's default).
EVAL_BATCH = 256


@dataclasses.dataclass(frozen=True)
class DatasetSize:
  """What loading a built-in dataset makes.

  Attributes:
    train: training examples (at most; a text corpus may hold fewer).
    bytes: the most host memory its loader holds at once.
  """

  train: int
  bytes: float


def _count(
  kwargs: Mapping[str, Any], name: str, default: Any, least: int, what: str
) -> Any:
  """``kwargs[name]`` (or ``default``), an integer ``>= least``, or None."""
  value = kwargs.get(name, default)
  if value is None and default is None:
    return None
  if not (
    isinstance(value, numbers.Integral)
    and not isinstance(value, bool)
    and value >= least
  ):
    raise ValueError(
      f"{what}.{name} must be an integer >= {least}, got {value!r}"
    )
  return int(value)


def _shape(kwargs: Mapping[str, Any], default: Sequence[int], what: str):
  value = kwargs.get("input_shape", default)
  if not isinstance(value, (list, tuple)) or not value:
    raise ValueError(
      f"{what}.input_shape must be a list of integers >= 1, got {value!r}"
    )
  for d in value:
    _count({"input_shape": d}, "input_shape", None, 1, what)
  return [int(d) for d in value]


def _stdlib_bytes(stdlib_dir: Any) -> int | None:
  """The bytes of the text corpus, or None if it cannot be listed (the
  loader then says why)."""
  try:
    return sum(p.stat().st_size for p in text_lib.stdlib_files(stdlib_dir))
  except (OSError, ValueError):
    return None


def dataset_size(
  name: str, kwargs: Mapping[str, Any], what: str = "config.dataset_kwargs"
) -> DatasetSize | None:
  """The training examples and peak bytes of a built-in dataset's loader.

  From the loader's arguments alone, before it runs; the arguments that
  size the data must be positive integers.

  Args:
    name: the dataset (:data:`qsync_jax.data.DATASET_NAMES`).
    kwargs: its loader's arguments.
    what: how the arguments are named in messages.

  Returns:
    The size, or None for a dataset that is not built in (a user's factory)
    or an unknown name (the loader reports it).

  Raises:
    ValueError: a size argument that is not a positive integer.
  """
  if name == "digits":
    fraction = kwargs.get("test_fraction", 0.2)
    test = math.ceil(1797 * fraction) if isinstance(fraction, float) else 0
    return DatasetSize(1797 - test, 1797 * 64 * 4 * 8)
  if name in ("synthetic", "synthetic_regression"):
    regression = name == "synthetic_regression"
    n = _count(kwargs, "num_train", 2048, 1, what)
    n_all = n + _count(kwargs, "num_test", 512, 1, what)
    dim = math.prod(_shape(kwargs, (16,) if regression else (8, 8, 1), what))
    if not regression:
      # The means of the labels, the noise and their sum in float64, then
      # the float32 inputs.
      return DatasetSize(n, n_all * dim * (3 * 8 + 4))
    hidden = _count(kwargs, "hidden", 32, 1, what)
    out = _count(kwargs, "output_dim", 1, 1, what)
    return DatasetSize(n, n_all * (dim * (8 + 4) + hidden * 16 + out * 12))
  if name == "mnist1d":
    n = _count(kwargs, "num_samples", 5000, 10, what)
    length = _count(kwargs, "final_seq_length", 40, 1, what)
    split = kwargs.get("train_split", 0.8)
    train = int(n * split) if isinstance(split, float) else n
    # Each example made in float64 (padded, transformed), then float32.
    return DatasetSize(train, n * length * 8 * 4)
  if name in ("text", "text_classes"):
    seq_len = _count(kwargs, "seq_len", 128 if name == "text" else 64, 1, what)
    max_bytes = _count(
      kwargs, "max_bytes", 2_000_000 if name == "text" else 400_000, 1, what
    )
    stride = _count(kwargs, "stride", None, 1, what) or seq_len
    corpus = _stdlib_bytes(kwargs.get("stdlib_dir"))
    read = max_bytes if corpus is None else min(max_bytes, corpus)
    windows = read // stride + 1
    # The int32 windows (seq_len + 1 each), then inputs and labels apart;
    # the classes' reversed copies on top.
    copies = 3 if name == "text" else 5
    return DatasetSize(windows, read + windows * (seq_len + 1) * 4 * copies)
  if name == "cifar10":
    # uint8 files, float32 images, and a normalized copy.
    return DatasetSize(50_000, 60_000 * 3072 * (1 + 4 + 4))
  return None


def _global_batch(config: ml_collections.ConfigDict, workers: int) -> int:
  # Both batch modes deal batch_size * workers examples a step.
  return int(config.batch_size) * workers


def check_sizes(config: ml_collections.ConfigDict) -> None:
  """Checks the config's sizes before JAX starts or data is loaded.

  Args:
    config: the job's config (already through
      :func:`experiments.config_lib.validate_config`).

  Raises:
    ValueError: naming the size, what it needs and the limit.
  """
  check_model_kwargs(
    config.model, config_lib.to_plain(config.get("model_kwargs", {})) or {}
  )
  if "allocator" in config:
    check_model_kwargs(
      config.model,
      config_lib.to_plain(config.allocator.get("timing_model_kwargs", {}))
      or {},
      "config.allocator.timing_model_kwargs",
    )
  steps = int(config.steps)
  host_memory.check(
    f"config.steps={steps}",
    steps * STEP_BYTES,
    f"the sync schedule's table of steps, {STEP_BYTES} bytes a step",
  )
  kwargs = config_lib.to_plain(config.get("dataset_kwargs", {})) or {}
  size = dataset_size(config.dataset, kwargs)
  if size is not None:
    host_memory.check(
      f"config.dataset={config.dataset!r} with {kwargs or 'its defaults'}",
      size.bytes,
      "its arrays while the loader makes them",
    )
  if size is None or config.cluster.strip().lower() == cluster_lib.AUTO:
    return
  n = cluster_lib.parse_cluster(config.cluster).num_workers
  batch = _global_batch(config, n)
  if batch > size.train:
    raise ValueError(
      f"config.cluster={config.cluster!r} with config.batch_size="
      f"{config.batch_size} needs a global batch of {batch} examples ("
      f"{n} workers x {config.batch_size}), more than the {size.train} "
      f"training examples of dataset {config.dataset!r}"
    )


def check_fake_devices(config: ml_collections.ConfigDict) -> None:
  """Checks the fake CPU devices a single process makes, one a worker.

  Raises:
    ValueError: their count needs more than this host's memory.
  """
  n = cluster_lib.parse_cluster(config.cluster).num_workers
  host_memory.check(
    f"config.cluster={config.cluster!r}",
    n * CPU_DEVICE_BYTES,
    f"{n} fake CPU devices, one a worker, {CPU_DEVICE_BYTES // 2**10} KiB each",
  )


def check_model_kwargs(
  model: str, kwargs: Mapping[str, Any], what: str = "config.model_kwargs"
) -> None:
  """Checks a built-in model's size arguments: positive integers.

  Every field of the model's config typed ``int`` (or a tuple of ints: a
  CNN's widths, a ResNet's stage sizes) must hold integers >= 1; a user's
  factory checks its own.

  Raises:
    ValueError: naming the argument and its value.
  """
  if model not in models_lib.MODELS:
    return
  hints = typing.get_type_hints(type(models_lib.MODELS[model].default_config))
  for name, value in kwargs.items():
    hint = hints.get(name)
    if hint is int:
      values = [value]
    elif typing.get_origin(hint) is tuple and set(typing.get_args(hint)) <= {
      int,
      Ellipsis,
    }:
      values = list(value) if isinstance(value, (list, tuple)) else [value]
      if not values:
        raise ValueError(f"{what}.{name} must be integers >= 1, got {value!r}")
    else:
      continue
    if not all(
      isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
      for v in values
    ):
      raise ValueError(
        f"{what}.{name} must be "
        f"{'an integer' if hint is int else 'integers'} >= 1, got {value!r}"
      )


#: A built-in model's config fields that set its depth, and the depth past
#: which its parameters are first extrapolated from shallow copies (an
#: abstract build takes longer the deeper the model).
_DEPTH_FIELDS = ("num_layers", "stage_sizes")
_SHALLOW = 32


def _param_count(build) -> int:
  model = models_lib.without_weights(build)
  return sum(
    math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
  )


def deep_model_params(
  config: ml_collections.ConfigDict, dataset: data_lib.Dataset
) -> int | None:
  """A deep built-in model's parameter count, from shallow copies.

  Parameters grow linearly in each depth field (``num_layers``, each of
  ``stage_sizes``): copies one block deep, and one block deeper per field,
  give the count at the asked depth without building it.

  Returns:
    The count, or None for a user's model or one at most
    ``_SHALLOW`` blocks deep.
  """
  if config.model not in models_lib.MODELS:
    return None
  kwargs = config_lib.to_plain(config.get("model_kwargs", {})) or {}
  default = models_lib.MODELS[config.model].default_config
  depths = {
    f: kwargs.get(f, getattr(default, f))
    for f in _DEPTH_FIELDS
    if hasattr(default, f)
  }
  flat = [
    (f, i, int(d))
    for f, v in depths.items()
    for i, d in enumerate(v if isinstance(v, (list, tuple)) else [v])
  ]
  if sum(d for _, _, d in flat) <= _SHALLOW:
    return None

  def count(deeper: tuple[str, int] | None) -> int:
    shallow = dict(kwargs)
    for f, v in depths.items():
      if isinstance(v, (list, tuple)):
        shallow[f] = [1 + (deeper == (f, i)) for i in range(len(v))]
      else:
        shallow[f] = 1 + (deeper == (f, 0))
    copy = config.copy_and_resolve_references()
    with copy.unlocked():
      copy.model_kwargs = ml_collections.ConfigDict(shallow)
    return _param_count(lambda: config_lib.build_model(copy, dataset))

  base = count(None)
  return base + sum((d - 1) * (count((f, i)) - base) for f, i, d in flat)


def optimizer_state_copies(config: ml_collections.ConfigDict) -> int:
  """Float32 copies of the parameters ``config.optimizer`` keeps."""
  if config.get("optimizer", "adam") == "adam":
    return 2
  return 1 if config.get("momentum", 0.0) else 0


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
    return self.fixed_bytes + self.example_bytes * batch


def step_memory(
  model: Any,
  dataset: data_lib.Dataset,
  batch_size: int,
  loss_fn: Any = None,
  optimizer_state_copies: int = 2,
) -> WorkerMemory:
  """The memory of ``model``'s training step, from shapes alone.

  ``model`` (abstract: ``models.without_weights``) is traced at
  ``batch_size`` on abstract inputs (its ``input_spec``, or the dataset's
  examples through the objective of ``loss_fn``); the predictor's analytic
  memory model prices the step. A model that cannot be traced abstractly is
  priced by its parameters alone (it reports its own error where it is
  built).
  """
  params = sum(
    math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))
  )
  fixed = 4.0 * params * (2 + optimizer_state_copies)
  try:
    sample = (
      None
      if callable(getattr(model, "input_spec", None))
      else task.as_objective(loss_fn).probe(
        task.abstract((dataset.x_train[:1], dataset.y_train[:1]))
      )
    )
    g = predictor.trace_graph(
      model, pipeline.sample_at(model, sample, batch_size)
    )
  except Exception as e:  # pylint: disable=broad-except
    # The model's own error comes where it is built and traced for real.
    logging.info("memory estimate by parameters alone: %s", e)
    return WorkerMemory(fixed, 0.0)
  step = memory_lib.analytic_memory_model(
    g, 0.0, optimizer_state_copies
  ).base_bytes
  return WorkerMemory(fixed, max(step - fixed, 0.0) / batch_size)


def worker_memory(
  config: ml_collections.ConfigDict,
  dataset: data_lib.Dataset,
  batch_size: int,
) -> WorkerMemory:
  """One worker's step memory (:func:`step_memory`) for the job's model,
  built with ``nnx.eval_shape``.

  Raises:
    ValueError: a bad model spec or model arguments.
  """
  model = models_lib.without_weights(
    lambda: config_lib.build_model(config, dataset)
  )
  return step_memory(
    model,
    dataset,
    batch_size,
    config_lib.make_loss_fn(config),
    optimizer_state_copies(config),
  )


def _device_bytes(device: Any) -> float | None:
  """A GPU's memory (jax's ``bytes_limit``), or None if not reported."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return None
  limit = stats.get("bytes_limit")
  return float(limit) if limit else None


def check_model_memory(
  config: ml_collections.ConfigDict,
  dataset: data_lib.Dataset,
  devices: Sequence[Any] | None = None,
) -> None:
  """Checks that this process's workers fit where they run, before the
  model is built.

  Workers on CPU devices share this host's memory with the data: their
  count on this process times one worker's step
  (:func:`worker_memory`), one evaluation batch and the dataset must fit
  it. A worker on a GPU must fit that GPU's memory.

  Args:
    config: the job's config (its cluster resolved).
    dataset: the job's data, in memory.
    devices: the devices the workers map onto (default ``jax.devices()``).

  Raises:
    ValueError: naming the sizes, the estimate and the limit.
  """
  spec = cluster_lib.parse_cluster(config.cluster)
  assigned = cluster_lib.assign_devices(spec, devices)
  here = [d for d in assigned if d.process_index == jax.process_index()]
  if not here:
    return
  batch = int(config.batch_size)
  local_examples = batch * len(here)
  if config.get("batch_mode", "equal") == "dynamic":
    # The global batch split by speed: at most all of it on this process,
    # and on one worker all but one example for each other worker.
    local_examples = _global_batch(config, spec.num_workers)
    batch = local_examples - (spec.num_workers - 1)
  sizes = (
    f"config.model={config.model!r} at config.batch_size={config.batch_size}"
  )
  model_kwargs = config_lib.to_plain(config.get("model_kwargs", {})) or {}
  if model_kwargs:
    sizes += f" with model_kwargs {model_kwargs}"
  copies = optimizer_state_copies(config)
  deep = deep_model_params(config, dataset)
  if deep is not None:  # its parameters alone, before the deep build
    _check_workers(
      config, sizes, here, dataset, WorkerMemory(4.0 * deep * (2 + copies), 0)
    )
  _check_workers(
    config,
    sizes,
    here,
    dataset,
    worker_memory(config, dataset, batch),
    batch,
    local_examples,
  )


def _check_workers(
  config: ml_collections.ConfigDict,
  sizes: str,
  here: Sequence[Any],
  dataset: data_lib.Dataset,
  worker: WorkerMemory,
  batch: int = 0,
  local_examples: int = 0,
) -> None:
  """Raises if this process's CPU workers' steps (``worker``'s fixed part
  each, its per-example part for ``local_examples`` in all), an evaluation
  batch and the data exceed the host's memory, or one worker's step at
  ``batch`` exceeds its GPU's."""
  on_cpu = [d for d in here if d.platform == "cpu"]
  if on_cpu:
    n = len(on_cpu)
    examples = min(local_examples, n * batch)
    data_bytes = float(
      sum(
        getattr(a, "nbytes", 0)
        for a in (dataset.x_train, dataset.y_train, dataset.x_test)
      )
    )
    eval_batch = min(EVAL_BATCH, max(len(dataset.x_test), 1))
    need = (
      n * worker.fixed_bytes
      + worker.example_bytes * (examples + eval_batch)
      + data_bytes
    )
    host_memory.check(
      f"{sizes} on {n} CPU worker(s) (config.cluster={config.cluster!r})",
      need,
      f"{host_memory.gib(worker.at(batch))} per worker's step: parameters, "
      "gradients, optimizer state and activations; plus an evaluation "
      "batch and the dataset",
    )
  for device in here:
    if device.platform == "cpu":
      continue
    capacity = _device_bytes(device)
    if capacity is not None and worker.at(batch) > capacity:
      raise ValueError(
        f"{sizes} needs about {host_memory.gib(worker.at(batch))} per "
        f"worker (parameters, gradients, optimizer state and activations),"
        f" more than {device}'s memory, {host_memory.gib(capacity)}"
      )
