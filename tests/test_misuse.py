"""The library's Python API misused, users' models that misbehave and data
wrong in content: each is one clear error, raised before any work.

The trainer's refusals run no step (nothing compiles), so one small trainer
serves them all.
"""

import os

import binaries
from flax import nnx
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qsync_jax as qs
from qsync_jax import models
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker


def _batch(n, seed=0, classes=10):
  rng = np.random.default_rng(seed)
  return (
    rng.uniform(size=(n, 8, 8, 1)).astype(np.float32),
    rng.integers(0, classes, size=n).astype(np.int32),
  )


def _trainer(sizes, devices=None, sample=True):
  devices = devices or jax.devices()[: len(sizes)]
  workers = [
    Worker(d, "cpu", qs.PrecisionPlan(), b) for d, b in zip(devices, sizes)
  ]
  return HybridTrainer(
    models.create_model("cnn", rngs=nnx.Rngs(0)),
    workers,
    optax.sgd(0.1),
    sample=_batch(sizes[0]) if sample else None,
  )


@pytest.fixture(scope="module")
def trainer():
  trainer = _trainer([4, 4])
  return trainer, trainer.init()


def _with(batch, inputs=None, labels=None):
  return (
    batch[0] if inputs is None else inputs,
    batch[1] if labels is None else labels,
  )


_GOOD = _batch(4)


@pytest.mark.parametrize(
  "batches, error, message",
  [
    (
      [_GOOD, _GOOD],
      TypeError,
      "batches must be a mapping {worker index: batch}, got list",
    ),
    ({0: _GOOD}, ValueError, "no batch for local workers [1]"),
    (
      {0: _GOOD, 1: _GOOD, 2: _GOOD},
      ValueError,
      "batches has entries for [2], which are not workers of this trainer",
    ),
    (
      {0: _batch(8), 1: _GOOD},
      ValueError,
      "batches[0] has 8 examples but worker 0 declared batch_size=4",
    ),
    (
      {0: _batch(2), 1: _GOOD},
      ValueError,
      "give it 4 examples, or declare Worker(..., batch_size=2)",
    ),
    (
      {0: _with(_GOOD, labels=_GOOD[1][:3]), 1: _GOOD},
      ValueError,
      "batches[0]: its inputs hold 4 examples but its labels 3",
    ),
    (
      {0: _with(_GOOD, inputs=np.zeros((4, 9, 9, 1), np.float32)), 1: _GOOD},
      ValueError,
      "batches[0]: its inputs have shape (4, 9, 9, 1), examples of shape (9, 9, 1), but the trainer was built with a sample of examples of shape (8, 8, 1)",
    ),
    (
      {0: _batch(4, classes=50), 1: _GOOD},
      ValueError,
      "labels range over 0..48, but the model outputs 10 classes",
    ),
    (
      {0: _with(_GOOD, labels=np.array([0, -1, 2, 3], np.int32)), 1: _GOOD},
      ValueError,
      "labels range over -1..3",
    ),
    (
      {0: _with(_GOOD, labels=_GOOD[1].astype(np.float32)), 1: _GOOD},
      ValueError,
      "its labels are float32, but the default classification objective takes integer class ids",
    ),
    (
      {0: _with(_GOOD, inputs=_GOOD[0].astype(object)), 1: _GOOD},
      TypeError,
      "batches[0]: its inputs are dtype object, not a numeric array",
    ),
    (
      {0: (_GOOD[0], _GOOD[1], _GOOD[1]), 1: _GOOD},
      ValueError,
      "batches[0] is structured as",
    ),
  ],
)
def test_train_step_refuses_batches_it_would_weigh_or_score_wrongly(
  trainer, batches, error, message
):
  trainer, state = trainer
  with pytest.raises(error) as info:
    trainer.train_step(state, batches)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_a_state_that_is_not_this_trainers_is_refused(trainer):
  trainer, state = trainer
  batches = {0: _GOOD, 1: _GOOD}
  with pytest.raises(TypeError, match="state must be a qsync_jax.TrainState"):
    trainer.train_step({"params": state.params}, batches)
  three = _trainer([4, 4, 4])
  with pytest.raises(
    ValueError,
    match=r"state is not this trainer's: its params have shape \(3, ",
  ):
    trainer.train_step(three.init(), batches)
  other_devices = _trainer([4, 4], devices=jax.devices()[2:4])
  with pytest.raises(
    ValueError, match="state is not this trainer's: its params lie on"
  ):
    trainer.train_step(other_devices.init(), batches)
  with pytest.raises(ValueError, match="state is not this trainer's"):
    trainer.evaluate(three.init(), _batch(8))


