"""The indicator, predictor and allocator on models written the usual way.

Users' NNX models have no ``input_spec`` and no ``task``, hold Dropout RNG
streams of their own or take ``train=`` / ``rngs=`` in ``__call__``, take
several inputs, or are a bare layer. Each goes through
``sensitivity.compute``, ``trace_graph``, ``profile``, ``predict`` and
``qs.allocate``, and its mode attributes are left as they were.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsync_jax as qs
from qsync_jax import allocation
from qsync_jax import predictor
from qsync_jax import sensitivity
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.task import losses
from qsync_jax.task import objective as objective_lib

CLUSTER = "v100:1,t4:1"


class UserCNN(nnx.Module):
  """Conv + BatchNorm + Dropout (own rngs) + Linear, as flax's docs write."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.fc = nnx.Linear(4 * 8 * 8, 16, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.bn(self.conv(x)))
    h = self.dropout(h.reshape(h.shape[0], -1))
    return self.head(nnx.relu(self.fc(h)))


class TwoInputs(nnx.Module):
  """Two inputs; dropout takes its rngs and mode at the call."""

  def __init__(self, rngs: nnx.Rngs):
    self.fx = nnx.Linear(6, 8, rngs=rngs)
    self.fz = nnx.Linear(4, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x, z, *, train=False, rngs=None):
    h = nnx.relu(self.fx(x) + self.fz(z))
    h = self.dropout(h, deterministic=not train, rngs=rngs)
    return self.head(h)


def two_input_loss(model, batch, rngs):
  """The user's own step on dict batches."""
  logits = model(batch["x"], batch["z"], train=True, rngs=rngs)
  return (
    losses.cross_entropy(logits, batch["y"]),
    {"accuracy": losses.accuracy(logits, batch["y"])},
  )


def _cnn_case():
  rng = np.random.default_rng(0)
  batches = [
    (
      rng.normal(size=(4, 8, 8, 1)).astype(np.float32),
      rng.integers(0, 3, 4).astype(np.int32),
    )
    for _ in range(2)
  ]
  return UserCNN(nnx.Rngs(0)), None, batches, ["conv", "fc", "head"]


def _two_input_case():
  rng = np.random.default_rng(1)
  batches = [
    {
      "x": rng.normal(size=(4, 6)).astype(np.float32),
      "z": rng.normal(size=(4, 4)).astype(np.float32),
      "y": rng.integers(0, 3, 4).astype(np.int32),
    }
    for _ in range(2)
  ]
  return TwoInputs(nnx.Rngs(1)), two_input_loss, batches, ["fx", "fz", "head"]


def _linear_case():
  rng = np.random.default_rng(2)
  batches = [
    (
      rng.normal(size=(4, 5)).astype(np.float32),
      rng.integers(0, 3, 4).astype(np.int32),
    )
    for _ in range(2)
  ]
  return (
    nnx.Linear(5, 3, rngs=nnx.Rngs(2)),
    losses.cross_entropy,
    batches,
    ["Linear"],
  )


CASES = {
  "cnn": _cnn_case,
  "two_inputs": _two_input_case,
  "bare_linear": _linear_case,
}


def _modes(model):
  """Every mode attribute of the model, and its parameters' values."""
  modes = [
    (tuple(path), name, getattr(node, name))
    for path, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Module)
    for name in ("deterministic", "use_running_average")
    if name in vars(node)
  ]
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  return modes, [np.asarray(p).copy() for p in params]


