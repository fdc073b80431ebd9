"""Membership of an elastic run: the slots a world holds, and how it changed.

This module owns what the elastic launcher (:mod:`qsync_jax.launch.elastic`)
and a restarted process tell each other. An elastic pool has ``pool_size``
*slots* (a slot is one process's place: its device kind in ``--cluster``, its
emulated link and CPU quota); a *world* is the slots running now, process
``i`` in slot ``slots[i]``. The launcher starts every world with the
variables of :meth:`ElasticWorld.to_env`; a process that checkpointed because
membership changes exits with :data:`MEMBERSHIP_CHANGED_EXIT_CODE`, distinct
from success (0) and failure (any other status), and the launcher starts the
next world. :func:`world_kinds` and :func:`world_plans` are a world's share of
the pool: its workers' kinds and the plans kept for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
import math
import os
from typing import Any

from qsync_jax.process import detection

#: Exit status of a process that checkpointed a step all processes agreed on
#: because a worker was told to leave (SIGTERM) or a slot came back: "start
#: again with the new membership". sysexits.h's EX_TEMPFAIL ("try again").
MEMBERSHIP_CHANGED_EXIT_CODE = 75

ENV_SLOTS = "QSYNC_ELASTIC_SLOTS"
ENV_POOL_SIZE = "QSYNC_ELASTIC_POOL_SIZE"
ENV_RESTART = "QSYNC_ELASTIC_RESTART"
ENV_CHANGE = "QSYNC_ELASTIC_CHANGE"
#: The directory where each process records a SIGTERM it received
#: (:func:`notice_path`), so that the launcher tells a reclaim of some slots
#: by someone else from a job-wide preemption.
ENV_NOTICES = "QSYNC_ELASTIC_NOTICES"
#: The file where a process says how far it got (:func:`progress_path`):
#: empty once it holds notices (a SIGTERM waits for its loop to take it),
#: :data:`STEPPED` once it has finished a step. A world whose processes all
#: hold notices and none has stepped has trained nothing since the
#: checkpoint it restored: the launcher ends it at once on a notice rather
#: than wait for its start and a checkpoint of the same state.
ENV_PROGRESS = "QSYNC_ELASTIC_PROGRESS"
#: The contents of :data:`ENV_PROGRESS`'s file after the first step.
STEPPED = "stepped"
ELASTIC_VARS = (
  ENV_SLOTS,
  ENV_POOL_SIZE,
  ENV_RESTART,
  ENV_CHANGE,
  ENV_NOTICES,
  ENV_PROGRESS,
)

#: Why a world ended: a slot told to leave (SIGTERM), a process that died
#: without notice (SIGKILL, node loss), a slot given back.
CAUSES = ("reclaimed", "died", "returned")
#: The causes whose world ended on a notice: its processes checkpointed the
#: step they agreed on, and no step was lost.
NOTICE_CAUSES = ("reclaimed", "returned")


def notice_path(directory: str, restart: int, process: int) -> str:
  """The file where process ``process`` of world ``restart`` records that
  it received SIGTERM (``{"time": time.time()}``).

  Args:
    directory: the launcher's notices directory (:data:`ENV_NOTICES`).
    restart: the world's :attr:`ElasticWorld.restart`.
    process: the process's index in its world.
  """
  return os.path.join(directory, f"sigterm-{restart}-{process}.json")


def progress_path(directory: str, restart: int, process: int) -> str:
  """The file the launcher names in process ``process``'s
  :data:`ENV_PROGRESS` in world ``restart``.

  Args:
    directory: the launcher's notices directory (:data:`ENV_NOTICES`).
    restart: the world's :attr:`ElasticWorld.restart`.
    process: the process's index in its world.
  """
  return os.path.join(directory, f"progress-{restart}-{process}")


def read_progress(
  directory: str, restart: int, num_processes: int
) -> list[str | None]:
  """Each process's progress file in world ``restart`` (:func:`progress_path`):
  ``""`` (it holds notices), :data:`STEPPED`, or None where there is none
  (not started yet, or a program that writes none)."""
  out: list[str | None] = []
  for i in range(num_processes):
    try:
      with open(progress_path(directory, restart, i)) as f:
        out.append(f.read().strip())
    except OSError:
      out.append(None)
  return out


@dataclasses.dataclass(frozen=True)
class Change:
  """One membership change, as the launcher saw it.

  Attributes:
    cause: one of :data:`CAUSES`.
    slots_before: the slots of the world that ended.
    slots_after: the slots of the world started next.
    event_time: ``time.time()`` when the launcher sent the notice (reclaimed,
      returned) or saw the death (died).
    exit_time: when the last process of the ended world exited.
    start_time: when the next world's processes were started.
    detail: one line for logs, e.g. ``"slot 2 reclaimed (availability)"``.
  """

  cause: str
  slots_before: tuple[int, ...]
  slots_after: tuple[int, ...]
  event_time: float
  exit_time: float
  start_time: float
  detail: str = ""

  def __post_init__(self) -> None:
    if self.cause not in CAUSES:
      raise ValueError(
        f"membership change cause {self.cause!r} is not one of "
        f"{', '.join(CAUSES)}"
      )
    for name in ("event_time", "exit_time", "start_time"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise ValueError(f"membership change {name} must be a number")

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready fields."""
    out = dataclasses.asdict(self)
    out["slots_before"] = list(self.slots_before)
    out["slots_after"] = list(self.slots_after)
    return out

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Change:
    """Inverse of :meth:`to_dict`.

    Raises:
      ValueError: a missing or malformed field, named.
    """
    try:
      return cls(
        cause=str(data["cause"]),
        slots_before=tuple(int(s) for s in data["slots_before"]),
        slots_after=tuple(int(s) for s in data["slots_after"]),
        event_time=float(data["event_time"]),
        exit_time=float(data["exit_time"]),
        start_time=float(data["start_time"]),
        detail=str(data.get("detail", "")),
      )
    except KeyError as e:
      raise ValueError(f"membership change has no field {e.args[0]}") from None
    except (TypeError, ValueError) as e:
      raise ValueError(f"malformed membership change: {e}") from None


