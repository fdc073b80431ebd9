"""Link emulation for localhost multi-process runs: namespaces, tc, cgroups.

This module owns the emulated network (and optional CPU throttle) that the
localhost launcher (:func:`qsync_jax.launch.local.launch`) can put
its processes behind, so that a run on one host sees links as slow as
Ethernet between nodes:

* process ``i`` runs in its own network namespace ``<prefix><pid>p<i>``
  (``<pid>`` the launcher's PID) with loopback up and one veth ``eth0`` at
  ``10.77.0.<i+1>/24``; the veth's other end is a port of bridge ``br0`` in
  a bridge namespace ``<prefix><pid>b``. Addresses exist only inside these
  namespaces; the host's network is untouched.
* ``per_node`` topology: a ``tbf`` qdisc at the rate on both ends of every
  veth, so each process has its own full-duplex link of that rate to the
  switch (as nodes on a switched Ethernet).
* ``shared`` topology: the veths are not rate-limited; instead every packet
  a process sends is redirected (ingress of the bridge ports, ``mirred``) to
  one ``ifb`` device in the bridge namespace with a ``tbf`` at the rate, then
  bridged on. All processes together send at most the rate: one shared
  bottleneck, as hosts on one shared segment.
* latency: a ``netem`` delay on both ends of every veth, so it is the
  one-way delay from a process to the switch (process to process: twice
  it). Kernels without ``sch_netem`` cannot emulate it; a non-zero latency
  is then refused with one line saying so.
* CPU quota: process ``i`` runs in its own cgroup with the cpu controller's
  quota set to ``quota[i]`` CPUs (v1 ``cpu.cfs_quota_us``, or v2
  ``cpu.max``), emulating a slower device kind.

Process 0's address is the JAX coordinator's. The hostname maps to each
process's own address in ``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts
it over ``/etc/hosts``), since gloo binds to the address the hostname
resolves to. Every name carries the prefix and the launcher's PID;
:func:`remove_stale` deletes those whose launcher is gone (one killed by
SIGKILL could not clean up), and :class:`LinkEmulator` tears everything down
on exit, on an exception and on SIGINT/SIGTERM/SIGHUP.

Children learn the link from ``QSYNC_LINK_*`` variables
(:meth:`LinkEmulator.env`); :func:`link_info_from_env` reads them back for a
program's JSON output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import types
from typing import Any

from qsync_jax.launch import link_probe

TOPOLOGIES = ("per_node", "shared")
#: Every namespace, cgroup and /etc/netns folder this module makes starts so.
PREFIX = "qsl"
SUBNET = "10.77.0"
_NETNS_ETC = "/etc/netns"
_CFS_PERIOD_US = 100_000
#: A signal handler as ``signal.signal`` takes and returns it.
_SignalHandler = Callable[[int, types.FrameType | None], Any] | int | None

ENV_LINK = "QSYNC_LINK"
ENV_LINK_RATE_BPS = "QSYNC_LINK_RATE_BPS"
ENV_LINK_LATENCY_S = "QSYNC_LINK_LATENCY_S"
ENV_LINK_TOPOLOGY = "QSYNC_LINK_TOPOLOGY"
ENV_LINK_MEASURED_BPS = "QSYNC_LINK_MEASURED_BPS"
ENV_CPU_QUOTA = "QSYNC_CPU_QUOTA"
_LINK_DETAILS = (
  ENV_LINK_RATE_BPS,
  ENV_LINK_LATENCY_S,
  ENV_LINK_TOPOLOGY,
  ENV_LINK_MEASURED_BPS,
  ENV_CPU_QUOTA,
)

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


class LinkUnavailableError(RuntimeError):
  """This machine cannot emulate links (no root, no ``ip``/``tc``, no
  netem for a latency, no cpu cgroup controller)."""


def parse_rate(text: str) -> float:
  """Parses a link rate such as ``"1gbit"``, ``"100mbit"``; returns bits/s.

  Units are tc's decimal ones: bit, kbit, mbit, gbit, tbit (case ignored).

  Raises:
    ValueError: not a positive number followed by one of those units.
  """
  m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
  if not m or m.group(2) not in _RATE_UNITS:
    raise ValueError(
      f"link rate must be a number and one of "
      f"{', '.join(_RATE_UNITS)} (as in 1gbit), got {text!r}"
    )
  bps = float(m.group(1)) * _RATE_UNITS[m.group(2)]
  if bps <= 0:
    raise ValueError(f"link rate must be positive, got {text!r}")
  return bps


def parse_duration(text: str) -> float:
  """Parses a delay such as ``"1ms"``, ``"250us"``, ``"0"``; returns seconds.

  Raises:
    ValueError: not a non-negative number with unit s, ms or us (a bare
      number must be 0).
  """
  m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", text.strip().lower())
  if not m or (
    m.group(2) not in _TIME_UNITS
    and not (m.group(2) == "" and float(m.group(1)) == 0)
  ):
    raise ValueError(
      f"latency must be a number and one of "
      f"{', '.join(_TIME_UNITS)} (as in 1ms), got {text!r}"
    )
  return float(m.group(1)) * _TIME_UNITS.get(m.group(2), 0.0)


def parse_cpu_quota(text: str, num_processes: int) -> tuple[float, ...]:
  """Parses ``"1.0,1.0,0.5,0.5"``: CPUs each process may use, in order.

  Raises:
    ValueError: not one positive number per process.
  """
  try:
    quota = tuple(float(v) for v in text.split(","))
  except ValueError:
    raise ValueError(
      f"cpu quota must be comma-separated numbers of CPUs, got {text!r}"
    ) from None
  if len(quota) != num_processes:
    raise ValueError(
      f"cpu quota needs one value per process "
      f"({num_processes}), got {len(quota)} in {text!r}"
    )
  if any(not (q > 0 and math.isfinite(q)) for q in quota):
    raise ValueError(
      f"cpu quota values must be positive finite numbers of CPUs, got {text!r}"
    )
  return quota


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """The emulated link of every process.

  Attributes:
    rate: The rate as given (``"1gbit"``), for names and records.
    rate_bps: The rate in bits per second.
    latency_s: One-way delay between a process and the switch.
    topology: ``per_node`` (a link each) or ``shared`` (one bottleneck).
    cpu_quota: CPUs per process, or None for no throttle.
  """

  rate: str
  rate_bps: float
  latency_s: float = 0.0
  topology: str = "per_node"
  cpu_quota: tuple[float, ...] | None = None

  @classmethod
  def parse(
    cls,
    rate: str,
    latency: str = "0",
    topology: str = "per_node",
    cpu_quota: str | None = None,
    num_processes: int | None = None,
  ) -> LinkSpec:
    """Builds a spec from flag strings.

    Raises:
      ValueError: a malformed value, an unknown topology, or a CPU quota
        without ``num_processes`` values.
    """
    if topology not in TOPOLOGIES:
      raise ValueError(
        f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}"
      )
    quota = None
    if cpu_quota:
      if num_processes is None:
        raise ValueError("a cpu quota needs the number of processes")
      quota = parse_cpu_quota(cpu_quota, num_processes)
    return cls(
      rate.strip().lower(),
      parse_rate(rate),
      parse_duration(latency),
      topology,
      quota,
    )


def unavailable_reason() -> str | None:
  """Why links cannot be emulated here (no root, no ip/tc); None if they can."""
  if os.geteuid() != 0:
    return "link emulation needs root (network namespaces and tc)"
  missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
  if missing:
    return f"link emulation needs {' and '.join(missing)} (iproute2)"
  return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  """Runs one ip/tc command; raises with its stderr when it fails."""
  p = subprocess.run(list(args), capture_output=True, text=True)
  if check and p.returncode != 0:
    raise LinkUnavailableError(
      f"`{' '.join(args)}` failed: {p.stderr.strip() or p.returncode}"
    )
  return p


def _add_qdiscs(
  ns: str, dev: str, rate_bps: float | None, latency_s: float
) -> None:
  """netem (latency) and/or tbf (rate) as the root of ``dev``'s egress.

  Raises:
    LinkUnavailableError: a latency on a kernel without netem, or tc failed.
  """
  parent = ["root"]
  if latency_s > 0:
    p = _run(
      "tc",
      "-n",
      ns,
      "qdisc",
      "add",
      "dev",
      dev,
      "root",
      "handle",
      "1:",
      "netem",
      "delay",
      f"{latency_s * 1e6:.0f}us",
      "limit",
      "100000",
      check=False,
    )
    if p.returncode != 0:
      raise LinkUnavailableError(
        f"this kernel cannot delay packets (tc netem: {p.stderr.strip()}); "
        "run with latency 0"
      )
    parent = ["parent", "1:"]
  if rate_bps is not None:
    rate_Bps = rate_bps / 8
    # Burst: 4 ms at the rate and at least two 64 KiB GSO packets (tbf
    # splits bigger ones); queue: 20 ms more at the rate.
    burst = int(max(rate_Bps * 0.004, 2 * 65536))
    limit = int(burst + rate_Bps * 0.02)
    _run(
      "tc",
      "-n",
      ns,
      "qdisc",
      "add",
      "dev",
      dev,
      *parent,
      "handle",
      "2:",
      "tbf",
      "rate",
      f"{rate_bps:.0f}bit",
      "burst",
      str(burst),
      "limit",
      str(limit),
    )


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _owner_pid(name: str) -> int | None:
  m = re.fullmatch(PREFIX + r"(\d+)(?:b|p\d+)", name)
  return int(m.group(1)) if m else None


def _cpu_cgroup_root() -> tuple[str, int] | None:
  """The cpu controller's mount point and cgroup version, or None."""
  with open("/proc/mounts") as f:
    mounts = [line.split() for line in f]
  for _, where, kind, opts, *_ in mounts:
    if kind == "cgroup" and "cpu" in opts.split(","):
      return where, 1
  for _, where, kind, *_ in mounts:
    controllers = os.path.join(where, "cgroup.controllers")
    if kind == "cgroup2" and os.path.exists(controllers):
      with open(controllers) as f:
        if "cpu" in f.read().split():
          return where, 2
  return None


