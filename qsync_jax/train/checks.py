"""What a :class:`~qsync_jax.train.trainer.HybridTrainer` checks at its door.

This module owns the checks of the arguments a trainer's caller passes, each
made once, before any work, with a one-line message naming the argument:

* at construction, the workers, model and optimizer
  (:func:`check_worker`, :func:`check_model_and_optimizer`), the model's
  parameters (:func:`check_params`: floating point, at least one) and, for
  the built-in classification objective, the model's outputs
  (:func:`output_classes`: one array of logits);
* every step, the state (:func:`check_state`: this trainer's workers and
  model) and the batches (:func:`check_batches`: one per local worker,
  none for a worker the trainer does not have, each of its worker's declared
  size, of the sample's structure and shapes, numeric, class ids within the
  model's classes);
* at evaluation, the state, the evaluation set and ``train_batches``
  (:func:`check_evaluation`).

A step's checks stay cheap: they compare shapes, keys and dtypes on the host
against what the trainer recorded at construction (:class:`Door`), read no
device value, and do no work that grows with the model. Labels are read only
where they are host (numpy) arrays, so a device batch costs no transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

from flax import nnx
import jax
from jax.sharding import NamedSharding
import numpy as np

from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.task import calling
from qsync_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Door:
  """What a trainer checks its callers' arguments against.

  Attributes:
    batch_sizes: each worker's declared batch size.
    local: this process's workers' indices.
    params_shape: ``(num_workers, num_params)`` of the state's parameters.
    sharding: the stacked state's sharding (the trainer's devices).
    treedef: a batch's pytree structure (the ``sample``'s), or None.
    shapes: each batch leaf's shape after the example axis (the
      ``sample``'s), or None.
    classes: the logits' last dimension under the built-in classification
      objective, or None (another objective, or not known).
  """

  batch_sizes: tuple[int, ...]
  local: tuple[int, ...]
  params_shape: tuple[int, int]
  sharding: NamedSharding
  treedef: Any = None
  shapes: tuple[tuple[int, ...], ...] | None = None
  classes: int | None = None


def sample_batch(sample: Any) -> Any:
  """``sample`` when it is one worker's batch of arrays (not a probe, not
  None), else None."""
  if sample is None or isinstance(sample, calling.Probe):
    return None
  leaves = jax.tree.leaves(sample)
  if not leaves or not all(getattr(a, "shape", ()) for a in leaves):
    return None
  return sample


def record(trainer: Any, sample: Any, classes: int | None) -> Door:
  """The :class:`Door` of ``trainer`` (a
  :class:`~qsync_jax.train.trainer.HybridTrainer` being built, its workers
  and parameters known).

  Args:
    trainer: the trainer.
    sample: its ``sample``: a batch fixes the batches' structure and
      example shapes.
    classes: the model's classes under the built-in classification
      objective (:func:`output_classes`; labels are checked against them),
      or None.

  Returns:
    The door.
  """
  batch = sample_batch(sample)
  treedef = shapes = None
  if batch is not None:
    leaves, treedef = jax.tree.flatten(batch)
    shapes = tuple(tuple(a.shape[1:]) for a in leaves)
  return Door(
    tuple(w.batch_size for w in trainer.workers),
    tuple(trainer.local_workers),
    (trainer.num_workers, trainer.num_params),
    trainer.sharding,
    treedef,
    shapes,
    classes or None,
  )


def check_worker(worker: Any, index: int, worker_type: Any) -> None:
  """Raises ``TypeError`` unless ``worker`` is a ``worker_type`` (the
  trainer's ``Worker``) on a jax device, with a device kind, a
  ``PrecisionPlan`` and an integer batch size."""
  what = f"workers[{index}]"
  if not isinstance(worker, worker_type):
    raise TypeError(
      f"{what} must be a qsync_jax.Worker(device, kind, plan, batch_size), "
      f"got {type(worker).__name__}"
    )
  fields = (
    ("device", jax.Device, "a jax device (jax.devices()[i])"),
    ("kind", str, "a device kind such as 'v100'"),
    ("plan", PrecisionPlan, "a qsync_jax.PrecisionPlan"),
  )
  for name, kind, wanted in fields:
    value = getattr(worker, name)
    if not isinstance(value, kind):
      raise TypeError(
        f"{what}.{name} must be {wanted}, got {type(value).__name__} {value!r}"
      )
  size = worker.batch_size
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
    raise TypeError(
      f"{what}.batch_size must be an integer, got {type(size).__name__} "
      f"{size!r}"
    )


def check_model_and_optimizer(model: Any, tx: Any, seed: Any) -> None:
  """Raises ``TypeError`` unless ``model`` is an NNX module, ``tx`` an optax
  transformation and ``seed`` an integer."""
  if not isinstance(model, nnx.Module):
    raise TypeError(
      f"model must be an nnx.Module, got {type(model).__name__}; wrap a "
      "Linen module or an (init, apply) pair with "
      "qsync_jax.plan.bridge.from_linen"
    )
  if not (
    callable(getattr(tx, "init", None))
    and callable(getattr(tx, "update", None))
  ):
    hint = " (call it: optax.sgd(0.1), not optax.sgd)" if callable(tx) else ""
    raise TypeError(
      f"tx must be an optax.GradientTransformation, got "
      f"{type(tx).__name__}{hint}"
    )
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"seed must be an integer, got {seed!r}")


def check_params(model: nnx.Module, params: nnx.State) -> None:
  """Raises unless ``model`` has parameters, all floating point.

  Raises:
    ValueError: no ``nnx.Param``, or an integer or boolean one (which has
      no gradient), naming it and its dtype.
  """
  name = type(model).__name__
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if not flat:
    raise ValueError(
      f"model {name} has no nnx.Param to train; give it trainable "
      "parameters (nnx.Linear, nnx.Conv, nnx.Param(...))"
    )
  for path, leaf in flat:
    dtype = np.dtype(getattr(leaf, "dtype", np.float32))
    if not np.issubdtype(dtype, np.inexact):
      where = jax.tree_util.keystr(path, simple=True, separator="/")
      where = where.removesuffix("/value")  # the Variable's own field
      raise ValueError(
        f"model {name} has a parameter of dtype {dtype} ({where}), which "
        "has no gradient: make it floating point, or hold it in an "
        "nnx.Variable rather than an nnx.Param"
      )


def default_classes(
  model: nnx.Module, given: Any, objective: Any, sample: Any
) -> int | None:
  """:func:`output_classes` where the trainer's objective is the built-in
  classification one (``given``, the objective argument, is None), else
  None."""
  return None if given is not None else output_classes(model, objective, sample)


def output_classes(
  model: nnx.Module, objective: Any, sample: Any, batch_size: int = 2
) -> int:
  """The number of classes the model's logits have, from its outputs on
  ``sample`` (a batch) or its ``input_spec``, computed abstractly (0 where
  neither is there, or the model cannot run on it).

  Raises:
    ValueError: the model's output is not one array of logits (a tuple or a
      dict, say), or its shape does not match the labels.
  """
  batch = sample_batch(sample)
  graphdef, state = nnx.split(model)

  def forward(state, inputs):
    return objective.call(
      nnx.merge(graphdef, state), inputs, train=False, rngs=calling.trace_rngs()
    )

  try:
    if batch is not None:
      inputs = objective.inputs(calling.abstract(batch))
    elif isinstance(sample, calling.Probe) or not hasattr(model, "input_spec"):
      return 0
    else:
      inputs = calling.abstract(model.input_spec(batch_size))
    out = jax.eval_shape(forward, state, inputs)
  except (AttributeError, TypeError, ValueError):
    # A sample the model cannot run: tracing the layers with it says what
    # it must be (HybridTrainer's sample check), as for no sample at all.
    return 0
  name = type(model).__name__
  if not isinstance(out, jax.ShapeDtypeStruct) or not out.shape:
    raise ValueError(
      f"model {name} returns {_described(out)}; the default classification "
      "objective needs one array of logits (batch, ..., classes): return "
      "the logits, or pass objective=loss_fn(model, batch, rngs)"
    )
  labels = jax.tree.leaves(batch)[-1] if batch is not None else None
  if labels is not None and tuple(out.shape[:-1]) != tuple(labels.shape):
    raise ValueError(
      f"model {name} returns logits of shape {tuple(out.shape)} for labels "
      f"of shape {tuple(labels.shape)} (the sample's); the default "
      "classification objective needs logits of shape "
      f"{(*labels.shape, 'classes')}, or pass objective=..."
    )
  return int(out.shape[-1])


def _described(value: Any) -> str:
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  if isinstance(value, dict):
    return f"a dict (keys {sorted(map(str, value))})"
  if isinstance(value, jax.ShapeDtypeStruct):
    return f"a scalar of dtype {value.dtype}"
  return f"a {type(value).__name__}"


def check_state(door: Door, state: Any) -> None:
  """Raises unless ``state`` is a state of this trainer.

  Raises:
    TypeError: ``state`` is not a ``TrainState``.
    ValueError: its parameters are of another shape (another model, other
      workers) or on other devices, or it holds other local workers.
  """
  if not isinstance(state, TrainState):
    raise TypeError(
      f"state must be a qsync_jax.TrainState (trainer.init(), or one "
      f"restored with Checkpointer.restore_latest), got "
      f"{type(state).__name__}"
    )
  params = state.params
  shape = tuple(getattr(params, "shape", ()))
  n, p = door.params_shape
  fix = (
    "start from trainer.init(), or restore a checkpoint with this trainer "
    "(Checkpointer.restore_latest(trainer, state))"
  )
  if shape != door.params_shape:
    raise ValueError(
      f"state is not this trainer's: its params have shape {shape}, this "
      f"trainer's {n} workers hold {p} parameters each {(n, p)} (a state "
      f"of another model or other workers); {fix}"
    )
  if getattr(params, "sharding", None) != door.sharding:
    raise ValueError(
      "state is not this trainer's: its params lie on "
      f"{_devices(params)}, this trainer's workers on "
      f"{list(door.sharding.mesh.devices.flat)}; {fix}"
    )
  if not isinstance(state.rest, Mapping) or sorted(state.rest) != list(
    door.local
  ):
    got = sorted(state.rest) if isinstance(state.rest, Mapping) else None
    raise ValueError(
      f"state is not this trainer's: it holds the model state of workers "
      f"{got}, this process's workers are {list(door.local)}; {fix}"
    )


def _devices(x: Any) -> Any:
  sharding = getattr(x, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  return list(mesh.devices.flat) if mesh is not None else type(x).__name__


def check_step(door: Door, state: Any, batches: Any) -> None:
  """The checks of a training step's arguments: :func:`check_state` and
  :func:`check_batches`."""
  check_state(door, state)
  check_batches(door, batches)


def check_evaluation(
  door: Door, state: Any, data: Any, train_batches: Any
) -> Any:
  """The checks of an evaluation's arguments: :func:`check_state`,
  :func:`check_eval_data` and :func:`check_train_batches`.

  Returns:
    ``data``; a stream (with ``batches``) wrapped so that each batch is
    checked as it is read.
  """
  check_state(door, state)
  check_train_batches(train_batches)
  if hasattr(data, "batches"):
    return _CheckedStream(door, data)
  check_eval_data(door, data)
  return data


class _CheckedStream:
  """An evaluation stream whose batches are checked as they are read."""

  def __init__(self, door: Door, stream: Any):
    self.door, self.stream = door, stream

  def batches(self, batch_size: int) -> Any:
    """The stream's batches, each checked (:func:`check_batch`)."""
    for k, batch in enumerate(self.stream.batches(batch_size)):
      check_batch(self.door, batch, f"data (evaluation stream), batch {k}")
      yield batch


