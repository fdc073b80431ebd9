"""Tests for qsync_jax.data: loaders' shapes/dtypes/ranges and batching."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from qsync_jax import data


def test_digits():
  ds = data.load_digits()
  assert ds.x_train.shape[1:] == (8, 8, 1) and ds.x_train.dtype == np.float32
  assert ds.y_train.dtype == np.int32
  assert ds.num_train + ds.num_test == 1797
  assert ds.num_test == pytest.approx(0.2 * 1797, abs=1)
  assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
  assert set(np.unique(ds.y_test)) == set(range(10))
  again = data.load_digits()
  np.testing.assert_array_equal(ds.x_test, again.x_test)


def test_digits_split_is_cached_and_read_without_scikit_learn(tmp_path):
  fresh = data.load_digits(seed=1, use_cache=False)
  assert not list(tmp_path.glob("*"))
  first = data.load_digits(seed=1, cache_dir=tmp_path)
  (cached,) = tmp_path.glob("digits_*.npz")
  for split in ("x_train", "y_train", "x_test", "y_test"):
    np.testing.assert_array_equal(getattr(first, split), getattr(fresh, split))
  # Another split is another entry.
  data.load_digits(seed=2, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("digits_*.npz"))) == 2
  # A process that reads the cache never imports scikit-learn.
  code = (
    "import sys; from qsync_jax import data; "
    f"ds = data.load_digits(seed=1, cache_dir={str(tmp_path)!r}); "
    "print(ds.num_train, 'sklearn' in sys.modules)"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  )
  assert out.stdout.split() == [str(fresh.num_train), "False"]
  # A damaged entry is made again.
  cached.write_bytes(cached.read_bytes()[:100])
  again = data.load_digits(seed=1, cache_dir=tmp_path)
  np.testing.assert_array_equal(again.x_test, fresh.x_test)
  np.testing.assert_array_equal(np.load(cached)["y_train"], fresh.y_train)


def test_mnist1d_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("QSYNC_JAX_CACHE", str(tmp_path / "env"))
  state = np.random.get_state()[1].copy()
  ds = data.load_mnist1d(num_samples=200, seed=3)
  # The generator's global seeding must not leak into the caller.
  np.testing.assert_array_equal(np.random.get_state()[1], state)
  assert ds.x_train.shape == (160, 40) and ds.x_test.shape == (40, 40)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  assert ds.y_train.min() >= 0 and ds.y_train.max() <= 9
  files = list((tmp_path / "env").glob("mnist1d_*.npz"))
  assert len(files) == 1
  cached = data.load_mnist1d(num_samples=200, seed=3)
  np.testing.assert_array_equal(ds.x_train, cached.x_train)
  # A different seed is a different cache entry; explicit dir beats env.
  other = data.load_mnist1d(num_samples=200, seed=4, cache_dir=tmp_path / "a")
  assert not np.array_equal(ds.x_train, other.x_train)
  assert len(list((tmp_path / "a").glob("mnist1d_*.npz"))) == 1
  with pytest.raises(ValueError, match="unknown mnist1d"):
    data.load_mnist1d(num_samples=200, bogus=1, cache_dir=tmp_path)


def test_text():
  ds = data.load_text(seq_len=32, max_bytes=60_000)
  assert ds.task == "lm" and ds.num_classes == 256
  assert ds.x_train.shape[1] == 32 and ds.x_train.dtype == np.int32
  assert ds.num_train > 0 and ds.num_test > 0
  assert ds.x_train.min() >= 0 and ds.x_train.max() < 256
  np.testing.assert_array_equal(ds.x_train[:, 1:], ds.y_train[:, :-1])
  # Consecutive windows chain: last target is the next window's first input.
  np.testing.assert_array_equal(ds.y_train[:-1, -1], ds.x_train[1:, 0])
  train, test = data.text.load_stdlib_bytes(60_000)
  assert len(train) + len(test) == 60_000
  assert 0.05 < len(test) / 60_000 < 0.5


def test_text_missing_sources(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    data.load_text(stdlib_dir=tmp_path)


def test_make_lm_windows():
  w = data.make_lm_windows(np.arange(10), seq_len=3)
  np.testing.assert_array_equal(w, [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]])


def test_synthetic():
  ds = data.load_synthetic(
    num_train=100, num_test=20, input_shape=(4, 4, 2), num_classes=3
  )
  assert ds.x_train.shape == (100, 4, 4, 2) and ds.x_test.shape == (20, 4, 4, 2)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  assert set(np.unique(ds.y_train)) <= {0, 1, 2}
  np.testing.assert_array_equal(
    ds.x_train, data.load_synthetic(100, 20, (4, 4, 2), 3).x_train
  )
  reg = data.load_dataset(
    "synthetic_regression", num_train=50, num_test=10, output_dim=2
  )
  assert reg.task == "regression" and reg.y_train.shape == (50, 2)
  assert reg.x_train.shape == (50, 16) and reg.y_train.dtype == np.float32


def _write_cifar(root, n=10, protocol=None):
  """Writes tiny CIFAR-10 pickle batches; returns the raw uint8 rows.

  Each batch is the dict the official files hold: b"batch_label", b"labels",
  b"data" (a uint8 numpy array) and b"filenames".
  """
  root.mkdir(parents=True)
  rng = np.random.default_rng(0)
  rows = {}
  for name in data.cifar10.EXPECTED_FILES:
    rows[name] = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    batch = {
      b"batch_label": name.encode(),
      b"labels": list(range(n)),
      b"data": rows[name],
      b"filenames": [b"img_%d.png" % i for i in range(n)] + [b""],
    }
    with open(root / name, "wb") as f:
      pickle.dump(batch, f, protocol=protocol)
  return rows


def test_cifar10_layout(tmp_path):
  rows = _write_cifar(tmp_path / "cifar-10-batches-py")
  ds = data.load_dataset("cifar10", data_dir=tmp_path)  # Parent dir works.
  assert ds.x_train.shape == (50, 32, 32, 3)
  assert ds.x_test.shape == (10, 32, 32, 3)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  np.testing.assert_array_equal(ds.y_test, np.arange(10))
  # Pixel (h, w) of channel c sits at row offset c*1024 + h*32 + w.
  raw = rows["data_batch_2"][3]
  img = ds.x_train[13]
  for c, h, w in [(0, 0, 0), (1, 5, 7), (2, 31, 30), (0, 12, 31)]:
    assert img[h, w, c] == np.float32(raw[c * 1024 + h * 32 + w] / 255.0)
  direct = data.load_cifar10(tmp_path / "cifar-10-batches-py", normalize=True)
  np.testing.assert_allclose(
    direct.x_test, (ds.x_test - data.cifar10.MEAN) / data.cifar10.STD, rtol=1e-6
  )


@pytest.mark.parametrize("protocol", [0, 2, None, 5])
def test_cifar10_loads_every_pickle_protocol(tmp_path, protocol):
  # Protocol 2 writes bytes as _codecs.encode and numpy 2 arrays under
  # numpy._core; 5 (numpy's _frombuffer); None is pickle's default.
  rows = _write_cifar(tmp_path / "b", n=4, protocol=protocol)
  ds = data.load_cifar10(tmp_path / "b")
  np.testing.assert_array_equal(  # Pixel (0, 1) of each channel.
    np.rint(ds.x_test[2, 0, 1] * 255), rows["test_batch"][2, [1, 1025, 2049]]
  )
  np.testing.assert_array_equal(ds.y_train, np.tile(np.arange(4), 5))


class _RunsCode:
  """Unpickles to ``os.system(command)``, as a crafted batch would."""

  def __init__(self, command):
    self.command = command

  def __reduce__(self):
    return os.system, (self.command,)


@pytest.mark.parametrize("protocol", [0, 2, None])
def test_cifar10_crafted_pickle_is_refused_without_running(tmp_path, protocol):
  root = tmp_path / "b"
  _write_cifar(root)
  marker = tmp_path / "ran"
  batch = {b"data": _RunsCode(f"touch {marker}"), b"labels": [0]}
  with open(root / "data_batch_3", "wb") as f:
    pickle.dump(batch, f, protocol=protocol)
  with pytest.raises(ValueError) as err:
    data.load_cifar10(root)
  msg = str(err.value)
  assert "\n" not in msg
  assert str(root / "data_batch_3") in msg
  assert f"refused to load global {os.system.__module__}.system" in msg
  assert not marker.exists()
  # The file is a real exploit: plain pickle runs its command.
  pickle.loads((root / "data_batch_3").read_bytes())
  assert marker.exists()


@pytest.mark.parametrize(
  "content, message",
  [
    (b"not a pickle", "not a CIFAR-10 batch pickle"),
    (
      pickle.dumps([1, 2]),
      "expected a dict with keys b'data' and b'labels', got list",
    ),
    (pickle.dumps({b"data": 1}), "got keys [\"b'data'\"]"),
    # _codecs.encode is admitted for pickle's latin1 bytes only.
    (b"c_codecs\nencode\n(Vx\nVrot13\ntR.", "refused _codecs.encode"),
  ],
  ids=["garbage", "list", "no_labels", "rot13"],
)
def test_cifar10_malformed_batch_is_one_clear_error(tmp_path, content, message):
  root = tmp_path / "b"
  _write_cifar(root)
  (root / "test_batch").write_bytes(content)
  with pytest.raises(ValueError) as err:
    data.load_cifar10(root)
  assert str(root / "test_batch") in str(err.value)
  assert message in str(err.value)


def test_cifar10_missing(tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError) as err:
    data.load_cifar10(missing)
  msg = str(err.value)
  assert str(missing) in msg
  for name in data.cifar10.EXPECTED_FILES:
    assert name in msg
  with pytest.raises(ValueError, match="data_dir"):
    data.load_dataset("cifar10")


def test_unknown_dataset():
  with pytest.raises(ValueError, match="mnist1d"):
    data.load_dataset("imagenet")


def test_batcher_unequal_sizes_and_epoch_coverage():
  x = np.arange(103) * 10
  y = np.arange(103)
  b = data.WorkerBatcher(x, y, batch_sizes=[7, 3, 10], seed=1)
  assert b.steps_per_epoch == 5 and b.num_workers == 3
  for epoch in range(2):
    seen = []
    for step in range(epoch * 5, epoch * 5 + 5):
      batches = b.step_batches(step)
      assert [len(xb) for xb, _ in batches] == [7, 3, 10]
      for xb, yb in batches:
        np.testing.assert_array_equal(xb, yb * 10)
        seen.extend(yb.tolist())
    assert len(seen) == len(set(seen)) == 100  # Each example at most once.
  # Epochs use different orders.
  assert not np.array_equal(b.step_batches(0)[0][1], b.step_batches(5)[0][1])


def test_batcher_determinism_and_resume():
  x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
  y = np.arange(64)
  a = data.WorkerBatcher(x, y, [5, 11], seed=7)
  for step in range(9):
    a.step_batches(step)
  fresh = data.WorkerBatcher(x, y, [5, 11], seed=7)
  for step in (17, 9, 3):  # Jump straight to a step, out of order.
    for (xa, ya), (xf, yf) in zip(
      a.step_batches(step), fresh.step_batches(step)
    ):
      np.testing.assert_array_equal(xa, xf)
      np.testing.assert_array_equal(ya, yf)
  other_seed = data.WorkerBatcher(x, y, [5, 11], seed=8)
  assert not np.array_equal(
    other_seed.step_batches(0)[0][1], a.step_batches(0)[0][1]
  )


@pytest.mark.parametrize("sizes", [[4, 0], [-1, 3], [], [60, 5]])
def test_batcher_invalid_sizes(sizes):
  with pytest.raises(ValueError):
    data.WorkerBatcher(np.zeros(64), np.zeros(64), sizes)


def test_eval_batches():
  x, y = np.arange(23), np.arange(23)
  got = list(data.eval_batches((x, y), 5))
  assert [len(b[0]) for b in got] == [5, 5, 5, 5, 3]
  np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), y)
  with pytest.raises(ValueError):
    data.eval_batches((x, y), 0)
  with pytest.raises(ValueError, match="differ in length"):
    data.eval_batches((x, y[:4]), 5)