def _owned_names() -> list[tuple[str, str]]:
  """(kind, path or name) of everything with this module's prefix."""
  found = []
  netns = _run("ip", "netns", "list", check=False).stdout.split("\n")
  found += [
    ("netns", line.split()[0]) for line in netns if line.startswith(PREFIX)
  ]
  if os.path.isdir(_NETNS_ETC):
    found += [
      ("etc", os.path.join(_NETNS_ETC, n))
      for n in os.listdir(_NETNS_ETC)
      if n.startswith(PREFIX)
    ]
  root = _cpu_cgroup_root()
  if root and os.path.isdir(root[0]):
    found += [
      ("cgroup", os.path.join(root[0], n))
      for n in os.listdir(root[0])
      if n.startswith(PREFIX)
    ]
  return found


def _remove(kind: str, what: str) -> None:
  if kind == "netns":
    _run("ip", "netns", "del", what, check=False)
  elif kind == "etc":
    shutil.rmtree(what, ignore_errors=True)
  else:
    with contextlib.suppress(OSError):
      os.rmdir(what)  # Fails while a process is still in it.


def remove_stale() -> list[str]:
  """Deletes namespaces, cgroups and /etc/netns folders of dead launchers.

  Returns:
    The names removed.
  """
  removed = []
  for kind, what in _owned_names():
    pid = _owner_pid(os.path.basename(what))
    if pid is not None and pid != os.getpid() and not _pid_alive(pid):
      _remove(kind, what)
      removed.append(what)
  return removed


