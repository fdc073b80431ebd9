"""Side-by-side step-time measurements (not tests: figures for docs/RESULTS.md).

``trainer_overhead`` measures what the hybrid design costs: the
:class:`~qsync_jax.train.trainer.HybridTrainer` (one jitted gradient function
per worker, then a shard_map that averages and updates) against one plain jitted
SPMD data-parallel step (XLA inserts the all-reduce) on the same devices, model,
optimizer and global batch. Both run in one process, interleaved in rounds, so
machine noise hits both alike; each round times a block of steps with
:func:`qsync_jax.predictor.timing.seconds_per_call`.

The SPMD step is written out here rather than built from
:mod:`qsync_jax.train.step`: it is the baseline a JAX user would write
(pytree parameters, no loss scale, no finiteness check, no accuracy), and the
hybrid trainer's extras are part of what the comparison measures.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from flax import nnx
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from qsync_jax import models as models_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor.timing import seconds_per_call
from qsync_jax.task import losses
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

#: The shortest round the default ``steps_per_round`` gives, in seconds.
MIN_ROUND_S = 0.5


def _spmd_step_fn(model: nnx.Module, tx: optax.GradientTransformation):
  """The plain SPMD data-parallel step (XLA inserts the all-reduce) and the
  model's parameters."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def step(params, opt_state, x, y):
    def loss(p):
      return losses.cross_entropy(nnx.merge(graphdef, p, rest)(x), y)

    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step, params


def trainer_overhead(
  model_name: str,
  batch_per_worker: int,
  *,
  num_workers: int = 4,
  rounds: int = 7,
  steps_per_round: int | None = None,
  model_kwargs: dict[str, Any] | None = None,
  example_spec: jax.ShapeDtypeStruct | None = None,
  seed: int = 0,
) -> dict[str, Any]:
  """Returns median step times of the hybrid trainer and a plain SPMD step.

  Args:
    model_name: a model without BatchNorm, built in (``cnn``, ``bert``,
      ``lm``, ``vit_tiny``) or a ``package.module:factory``
      (:func:`qsync_jax.models.build_model`): the SPMD step would
      synchronize BatchNorm statistics, which the hybrid trainer (like DDP)
      does not.
    batch_per_worker: the local batch size.
    num_workers: workers (devices) used by both.
    rounds: interleaved measurement rounds.
    steps_per_round: steps per round, timed together (dispatch pipelines
      as in training); default enough for a round of the hybrid trainer to
      last :data:`MIN_ROUND_S` (at least 10): on a shared host a short
      round is one preemption away from a wrong figure.
    model_kwargs: config overrides of a built-in model, or the factory's
      keyword arguments.
    example_spec: the shape and dtype of one input example, for a model
      without ``input_spec`` (integer inputs are token ids below 8);
      default the model's ``input_spec``.
    seed: parameter and data seed.

  Returns:
    {model, num_workers, batch_per_worker, hybrid_step_s, spmd_step_s,
     ratio (hybrid / spmd, of the medians), round_ratio (the median of each
     round's ratio: the two sides of a round ran back to back, so a change
     of the host's load between rounds cancels), hybrid_rounds_s and
     spmd_rounds_s (each round's seconds per step), rounds,
     steps_per_round}.
  """
  devices = jax.devices()[:num_workers]
  if len(devices) < num_workers:
    raise ValueError(f"need {num_workers} devices, have {len(devices)}")
  tx = optax.adam(1e-3)
  make = lambda: models_lib.build_model(
    model_name, rngs=nnx.Rngs(seed), **(model_kwargs or {})
  )
  model = make()
  global_batch = batch_per_worker * num_workers
  if example_spec is None:
    spec = model.input_spec(global_batch)
  else:
    spec = jax.ShapeDtypeStruct(
      (global_batch, *example_spec.shape), example_spec.dtype
    )
  rng = np.random.default_rng(seed)
  if np.issubdtype(spec.dtype, np.integer):
    x = rng.integers(0, 8, size=spec.shape).astype(spec.dtype)
  else:
    x = rng.standard_normal(spec.shape).astype(spec.dtype)
  out_shape = jax.eval_shape(model, spec).shape
  y = rng.integers(0, out_shape[-1], size=out_shape[:-1]).astype(np.int32)

  trainer = HybridTrainer(
    make(),
    [Worker(d, "cpu", PrecisionPlan(), batch_per_worker) for d in devices],
    tx,
    sample=(x[:batch_per_worker], y[:batch_per_worker]),
  )
  b = batch_per_worker
  # Both sides get their batches already on the devices: the comparison is
  # of the step, not of host-to-device copies.
  batches = {
    i: jax.device_put(
      (x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]), devices[i]
    )
    for i in range(num_workers)
  }

  mesh = Mesh(np.array(devices), ("workers",))
  step, params = _spmd_step_fn(make(), tx)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  xs, ys = jax.device_put((x, y), NamedSharding(mesh, P("workers")))
  state = {"params": params, "opt": opt_state}

  hybrid_state = [trainer.init()]

  def run_hybrid(k):
    current = hybrid_state[0]
    for _ in range(k):
      current, _ = trainer.train_step(current, batches)
    hybrid_state[0] = current
    current.params.block_until_ready()

  def run_spmd(k):
    for _ in range(k):
      state["params"], state["opt"] = step(
        state["params"], state["opt"], xs, ys
      )
    jax.block_until_ready(state["params"])

  run_hybrid(2)  # compile and warm up both
  run_spmd(2)
  if steps_per_round is None:
    warm = seconds_per_call(run_hybrid, 3)
    steps_per_round = max(10, math.ceil(MIN_ROUND_S / warm))
  hybrid, spmd = [], []
  for _ in range(rounds):
    hybrid.append(seconds_per_call(run_hybrid, steps_per_round))
    spmd.append(seconds_per_call(run_spmd, steps_per_round))
  h, s = statistics.median(hybrid), statistics.median(spmd)
  return {
    "model": model_name,
    "num_workers": num_workers,
    "batch_per_worker": batch_per_worker,
    "hybrid_step_s": h,
    "spmd_step_s": s,
    "ratio": h / s,
    "round_ratio": statistics.median(hh / ss for hh, ss in zip(hybrid, spmd)),
    "hybrid_rounds_s": hybrid,
    "spmd_rounds_s": spmd,
    "rounds": rounds,
    "steps_per_round": steps_per_round,
  }