def check_batches(door: Door, batches: Any) -> None:
  """Raises unless ``batches`` gives each local worker one batch of its
  size, as the trainer was built for.

  Raises:
    TypeError: ``batches`` is not a mapping, or a batch holds something
      other than numeric arrays (objects, Python lists).
    ValueError: a local worker without a batch, an entry for no worker of
      this trainer, a batch of another size than its worker declared, of
      another structure or example shape than the sample's, with float
      labels or class ids outside the model's classes.
  """
  if not isinstance(batches, Mapping):
    raise TypeError(
      f"batches must be a mapping {{worker index: batch}}, got "
      f"{type(batches).__name__}; e.g. dict(enumerate(batch_list))"
    )
  n = len(door.batch_sizes)
  if len(batches) > len(door.local):
    extra = [k for k in batches if not _is_worker(k, n)]
    if extra:
      raise ValueError(
        f"batches has entries for {extra}, which are not workers of this "
        f"trainer (its workers are 0..{n - 1}); give one batch per worker"
      )
  missing = [i for i in door.local if i not in batches]
  if missing:
    bad = [k for k in batches if not _is_worker(k, n)]
    hint = f" (and entries for {bad}, no worker's)" if bad else ""
    raise ValueError(f"no batch for local workers {missing}{hint}")
  for i in door.local:
    check_batch(door, batches[i], f"batches[{i}]", door.batch_sizes[i], i)


