"""An elastic pool: its slots, when each is available, and the options.

This module owns what the elastic launcher (:mod:`qsync_jax.launch.elastic`)
knows of its pool apart from the processes: the ``--availability`` trace of
when each slot is reclaimed (:class:`Availability`, read and checked by
:func:`load_availability`), the launcher's elastic options
(:class:`ElasticOptions`, checked as they are built), and which slots are
available at a time (:class:`Pool`: the trace, and the slots that died or
were reclaimed by someone else, until they come back).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import itertools
import json
import math
from typing import Any


def _number(value: Any) -> bool:
  return (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
  )


@dataclasses.dataclass(frozen=True)
class Availability:
  """When each slot of a pool is reclaimed: the ``--availability`` trace.

  Attributes:
    intervals: per slot, sorted ``(start, end)`` pairs in seconds since the
      job started; the slot is reclaimed while ``start <= t < end``. A slot
      not named is always available.
  """

  intervals: Mapping[int, tuple[tuple[float, float], ...]] = dataclasses.field(
    default_factory=dict
  )

  @classmethod
  def parse(cls, data: Any, pool_size: int) -> Availability:
    """Reads the JSON form, ``{"2": [[30, 60], [90, 100]], ...}``.

    Raises:
      ValueError: not an object, a key that is not a slot of the pool or
        names one twice, an interval that is not ``[start, end]`` with
        ``0 <= start < end``, or two intervals of a slot that overlap; the
        message reads on from "the availability file".
    """
    if not isinstance(data, dict):
      raise ValueError(
        'is not a JSON object of slot: intervals, as {"2": [[30, 60]]}'
      )
    out: dict[int, tuple[tuple[float, float], ...]] = {}
    for key, value in data.items():
      try:
        slot = int(key)
      except ValueError:
        slot = -1
      if not 0 <= slot < pool_size or str(slot) != key.strip():
        raise ValueError(
          f"names slot {key!r}; the pool's slots are 0..{pool_size - 1}"
        )
      if slot in out:
        raise ValueError(
          f"names slot {slot} twice; give each slot one list of intervals"
        )
      if not isinstance(value, list):
        raise ValueError(
          f"has slot {slot} intervals that are not a list of [start, end]"
        )
      pairs = []
      for pair in value:
        if not (
          isinstance(pair, list)
          and len(pair) == 2
          and all(_number(v) for v in pair)
        ):
          raise ValueError(
            f"has slot {slot} interval {pair!r}, which is not [start, end] "
            "in seconds"
          )
        start, end = float(pair[0]), float(pair[1])
        if start < 0 or end <= start:
          raise ValueError(
            f"has slot {slot} interval [{start:g}, {end:g}], which must "
            "have 0 <= start < end"
          )
        pairs.append((start, end))
      pairs.sort()
      for (s0, e0), (s1, e1) in itertools.pairwise(pairs):
        if s1 < e0:
          raise ValueError(
            f"has slot {slot} intervals [{s0:g}, {e0:g}] and [{s1:g}, "
            f"{e1:g}], which overlap; merge them into one"
          )
      out[slot] = tuple(pairs)
    return cls(out)

  def reclaimed(self, slot: int, t: float) -> bool:
    """Whether ``slot`` is reclaimed at ``t`` seconds into the job."""
    return any(s <= t < e for s, e in self.intervals.get(slot, ()))

  def ends_after(self, slot: int, t: float) -> list[float]:
    """The ends of ``slot``'s intervals later than ``t``, ascending."""
    return sorted(e for _, e in self.intervals.get(slot, ()) if e > t)


