r"""Throughput of the Pallas kernels and of XLA's int8 / bf16 / fp32 dots.

Usage:
  python -m experiments.kernels_bench --out=kernels_bench.json \
      [--sizes=1024,2048,4096,8192] [--repeats=5]

Writes JSON {device_kind, backend, jax_version, interpret_mode, [note],
sizes, repeats, steps, results: [{size, kernels: {name: {seconds, tflops |
gbps}}, ratios}]} (see experiments.benches.kernels.run) and prints one line per
size. Off a GPU the kernels run in Pallas interpret mode and the JSON says
"interpret-mode figures on CPU are not meaningful".
"""

import json

from absl import app
from absl import flags

from experiments.benches import kernels
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output JSON file.")
flags.DEFINE_list(
  "sizes",
  None,
  "Square sizes n (n x n x n GEMMs, n x n quantize / encode). Default: "
  "1024,2048,4096,8192 on a GPU; 256,512 elsewhere, where the kernels run "
  "in interpret mode (minutes per size above 1024, and not meaningful).",
)
flags.DEFINE_integer("repeats", 5, "Timed rounds per case (median reported).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  with cli.bad_input_exits():
    try:
      sizes = None if FLAGS.sizes is None else [int(s) for s in FLAGS.sizes]
    except ValueError:
      raise ValueError(f"--sizes must be integers, got {FLAGS.sizes}") from None
    result = kernels.run(sizes, repeats=FLAGS.repeats)
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