def _is_worker(key: Any, n: int) -> bool:
  return bool(isinstance(key, (int, np.integer)) and 0 <= key < n)


def check_batch(
  door: Door,
  batch: Any,
  what: str,
  size: int | None = None,
  worker: int | None = None,
) -> int:
  """Raises unless ``batch`` is one batch as the trainer takes it.

  Args:
    door: what the trainer recorded.
    batch: the batch.
    what: how messages name it (``"batches[0]"``).
    size: the examples it must hold (a worker's batch size), or None.
    worker: the worker whose batch it is, for messages.

  Returns:
    The batch's number of examples.

  Raises:
    TypeError, ValueError: see :func:`check_batches`.
  """
  leaves, treedef = jax.tree.flatten(batch)
  if door.treedef is not None and treedef != door.treedef:
    raise ValueError(
      f"{what} is structured as {treedef}, but the trainer was built with "
      f"a sample structured as {door.treedef}; give every batch the "
      "sample's structure"
    )
  if not leaves:
    raise ValueError(f"{what} holds no array")
  count = None
  for k, leaf in enumerate(leaves):
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or getattr(dtype, "kind", "O") == "O":
      got = f"dtype {dtype}" if dtype is not None else type(leaf).__name__
      raise TypeError(
        f"{what}: its {_leaf(batch, k)} are {got}, not a numeric array; "
        "convert them with np.asarray(..., dtype) first"
      )
    if not shape:
      raise ValueError(
        f"{what}: its {_leaf(batch, k)} have no example axis (a scalar)"
      )
    if count is None:
      count = int(shape[0])
    if shape[0] != count:
      raise ValueError(
        f"{what}: its {_leaf(batch, 0)} hold {count} examples but its "
        f"{_leaf(batch, k)} {shape[0]}; every array of a batch has one "
        "entry per example"
      )
    if door.shapes is not None and tuple(shape[1:]) != door.shapes[k]:
      raise ValueError(
        f"{what}: its {_leaf(batch, k)} have shape {tuple(shape)}, "
        f"examples of shape {tuple(shape[1:])}, but the trainer was built "
        f"with a sample of examples of shape {door.shapes[k]}"
      )
  assert count is not None
  if size is not None and count != size:
    raise ValueError(
      f"{what} has {count} examples but worker {worker} declared "
      f"batch_size={size} (its share of the average is weighted by it): "
      f"give it {size} examples, or declare Worker(..., batch_size={count})"
    )
  if door.classes:
    _check_labels(door.classes, batch, what)
  return count


