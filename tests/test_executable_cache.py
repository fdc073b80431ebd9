"""Tests for qsync_jax.train.executable_cache.

The cache acts in processes other than 0 of a multi-process run; these tests
drive :func:`load_or_compile` in this one process, and
``test_launchers.py``'s resumed two-rank run checks that rank 1 loads its
gradient program there.
"""

import contextlib
import logging as std_logging
import os

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qsync_jax.train import executable_cache


@jax.jit
def _step(w, batch):
  return jnp.tanh(batch["x"] @ w).sum(), w * 2


def _args(device=None):
  device = device or jax.local_devices()[0]
  w = jax.device_put(jnp.arange(12.0).reshape(4, 3), device)
  return w, {"x": np.ones((2, 4), np.float32)}


def _entries(directory):
  return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


@contextlib.contextmanager
def _config(name, value):
  """jax's configuration ``name`` set to ``value`` inside the block."""
  before = jax.config.values[name]
  jax.config.update(name, value)
  try:
    yield
  finally:
    jax.config.update(name, before)


def _compile_forbidden(monkeypatch):
  def refuse(self, *args, **kwargs):
    raise AssertionError("compiled instead of loaded")

  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)


def test_one_process_keeps_nothing_of_its_own():
  assert jax.process_count() == 1
  assert executable_cache.directory() is None
  assert executable_cache.cached(_step) is _step


def test_a_miss_is_compiled_and_written_and_a_hit_is_loaded(
  tmp_path, monkeypatch
):
  args = _args()
  expected = _step(*args)
  compiled = executable_cache.load_or_compile(_step, args, str(tmp_path))
  (entry,) = _entries(tmp_path)
  assert entry.endswith(".executable")
  assert jax.tree.all(jax.tree.map(np.array_equal, compiled(*args), expected))

  _compile_forbidden(monkeypatch)
  loaded = executable_cache.load_or_compile(_step, args, str(tmp_path))
  assert jax.tree.all(jax.tree.map(np.array_equal, loaded(*args), expected))
  assert _entries(tmp_path) == [entry]


def test_the_key_names_the_device_and_the_compiler_settings(
  tmp_path, monkeypatch
):
  devices = jax.local_devices()
  assert len(devices) >= 2, "tests/conftest.py gives this process 8 devices"
  lowered = _step.lower(*_args())
  key = executable_cache.entry_key(lowered, [devices[0]])
  assert key == executable_cache.entry_key(lowered, [devices[0]])
  assert key != executable_cache.entry_key(lowered, [devices[1]])
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
  assert key != executable_cache.entry_key(lowered, [devices[0]])
  monkeypatch.delenv("XLA_FLAGS")
  flipped = not jax.config.values["jax_disable_most_optimizations"]
  with _config("jax_disable_most_optimizations", flipped):
    assert key != executable_cache.entry_key(lowered, [devices[0]])
  # Another device's program is an entry of its own.
  executable_cache.load_or_compile(_step, _args(devices[0]), str(tmp_path))
  executable_cache.load_or_compile(_step, _args(devices[1]), str(tmp_path))
  assert len(_entries(tmp_path)) == 2


def test_an_entry_that_does_not_load_is_compiled_and_written_again(
  tmp_path, caplog
):
  args = _args()
  executable_cache.load_or_compile(_step, args, str(tmp_path))
  (entry,) = _entries(tmp_path)
  (tmp_path / entry).write_bytes(b"not an executable")
  logging.get_absl_logger().propagate = True
  with caplog.at_level(std_logging.WARNING):
    compiled = executable_cache.load_or_compile(_step, args, str(tmp_path))
  assert any("did not load" in r.getMessage() for r in caplog.records)
  expected = _step(*args)
  assert jax.tree.all(jax.tree.map(np.array_equal, compiled(*args), expected))
  assert (tmp_path / entry).read_bytes() != b"not an executable"


@pytest.mark.parametrize("min_s, written", [(0.0, 1), (3600.0, 0)])
def test_quick_compiles_are_not_written_as_jax_writes_none(
  tmp_path, min_s, written
):
  with _config("jax_persistent_cache_min_compile_time_secs", min_s):
    executable_cache.load_or_compile(_step, _args(), str(tmp_path))
  assert len(_entries(tmp_path)) == written