@dataclasses.dataclass(frozen=True)
class ElasticWorld:
  """The world an elastic launcher started this process in.

  Attributes:
    slots: the pool slots of this world in process order (process ``i``
      runs slot ``slots[i]``).
    pool_size: how many slots the pool has.
    restart: how many worlds the launcher started before this one.
    change: the change that ended the previous world; None for the first.
  """

  slots: tuple[int, ...]
  pool_size: int
  restart: int = 0
  change: Change | None = None

  def __post_init__(self) -> None:
    if self.pool_size < 1:
      raise ValueError(f"{ENV_POOL_SIZE} must be >= 1, got {self.pool_size}")
    if not self.slots:
      raise ValueError(f"{ENV_SLOTS} names no slot")
    if len(set(self.slots)) != len(self.slots) or not all(
      0 <= s < self.pool_size for s in self.slots
    ):
      raise ValueError(
        f"{ENV_SLOTS} must name distinct slots in [0, {self.pool_size}), "
        f"got {','.join(map(str, self.slots))}"
      )
    if self.restart < 0:
      raise ValueError(f"{ENV_RESTART} must be >= 0, got {self.restart}")

  def to_env(self) -> dict[str, str]:
    """The variables :func:`from_env` reads back."""
    env = {
      ENV_SLOTS: ",".join(map(str, self.slots)),
      ENV_POOL_SIZE: str(self.pool_size),
      ENV_RESTART: str(self.restart),
    }
    if self.change is not None:
      env[ENV_CHANGE] = json.dumps(self.change.to_dict())
    return env

  def select(self, pool: Sequence[Any]) -> list[Any]:
    """The entries of a per-slot list (e.g. a pool's device kinds) that this
    world's slots hold, in process order.

    Raises:
      ValueError: ``pool`` does not have one entry per slot.
    """
    if len(pool) != self.pool_size:
      raise ValueError(
        f"the cluster names {len(pool)} workers and the elastic pool has "
        f"{self.pool_size} slots; give --cluster one worker per slot "
        "(--num_processes), or --cluster=auto"
      )
    return [pool[s] for s in self.slots]


def from_env(environ: Mapping[str, str] = os.environ) -> ElasticWorld | None:
  """The world the elastic launcher's variables describe.

  Args:
    environ: the environment to read.

  Returns:
    The world, or None when this process was not started by an elastic
    launcher (none of :data:`ELASTIC_VARS` set).

  Raises:
    ValueError: some but not all of the required variables are set, or one
      is malformed; the message names the variable.
  """
  present = [n for n in ELASTIC_VARS if environ.get(n)]
  if not present:
    return None
  required = (ENV_SLOTS, ENV_POOL_SIZE, ENV_RESTART)
  missing = [n for n in required if not environ.get(n)]
  if missing:
    raise ValueError(
      f"{missing[0]} is not set but {present[0]} is; an elastic launcher "
      f"sets {', '.join(required)}"
    )
  try:
    slots = tuple(int(s) for s in environ[ENV_SLOTS].split(","))
  except ValueError:
    raise ValueError(
      f"{ENV_SLOTS} must be comma-separated integers, got "
      f"{environ[ENV_SLOTS]!r}"
    ) from None
  change = None
  if environ.get(ENV_CHANGE):
    try:
      data = json.loads(environ[ENV_CHANGE])
    except json.JSONDecodeError as e:
      raise ValueError(f"{ENV_CHANGE} is not JSON: {e}") from None
    if not isinstance(data, dict):
      raise ValueError(f"{ENV_CHANGE} must be a JSON object")
    try:
      change = Change.from_dict(data)
    except ValueError as e:
      raise ValueError(f"{ENV_CHANGE}: {e}") from None
  return ElasticWorld(
    slots=slots,
    pool_size=detection.env_int(environ, ENV_POOL_SIZE),
    restart=detection.env_int(environ, ENV_RESTART),
    change=change,
  )


def world_kinds(
  pool_kinds: Sequence[str], world: ElasticWorld | None
) -> list[str]:
  """The device kinds of this world's workers, one per slot it runs.

  Args:
    pool_kinds: the pool's kinds, one per slot (``--cluster`` of an elastic
      job names the pool).
    world: the elastic world (:func:`from_env`), or None when the run is not
      elastic.

  Returns:
    The kinds of the world's slots in process order
    (:meth:`ElasticWorld.select`); without a world, ``pool_kinds``.

  Raises:
    ValueError: ``pool_kinds`` does not name one kind per slot.
  """
  if world is None:
    return list(pool_kinds)
  return [str(kind) for kind in world.select(pool_kinds)]


def world_plans(
  plans: Mapping[str, Any], kinds: Sequence[str]
) -> dict[str, Any]:
  """The plans of ``plans`` (``{kind: plan}``) for the kinds ``kinds`` has.

  The command is the same in every world of an elastic job, so its plans
  may name kinds of the pool that no slot of this world runs: those go.
  """
  return {kind: plan for kind, plan in plans.items() if kind in kinds}
