"""Tests for precision plans on Linen models (qsync_jax.plan.linen)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxpr_utils import contractions_of
import numpy as np
import pytest

import qsync_jax as qs
from qsync_jax.numerics.precision import Precision


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3), name="conv1")(x))
    x = nn.relu(nn.Conv(8, (3, 3), name="conv2")(x)).mean((1, 2))
    x = nn.relu(nn.Dense(16, name="fc")(x))
    return nn.Dense(10, name="head")(x)


X = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))


def test_layer_paths_in_forward_order():
  assert qs.linen.layer_paths(LinenCNN(), jax.random.key(0), X) == [
    "conv1",
    "conv2",
    "fc",
    "head",
  ]


def test_plan_applies_through_interception():
  module = LinenCNN()
  planned = qs.linen.apply_plan(
    module, qs.PrecisionPlan([("conv1", "int8"), ("fc", "fp16")])
  )
  variables = planned.init(jax.random.key(0), X)
  plain = module.init(jax.random.key(0), X)
  # Same variables, all FP32: the plan changes compute only.
  jax.tree.map(np.testing.assert_array_equal, variables, plain)
  assert planned.precisions() == {
    "conv1": Precision.INT8,
    "conv2": Precision.FP32,
    "fc": Precision.FP16,
    "head": Precision.FP32,
  }
  found = contractions_of(lambda v: planned.apply(v, X), variables)
  assert [f[1] for f in found] == [
    ("int8", "int8"),
    ("float32", "float32"),
    ("float16", "float16"),
    ("float32", "float32"),
  ]
  out, ref = planned.apply(variables, X), module.apply(variables, X)
  assert 0 < float(jnp.abs(out - ref).max()) < 0.05
  grads = jax.grad(lambda v: planned.apply(v, X).sum())(variables)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_errors():
  planned = qs.linen.apply_plan(
    LinenCNN(), qs.PrecisionPlan([("conv9", "int8")])
  )
  with pytest.raises(qs.PlanError, match="conv1, conv2, fc, head"):
    planned.init(jax.random.key(0), X)
  planned = qs.linen.apply_plan(
    LinenCNN(), qs.PrecisionPlan([("conv1", "int8")]), device_kind="v100"
  )
  with pytest.raises(qs.PlanError, match="'v100' does not support int8"):
    planned.init(jax.random.key(0), X)