def _unchanged(model, before):
  modes, params = _modes(model)
  assert modes == before[0]
  for a, b in zip(params, before[1]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_model_through_indicator_graph_prediction_and_allocation(case):
  model, loss_fn, batches, paths = CASES[case]()
  # Users' modes stay as they set them: train for the CNN, eval for the
  # two-input model's own default.
  before = _modes(model)
  scores = sensitivity.compute(
    model, loss_fn, batches, "qsync", ["int8", "fp16"]
  )
  _unchanged(model, before)
  assert scores.layers == paths
  for row in scores.values.values():
    assert row["fp32"] == 0.0
    assert all(np.isfinite(v) and v >= 0 for v in row.values())
    if len(paths) > 1:  # one layer has depth 0 = L: QSync's score is 0
      assert row["int8"] > 0
  # Another method on the same batches: the Hessian trace (dropout masks
  # are fixed per batch, so every probe sees one function).
  hessian = sensitivity.compute(
    model, loss_fn, batches, "hessian", ["int8", "fp16"], hessian_probes=2
  )
  assert all(hessian[p]["int8"] > hessian[p]["fp16"] > 0 for p in paths)

  objective = objective_lib.as_objective(loss_fn)
  batch = batches[0]
  g = predictor.trace_graph(model, objective.probe(batch))
  _unchanged(model, before)
  assert g.paths == paths
  assert g.batch_size == 4
  assert all(n.flops > 0 for n in g.nodes)

  prof = predictor.profile(
    model,
    batch,
    loss_fn=loss_fn,
    precisions=["fp32"],
    tx=optax.sgd(0.1),
    repeats=1,
  )
  _unchanged(model, before)
  assert set(prof.layers) == set(paths)
  assert prof.memory.base_bytes > 0
  measured = predictor.predict(g, "cpu:1", {}, {"cpu": prof}, link=(0.0, 0.0))
  assert measured.step_time_s > 0

  profiles = {k: predictor.analytic_profile(g, k) for k in ("v100", "t4")}
  fp32 = predictor.predict(g, CLUSTER, {}, profiles)
  assert fp32.step_time_s > 0
  a = qs.allocate(g, CLUSTER, scores.values, profiles)
  assert set(a.plans) == {"v100", "t4"}
  assert set(a.precisions["t4"]) == set(paths)
  assert a.prediction.step_time_s <= fp32.step_time_s * (1 + 1e-9)
  _unchanged(model, before)


def test_plan_cluster_takes_a_sample_input_at_any_batch():
  model, _, batches, paths = _two_input_case()
  inputs = {"x": batches[0]["x"], "z": batches[0]["z"]}
  scores = {p: {"int8": 2.0, "fp16": 1.0} for p in paths}
  result = allocation.plan_cluster(
    model, CLUSTER, scores, 16, sample_input=inputs
  )
  assert result.graph.paths == paths
  assert result.graph.batch_size == 16  # resized from the sample's 4
  assert result.baselines["dynamic_batch"]["step_time_s"] > 0
  with pytest.raises(ValueError, match="pass sample_input"):
    allocation.plan_cluster(model, CLUSTER, scores, 16)


def test_a_two_input_graph_marks_both_inputs_as_model_input():
  model, _, batches, _ = _two_input_case()
  inputs = (jnp.asarray(batches[0]["x"]), jnp.asarray(batches[0]["z"]))
  g = predictor.trace_graph(model, inputs)
  fx, fz, head = g.nodes
  assert fx.operands[0].producers == (graph_lib.INPUT,)
  assert fz.operands[0].producers == (graph_lib.INPUT,)
  assert not fx.operands[0].needs_grad and not fz.operands[0].needs_grad
  assert head.operands[0].producers == (0, 1)
  # Both inputs count as the batch (a graph traced from the first alone
  # would undercount it).
  assert g.batch_bytes == 4 * (6 + 4) * 4


def test_indicator_errors_name_the_problem_without_input_spec():
  model, _, _, _ = _cnn_case()
  wrong = [(np.zeros((4, 9, 9, 1), np.float32), np.zeros(4, np.int32))]
  with pytest.raises(ValueError, match="cannot run on batches of shape"):
    sensitivity.compute(model, None, wrong, "qsync")


def test_dropout_masks_are_fixed_per_batch_and_seed():
  model, loss_fn, batches, _ = _two_input_case()
  runs = [
    sensitivity.compute(
      model, loss_fn, batches, "qsync_var", ["int8"], seed=s
    ).values
    for s in (0, 0, 1)
  ]
  assert runs[0] == runs[1]  # the same masks for the same seed
  assert runs[0] != runs[2]  # dropout is on: another seed, other masks
