"""Models whose parameters carry flax sharding annotations, unmodified.

The models annotate their parameters as flax's examples and MaxText do: NNX
with ``nnx.with_partitioning`` and ``out_sharding=`` / ``sharding=``
metadata, Linen with ``nn.with_partitioning`` and
``nn.with_logical_partitioning``; some names are mesh axes, some logical
names. Each goes through every stage with and without a mesh: where the mesh
has an annotation's axes they are applied, the rest is left unsharded, and
the annotations stay on the model as written (qsync_jax/task/sharding.py).
The factories below also serve the train binary
(``test_sharding_annotations:linen_net``).
"""

import contextlib
import json
import math
import os
import subprocess
import sys

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import qsync_jax as qs
from qsync_jax import models
from qsync_jax import sensitivity
from qsync_jax.plan import devices
from qsync_jax.predictor import casting
from qsync_jax.train.layout import AXIS

# The NNX model's bias uses flax's older ``sharding=`` metadata name.
pytestmark = pytest.mark.filterwarnings(
  "ignore:'sharding' is deprecated:DeprecationWarning"
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
CLUSTER = "v100:1,t4:1"
# The logical rules of a run that maps the logical names onto the mesh.
RULES = (("embed", "data"), ("mlp", "model"))


class NNXNet(nnx.Module):
  """A Linear on mesh axes and an Einsum on logical axes (no rules map
  them unless the caller sets some); the biases carry ``out_sharding=`` and
  the older ``sharding=`` metadata."""

  def __init__(self, din: int, num_classes: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.linear = nnx.Linear(
      din,
      16,
      kernel_init=nnx.with_partitioning(init, ("data", "model")),
      bias_metadata={"out_sharding": ("model",)},
      rngs=rngs,
    )
    self.einsum = nnx.Einsum(
      "bi,io->bo",
      (16, num_classes),
      (num_classes,),
      kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
      bias_metadata={"sharding": ("mlp",)},
      rngs=rngs,
    )

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    return self.einsum(nnx.relu(self.linear(x)))


def nnx_net(*, rngs, input_shape, num_classes):
  return NNXNet(math.prod(input_shape), num_classes, rngs=rngs)


class LinenNet(nn.Module):
  """Pixel intensities as tokens through an Embed on ``("vocab",
  "model")`` (a mesh axis and one no mesh here has), a Dense on the logical
  axes ``("embed", "mlp")`` and a plain Dense head."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    tokens = jnp.round(x.reshape(x.shape[0], -1) * 16).astype(jnp.int32)
    embed = nn.with_partitioning(
      nn.initializers.normal(0.1), ("vocab", "model")
    )
    h = nn.Embed(17, 8, embedding_init=embed)(tokens)
    dense = nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), ("embed", "mlp")
    )
    h = nn.Dense(16, kernel_init=dense)(h.reshape(h.shape[0], -1))
    return nn.Dense(self.num_classes)(nn.relu(h))


def linen_net(*, rngs, num_classes):
  del rngs  # the library initialises Linen modules
  return LinenNet(num_classes=num_classes)


# family: (factory spec, layer paths, {state path: annotation as written})
FAMILIES = {
  "nnx": (
    "test_sharding_annotations:nnx_net",
    ["linear", "einsum"],
    {
      ("linear", "kernel"): ("data", "model"),
      ("linear", "bias"): ("model",),
      ("einsum", "kernel"): ("embed", "mlp"),
      ("einsum", "bias"): ("mlp",),
    },
  ),
  "linen": (
    "test_sharding_annotations:linen_net",
    ["Embed_0", "Dense_0", "Dense_1"],
    {
      ("linen_variables", "params", "Embed_0", "embedding"): (
        "vocab",
        "model",
      ),
      ("linen_variables", "params", "Dense_0", "kernel"): ("embed", "mlp"),
    },
  ),
}
# What a (data: 2, model: 2) mesh keeps of each annotation, without and with
# RULES; None: nothing, the parameter is not sharded.
KEPT = {
  ("linear", "kernel"): (P("data", "model"), P("data", "model")),
  ("linear", "bias"): (P("model"), P("model")),
  ("einsum", "kernel"): (None, P("data", "model")),
  ("einsum", "bias"): (None, P("model")),
  ("linen_variables", "params", "Embed_0", "embedding"): (
    P(None, "model"),
    P(None, "model"),
  ),
  ("linen_variables", "params", "Dense_0", "kernel"): (
    None,
    P("data", "model"),
  ),
}


def _mesh():
  return jax.make_mesh(
    (2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def _data(n=8, seed=0):
  rng = np.random.default_rng(seed)
  return (
    rng.uniform(size=(n, 8, 8, 1)).astype(np.float32),
    rng.integers(0, 10, n).astype(np.int32),
  )


def _build(family, seed=0):
  """The family's model, built through the library as the binary builds it
  (an annotated NNX model cannot be built without a mesh by flax alone)."""
  x, _ = _data()
  return models.build_model(
    FAMILIES[family][0],
    rngs=nnx.Rngs(seed),
    data_kwargs={"input_shape": (8, 8, 1), "num_classes": 10},
    sample_input=x[:2],
  )


def _variable(model, path):
  node = nnx.state(model)
  for part in path:
    node = node[part]
  return node


def _annotations(model, family):
  return {
    path: _variable(model, path).get_metadata("out_sharding")
    for path in FAMILIES[family][2]
  }


def _assert_placed(model, family, index):
  """Each annotated parameter is sharded as the mesh keeps it, or not."""
  for path in FAMILIES[family][2]:
    value = _variable(model, path)[...]
    want = KEPT[path][index]
    if want is None:
      assert len(value.sharding.device_set) == 1 or (
        value.sharding.is_fully_replicated
      ), path
    else:
      assert value.sharding.spec == want, path


def test_a_mesh_gets_the_axes_it_has_and_the_rest_is_left_unsharded():
  x, _ = _data()
  for family in FAMILIES:
    # No mesh: flax alone refuses these models (from_linen and an NNX
    # factory failed before anything ran); nothing is sharded.
    model = _build(family)
    assert _annotations(model, family) == FAMILIES[family][2]
    for path in FAMILIES[family][2]:
      assert len(_variable(model, path)[...].sharding.device_set) == 1
    with jax.set_mesh(_mesh()):
      model = _build(family)
      _assert_placed(model, family, 0)
      # The annotations stay as written, for the user's own sharded code.
      assert _annotations(model, family) == FAMILIES[family][2]
      with nn.logical_axis_rules(RULES):
        _assert_placed(_build(family), family, 1)
  # Linen reads its boxes under a sharding constraint: on the mesh it names
  # the kept axes only ("model" of the Embed's ("vocab", "model")).
  model = qs.from_linen(LinenNet(), x[:2], rngs=nnx.Rngs(0))
  with jax.set_mesh(_mesh()):
    jaxpr = str(jax.make_jaxpr(lambda v: model(v, train=False))(x))
  assert "P(None, 'model')" in jaxpr
  assert "vocab" not in jaxpr and "embed" not in jaxpr


def test_placeholder_weights_are_placed_as_a_build_places_them():
  for family in FAMILIES:
    with jax.set_mesh(_mesh()):
      model = models.placeholder_weights(lambda f=family: _build(f))
      _assert_placed(model, family, 0)
      built = _build(family)
    assert _annotations(model, family) == FAMILIES[family][2]
    placeholders = nnx.to_flat_state(nnx.state(model))
    real = nnx.to_flat_state(nnx.state(built))
    assert [path for path, _ in placeholders] == [path for path, _ in real]
    for (path, var), (_, want) in zip(placeholders, real):
      assert var[...].shape == want[...].shape, path
      assert var[...].dtype == want[...].dtype, path
      assert var[...].sharding == want[...].sharding, path
      if isinstance(want, nnx.Param):
        assert not np.any(np.asarray(var[...])), path


class WorkerSharded(nn.Module):
  """A Dense whose kernel names the trainer's mesh axis."""

  @nn.compact
  def __call__(self, x):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (AXIS, None))
    return nn.Dense(4, kernel_init=init)(x)


def test_a_shard_map_over_the_workers_axis_runs_a_linen_model_naming_it():
  # In a shard_map over the trainer's mesh (a user's own loop, as
  # examples/byo_model.py writes it) the axis is manual: flax's constraint
  # on it fails there; the model's kept part leaves it out.
  x = np.ones((4, 6), np.float32)
  model = qs.from_linen(WorkerSharded(), x[:2], rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))

  def body(rows):
    return nnx.merge(graphdef, state)(rows, train=False)

  run = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  )
  np.testing.assert_allclose(
    run(x), model(x, train=False), rtol=1e-6, atol=1e-6
  )