@pytest.mark.parametrize(
  "data, kwargs, error, message",
  [
    (
      (_batch(8)[0], _batch(6)[1]),
      {},
      ValueError,
      "data: its inputs hold 8 examples but its labels 6",
    ),
    (
      (np.zeros((8, 9, 9, 1), np.float32), _batch(8)[1]),
      {},
      ValueError,
      "data: its inputs have shape (8, 9, 9, 1)",
    ),
    (_batch(8, classes=40), {}, ValueError, "data: its labels range over"),
    ((_batch(0)[0], _batch(0)[1]), {}, ValueError, "data holds no examples"),
    (
      _with(_batch(8), inputs=np.full((8, 8, 8, 1), np.nan, np.float32)),
      {},
      ValueError,
      "data: its inputs are not finite (NaN or inf) at example 0 (8 of 8)",
    ),
    (
      _batch(8),
      {"train_batches": {0: _GOOD, 1: _GOOD}},
      TypeError,
      "train_batches is one step's {worker index: batch}",
    ),
  ],
)
def test_evaluate_refuses_data_it_would_score_wrongly(
  trainer, data, kwargs, error, message
):
  trainer, state = trainer
  with pytest.raises(error) as info:
    trainer.evaluate(state, data, **kwargs)
  assert message in str(info.value)


class _Out(nnx.Module):
  def __init__(self, form):
    self.layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    self.form = form

  def __call__(self, x):
    y = self.layer(x)
    return {"tuple": (y, y), "dict": {"logits": y}}[self.form]


class _IntParams(nnx.Module):
  def __init__(self):
    self.layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    self.table = nnx.Param(jnp.ones((3,), jnp.int32))

  def __call__(self, x):
    return self.layer(x) * self.table.value


@pytest.mark.parametrize(
  "model, message",
  [
    (
      _Out("tuple"),
      "model _Out returns a tuple of 2; the default classification objective needs one array of logits",
    ),
    (_Out("dict"), "model _Out returns a dict (keys ['logits'])"),
    (
      _IntParams(),
      "model _IntParams has a parameter of dtype int32 (table), which has no gradient",
    ),
  ],
)
def test_a_model_that_misbehaves_is_refused_when_the_trainer_is_built(
  model, message
):
  sample = (np.zeros((2, 4), np.float32), np.zeros((2,), np.int32))
  workers = [Worker(jax.devices()[0], "cpu", qs.PrecisionPlan(), 2)]
  with pytest.raises(ValueError) as info:
    HybridTrainer(model, workers, optax.sgd(0.1), sample=sample)
  assert message in str(info.value), str(info.value)


def _raising_factory(*, rngs, **kwargs):
  raise RuntimeError("weights file missing")


def test_a_model_factory_that_raises_is_named_with_its_exception():
  with pytest.raises(models.FactoryError) as info:
    models.build_model(f"{__name__}:_raising_factory", rngs=nnx.Rngs(0))
  assert str(info.value) == (
    f"model '{__name__}:_raising_factory' raised RuntimeError: weights file "
    "missing (its traceback is above)"
  )
  assert isinstance(info.value.__cause__, RuntimeError)


