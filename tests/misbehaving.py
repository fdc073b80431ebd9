"""Model and dataset factories that misbehave at run time, for
tests/test_misuse.py: the train binary must name each in one line."""

import grain
import numpy as np
import user_datasets


def model_raises(*, rngs, **kwargs):
  """A model factory whose own code fails (a missing weights file)."""
  del rngs, kwargs
  return _read_weights("/nonexistent/weights.npz")


def _read_weights(path):
  raise FileNotFoundError(f"no weights at {path}")


class _Shards:
  """Examples read one by one; the sixth fails, as an unreadable shard."""

  def __init__(self, split):
    self.x, self.y = user_datasets.arrays(split)

  def __len__(self):
    return len(self.x)

  def __getitem__(self, i):
    if i == 5:
      raise OSError("shard 1 unreadable")
    return self.x[i], self.y[i]


def stream_raises(split):
  """An IterDataset that raises mid-epoch, after its first examples."""
  return grain.MapDataset.source(_Shards(split)).to_iter_dataset()


def nan_inputs(split):
  """Arrays whose example 7 holds a NaN input."""
  x, y = user_datasets.arrays(split)
  x = x.copy()
  x[7, 3] = np.nan
  return x, y
