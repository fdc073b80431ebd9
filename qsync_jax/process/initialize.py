"""How one process joins a multi-process JAX run, and leaves it.

This module owns the process side of a multi-process run: :func:`initialize`
joins the run that :mod:`qsync_jax.process.detection` finds (srun, mpirun,
Kubernetes, explicit arguments or the ``QSYNC_*`` variables of the localhost
launcher, :mod:`qsync_jax.launch.local`), or the one it is given;
:func:`shutdown` leaves it; :func:`config_from_env` reads the ``QSYNC_*``
variables alone. The defaults of the ``jax.distributed`` timeouts are the main
job's (``config.distributed`` of ``experiments/configs/default.py`` reads them
from here).
"""

from __future__ import annotations

from collections.abc import Mapping
import os

from absl import logging
import jax

from qsync_jax.process import detection

#: The variables the localhost launcher sets and :func:`initialize` reads.
ENV_COORDINATOR_ADDRESS = detection.ENV_COORDINATOR_ADDRESS
ENV_NUM_PROCESSES = detection.ENV_NUM_PROCESSES
ENV_PROCESS_ID = detection.ENV_PROCESS_ID

#: Seconds to wait for every process to reach the coordinator.
INITIALIZATION_TIMEOUT_S = 300
#: Seconds without a heartbeat before the coordinator declares a process dead.
HEARTBEAT_TIMEOUT_S = 100
#: Seconds the shutdown barrier waits for every process.
SHUTDOWN_TIMEOUT_S = 300


def config_from_env(
  environ: Mapping[str, str] = os.environ,
) -> detection.Launch | None:
  """Reads the ``QSYNC_*`` variables the localhost launcher sets.

  Args:
    environ: The environment to read.

  Returns:
    The launch they describe (``source="qsync"``, every process on this
    host), or None when none of the variables is set (a plain
    single-process run).

  Raises:
    ValueError: Some but not all variables are set, or one is malformed;
      the message names the variable.
  """
  return detection.from_qsync_env(environ)


def initialize(
  config: detection.Launch | None = None,
  *,
  timeout_s: int = INITIALIZATION_TIMEOUT_S,
  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
  shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S,
  local_devices: str = "auto",
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  environ: Mapping[str, str] | None = None,
) -> bool:
  """Joins the multi-process run its launcher or its arguments describe.

  The run is ``config``, else what
  :func:`qsync_jax.process.detection.detect` finds from the explicit
  arguments and the environment (srun, mpirun, Kubernetes, the localhost
  launcher); where ``jax.distributed`` detects the environment itself, it is
  left to do so. Explicit ``coordinator_address``, ``num_processes`` and
  ``process_id`` win over both ``config`` and the launcher. Call it before
  anything starts a JAX backend (``jax.devices()``, any computation).
  Calling it again once initialized does nothing.

  Args:
    config: The run to join (e.g. ``Launch("explicit", 2, 0,
      "10.0.0.1:1234")``); None detects it.
    timeout_s: Seconds to wait for every process to reach the coordinator.
    heartbeat_timeout_s: Seconds without a heartbeat before the coordinator
      declares a process dead (and every process fails).
    shutdown_timeout_s: Seconds the shutdown barrier waits for every process.
    local_devices: ``"one"`` device per process, ``"all"`` of its node's, or
      ``"auto"``: all when the launcher put one process on the node.
    coordinator_address: ``--coordinator_address``; overrides ``config``'s
      and the launcher's.
    num_processes: ``--num_processes``; overrides ``config``'s and the
      launcher's.
    process_id: ``--process_id``; overrides ``config``'s and the launcher's.
    environ: The environment to read; None: ``os.environ``.

  Returns:
    True when this process is part of an initialized multi-process run, False
    for a single-process run (no launcher, or one process).

  Raises:
    ValueError: A malformed or incomplete launch configuration; the message
      names the variable or flag.
    RuntimeError: A JAX backend was started before this call.
  """
  if jax.distributed.is_initialized():
    return True
  launch: detection.Launch | None
  if config is not None:
    launch = detection.override(
      config,
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
    )
  else:
    launch = detection.detect(
      os.environ if environ is None else environ,
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
    )
  if launch is None or launch.num_processes == 1:
    return False
  every_device = detection.wants_all_devices(launch, local_devices)
  local_ids = (
    None if every_device or launch.local_rank is None else [launch.local_rank]
  )
  known = None not in (
    launch.coordinator_address,
    launch.num_processes,
    launch.process_id,
  )
  jax.distributed.initialize(
    coordinator_address=launch.coordinator_address,
    num_processes=launch.num_processes,
    process_id=launch.process_id,
    local_device_ids=local_ids,
    # Known values need no detection, which would also pick device ids;
    # else the launcher found decides which of jax's detections runs.
    cluster_detection_method="deactivate" if known else launch.detection,
    initialization_timeout=timeout_s,
    heartbeat_timeout_seconds=heartbeat_timeout_s,
    shutdown_timeout_seconds=shutdown_timeout_s,
  )
  if every_device:
    # jax's detection restricts a process to its local rank's device; one
    # process per node of several GPUs uses them all.
    jax.config.update("jax_cuda_visible_devices", "all")
    jax.config.update("jax_rocm_visible_devices", "all")
  # Both only affect the CPU backend. Gloo gives CPU processes cross-process
  # collectives; more than one CPU device per process hangs the first one.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 1)
  logging.info(
    "joined a %d-process run as process %d (launcher: %s, coordinator: %s)",
    jax.process_count(),
    jax.process_index(),
    launch.source,
    launch.coordinator_address or "detected by jax",
  )
  return True


def shutdown() -> None:
  """Leaves the multi-process run, if this process joined one."""
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