def _stages(family, model, batches):
  """Every stage the library runs on a model, with what each must find.

  The profile's cast costs are the device's, not the model's: the test
  takes a GPU's from the device table instead of timing them here.
  """
  x, y = batches[0]
  paths = FAMILIES[family][1]
  annotations = _annotations(model, family)
  assert qs.layer_paths(model, x) == paths
  for method in sensitivity.METHODS:
    scores = sensitivity.compute(
      model, None, batches, method, ["int8", "fp16"], hessian_probes=1
    )
    assert scores.layers == paths
    assert all(
      np.isfinite(v) for r in scores.values.values() for v in r.values()
    )
  measured = sensitivity.measure(model, None, batches[:1], ["fp16"])
  assert measured["loss"].layers == paths
  graph = qs.trace_graph(model, x)
  assert graph.paths == paths
  profile = qs.profile(
    model, (x, y), precisions=["fp32"], tx=optax.sgd(0.1), repeats=1
  )
  assert set(profile.layers) == set(paths)
  profiles = {k: qs.analytic_profile(graph, k) for k in ("v100", "t4")}
  assert qs.predict(graph, CLUSTER, {}, profiles).step_time_s > 0
  allocation = qs.allocate(graph, CLUSTER, scores.values, profiles)
  assert set(allocation.precisions["t4"]) == set(paths)

  # A plan puts the head in FP16: its operands are f16 in the jaxpr.
  def jaxpr():
    return str(
      jax.make_jaxpr(lambda v: qs.call_model(model, v, train=False))(x)
    )

  assert "f16[" not in jaxpr()
  qs.apply_plan(model, qs.PrecisionPlan([(paths[-1], "fp16")]), x)
  assert "f16[" in jaxpr()
  qs.apply_plan(model, qs.PrecisionPlan(), x)
  assert _annotations(model, family) == annotations


