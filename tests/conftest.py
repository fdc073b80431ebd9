"""Test-wide JAX settings: fast compiles on a 2-core CPU."""

import atexit
import os
import shutil
import sys
import tempfile

import jax

# The tests import their helpers (jaxpr_utils) and the experiments package.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# Most test programs are tiny and run a few times: XLA's optimization passes
# cost more than they save (the flax examples' tests do the same). The
# variable carries the setting to the binaries the tests start.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
jax.config.update("jax_disable_most_optimizations", True)
# One compilation cache for the whole run, shared by the xdist workers and the
# binaries the tests start (they inherit the variables): many tests compile
# the same small programs, in this process or in a binary's. Tests of the
# cache's own users pass their own directory.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="qsync_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
jax.config.update(
  "jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"]
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# Four fake CPU devices for the multi-worker tests (before the backend starts).
jax.config.update("jax_num_cpu_devices", 4)


def _gpu_count() -> int:
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:  # No GPU backend: jax has only CPU devices.
    return 0


def pytest_runtest_setup(item):
  # Checked when a `gpu` test is about to run, not at collection, so that
  # collecting starts no JAX backend.
  marker = item.get_closest_marker("gpu")
  if marker is None:
    return
  need = marker.kwargs.get("count", 1)
  have = _gpu_count()
  if have < need:
    import pytest  # local: conftest otherwise needs only jax

    pytest.skip(
      f"needs {need} GPU{'s' if need > 1 else ''}; jax sees "
      f"{have} (run on a GPU host: pytest -m gpu tests)"
    )
