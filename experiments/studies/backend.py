"""JAX settings shared by the study binaries.

They are applied before the backend starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import os

import jax

from qsync_jax import cli


def start_backend(out_dir: str, num_devices: int) -> None:
  """JAX settings of a study binary; call before the backend starts.

  ``num_devices`` fake CPU devices (one per worker; no effect on GPU
  backends), and compiled programs cached under ``out_dir/jax_cache`` so
  reruns and later seeds compile less (or where ``JAX_COMPILATION_CACHE_DIR``
  says, when it is set).
  """
  jax.config.update("jax_num_cpu_devices", num_devices)
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update(
      "jax_compilation_cache_dir", os.path.join(out_dir, "jax_cache")
    )
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def check_runs(
  tasks: Sequence[str],
  configs: Sequence[str],
  seeds: int,
  all_tasks: Iterable[str],
  all_configs: Iterable[str],
) -> None:
  """Checks a study's tasks, configurations and seed count.

  Raises:
    ValueError: an unknown task or configuration, none of either, or fewer
      than 1 seed.
  """
  cli.check_names("task", tasks, all_tasks)
  cli.check_names("configuration", configs, all_configs)
  if not tasks or not configs or seeds < 1:
    raise ValueError(
      f"a study needs a task, a configuration and a seed, got "
      f"{len(tasks)} tasks, {len(configs)} configurations "
      f"and {seeds} seeds"
    )