def _trainer(model, x):
  workers = [
    qs.Worker(d, k, qs.PrecisionPlan(), 4)
    for d, k in zip(jax.devices()[:2], ("v100", "t4"))
  ]
  return qs.HybridTrainer(
    model, workers, optax.adam(1e-2), sample=qs.task.input_probe(x)
  )


def _step(trainer, state, seed):
  x, y = _data(8, seed)
  return trainer.train_step(state, {0: (x[:4], y[:4]), 1: (x[4:], y[4:])})


def _train_and_resume(family, build, directory):
  """Two steps with a checkpoint between them, and the second step again
  from that checkpoint in a trainer of a model built afresh."""
  x, _ = _data()
  trainer = _trainer(build(), x[:2])
  state, _ = _step(trainer, trainer.init(), 0)
  checkpointer = qs.Checkpointer(directory)
  checkpointer.save(trainer, state)
  state, metrics = _step(trainer, state, 1)
  assert all(np.isfinite(float(m["loss"])) for m in metrics.values())
  # The trainer's parameters carry the model's annotations, unapplied.
  params = trainer.worker_params(state, 1)
  for path, names in FAMILIES[family][2].items():
    node = params
    for part in path:
      node = node[part]
    assert node.get_metadata("out_sharding") == names
  resumed = _trainer(build(), x[:2])
  restored = checkpointer.restore_latest(resumed, resumed.init())
  assert restored.meta["step"] == 1
  checkpointer.close()
  resumed_state, _ = _step(resumed, restored.state, 1)
  assert resumed.params_digest(resumed_state) == trainer.params_digest(state)


@pytest.mark.parametrize("on_mesh", [False, True], ids=["no_mesh", "mesh"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_stage_runs_on_annotated_models(
  family, on_mesh, tmp_path, monkeypatch
):
  casts = casting.analytic_cast_model(devices.device_spec("t4"))
  monkeypatch.setattr(casting, "fit_cast_model", lambda *a, **k: casts)
  batches = [_data(4, seed) for seed in range(2)]
  with jax.set_mesh(_mesh()) if on_mesh else contextlib.nullcontext():
    _stages(family, _build(family), batches)
    _train_and_resume(family, lambda: _build(family), str(tmp_path / "ckpt"))


def test_the_train_binary_plans_and_trains_an_annotated_linen_factory(
  tmp_path,
):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  out = tmp_path / "run"
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={out}",
      "--config.model=test_sharding_annotations:linen_net",
      "--config.dataset=digits",
      "--plan=auto",
      f"--cluster={CLUSTER}",
      "--config.batch_size=16",
      "--config.steps=2",
      "--config.eval_every=2",
      "--config.log_every=1",
      "--config.checkpoint_every=2",
      "--config.allocator.num_batches=1",
      "--config.allocator.timing_batch_size=16",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 2
  assert np.isfinite(summary["final_eval_loss"])
  assert (out / "plans" / "t4.json").exists()
  assert (out / "checkpoints" / "2").is_dir()