def load_availability(path: str, pool_size: int) -> Availability:
  """Reads an ``--availability`` file (see :meth:`Availability.parse`).

  Raises:
    ValueError: unreadable, not JSON, or malformed; the message names the
      file and what is wrong.
  """
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise ValueError(
      f"cannot read the availability file {path}: {e.strerror}"
    ) from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"the availability file {path} is not JSON: {e}") from None
  try:
    return Availability.parse(data, pool_size)
  except ValueError as e:
    raise ValueError(f"the availability file {path} {e}") from None


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
  """How an elastic launch treats its pool (the launcher's elastic flags).

  Attributes:
    pool_size: how many slots (``--num_processes``).
    min_processes: the fewest processes a world may have.
    availability: when slots are reclaimed.
    rejoin_after_s: seconds after which a dead slot comes back; None: only
      when an availability interval of it ends.
    max_restarts: the most worlds started after the first.
    grace_s: seconds a world has to exit after a notice.
    compilation_cache: give the processes a persistent XLA compilation
      cache that lasts the job
      (:data:`~qsync_jax.launch.elastic.COMPILATION_CACHE_VAR`), unless the
      environment names one already.
    hot_standby: once every process of a world has stepped, start
      standbys in each slot for the next world, its imports done
      (:mod:`qsync_jax.launch.standby`): for a Python program run as
      ``python -m MODULE`` or ``python SCRIPT`` by the launcher's
      interpreter, that writes progress files.
    standbys_per_slot: how many standbys ``hot_standby`` keeps per slot.
      Two cover a world that ends before its first step (a slot that
      returns at once after a death): the next world still finds one
      ready per slot. Each is an idle interpreter with the program's
      imports (about 200 MB with jax and flax).
  """

  pool_size: int
  min_processes: int = 1
  availability: Availability = dataclasses.field(default_factory=Availability)
  rejoin_after_s: float | None = None
  max_restarts: int = 100
  grace_s: float = 60.0
  compilation_cache: bool = True
  hot_standby: bool = True
  standbys_per_slot: int = 2

  def __post_init__(self) -> None:
    if self.pool_size < 1:
      raise ValueError(f"--num_processes must be >= 1, got {self.pool_size}")
    if not 1 <= self.min_processes <= self.pool_size:
      raise ValueError(
        f"--min_processes must be in [1, --num_processes={self.pool_size}], "
        f"got {self.min_processes}"
      )
    if self.rejoin_after_s is not None and not (
      math.isfinite(self.rejoin_after_s) and self.rejoin_after_s > 0
    ):
      raise ValueError(
        f"--rejoin_after must be a finite number > 0, got {self.rejoin_after_s}"
      )
    if self.max_restarts < 0:
      raise ValueError(f"--max_restarts must be >= 0, got {self.max_restarts}")
    if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
      raise ValueError(
        f"--grace_s must be a finite number >= 0, got {self.grace_s}"
      )
    if self.standbys_per_slot < 1:
      raise ValueError(
        f"--standbys_per_slot must be >= 1, got {self.standbys_per_slot}"
      )
    bad = [s for s in self.availability.intervals if s >= self.pool_size]
    if bad:
      raise ValueError(
        f"the availability names slot {bad[0]}; the pool's slots are "
        f"0..{self.pool_size - 1}"
      )


class Pool:
  """Which slots are available when: the trace, and the deaths seen."""

  def __init__(self, options: ElasticOptions):
    self.options = options
    #: A dead slot -> (when it died, when it is back or None: never).
    self.dead: dict[int, tuple[float, float | None]] = {}
    #: A dead slot -> why it is out: "died", or "reclaimed" (a SIGTERM
    #: this launcher did not send).
    self.causes: dict[int, str] = {}

  def died(self, slot: int, t: float, cause: str = "died") -> None:
    """Slot ``slot``'s process died at ``t`` seconds into the job, or was
    reclaimed by someone else then (``cause="reclaimed"``); either way the
    slot is out until ``rejoin_after_s`` or the end of an availability
    interval of it."""
    self.causes[slot] = cause
    back = (
      [t + self.options.rejoin_after_s] if self.options.rejoin_after_s else []
    )
    back += self.options.availability.ends_after(slot, t)[:1]
    self.dead[slot] = (t, min(back) if back else None)

  def available(self, slot: int, t: float) -> bool:
    """Whether ``slot`` may run at ``t`` seconds into the job."""
    if self.options.availability.reclaimed(slot, t):
      return False
    if slot in self.dead:
      _, back = self.dead[slot]
      return back is not None and t >= back
    return True

  def slots(self, t: float) -> tuple[int, ...]:
    """The slots available at ``t``, ascending."""
    return tuple(
      s for s in range(self.options.pool_size) if self.available(s, t)
    )

  def back_at(self, slot: int, t: float) -> float | None:
    """When ``slot``, out at ``t``, is next available; None: never."""
    # Availability changes only where an interval ends or a death's time
    # out is over, so the earliest such time it is available at is the one.
    times = self.options.availability.ends_after(slot, t)
    back = self.dead[slot][1] if slot in self.dead else None
    if back is not None and back > t:
      times.append(back)
    return next((c for c in sorted(times) if self.available(slot, c)), None)

  def why_out(self, slot: int, t: float) -> str:
    """Why ``slot`` is not available at ``t``, for one line."""
    if self.options.availability.reclaimed(slot, t):
      return f"slot {slot} reclaimed"
    died, back = self.dead[slot]
    what = (
      "was reclaimed (a SIGTERM not from this launcher)"
      if self.causes.get(slot) == "reclaimed"
      else "died"
    )
    if back is None:
      return (
        f"slot {slot} {what} at {died:.1f} s and never comes back (no "
        "--rejoin_after, and no availability interval of it ends later)"
      )
    return f"slot {slot} {what} at {died:.1f} s"