def leftovers(tag: int | None = None) -> list[str]:
  """Names this module made that still exist (of launcher ``tag`` only when
  given): namespaces, cgroups, /etc/netns folders."""
  return [
    what
    for _, what in _owned_names()
    if tag is None or _owner_pid(os.path.basename(what)) == tag
  ]


def link_info_from_env(environ: Mapping[str, str] = os.environ) -> dict | None:
  """The link the launcher emulates, read from ``QSYNC_LINK_*``.

  Every binary reads them at start (:func:`qsync_jax.cli.start_binary`), so
  a malformed one fails there, not in the run's last record.

  Returns:
    {link, rate_bps, latency_s, topology, measured_bps, cpu_quota} for a
    JSON record, or None when the run has no emulated link.

  Raises:
    ValueError: a variable that is not a number (a list of them for
      ``QSYNC_CPU_QUOTA``), naming it and its value; or ``QSYNC_LINK_*``
      set without ``QSYNC_LINK`` (they would be ignored).
  """

  def number(name: str, default: str | None) -> float | None:
    text = environ.get(name) or default
    if text is None:
      return None
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"{name} must be a number, got {text!r}") from None

  if not environ.get(ENV_LINK):
    stray = [n for n in _LINK_DETAILS if environ.get(n)]
    if stray:
      raise ValueError(
        f"{', '.join(stray)} set without {ENV_LINK}: the launcher sets "
        "them together (python -m qsync_jax.distributed --link=...); "
        "unset them"
      )
    return None
  quota = environ.get(ENV_CPU_QUOTA)
  try:
    cpu_quota = [float(q) for q in quota.split(",")] if quota else None
  except ValueError:
    raise ValueError(
      f"{ENV_CPU_QUOTA} must be comma-separated numbers, got {quota!r}"
    ) from None
  return {
    "link": environ[ENV_LINK],
    "rate_bps": number(ENV_LINK_RATE_BPS, "nan"),
    "latency_s": number(ENV_LINK_LATENCY_S, "0"),
    "topology": environ.get(ENV_LINK_TOPOLOGY),
    "measured_bps": number(ENV_LINK_MEASURED_BPS, None),
    "cpu_quota": cpu_quota,
  }


