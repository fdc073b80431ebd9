"""A user's own data through the train binary: arrays, Grain datasets.

The factories (tests/user_datasets.py) return one tiny three-class problem as
``(inputs, labels)`` arrays, a Grain ``MapDataset`` and a Grain
``IterDataset``. The binary trains each on two workers of different kinds
with the dynamic-batch baseline's unequal batches (6 and 4), and a resumed
run ends bit-identical to an uninterrupted one: a ``MapDataset`` is read by
index as arrays are (the same batches), an ``IterDataset``'s position is
checkpointed. The bad factories each end the binary with one ``error:`` line
before anything is written into ``--out_dir``.
"""

import json
import os
import shutil

import binaries
import grain
import numpy as np
import pytest
import user_datasets

import qsync_jax as qs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

# Two kinds, the dynamic-batch baseline: batch_size 5 a worker is a global
# batch of 10, split 6 (v100) and 4 (t4) by config.speeds.
_FLAGS = (
  "--cluster=v100:1,t4:1",
  "--config.batch_mode=dynamic",
  "--config.batch_size=5",
  "--config.model=user_models:bare_linear",
  "--config.plan_mode=manual",
  "--config.learning_rate=0.01",
  "--config.steps=8",
  "--config.eval_every=4",
  "--config.log_every=2",
  "--config.checkpoint_every=2",
  # Counting a Grain dataset's classes would read every label: the model
  # is told.
  '--model_kwargs={"num_classes": 3}',
)


def _train(out, dataset, *extra):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # faster compiles
  return binaries.run(
    "experiments.train",
    f"--out_dir={out}",
    f"--config.dataset=user_datasets:{dataset}",
    *_FLAGS,
    *extra,
    env=env,
    timeout=600,
  )


def _summary(out):
  return json.loads((out / "summary.json").read_text())


def _resume_from_step_6(out, dataset):
  """Resumes ``out`` from its step-6 checkpoint; returns the summary."""
  shutil.rmtree(out / "checkpoints" / "8")
  result = _train(out, dataset, "--resume")
  assert result.returncode == 0, result.stderr[-3000:]
  summary = _summary(out)
  assert summary["steps_this_run"] == 2
  return summary


def test_arrays_train_and_a_map_dataset_resumes_them_bit_identically(
  tmp_path,
):
  out = tmp_path / "run"
  result = _train(out, "arrays")
  assert result.returncode == 0, result.stderr[-3000:]
  straight = _summary(out)
  assert [w["batch_size"] for w in straight["workers"]] == [6, 4]
  assert straight["steps"] == 8 and straight["final_eval_accuracy"] > 0.4
  # The same examples as a MapDataset finish the run from step 6 and end
  # where the uninterrupted run ended: a MapDataset is read by index
  # through the arrays' permutations (one path), and the position in it is
  # the step.
  resumed = _resume_from_step_6(out, "map_dataset")
  assert resumed["params_sha256"] == straight["params_sha256"]
  assert resumed["final_eval_loss"] == straight["final_eval_loss"]
  assert resumed["final_eval_accuracy"] == straight["final_eval_accuracy"]


def test_an_iter_dataset_streams_and_resumes_bit_identically(tmp_path):
  out = tmp_path / "iter"
  result = _train(out, "iter_dataset")
  assert result.returncode == 0, result.stderr[-3000:]
  straight = _summary(out)
  assert [w["batch_size"] for w in straight["workers"]] == [6, 4]
  # 53 examples: 5 global batches an epoch, so step 6 is in the second.
  meta = json.loads(
    (out / "checkpoints" / "6" / "meta" / "metadata").read_text()
  )
  assert meta["data"]["stream"] == {
    "step": 6,
    "epoch": 1,
    "batches_in_epoch": 1,
    "iterator": {"next_index": 10},
  }
  resumed = _resume_from_step_6(out, "iter_dataset")
  assert resumed["params_sha256"] == straight["params_sha256"]
  assert resumed["final_eval_loss"] == straight["final_eval_loss"]
  assert resumed["final_eval_accuracy"] == straight["final_eval_accuracy"]


def _labels(batches):
  return [y.tolist() for _, y in batches.values()]