def test_a_checkpointer_pointed_at_a_file_is_refused(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(ValueError, match="is a file, not a directory"):
    qs.Checkpointer(str(path))
  with pytest.raises(ValueError, match="lies under .* which is a file"):
    qs.Checkpointer(os.path.join(path, "sub"))
  with pytest.raises(ValueError, match="directory is empty"):
    qs.Checkpointer("")
  with pytest.raises(TypeError, match="must be a path"):
    qs.Checkpointer(None)
  with pytest.raises(ValueError, match="max_to_keep must be >= 1"):
    qs.Checkpointer(str(tmp_path / "ok"), max_to_keep=0)
  assert not (tmp_path / "ok").exists()


def test_data_wrong_in_content_is_refused_where_it_is_read():
  x, y = _batch(16)
  x[5, 1, 1, 0] = np.nan
  with pytest.raises(
    ValueError, match="x: its inputs are not finite .* at example 5"
  ):
    qs.data.WorkerBatcher(x, y, [4, 4])
  with pytest.raises(TypeError, match="x is an array of objects"):
    qs.data.WorkerBatcher(_batch(16)[0].astype(object), y, [4, 4])


class _Raises:
  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    if i == 5:
      raise OSError("shard 1 unreadable")
    return np.zeros(4, np.float32), np.int32(i % 3)


def test_a_grain_dataset_that_raises_mid_epoch_is_named():
  def factory(split):
    return grain.MapDataset.source(_Raises(8))

  data = qs.data.open_dataset(factory, integer_labels=True)
  with pytest.raises(qs.data.FactoryError) as info:
    data.head(8)
  assert "raised OSError as it was read: shard 1 unreadable" in str(info.value)
  stream = grain.MapDataset.source(_Raises(8)).to_iter_dataset()
  data = qs.data.open_dataset(lambda split: stream, integer_labels=True)
  with pytest.raises(qs.data.FactoryError, match="shard 1 unreadable"):
    list(data.eval_set().batches(4))


def test_a_streamed_example_with_nan_inputs_is_named():
  def factory(split):
    xs = np.zeros((8, 4), np.float32)
    xs[6, 2] = np.inf
    return grain.MapDataset.source([(xs[i], np.int32(i % 3)) for i in range(8)])

  data = qs.data.open_dataset(factory, integer_labels=True)
  with pytest.raises(ValueError, match="example 6: its inputs are not finite"):
    data.head(8)


def test_impossible_periods_and_unknown_averager_fields_are_named():
  with pytest.raises(
    ValueError, match="total_steps must be a positive integer, got 0"
  ):
    qs.make_schedule("local", total_steps=0, h_base=2)
  with pytest.raises(
    ValueError, match="switch_step=50 is not before total_steps=10"
  ):
    qs.make_schedule("postlocal", total_steps=10, h_base=2, switch_step=50)
  with pytest.raises(TypeError) as info:
    qs.make_averager("gqsgd", levels=4)
  assert str(info.value) == (
    "make_averager('gqsgd') takes no levels; it takes wire, bucket_size, "
    "seed, noise"
  )
  with pytest.raises(
    TypeError, match=r"make_averager\('fp16'\) takes no dtype"
  ):
    qs.make_averager("fp16", dtype="float32")


def test_a_plan_rule_that_conflicts_with_an_earlier_one_is_refused():
  with pytest.raises(
    qs.PlanError, match="rule 1 \\('conv1', fp16\\) repeats rule 0's pattern"
  ):
    qs.PrecisionPlan([("conv1", "int8"), ("conv1", "fp16")])
  model = models.create_model("cnn", rngs=nnx.Rngs(0))
  shadowed = qs.PrecisionPlan([(r"conv\d", "int8"), ("conv1", "fp16")])
  with pytest.raises(
    qs.PlanError, match=r"plan rule 1 \('conv1', fp16\) never applies"
  ):
    qs.apply_plan(model, shadowed, device_kind="t4")
  # The ordered override idiom stays: the later rule still takes layers.
  qs.apply_plan(
    model,
    qs.PrecisionPlan([("conv1", "fp16"), (r"conv\d", "int8")]),
    device_kind="t4",
  )


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(out, *flags):
  env = dict(os.environ)
  tests = os.path.join(_ROOT, "tests")
  env["PYTHONPATH"] = os.pathsep.join([_ROOT, tests, env.get("PYTHONPATH", "")])
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  return binaries.run(
    "experiments.train",
    f"--out_dir={out}",
    "--cluster=v100:1,t4:1",
    "--config.plan_mode=manual",
    "--config.batch_size=4",
    "--config.steps=2",
    "--config.eval_every=2",
    "--config.log_every=1",
    '--model_kwargs={"num_classes": 3}',
    *flags,
    env=env,
    timeout=600,
  )


def test_the_binary_names_a_model_factory_that_raises_in_one_line(tmp_path):
  # The library's refusals are tested in-process above; here the exit
  # status, the line and the factory's own traceback above it.
  out = tmp_path / "out"
  result = _train(
    out,
    "--config.model=misbehaving:model_raises",
    "--config.dataset=user_datasets:arrays",
  )
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
    "error: model 'misbehaving:model_raises' raised FileNotFoundError: no "
    "weights at /nonexistent/weights.npz (its traceback is above)"
  )
  trace = result.stderr[result.stderr.index("Traceback") :]
  assert "in model_raises" in trace and "in _read_weights" in trace
  assert not out.exists()