def byte_delta(
  before: Sequence[Mapping[str, int]], after: Sequence[Mapping[str, int]]
) -> list[dict[str, int]]:
  """Per process, the bytes sent and received between two reads of
  :meth:`LinkEmulator.byte_counts` (``after`` minus ``before``)."""
  return [
    {key: int(a[key]) - int(b[key]) for key in ("sent_bytes", "received_bytes")}
    for b, a in zip(before, after, strict=True)
  ]


class LinkEmulator:
  """Namespaces, shaped links and cgroups for ``num_processes`` processes.

  A context manager: entering builds everything (tearing down what it built
  if a step fails), leaving tears it all down. While entered, SIGINT, SIGTERM
  and SIGHUP raise ``SystemExit(128 + signal)``, so the teardown runs on
  those too (no traceback); a launch inside installs its own handlers and
  restores these after.
  """

  def __init__(
    self, num_processes: int, spec: LinkSpec, *, tag: int | None = None
  ):
    """Describes the emulated network; nothing is built before ``enter``.

    Args:
      num_processes: How many processes, each with its own namespace.
      spec: The link.
      tag: The number in every name (default: this process's PID).

    Raises:
      ValueError: ``num_processes`` outside [1, 250], or a CPU quota of
        another length.
    """
    if not 1 <= num_processes <= 250:
      raise ValueError(
        f"num_processes must be in [1, 250] for the "
        f"{SUBNET}.0/24 subnet, got {num_processes}"
      )
    if spec.cpu_quota is not None and len(spec.cpu_quota) != num_processes:
      raise ValueError(
        f"cpu quota has {len(spec.cpu_quota)} values for "
        f"{num_processes} processes"
      )
    self.num_processes = num_processes
    self.spec = spec
    self.tag = os.getpid() if tag is None else tag
    self.bridge_ns = f"{PREFIX}{self.tag}b"
    self._made: list[tuple[str, str]] = []
    self._cgroup_procs: list[str] = []
    self._signals: dict[int, _SignalHandler] = {}

  def namespace(self, i: int) -> str:
    """Process ``i``'s network namespace."""
    return f"{PREFIX}{self.tag}p{i}"

  def address(self, i: int) -> str:
    """Process ``i``'s IPv4 address (inside its namespace)."""
    return f"{SUBNET}.{i + 1}"

  def wrap(self, i: int, command: Sequence[str]) -> list[str]:
    """``command`` run in process ``i``'s namespace (and cgroup)."""
    wrapped = ["ip", "netns", "exec", self.namespace(i), *command]
    if self._cgroup_procs:
      # The shell joins the cgroup, then execs: the PID stays the same.
      wrapped = [
        "sh",
        "-c",
        'echo $$ > "$0" && exec "$@"',
        self._cgroup_procs[i],
        *wrapped,
      ]
    return wrapped

  def env(self, measured_bps: float | None = None) -> dict[str, str]:
    """The ``QSYNC_LINK_*`` variables describing this link to children."""
    out = {
      ENV_LINK: self.spec.rate,
      ENV_LINK_RATE_BPS: repr(self.spec.rate_bps),
      ENV_LINK_LATENCY_S: repr(self.spec.latency_s),
      ENV_LINK_TOPOLOGY: self.spec.topology,
    }
    if measured_bps is not None:
      out[ENV_LINK_MEASURED_BPS] = repr(measured_bps)
    if self.spec.cpu_quota is not None:
      out[ENV_CPU_QUOTA] = ",".join(map(repr, self.spec.cpu_quota))
    return out

  def byte_counts(self) -> list[dict[str, int]]:
    """Bytes each process's ``eth0`` has sent and received so far.

    Read from the veth's own counters in the process's namespace (``ip -s
    -j link show``): every frame on the emulated link, headers included,
    whatever program sent it. The counters start when the link is built,
    so a run's traffic is the difference of two reads (:func:`byte_delta`).

    Returns:
      One ``{"sent_bytes", "received_bytes"}`` per process, in order.

    Raises:
      LinkUnavailableError: ``ip`` failed (the namespaces are gone).
    """
    out = []
    for i in range(self.num_processes):
      p = _run(
        "ip", "-n", self.namespace(i), "-s", "-j", "link", "show", "eth0"
      )
      stats = json.loads(p.stdout)[0]["stats64"]
      out.append(
        {
          "sent_bytes": int(stats["tx"]["bytes"]),
          "received_bytes": int(stats["rx"]["bytes"]),
        }
      )
    return out

  def measure_rate(self, seconds: float = 0.5) -> float | None:
    """Achieved rate from process 0 to process 1 (None with one process)."""
    if self.num_processes < 2:
      return None
    return link_probe.measure_rate(
      self.namespace(0), self.namespace(1), self.address(1), seconds=seconds
    )

  def __enter__(self) -> LinkEmulator:
    reason = unavailable_reason()
    if reason:
      raise LinkUnavailableError(reason)
    self._catch_signals()
    try:
      remove_stale()
      self._build()
    except BaseException:
      self.teardown()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.teardown()

  def _catch_signals(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return

    def stop(signum, frame):
      del frame
      raise SystemExit(128 + signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      self._signals[s] = signal.signal(s, stop)

  def _netns(self, name: str) -> None:
    _run("ip", "netns", "add", name)
    self._made.append(("netns", name))
    _run("ip", "-n", name, "link", "set", "lo", "up")

  def _build(self) -> None:
    br = self.bridge_ns
    self._netns(br)
    _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", br, "link", "set", "br0", "up")
    hostname = socket.gethostname()
    for i in range(self.num_processes):
      ns = self.namespace(i)
      self._netns(ns)
      _run(
        "ip",
        "-n",
        br,
        "link",
        "add",
        f"v{i}",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        ns,
      )
      _run("ip", "-n", br, "link", "set", f"v{i}", "master", "br0", "up")
      _run(
        "ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"
      )
      _run("ip", "-n", ns, "link", "set", "eth0", "up")
      # gloo binds to what the hostname resolves to: this process's address.
      etc = os.path.join(_NETNS_ETC, ns)
      os.makedirs(etc, exist_ok=True)
      self._made.append(("etc", etc))
      with open(os.path.join(etc, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(i)} {hostname}\n")
    self._shape()
    if self.spec.cpu_quota is not None:
      self._throttle(self.spec.cpu_quota)

  def _shape(self) -> None:
    per_node = self.spec.topology == "per_node"
    for i in range(self.num_processes):
      rate = self.spec.rate_bps if per_node else None
      _add_qdiscs(self.namespace(i), "eth0", rate, self.spec.latency_s)
      _add_qdiscs(self.bridge_ns, f"v{i}", rate, self.spec.latency_s)
    if per_node:
      return
    br = self.bridge_ns
    _run("ip", "-n", br, "link", "add", "ifb0", "type", "ifb")
    _run("ip", "-n", br, "link", "set", "ifb0", "up")
    # The one bottleneck of the shared topology.
    _add_qdiscs(br, "ifb0", self.spec.rate_bps, 0.0)
    for i in range(self.num_processes):
      _run(
        "tc",
        "-n",
        br,
        "qdisc",
        "add",
        "dev",
        f"v{i}",
        "handle",
        "ffff:",
        "ingress",
      )
      _run(
        "tc",
        "-n",
        br,
        "filter",
        "add",
        "dev",
        f"v{i}",
        "parent",
        "ffff:",
        "protocol",
        "all",
        "u32",
        "match",
        "u32",
        "0",
        "0",
        "action",
        "mirred",
        "egress",
        "redirect",
        "dev",
        "ifb0",
      )

  def _throttle(self, cpu_quota: Sequence[float]) -> None:
    root = _cpu_cgroup_root()
    if root is None:
      raise LinkUnavailableError(
        "a cpu quota needs the cgroup cpu controller, which is not mounted"
      )
    where, version = root
    if version == 2:
      with open(os.path.join(where, "cgroup.subtree_control"), "w") as f:
        f.write("+cpu")
    for i, quota in enumerate(cpu_quota):
      path = os.path.join(where, self.namespace(i))
      os.makedirs(path, exist_ok=True)
      self._made.append(("cgroup", path))
      us = max(1000, int(quota * _CFS_PERIOD_US))
      if version == 1:
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
          f.write(str(_CFS_PERIOD_US))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
          f.write(str(us))
      else:
        with open(os.path.join(path, "cpu.max"), "w") as f:
          f.write(f"{us} {_CFS_PERIOD_US}")
      self._cgroup_procs.append(os.path.join(path, "cgroup.procs"))

  def teardown(self) -> None:
    """Removes everything built, newest first; safe to call twice.

    SIGINT/SIGTERM/SIGHUP are held off meanwhile, so a second Ctrl-C cannot
    cut it short, then the handlers from before ``enter`` come back.
    """
    held = {}
    if threading.current_thread() is threading.main_thread():
      held = {
        s: signal.signal(s, signal.SIG_IGN)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
      }
    try:
      while self._made:
        kind, what = self._made.pop()
        _remove(kind, what)
      self._cgroup_procs = []
    finally:
      for s, handler in held.items():
        signal.signal(s, handler)
      for num, old in self._signals.items():
        signal.signal(num, old)
      self._signals = {}
