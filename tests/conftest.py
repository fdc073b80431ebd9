"""Test-wide JAX settings: fast compiles on a 2-core CPU."""

import os
import sys

import jax

# The tests import their helpers (jaxpr_utils) and the experiments package.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# Most test programs are tiny and run a few times: XLA's optimization passes
# cost more than they save (the flax examples' tests do the same). The
# variable carries the setting to the binaries the tests start.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
jax.config.update("jax_disable_most_optimizations", True)
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
    pytest.skip(f"needs {need} GPU{'s' if need > 1 else ''}; jax sees "
                f"{have} (run on a GPU host: pytest -m gpu tests)")