def test_a_dataset_factory_with_nan_inputs_is_named():
  with pytest.raises(ValueError) as info:
    qs.data.open_dataset("misbehaving:nan_inputs", integer_labels=True)
  assert str(info.value) == (
    "dataset 'misbehaving:nan_inputs', split 'train': its inputs are not "
    "finite (NaN or infinity) at example 7 (1 example); clean or drop "
    "those examples"
  )


def test_a_stream_that_raises_mid_epoch_is_named_by_its_dataset():
  data = qs.data.open_dataset("misbehaving:stream_raises", integer_labels=True)
  batcher = qs.data.training_batcher(data, [2, 2], seed=0)
  batcher.worker_batches(0, [0, 1])  # examples 0..3 read
  with pytest.raises(qs.data.FactoryError) as info:
    batcher.worker_batches(1, [0, 1])
  assert str(info.value) == (
    "dataset 'misbehaving:stream_raises', split 'train' raised OSError as "
    "it was read: shard 1 unreadable (its traceback is above)"
  )


def _worker(**fields):
  base = dict(
    device=jax.devices()[0], kind="cpu", plan=qs.PrecisionPlan(), batch_size=4
  )
  return Worker(**{**base, **fields})


_SGD = optax.sgd(0.1)


@pytest.mark.parametrize(
  "workers, tx, message",
  [
    (
      [_worker(batch_size=4.5)],
      _SGD,
      "workers[0].batch_size must be an integer, got float 4.5",
    ),
    (
      [_worker(plan={"default": "fp16"})],
      _SGD,
      "workers[0].plan must be a qsync_jax.PrecisionPlan, got dict",
    ),
    ([_worker(device="cpu:0")], _SGD, "workers[0].device must be a jax device"),
    (_worker(), _SGD, "workers must be a list of qsync_jax.Worker, got Worker"),
    (
      [_worker()],
      optax.sgd,
      "tx must be an optax.GradientTransformation, got function (call it: optax.sgd(0.1), not optax.sgd)",
    ),
    ([_worker()], "sgd", "tx must be an optax.GradientTransformation, got str"),
  ],
)
def test_the_trainers_arguments_of_the_wrong_type_are_named(
  workers, tx, message
):
  with pytest.raises(TypeError) as info:
    HybridTrainer(models.create_model("cnn", rngs=nnx.Rngs(0)), workers, tx)
  assert message in str(info.value)


class _Stream:
  """An evaluation stream (a streamed dataset's test split): its second
  batch holds a class the model does not have."""

  def batches(self, batch_size):
    yield _batch(4)
    yield _batch(4, classes=40)


def test_an_evaluation_stream_is_checked_as_it_is_read(trainer):
  trainer, state = trainer
  with pytest.raises(ValueError) as info:
    trainer.evaluate(state, _Stream())
  assert str(info.value).startswith(
    "data (evaluation stream), batch 1: its labels range over"
  )
