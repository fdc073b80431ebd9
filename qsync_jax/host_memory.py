"""What this host's memory can hold, and sizes checked against it.

This module owns :func:`limit`, the memory this process may use: the
memory limit of its cgroup (v1 or v2, the least one along the cgroup's
ancestors) when one is set below the physical memory, else the physical
memory; and :func:`check`, which refuses an estimated size above it with one
sentence naming the value, the estimate and the limit. The binaries check
every size a user gives against it before they allocate anything, so that
no input makes a process grow until the kernel's OOM killer ends it.
"""

from __future__ import annotations

import dataclasses
import os

#: The files the kernel describes this process's cgroups and mounts in.
_PROC_CGROUP = "/proc/self/cgroup"
_PROC_MOUNTINFO = "/proc/self/mountinfo"
# A cgroup v1 limit at or above this is "no limit" (the kernel writes
# PAGE_COUNTER_MAX pages: 2**63 rounded down to a page).
_UNLIMITED = 2**62


@dataclasses.dataclass(frozen=True)
class Limit:
  """The memory this process may use.

  Attributes:
    bytes: the limit.
    source: where it comes from, in words (``"the cgroup memory limit"`` or
      ``"physical memory"``).
  """

  bytes: int
  source: str

  def __str__(self) -> str:
    return f"{gib(self.bytes)} ({self.source})"


def gib(n: float) -> str:
  """``n`` bytes in GiB, for messages (``"1.5 GiB"``, ``"16700 GiB"``)."""
  value = n / 2**30
  return f"{value:.0f} GiB" if value >= 100 else f"{value:.3g} GiB"


def physical_bytes() -> int:
  """The host's physical memory."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
  """``(fstype, root, mount point, super options)`` of each cgroup mount."""
  out: list[tuple[str, str, str, set[str]]] = []
  try:
    with open(mountinfo) as f:
      lines = f.read().splitlines()
  except OSError:
    return out
  for line in lines:
    fields = line.split()
    if "-" not in fields:
      continue
    sep = fields.index("-")
    if len(fields) < sep + 4 or len(fields) < 5:
      continue
    fstype = fields[sep + 1]
    if fstype in ("cgroup", "cgroup2"):
      options = set(fields[sep + 3].split(","))
      out.append((fstype, fields[3], fields[4], options))
  return out


def _read_limit(path: str) -> int | None:
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  if not text.isdigit():  # "max": no limit (cgroup v2)
    return None
  value = int(text)
  return value if value < _UNLIMITED else None


def cgroup_limit_bytes(
  cgroup_file: str | None = None, mountinfo: str | None = None
) -> int | None:
  """The least memory limit set on this process's cgroup or its ancestors.

  Reads cgroup v2's ``memory.max`` and cgroup v1's
  ``memory.limit_in_bytes`` under the mounts ``mountinfo`` lists.

  Args:
    cgroup_file: the process's cgroup membership (default
      ``/proc/self/cgroup``).
    mountinfo: its mount table (default ``/proc/self/mountinfo``).

  Returns:
    The limit in bytes, or None where none is set (or none can be read).
  """
  try:
    with open(cgroup_file or _PROC_CGROUP) as f:
      entries = [line.split(":", 2) for line in f.read().splitlines()]
  except OSError:
    return None
  limits = []
  for fstype, root, point, options in _mounts(mountinfo or _PROC_MOUNTINFO):
    for entry in entries:
      if len(entry) != 3:
        continue
      _, controllers, path = entry
      if fstype == "cgroup2" and controllers == "":
        name = "memory.max"
      elif fstype == "cgroup" and "memory" in controllers.split(","):
        if "memory" not in options:
          continue
        name = "memory.limit_in_bytes"
      else:
        continue
      # The cgroup's path relative to the mount's root, then up to it.
      rel = os.path.relpath(path, root) if path.startswith(root) else path
      parts = [p for p in rel.split("/") if p and p != "."]
      for depth in range(len(parts), -1, -1):
        found = _read_limit(os.path.join(point, *parts[:depth], name))
        if found is not None:
          limits.append(found)
  return min(limits) if limits else None


def limit(
  cgroup_file: str | None = None, mountinfo: str | None = None
) -> Limit:
  """The memory this process may use: its cgroup's limit, if lower than the
  physical memory, else the physical memory.

  Args:
    cgroup_file: as in :func:`cgroup_limit_bytes`.
    mountinfo: as in :func:`cgroup_limit_bytes`.
  """
  physical = physical_bytes()
  cgroup = cgroup_limit_bytes(cgroup_file, mountinfo)
  if cgroup is not None and cgroup < physical:
    return Limit(cgroup, "the cgroup memory limit")
  return Limit(physical, "physical memory")


def check(what: str, need_bytes: float, why: str) -> None:
  """Raises ``ValueError`` if ``need_bytes`` exceed this host's memory.

  Args:
    what: the value the user gave, e.g. ``"--cluster=v100:100000"``.
    need_bytes: the estimated bytes it needs.
    why: what the estimate counts, e.g. ``"100000 workers' parameters and
      optimizer state"``.

  Raises:
    ValueError: ``"<what> needs about X GiB (<why>), more than this host's
      memory, Y GiB (<source>)"``.
  """
  host = limit()
  if need_bytes > host.bytes:
    raise ValueError(
      f"{what} needs about {gib(need_bytes)} ({why}), more than this "
      f"host's memory, {host}"
    )
