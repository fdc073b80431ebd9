r"""qsync_jax beside PyTorch DDP and torchft on the same emulated links.

Usage:
  python -m experiments.peer_bench --out=results/peer_bench \
      [--configs=ddp_fp32,torchft_diloco,dp,qsr_gqsgd,...] [--seeds=3] \
      [--steps=N] [--recovery_repeats=3] [--nolinks] [--model_kwargs=JSON]

Every run is the network study's task (four processes, each behind its own
emulated 1 Gbit/s link, the wide CNN on digits) under one system: PyTorch
DDP with a communication hook (ddp_fp32, ddp_fp16, ddp_powersgd), torchft
(torchft_localsgd, torchft_diloco, torchft_streaming) or qsync_jax (dp,
dp_gqsgd, qsr, qsr_gqsgd, diloco, auto: the allocator's pick on the link),
plus each framework's compute floor; then the recovery of a replica killed
mid-run under torchft and under the elastic launcher. Needs root for the
links (--nolinks runs without them, counting no bytes) and the peers extra
(pip install -e ".[peers]"). Finished runs (their summary.json) are reused.

Writes --out/summary.json and --out/time_to_accuracy.png
(experiments.benches.peers.bench).
"""

import json

from absl import app
from absl import flags

from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_list("configs", None, "Configurations (default: all).")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.")
flags.DEFINE_integer("steps", None, "Override the training steps.")
flags.DEFINE_float("target", 0.95, "Target eval accuracy.")
flags.DEFINE_string("link", "1gbit", "Each process's emulated link rate.")
flags.DEFINE_bool(
  "links", True, "Emulate the links (root); --nolinks: none, no bytes."
)
flags.DEFINE_integer(
  "recovery_repeats", 3, "Recoveries per framework (0: none)."
)
flags.DEFINE_integer("num_processes", 4, "Processes per run.")
flags.DEFINE_bool(
  "floors", True, "Add each framework's compute floor (no averaging)."
)
flags.DEFINE_string(
  "model_kwargs",
  None,
  "The CNN's arguments as JSON instead of the study's wide CNN, e.g. "
  '\'{"widths": [8, 16], "hidden": 64}\' for a quick check.',
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  import jax

  # The allocator's pick profiles the workers sharing this host's cores.
  jax.config.update("jax_num_cpu_devices", 4)
  from experiments.benches.peers import bench

  try:
    model_kwargs = (
      None if FLAGS.model_kwargs is None else json.loads(FLAGS.model_kwargs)
    )
  except json.JSONDecodeError as e:
    raise SystemExit(f"error: --model_kwargs is not JSON: {e}") from None
  if FLAGS.num_processes < 1:
    raise SystemExit(
      f"error: --num_processes must be >= 1, got {FLAGS.num_processes}"
    )
  try:
    with cli.bad_input_exits():
      result = bench.run(
        FLAGS.out,
        names=FLAGS.configs or list(bench.DEFAULT_CONFIGS),
        seeds=FLAGS.seeds,
        target=FLAGS.target,
        link=FLAGS.link if FLAGS.links else None,
        steps=FLAGS.steps,
        model_kwargs=model_kwargs,
        num_processes=FLAGS.num_processes,
        recovery_repeats=FLAGS.recovery_repeats,
        floors=FLAGS.floors,
      )
  except RuntimeError as e:  # missing extra, no links, a failed run
    raise SystemExit(f"error: {e}") from None
  print(bench.table(result))


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
