r"""The localhost launcher as a command: ``python -m qsync_jax.distributed``.

Usage:
  python -m qsync_jax.distributed --num_processes=4 [--port=N] \
      [--timeout_s=S] [--link=1gbit [--latency=0ms] [--topology=per_node]
      [--cpu_quota=1,1,0.5,0.5]] -- python -m experiments.train --out_dir=R

Starts the processes with :func:`qsync_jax.parallel.distributed.launch` and
exits with its status. With ``--link`` (root only) every process runs in its
own network namespace behind an emulated link
(:class:`qsync_jax.parallel.links.LinkEmulator`), the achieved rate between
processes 0 and 1 is measured first and passed on in
``QSYNC_LINK_MEASURED_BPS``, and everything is torn down at exit; without
root, or without ip/tc, it says so in one line and exits with 1. The library
itself lives in :mod:`qsync_jax.parallel.distributed` and
:mod:`qsync_jax.parallel.links`; this module only parses flags.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
import os
import sys

from absl import app
from absl import flags

from qsync_jax import cli
from qsync_jax.parallel import links
from qsync_jax.parallel.distributed import check_program
from qsync_jax.parallel.distributed import launch


def _define_flags() -> None:
  # Defined only when run as a program, so that importing this module from a
  # trainer adds no flags that could clash with the trainer's own.
  flags.DEFINE_integer("num_processes", None, "How many processes to start.")
  flags.DEFINE_integer("port", None, "Coordinator port; default: a free one.")
  flags.DEFINE_float("timeout_s", None, "Kill every process after this long.")
  flags.DEFINE_float(
    "dead_peer_timeout_s", 60, "Longest wait for killed processes to be reaped."
  )
  flags.DEFINE_string(
    "link",
    None,
    "Emulated link rate per process, as "
    "1gbit or 100mbit (root only); default: no emulation.",
  )
  flags.DEFINE_string(
    "latency",
    "0ms",
    "With --link: one-way delay from "
    "each process to the switch (needs tc netem).",
  )
  flags.DEFINE_enum(
    "topology",
    "per_node",
    list(links.TOPOLOGIES),
    "With --link: a link each (per_node) or one bottleneck "
    "all processes share (shared).",
  )
  flags.DEFINE_string(
    "cpu_quota",
    None,
    "With --link: CPUs each process "
    "may use, as 1,1,0.5,0.5 (cgroup cpu controller).",
  )
  flags.DEFINE_float(
    "link_probe_s",
    0.5,
    "With --link: seconds of the rate measurement before the run.",
  )


#: The flags that only shape an emulated link: each needs --link.
_LINK_FLAGS = ("latency", "topology", "cpu_quota", "link_probe_s")


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
    given = [f"--{name}" for name in _LINK_FLAGS if opts[name].present]
    if given:
      raise ValueError(
        f"{', '.join(given)} only "
        + ("shapes" if len(given) == 1 else "shape")
        + " an emulated link: add --link=RATE (e.g. --link=1gbit), or "
        "leave " + ("it" if len(given) == 1 else "them") + " out"
      )


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
    kwargs = dict(
      port=opts.port,
      timeout_s=opts.timeout_s,
      dead_peer_timeout_s=opts.dead_peer_timeout_s,
    )
    if opts.link is None:
      sys.exit(launch(argv[1:], opts.num_processes, **kwargs))
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
        code = launch(
          argv[1:],
          opts.num_processes,
          env={**os.environ, **emulator.env(measured)},
          coordinator_host=emulator.address(0),
          wrap=emulator.wrap,
          **kwargs,
        )
    except links.LinkUnavailableError as e:
      print(f"error: {e}", file=sys.stderr)
      code = 1
  sys.exit(code)


if __name__ == "__main__":
  _define_flags()
  app.run(_main)
