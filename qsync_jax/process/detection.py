"""Which launcher started this process, and what ``jax.distributed`` needs.

This module owns the detection of a multi-process run from the environment
its launcher set: explicit arguments, the localhost launcher's ``QSYNC_*``
variables, SLURM (``srun``), Open MPI 4 and 5 (``mpirun``) and Kubernetes
indexed Jobs and JobSets. :func:`detect` returns a :class:`Launch`; where
``jax.distributed`` detects the environment itself (SLURM, Open MPI 4 through
its ORTE variable, Kubernetes when the ``kubernetes`` client is installed), the
coordinator is left to it (``coordinator_address=None``) so that the project
stands on jax's detection; elsewhere this module derives what jax cannot:

* Open MPI 5 sets no ORTE variable. The ranks come from
  ``OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_RANK,LOCAL_SIZE}``; the coordinator is
  127.0.0.1 when every rank is on one node, else the host ``mpirun`` runs on
  (from ``PMIX_NAMESPACE``, ``prterun-<host>-<pid>@<job>``: the same
  assumption as jax's Open MPI 4 detection, rank 0 on mpirun's node); the
  port is derived from mpirun's pid, as jax derives it from the job id.
* Kubernetes without the ``kubernetes`` client: the pod's index is
  ``JOB_COMPLETION_INDEX`` (set for ``completionMode: Indexed``); a JobSet's
  ``JOB_GLOBAL_INDEX``, ``GLOBAL_REPLICAS``, ``JOBSET_NAME`` and
  ``REPLICATED_JOB_NAME`` (from its annotations through the downward API, one
  pod per Job) give the rank, the size and the coordinator
  ``<jobset>-<replicated job>-0-0.<jobset>``. A plain indexed Job's size is not
  in its environment: pass ``--num_processes``.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import importlib.util
import os
import re
import socket

ENV_COORDINATOR_ADDRESS = "QSYNC_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "QSYNC_NUM_PROCESSES"
ENV_PROCESS_ID = "QSYNC_PROCESS_ID"
QSYNC_VARS = (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

#: jax's own variable for the coordinator's port (it reads it too).
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"

# The ports jax's SLURM and Open MPI detection pick from: [61440, 65535].
_PORT_BASE, _PORT_SPAN = 65535 - 2**12 + 1, 2**12
# The Kubernetes coordinator port jax's K8sCluster uses; kept for parity.
K8S_COORDINATOR_PORT = 55527

_SLURM_VARS = (
  "SLURM_JOB_ID",
  "SLURM_STEP_NODELIST",
  "SLURM_NTASKS",
  "SLURM_PROCID",
  "SLURM_LOCALID",
)
_PMIX_NAMESPACE = re.compile(r"^prterun-(?P<host>.+)-(?P<pid>\d+)@\d+$")

#: How many devices a process uses: its own one, all of its node's, or
#: "auto" (all when it is the only process on its node, else one).
LOCAL_DEVICES = ("auto", "one", "all")


@dataclasses.dataclass(frozen=True)
class Launch:
  """Where this process sits in a multi-process run, and who said so.

  :func:`detect` finds it; :func:`qsync_jax.process.initialize.initialize`
  joins it (a caller may build one: ``Launch("explicit", 2, 0,
  "10.0.0.1:1234")``).

  Attributes:
    source: The launcher: ``explicit``, ``qsync``, ``slurm``, ``ompi4``,
      ``ompi5``, ``k8s-jax`` (jax's API-based detection) or ``k8s``.
    num_processes: Processes in the run.
    process_id: This process's index, in ``[0, num_processes)``.
    coordinator_address: ``host:port`` of process 0's coordination service;
      None lets ``jax.distributed`` detect it (and the local device ids).
    local_rank: This process's index on its node, when known.
    local_size: Processes on this node, when known.
    detection: The ``cluster_detection_method`` that makes jax detect the
      coordinator from this launcher (None: jax tries each it knows).
  """

  source: str
  num_processes: int | None
  process_id: int | None
  coordinator_address: str | None
  local_rank: int | None = None
  local_size: int | None = None
  detection: str | None = None


def env_int(environ: Mapping[str, str], name: str) -> int:
  """``environ[name]`` as an int; a ValueError naming it otherwise."""
  try:
    return int(environ[name])
  except ValueError:
    raise ValueError(
      f"{name} must be an integer, got {environ[name]!r}"
    ) from None


def check_address(address: str, what: str) -> str:
  """Returns ``address`` if it is ``host:port``.

  Raises:
    ValueError: It is not; the message names ``what``.
  """
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{what} must be host:port, got {address!r}")
  return address


def _check_rank(launch: Launch, count_name: str, rank_name: str) -> Launch:
  n, i = launch.num_processes, launch.process_id
  if n is not None and n < 1:
    raise ValueError(f"{count_name} must be >= 1, got {n}")
  if n is not None and i is not None and not 0 <= i < n:
    raise ValueError(
      f"{rank_name} must be in [0, {n}) ({count_name}={n}), got {i}"
    )
  return launch


def from_qsync_env(environ: Mapping[str, str]) -> Launch | None:
  """The launch the localhost launcher's ``QSYNC_*`` variables describe.

  Args:
    environ: The environment to read.

  Returns:
    The launch, or None when none of the variables is set.

  Raises:
    ValueError: Some but not all are set, or one is malformed; the message
      names the variable.
  """
  present = [name for name in QSYNC_VARS if environ.get(name)]
  if not present:
    return None
  missing = [name for name in QSYNC_VARS if name not in present]
  if missing:
    raise ValueError(
      f"{missing[0]} is not set but {present[0]} is; set all "
      f"of {', '.join(QSYNC_VARS)} or none"
    )
  address = check_address(
    environ[ENV_COORDINATOR_ADDRESS], ENV_COORDINATOR_ADDRESS
  )
  n = env_int(environ, ENV_NUM_PROCESSES)
  # The localhost launcher puts every process on this host, one device each.
  return _check_rank(
    Launch(
      "qsync",
      n,
      env_int(environ, ENV_PROCESS_ID),
      address,
      env_int(environ, ENV_PROCESS_ID),
      n,
    ),
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
  )


def _slurm_tasks_on_node(environ: Mapping[str, str]) -> int | None:
  """Tasks on this node from SLURM_STEP_TASKS_PER_NODE, e.g. ``2(x3),1``."""
  spec = environ.get(
    "SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE")
  )
  node = environ.get("SLURM_NODEID")
  if not spec or node is None or not node.isdigit():
    return None
  counts = []
  for part in spec.split(","):
    m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
    if m is None:
      return None
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  return counts[int(node)] if int(node) < len(counts) else None


def _from_slurm(environ: Mapping[str, str]) -> Launch | None:
  if not all(name in environ for name in _SLURM_VARS):
    return None
  # jax's SlurmCluster derives the coordinator from the job id and node list.
  return _check_rank(
    Launch(
      "slurm",
      env_int(environ, "SLURM_NTASKS"),
      env_int(environ, "SLURM_PROCID"),
      None,
      env_int(environ, "SLURM_LOCALID"),
      _slurm_tasks_on_node(environ),
      "slurm",
    ),
    "SLURM_NTASKS",
    "SLURM_PROCID",
  )


def _ompi5_coordinator(
  environ: Mapping[str, str], n: int, local_size: int | None
) -> str:
  namespace = environ.get("PMIX_NAMESPACE", "")
  m = _PMIX_NAMESPACE.match(namespace)
  port = environ.get(ENV_COORDINATOR_PORT)
  if port is None:
    if m is None:
      raise ValueError(
        f"Open MPI 5 run: cannot derive a coordinator port from "
        f"PMIX_NAMESPACE={namespace!r}; pass --coordinator_address=HOST:PORT "
        f"of rank 0 (or set {ENV_COORDINATOR_PORT})"
      )
    port = str(int(m.group("pid")) % _PORT_SPAN + _PORT_BASE)
  if local_size == n:
    return f"127.0.0.1:{port}"  # Every rank on this one node.
  if m is None:
    raise ValueError(
      f"Open MPI 5 run over several nodes: cannot find mpirun's host in "
      f"PMIX_NAMESPACE={namespace!r}; pass --coordinator_address=HOST:PORT "
      "of rank 0"
    )
  return f"{m.group('host')}:{port}"


def _from_ompi(environ: Mapping[str, str]) -> Launch | None:
  if "OMPI_COMM_WORLD_SIZE" not in environ:
    return None
  n = env_int(environ, "OMPI_COMM_WORLD_SIZE")
  rank = env_int(environ, "OMPI_COMM_WORLD_RANK")
  local_rank = env_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
  local_size = (
    env_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "OMPI_COMM_WORLD_LOCAL_SIZE" in environ
    else None
  )
  if "OMPI_MCA_orte_hnp_uri" in environ:  # Open MPI 4: jax's OmpiCluster.
    launch = Launch("ompi4", n, rank, None, local_rank, local_size, "ompi")
  else:
    launch = Launch("ompi5", n, rank, None, local_rank, local_size)
  return _check_rank(launch, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


def _k8s_coordinator(environ: Mapping[str, str]) -> str | None:
  jobset, rjob = environ.get("JOBSET_NAME"), environ.get("REPLICATED_JOB_NAME")
  port = environ.get(ENV_COORDINATOR_PORT, str(K8S_COORDINATOR_PORT))
  if jobset and rjob:
    # JobSet pods are <jobset>-<replicated job>-<job index>-<pod index>, in
    # the headless service named after the JobSet.
    return f"{jobset}-{rjob}-0-0.{jobset}:{port}"
  host = environ.get("HOSTNAME", "")
  index = environ["JOB_COMPLETION_INDEX"]
  if not host.endswith(f"-{index}"):
    return None
  # An indexed Job's pods are <job>-<index>; the rest of the FQDN is the
  # subdomain (the Job's headless service) and the namespace.
  fqdn = socket.getfqdn(host)
  domain = fqdn.partition(".")[2] if fqdn.startswith(host + ".") else ""
  if not domain:
    return None
  return f"{host[: -len(index) - 1]}-0.{domain}:{port}"


def _from_k8s(environ: Mapping[str, str]) -> Launch | None:
  if "KUBERNETES_SERVICE_HOST" not in environ or (
    "JOB_COMPLETION_INDEX" not in environ
  ):
    return None
  index = env_int(environ, "JOB_COMPLETION_INDEX")
  if "JOB_GLOBAL_INDEX" in environ and "GLOBAL_REPLICAS" in environ:
    # One pod per Job of the JobSet: the Job's global index is the rank.
    return _check_rank(
      Launch(
        "k8s",
        env_int(environ, "GLOBAL_REPLICAS"),
        env_int(environ, "JOB_GLOBAL_INDEX"),
        _k8s_coordinator(environ),
        0,
        1,
      ),
      "GLOBAL_REPLICAS",
      "JOB_GLOBAL_INDEX",
    )
  if importlib.util.find_spec("kubernetes") is not None:
    # jax's K8sCluster reads the Job's size and coordinator from the API.
    return Launch("k8s-jax", None, None, None, 0, 1)
  # A pod is one process: it uses all of its devices.
  return Launch("k8s", None, index, _k8s_coordinator(environ), 0, 1)


def detect(
  environ: Mapping[str, str] = os.environ,
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> Launch | None:
  """Finds the multi-process run this process belongs to.

  Explicit arguments win over the environment, which is read in the order
  ``QSYNC_*`` (the localhost launcher), Open MPI, SLURM, Kubernetes: mpirun
  inside a SLURM allocation inherits the allocation's variables, but its own
  per-rank ones describe the run.

  Args:
    environ: The environment to read.
    coordinator_address: ``--coordinator_address``; None: from the launcher.
    num_processes: ``--num_processes``; None: from the launcher.
    process_id: ``--process_id``; None: from the launcher.

  Returns:
    The launch, or None for a plain single-process run (nothing set).

  Raises:
    ValueError: A malformed or incomplete setting; the message names the
      variable or flag and what to pass.
  """
  if coordinator_address is not None:
    check_address(coordinator_address, "--coordinator_address")
  launch = None
  for finder in (from_qsync_env, _from_ompi, _from_slurm, _from_k8s):
    launch = finder(environ)
    if launch is not None:
      break
  explicit = (coordinator_address, num_processes, process_id)
  if launch is None:
    if all(v is None for v in explicit):
      return None
    if any(v is None for v in explicit):
      raise ValueError(
        "no launcher (srun, mpirun, Kubernetes, python -m "
        "qsync_jax.distributed) found in the environment: pass all of "
        "--coordinator_address, --num_processes and --process_id"
      )
    launch = Launch("explicit", None, None, None)
  address = coordinator_address or launch.coordinator_address
  n = launch.num_processes
  if address is None and launch.source == "ompi5" and n is not None and n > 1:
    # Derived only here: an explicit --coordinator_address makes it moot.
    address = _ompi5_coordinator(environ, n, launch.local_size)
  launch = dataclasses.replace(
    launch,
    coordinator_address=address,
    num_processes=(
      num_processes if num_processes is not None else launch.num_processes
    ),
    process_id=process_id if process_id is not None else launch.process_id,
  )
  if launch.source == "k8s" and launch.num_processes is None:
    raise ValueError(
      "Kubernetes indexed Job: its size is not in the pod's environment; "
      "pass --num_processes=N (the Job's parallelism), or install the "
      "kubernetes package (pip install jax[k8s]) for jax to read it"
    )
  if launch.source == "k8s" and launch.coordinator_address is None:
    raise ValueError(
      "Kubernetes indexed Job: cannot derive process 0's address (give the "
      "Job a headless service as its subdomain); pass "
      "--coordinator_address=HOST:PORT"
    )
  return _check_rank(launch, "--num_processes", "--process_id")


def override(
  launch: Launch,
  *,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> Launch:
  """``launch`` with the explicit values given in place of its own.

  Explicit arguments win, as they do over the environment in :func:`detect`.

  Args:
    launch: The run, e.g. the one a caller passed to ``initialize``.
    coordinator_address: ``--coordinator_address``; None: ``launch``'s.
    num_processes: ``--num_processes``; None: ``launch``'s.
    process_id: ``--process_id``; None: ``launch``'s.

  Returns:
    The launch with those fields replaced.

  Raises:
    ValueError: ``coordinator_address`` is not ``host:port``, the number of
      processes is below 1, or the process id is outside
      ``[0, num_processes)``; the message names the flag.
  """
  if coordinator_address is not None:
    check_address(coordinator_address, "--coordinator_address")
  launch = dataclasses.replace(
    launch,
    coordinator_address=(
      launch.coordinator_address
      if coordinator_address is None
      else coordinator_address
    ),
    num_processes=(
      launch.num_processes if num_processes is None else num_processes
    ),
    process_id=launch.process_id if process_id is None else process_id,
  )
  return _check_rank(launch, "--num_processes", "--process_id")


def wants_all_devices(launch: Launch, local_devices: str) -> bool:
  """Whether the process should see every device of its node.

  Args:
    launch: The run.
    local_devices: One of :data:`LOCAL_DEVICES`.

  Returns:
    True for ``"all"``, False for ``"one"``; for ``"auto"``, True when the
    process is alone on its node (one process per node of several GPUs).

  Raises:
    ValueError: ``local_devices`` is not one of :data:`LOCAL_DEVICES`.
  """
  if local_devices not in LOCAL_DEVICES:
    raise ValueError(
      f"local_devices must be one of {', '.join(LOCAL_DEVICES)}"
      f", got {local_devices!r}"
    )
  if local_devices != "auto":
    return local_devices == "all"
  return launch.local_size == 1
