"""Test-wide JAX settings: fast compiles on a 2-core CPU."""

import os
import sys

import jax

# The tests import their helpers (jaxpr_utils) and the experiments package.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# Most test programs are tiny and run a few times: XLA's optimization passes
# cost more than they save (the flax examples' tests do the same).
jax.config.update("jax_disable_most_optimizations", True)
# Four fake CPU devices for the multi-worker tests (before the backend starts).
jax.config.update("jax_num_cpu_devices", 4)
