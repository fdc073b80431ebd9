"""Single-device training of a model under a precision plan.

This module owns the losses and metrics every trainer shares and a compact
``train_and_evaluate`` (one device, one plan) that the main job runs until the
hybrid multi-worker trainer lands. The loss is computed in float32 whatever
the plan, so low-precision layers change the arithmetic, not the objective.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator, Mapping

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import policy
from qsync_jax.precision import PrecisionPlan


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy in float32 (labels are integer class ids)."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Fraction of positions whose arg-max logit is the label."""
  return (jnp.argmax(logits, -1) == labels).mean()


def loss_fn(model: nnx.Module, x: jax.Array, y: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
  """Returns (loss, logits) of ``model`` on a batch."""
  logits = model(x)
  return cross_entropy(logits, y), logits


@nnx.jit
def train_step(model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array,
               y: jax.Array) -> dict[str, jax.Array]:
  """One optimizer step on a batch; returns loss and accuracy."""
  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
      model, x, y)
  optimizer.update(model, grads)
  return {"loss": loss, "accuracy": accuracy(logits, y)}


@nnx.jit
def eval_step(model: nnx.Module, x: jax.Array, y: jax.Array
              ) -> dict[str, jax.Array]:
  """Summed loss and correct count of a batch (for exact dataset means)."""
  loss, logits = loss_fn(model, x, y)
  n = y.size
  return {"loss_sum": loss * n,
          "correct": (jnp.argmax(logits, -1) == y).sum()}


def evaluate(model: nnx.Module, x: np.ndarray, y: np.ndarray,
             batch_size: int = 256) -> dict[str, float]:
  """Returns mean loss and accuracy of ``model`` over (x, y)."""
  model.eval()
  loss_sum = correct = count = 0.0
  for xb, yb in data_lib.eval_batches(x, y, batch_size):
    out = eval_step(model, jnp.asarray(xb), jnp.asarray(yb))
    loss_sum += float(out["loss_sum"])
    correct += float(out["correct"])
    count += yb.size
  model.train()
  return {"loss": loss_sum / count, "accuracy": correct / count}


def load_plan(spec: Any) -> PrecisionPlan:
  """Builds a plan from a JSON file path, JSON text, or a config dict.

  Accepts what a config holds: a path to a plan ``.json`` file, the JSON text
  itself, or a mapping with ``rules`` / ``default`` / ``quant``.
  """
  if isinstance(spec, PrecisionPlan):
    return spec
  spec = _to_plain(spec)
  if isinstance(spec, Mapping):
    return PrecisionPlan.from_dict(spec)
  if isinstance(spec, str) and not spec.lstrip().startswith("{"):
    if not os.path.exists(spec):
      raise FileNotFoundError(f"plan file {spec!r} does not exist")
    with open(spec) as f:
      return PrecisionPlan.from_json(f.read())
  return PrecisionPlan.from_json(spec)


def _to_plain(value: Any) -> Any:
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: _to_plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_plain(v) for v in value]
  return value


def _batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  batcher = data_lib.WorkerBatcher(x, y, [batch_size], seed=seed)
  step = 0
  while True:
    ((xb, yb),) = batcher.step_batches(step)
    yield xb, yb
    step += 1


def train_and_evaluate(config: ml_collections.ConfigDict,
                       out_dir: str) -> dict[str, Any]:
  """Trains ``config.model`` on ``config.dataset`` under ``config.plan``.

  Args:
    config: see ``experiments/configs/default.py`` for the fields.
    out_dir: receives ``summary.json`` and ``plan.json``.

  Returns:
    The summary: final_eval_accuracy, final_eval_loss, final_train_loss,
    steps, wall_time_s, precisions (layer -> precision), device_kind.
  """
  os.makedirs(out_dir, exist_ok=True)
  dataset = data_lib.load_dataset(config.dataset,
                                  **_to_plain(config.get("dataset_kwargs", {})))
  factory = models_lib.load_model_factory(config.model)
  model = factory(rngs=nnx.Rngs(config.seed),
                  **_to_plain(config.get("model_kwargs", {})))
  plan = load_plan(config.plan_file or config.plan)
  policy.apply_plan(model, plan, device_kind=config.device_kind)
  precisions = policy.effective_precisions(model, plan)
  logging.info("precision plan:\n%s", policy.describe(model, plan))

  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate),
                            wrt=nnx.Param)
  batches = _batches(dataset.x_train, dataset.y_train, config.batch_size,
                     config.seed)
  start = time.perf_counter()
  metrics = {}
  for step in range(1, config.steps + 1):
    xb, yb = next(batches)
    metrics = train_step(model, optimizer, jnp.asarray(xb), jnp.asarray(yb))
    if step % config.log_every == 0 or step == config.steps:
      elapsed = time.perf_counter() - start
      logging.info("step %d/%d loss %.4f accuracy %.3f (%.1f steps/s)", step,
                   config.steps, float(metrics["loss"]),
                   float(metrics["accuracy"]), step / elapsed)
  wall = time.perf_counter() - start
  final = evaluate(model, dataset.x_test, dataset.y_test)
  summary = {
      "final_eval_accuracy": final["accuracy"],
      "final_eval_loss": final["loss"],
      "final_train_loss": float(metrics["loss"]),
      "steps": config.steps,
      "wall_time_s": wall,
      "device_kind": config.device_kind,
      "precisions": {k: v.value for k, v in precisions.items()},
  }
  with open(os.path.join(out_dir, "plan.json"), "w") as f:
    f.write(plan.to_json())
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  logging.info("eval accuracy %.4f, loss %.4f; wrote %s",
               final["accuracy"], final["loss"], out_dir)
  return summary
