r"""The localhost launcher as a command: ``python -m qsync_jax.distributed``.

Usage:
  python -m qsync_jax.distributed --num_processes=4 [--port=N] \
      [--timeout_s=S] [--link=1gbit [--latency=0ms] [--topology=per_node]
      [--cpu_quota=1,1,0.5,0.5] [--link_stats=FILE]] \
      -- python -m experiments.train --out_dir=R

  python -m qsync_jax.distributed --num_processes=4 --elastic \
      [--min_processes=2] [--availability=FILE] [--rejoin_after=S] \
      [--max_restarts=100] [--grace_s=60] [--link=... --cpu_quota=...] \
      -- python -m experiments.train --out_dir=R

Starts the processes with :func:`qsync_jax.launch.local.launch` and
exits with its status. With ``--link`` (root only) every process runs in its
own network namespace behind an emulated link
(:class:`qsync_jax.launch.links.LinkEmulator`), the achieved rate between
processes 0 and 1 is measured first and passed on in
``QSYNC_LINK_MEASURED_BPS``, and everything is torn down at exit; without
root, or without ip/tc, it says so in one line and exits with 1. With
``--link_stats=FILE`` the bytes each process sent and received on its link
during the run (its veth's counters, read after the rate probe and at the
end, before the teardown) are written to FILE as JSON.

With ``--elastic`` the ``--num_processes`` processes are a pool of slots run
by :func:`qsync_jax.launch.elastic.launch_elastic`: each world is the slots
available (at least ``--min_processes``), started again as slots are
reclaimed (the ``--availability`` file: ``{"2": [[30, 60]]}`` reclaims slot
2 from 30 s to 60 s into the job), die (back after ``--rejoin_after``
seconds) and return. The job ends when a world's processes all exit 0;
``--timeout_s`` bounds the whole job; with ``--link`` slot ``s`` keeps its
namespace, address and CPU quota (the ``s``-th of ``--cpu_quota``) in every
world. The library itself lives in :mod:`qsync_jax.launch.local`,
:mod:`qsync_jax.launch.elastic` and :mod:`qsync_jax.launch.links`; this
module only parses flags (:mod:`qsync_jax.distributed` runs it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
import os
import sys
from typing import Any

from absl import app
from absl import flags

from qsync_jax import cli
from qsync_jax import files
from qsync_jax.launch import elastic
from qsync_jax.launch import links
from qsync_jax.launch import pool
from qsync_jax.launch.local import check_program
from qsync_jax.launch.local import launch

# The flags defined here belong to the program that runs this command (the
# module calling run()), so that its --help lists them as its own.
flags.disclaim_key_flags()


def _define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  # Defined only when run as a program, so that importing this module from a
  # trainer adds no flags that could clash with the trainer's own (a test
  # defines them in a FlagValues of its own).
  flags.DEFINE_integer(
    "num_processes", None, "How many processes to start.", flag_values=fv
  )
  flags.DEFINE_integer(
    "port", None, "Coordinator port; default: a free one.", flag_values=fv
  )
  flags.DEFINE_float(
    "timeout_s", None, "Kill every process after this long.", flag_values=fv
  )
  flags.DEFINE_float(
    "dead_peer_timeout_s",
    60,
    "Longest wait for killed processes to be reaped.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "link",
    None,
    "Emulated link rate per process, as "
    "1gbit or 100mbit (root only); default: no emulation.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "latency",
    "0ms",
    "With --link: one-way delay from "
    "each process to the switch (needs tc netem).",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "topology",
    "per_node",
    list(links.TOPOLOGIES),
    "With --link: a link each (per_node) or one bottleneck "
    "all processes share (shared).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "cpu_quota",
    None,
    "With --link: CPUs each process "
    "may use, as 1,1,0.5,0.5 (cgroup cpu controller).",
    flag_values=fv,
  )
  flags.DEFINE_float(
    "link_probe_s",
    0.5,
    "With --link: seconds of the rate measurement before the run.",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "link_stats",
    None,
    "With --link: write each process's bytes sent and received on its "
    "emulated link during the run (its veth's counters) to this JSON file "
    "when the run ends.",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "elastic",
    False,
    "Run --num_processes slots as an elastic pool: worlds restarted as "
    "slots are reclaimed, die and return.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "min_processes",
    None,
    "With --elastic: the fewest processes (default 1).",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "availability",
    None,
    'With --elastic: a JSON file {"<slot>": [[start_s, end_s], ...]} of '
    "when each slot is reclaimed, in seconds since the job started.",
    flag_values=fv,
  )
  flags.DEFINE_float(
    "rejoin_after",
    None,
    "With --elastic: seconds after which a slot whose process died comes "
    "back; default: when an availability interval of it ends, else never.",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "max_restarts",
    100,
    "With --elastic: the most worlds after the first.",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "compilation_cache",
    True,
    "With --elastic: give the processes a persistent XLA compilation cache "
    "for the job, so that restarted worlds load what earlier ones compiled "
    "(unless JAX_COMPILATION_CACHE_DIR names one already).",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "hot_standby",
    True,
    "With --elastic: once a world has stepped, start processes in each slot "
    "for the next world, its imports done (a Python program run as "
    "`python -m MODULE` or `python SCRIPT` by this interpreter).",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "standbys_per_slot",
    2,
    "With --elastic: standbys per slot (two cover a world that ends early).",
    flag_values=fv,
  )
  flags.DEFINE_float(
    "grace_s",
    60,
    "With --elastic: seconds a world has to exit after a notice before "
    "every process is SIGKILLed.",
    flag_values=fv,
  )


#: The flags that only shape an emulated link: each needs --link.
_LINK_FLAGS = (
  "latency",
  "topology",
  "cpu_quota",
  "link_probe_s",
  "link_stats",
)
#: The flags of an elastic pool: each needs --elastic.
_ELASTIC_FLAGS = (
  "min_processes",
  "availability",
  "rejoin_after",
  "max_restarts",
  "grace_s",
  "compilation_cache",
  "hot_standby",
  "standbys_per_slot",
)


def _check_flags(opts: flags.FlagValues) -> None:
  """Raises ``ValueError`` naming a duration out of range, or a link flag
  given without ``--link`` (it would be ignored)."""
  for name, least in (("timeout_s", 0), ("link_probe_s", 0)):
    value = opts[name].value
    if value is not None and not (math.isfinite(value) and value > least):
      raise ValueError(f"--{name} must be a finite number > 0, got {value}")
  wait = opts.dead_peer_timeout_s
  if not (math.isfinite(wait) and wait >= 0):
    raise ValueError(
      f"--dead_peer_timeout_s must be a finite number >= 0, got {wait}"
    )
  if opts.link is None:
    cli.check_flags_need(
      [f"--{name}" for name in _LINK_FLAGS if opts[name].present],
      "an emulated link",
      verbs=("shapes", "shape"),
      fix="add --link=RATE (e.g. --link=1gbit)",
    )
  if not opts.elastic:
    cli.check_flags_need(
      [f"--{name}" for name in _ELASTIC_FLAGS if opts[name].present],
      "to an elastic pool",
      fix="add --elastic",
    )


def _elastic_options(opts: flags.FlagValues) -> pool.ElasticOptions:
  """The checked pool of ``--elastic`` (raises ``ValueError`` naming a
  flag or the availability file)."""
  n = opts.num_processes
  return pool.ElasticOptions(
    pool_size=n,
    min_processes=1 if opts.min_processes is None else opts.min_processes,
    availability=(
      pool.Availability()
      if opts.availability is None
      else pool.load_availability(opts.availability, n)
    ),
    rejoin_after_s=opts.rejoin_after,
    max_restarts=opts.max_restarts,
    grace_s=opts.grace_s,
    compilation_cache=opts.compilation_cache,
    hot_standby=opts.hot_standby,
    standbys_per_slot=opts.standbys_per_slot,
  )


def _runner(
  opts: flags.FlagValues, command: list[str]
) -> Callable[[links.LinkEmulator | None, dict[str, str]], int]:
  """What runs ``command`` (plain or elastic), given the emulated link, if
  any, and the processes' environment; every flag is checked here, before
  anything is built or started."""
  kwargs: dict[str, Any] = dict(
    port=opts.port,
    timeout_s=opts.timeout_s,
    dead_peer_timeout_s=opts.dead_peer_timeout_s,
  )
  if opts.elastic:
    options = _elastic_options(opts)

    def run_elastic(emulator, env):
      if emulator is not None:
        kwargs.update(address=emulator.address, wrap=emulator.wrap)
      return elastic.launch_elastic(command, options, env=env, **kwargs)

    return run_elastic

  def run(emulator, env):
    if emulator is not None:
      kwargs.update(coordinator_host=emulator.address(0), wrap=emulator.wrap)
    return launch(command, opts.num_processes, env=env, **kwargs)

  return run


def _write_link_stats(
  path: str, emulator: links.LinkEmulator, before: list[dict[str, int]]
) -> None:
  """Writes ``--link_stats``: the link, and per process its address and the
  bytes its veth sent and received since ``before``."""
  delta = links.byte_delta(before, emulator.byte_counts())
  record = {
    "link": emulator.spec.rate,
    "rate_bps": emulator.spec.rate_bps,
    "topology": emulator.spec.topology,
    "processes": [
      {"process": i, "address": emulator.address(i), **counts}
      for i, counts in enumerate(delta)
    ],
  }
  files.write_json(path, record, indent=2)


def _main(argv: Sequence[str]) -> None:
  opts = flags.FLAGS
  with cli.bad_input_exits():
    if opts.num_processes is None or opts.num_processes < 1:
      raise ValueError(
        f"--num_processes must be >= 1, got {opts.num_processes}"
      )
    if len(argv) < 2:
      raise ValueError(
        "no command to launch; put it after --, as in "
        "-- python -m experiments.train"
      )
    _check_flags(opts)
    # Before any namespace is built for it.
    check_program(argv[1], os.environ)
    run = _runner(opts, list(argv[1:]))
    if opts.link is None:
      sys.exit(run(None, dict(os.environ)))
    spec = links.LinkSpec.parse(
      opts.link, opts.latency, opts.topology, opts.cpu_quota, opts.num_processes
    )
    try:
      with links.LinkEmulator(opts.num_processes, spec) as emulator:
        measured = emulator.measure_rate(opts.link_probe_s)
        if measured is not None:
          print(
            f"link: {spec.rate} {spec.topology}, measured "
            f"{measured / 1e6:.1f} Mbit/s from process 0 to 1",
            file=sys.stderr,
            flush=True,
          )
        # Counted from here: the rate probe's traffic is not the run's.
        before = emulator.byte_counts() if opts.link_stats else None
        code = run(emulator, {**os.environ, **emulator.env(measured)})
        if before is not None:
          _write_link_stats(opts.link_stats, emulator, before)
    except links.LinkUnavailableError as e:
      print(f"error: {e}", file=sys.stderr)
      code = 1
  sys.exit(code)


def run() -> None:
  """Runs the command as the program, e.g. ``python -m qsync_jax.distributed``.

  Its flags are defined now, as the calling program's own, and ``--help``
  shows this module's usage text.
  """
  sys.modules["__main__"].__doc__ = __doc__
  _define_flags()
  app.run(_main)
