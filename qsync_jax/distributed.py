r"""The localhost launcher as a command: ``python -m qsync_jax.distributed``.

Usage:
  python -m qsync_jax.distributed --num_processes=4 [--port=N] \
      [--timeout_s=S] -- python -m experiments.train --out_dir=/tmp/run

Starts the processes with :func:`qsync_jax.parallel.distributed.launch` and
exits with its status. The library itself lives in
:mod:`qsync_jax.parallel.distributed`; this module only parses flags.
"""

from __future__ import annotations

import sys
from typing import Sequence

from absl import app
from absl import flags

from qsync_jax import cli
from qsync_jax.parallel.distributed import launch


def _define_flags() -> None:
  # Defined only when run as a program, so that importing this module from a
  # trainer adds no flags that could clash with the trainer's own.
  flags.DEFINE_integer("num_processes", None, "How many processes to start.")
  flags.DEFINE_integer("port", None, "Coordinator port; default: a free one.")
  flags.DEFINE_float("timeout_s", None, "Kill every process after this long.")
  flags.DEFINE_float("dead_peer_timeout_s", 60,
                     "Longest wait for killed processes to be reaped.")


def _main(argv: Sequence[str]) -> None:
  opts = flags.FLAGS
  with cli.bad_input_exits():
    if opts.num_processes is None or opts.num_processes < 1:
      raise ValueError(
          f"--num_processes must be >= 1, got {opts.num_processes}")
    if len(argv) < 2:
      raise ValueError("no command to launch; put it after --, as in "
                       "-- python -m experiments.train")
    code = launch(argv[1:], opts.num_processes, port=opts.port,
                  timeout_s=opts.timeout_s,
                  dead_peer_timeout_s=opts.dead_peer_timeout_s)
  sys.exit(code)


if __name__ == "__main__":
  _define_flags()
  app.run(_main)