def test_a_stream_resumes_where_it_stopped_without_repeats_or_skips():
  data = qs.data.open_dataset(user_datasets.iter_dataset, integer_labels=True)
  assert isinstance(data, qs.data.StreamedDataset)
  # Only what one example shows: the classes are the model's to know.
  assert data.head(4).model_kwargs() == {"input_shape": (8,)}
  x_all, _ = user_datasets.arrays("train", 53)
  batcher = qs.data.training_batcher(data, [6, 4])
  read, state = [], None
  for step in range(12):
    if step == 7:
      state = json.loads(json.dumps(batcher.state_dict()))
      # Reading ahead (BatchNorm re-estimation) leaves the position.
      ahead = list(batcher.upcoming(step, 2, [0, 1]))
    batches = batcher.worker_batches(step, [0, 1])
    assert [len(x) for x, _ in batches.values()] == [6, 4]
    read.append(np.concatenate([x for x, _ in batches.values()]))
    if step in (7, 8):
      assert _labels(ahead[step - 7]) == _labels(batches)
  # Each epoch reads the first 50 examples once, in order; the 3 left
  # short of a global batch are dropped.
  for epoch in range(2):
    np.testing.assert_array_equal(
      np.concatenate(read[epoch * 5 : epoch * 5 + 5]), x_all[:50]
    )
  resumed = qs.data.training_batcher(data, [6, 4])
  resumed.load_state_dict(state, 7)
  for step in range(7, 12):
    x = np.concatenate(
      [x for x, _ in resumed.worker_batches(step, [0, 1]).values()]
    )
    np.testing.assert_array_equal(x, read[step])
  with pytest.raises(ValueError, match="read in order: step 3"):
    resumed.worker_batches(3, [0, 1])
  with pytest.raises(ValueError, match="holds no position"):
    qs.data.training_batcher(data, [6, 4]).load_state_dict({}, 7)


def test_a_map_dataset_is_read_by_index_only_where_asked():
  reads = []

  def factory(split):
    x, y = user_datasets.arrays(split)
    examples = grain.MapDataset.source(list(zip(x, y)))
    return examples.map(lambda e: reads.append(e[1]) or e)

  data = qs.data.open_dataset(factory, integer_labels=True)
  # Checking a split reads its first example, not the split.
  assert len(reads) == 2
  reads.clear()
  x, y = user_datasets.arrays("train")
  by_index = qs.data.training_batcher(data, [6, 4], seed=3)
  from_arrays = qs.data.WorkerBatcher(x, y, [6, 4], seed=3)
  for step in (0, 4, 5, 11):  # across epochs, out of order
    got = by_index.worker_batches(step, [1])
    assert list(got) == [1]
    want = from_arrays.step_batches(step)[1]
    np.testing.assert_array_equal(got[1][0], want[0])
    np.testing.assert_array_equal(got[1][1], want[1])
  assert len(reads) == 4 * 4  # worker 1's four examples a step, no more


@pytest.mark.parametrize(
  "factory, message",
  [
    (
      "returns_dict",
      "split 'train' is a dict; a dataset factory returns (inputs, labels) "
      "arrays, a grain.MapDataset or a grain.IterDataset",
    ),
    ("lengths_differ", "split 'train': 50 inputs but 49 labels"),
    (
      "float_labels",
      "split 'train': its labels are float32, not integers",
    ),
    ("empty_test", "split 'test' is empty"),
    (
      "shapes_differ",
      "examples of inconsistent shapes: the training split's inputs and "
      "labels are (8,) and (), the test split's (4,) and ()",
    ),
    ("ragged", "split 'train': examples of inconsistent shapes"),
    ("no_split", "cannot be called as factory(split='train')"),
    ("missing", "module 'user_datasets' has no attribute 'missing'"),
    (
      "stream_shape_changes",
      "split 'train', example 11 has inputs of shape (7,) and labels of "
      "shape (); the first example's are (8,) and ()",
    ),
  ],
)
def test_an_unusable_factory_is_one_clear_error(factory, message):
  spec = f"user_datasets:{factory}"
  with pytest.raises(ValueError) as info:
    data = qs.data.open_dataset(spec, integer_labels=True)
    # A stream is checked on its first example; the rest as it is read.
    data.head(20)
  text = str(info.value)
  assert "\n" not in text
  assert text.startswith(f"dataset {spec!r}"), text
  assert message in text, text


def test_a_module_that_does_not_exist_is_one_clear_error():
  with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
    qs.data.open_dataset("no_such_mod:data")


def test_the_binary_shows_a_raising_factory_and_one_line_before_writing(
  tmp_path,
):
  out = tmp_path / "out"
  result = _train(out, "raises")
  assert result.returncode == 1, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last == (
    "error: dataset 'user_datasets:raises' raised FileNotFoundError for "
    "split='train': no shards under /nonexistent/shards (its traceback is "
    "above)"
  )
  # The user's own traceback, from the factory down, above the line.
  trace = result.stderr[result.stderr.index("Traceback") :]
  assert "in raises" in trace and "in _load_shards" in trace
  assert "qsync_jax" not in trace
  # Refused before the first write: the directory it created is gone.
  assert not out.exists()
