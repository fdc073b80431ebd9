"""JAX settings shared by the study binaries.

They are applied before the backend starts.
"""

from __future__ import annotations

import os

import jax


def start_backend(out_dir: str, num_devices: int) -> None:
  """JAX settings of a study binary; call before the backend starts.

  ``num_devices`` fake CPU devices (one per worker; no effect on GPU
  backends), and compiled programs cached under ``out_dir/jax_cache`` so
  reruns and later seeds compile less.
  """
  jax.config.update("jax_num_cpu_devices", num_devices)
  jax.config.update("jax_compilation_cache_dir",
                    os.path.join(out_dir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
