"""Dataset factories written the usual way, for tests/test_user_data.py.

Each is called as ``factory(split="train"|"test", **kwargs)``: the good ones
return the same tiny three-class problem as arrays, a Grain ``MapDataset``
or a Grain ``IterDataset``; the others are the mistakes the train binary
must name in one line.
"""

import time

import grain
import jax
import numpy as np

FEATURES = 8
CLASSES = 3


def arrays(split, n=50):
  """``(inputs, labels)``: float32 features whose class shifts the mean."""
  rng = np.random.default_rng(0 if split == "train" else 1)
  y = rng.integers(0, CLASSES, n).astype(np.int32)
  centers = np.eye(CLASSES, FEATURES, dtype=np.float32) * 2
  x = (centers[y] + rng.normal(size=(n, FEATURES))).astype(np.float32)
  return x, y


def map_dataset(split, n=50):
  """The same examples as :func:`arrays`, one ``(inputs, label)`` each."""
  x, y = arrays(split, n)
  return grain.MapDataset.source(list(zip(x, y)))


def iter_dataset(split, n=53):
  """The same examples as a stream (53: the last 3 short of a batch)."""
  return map_dataset(split, n).to_iter_dataset()


def raises(split):
  del split
  return _load_shards("/nonexistent/shards")


def _load_shards(path):
  raise FileNotFoundError(f"no shards under {path}")


def returns_dict(split):
  x, y = arrays(split)
  return {"x": x, "y": y}


def lengths_differ(split):
  x, y = arrays(split)
  return x, y[:-1]


def float_labels(split):
  x, y = arrays(split)
  return x, y.astype(np.float32)


def empty_test(split):
  return map_dataset(split, 0 if split == "test" else 50)


def shapes_differ(split):
  x, y = arrays(split)
  return grain.MapDataset.source(
    list(zip(x[:, : 4 if split == "test" else 8], y))
  )


def ragged(split):
  del split
  return [np.zeros(3), np.zeros(4)], [0, 1]


def stream_shape_changes(split):
  """A stream whose 12th example is shorter than the first 11."""
  x, y = arrays(split)
  examples = [(x[i, : 7 if i == 11 else 8], y[i]) for i in range(len(x))]
  return grain.MapDataset.source(examples).to_iter_dataset()


def no_split():
  return arrays("train")


#: Seconds :func:`slow_on_process_1` takes to read one training example on
#: process 1.
SLOW_READ_S = 0.05


def slow_on_process_1(split, n=50):
  """:func:`map_dataset`, whose training examples process 1 of a
  multi-process run reads :data:`SLOW_READ_S` each: a slow worker."""

  def read(example):
    if jax.process_index() == 1:
      time.sleep(SLOW_READ_S)
    return example

  dataset = map_dataset(split, n)
  return dataset.map(read) if split == "train" else dataset