def _leaf(batch: Any, k: int) -> str:
  """How a message names leaf ``k`` of ``batch``."""
  if isinstance(batch, (tuple, list)) and len(batch) == 2:
    if all(not isinstance(b, (tuple, list, dict)) for b in batch):
      return ("inputs", "labels")[k]
  if not isinstance(batch, (tuple, list, dict)):
    return "examples"
  path = jax.tree_util.tree_flatten_with_path(batch)[0][k][0]
  return f"entry {jax.tree_util.keystr(path)}"


def _check_labels(classes: int, batch: Any, what: str) -> None:
  """Class ids of a classification batch, read only when on the host."""
  if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
    return
  labels = batch[1]
  dtype = getattr(labels, "dtype", None)
  if dtype is not None and not np.issubdtype(dtype, np.integer):
    raise ValueError(
      f"{what}: its labels are {dtype}, but the default classification "
      "objective takes integer class ids; convert them (astype(np.int32)), "
      "or pass an objective for other targets"
    )
  if isinstance(labels, np.ndarray) and labels.size:
    # One pass: seen as unsigned, a negative id is above any class too.
    unsigned = labels.view(labels.dtype.str.replace("i", "u"))
    if unsigned.max() >= classes:
      low, high = int(labels.min()), int(labels.max())
      head = f" (or give the model a head of {high + 1})" if low >= 0 else ""
      raise ValueError(
        f"{what}: its labels range over {low}..{high}, but the model "
        f"outputs {classes} classes: labels must be class ids in "
        f"0..{classes - 1}{head}"
      )


def check_eval_data(door: Door, data: Any) -> None:
  """Raises unless ``data`` is an evaluation set the trainer can score:
  one batch as :func:`check_batch` takes it (any size but 0), with finite
  inputs where they are host arrays.

  Raises:
    TypeError, ValueError: naming ``data`` and what is wrong with it.
  """
  if check_batch(door, data, "data") == 0:
    raise ValueError("data holds no examples; evaluation needs at least one")
  first = jax.tree.leaves(data)[0]
  if isinstance(first, np.ndarray) and np.issubdtype(first.dtype, np.inexact):
    bad = np.asarray(~np.isfinite(first.reshape(len(first), -1)).all(axis=1))
    if bad.any():
      raise ValueError(
        f"data: its inputs are not finite (NaN or inf) at example "
        f"{int(np.argmax(bad))} ({int(bad.sum())} of {len(bad)}); clean or "
        "drop them"
      )


def check_train_batches(train_batches: Any) -> None:
  """Raises unless ``train_batches`` is a sequence of steps' batches.

  Raises:
    TypeError: one step's ``{worker index: batch}`` given where a sequence
      of them is expected.
  """
  if isinstance(train_batches, Mapping):
    raise TypeError(
      "train_batches is one step's {worker index: batch}; pass a sequence "
      "of steps' batches, e.g. [batches]"
    )
