r"""Step time of the hybrid trainer against a plain SPMD data-parallel step.

Usage:
  python -m experiments.trainer_bench --out=trainer_bench.json \
      [--num_workers=4] [--rounds=7]

Both run 4 FP32 workers on the same (fake CPU) devices, model, optimizer and
global batch, interleaved in one process. Writes JSON
{"device": str, "cases": [{model, num_workers, batch_per_worker,
hybrid_step_s, spmd_step_s, ratio, rounds, steps_per_round}]} and prints one
line per case. The goal is ratio <= 1.15.
"""

import json

from absl import app
from absl import flags
import jax

from experiments.benches import trainer_overhead
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output JSON file.")
flags.DEFINE_integer("num_workers", 4, "Workers (fake CPU devices on CPU).")
flags.DEFINE_integer("rounds", 7, "Interleaved measurement rounds.")

# (model, batch per worker, config overrides): the main job's CNN on digits,
# the network study's wide CNN (4.26M parameters, most in one dense layer),
# and a small BERT-style encoder on 64-token sequences.
CASES = [
  ("cnn", 32, {}),
  ("cnn", 128, {}),
  ("cnn", 16, {"widths": (32, 64), "hidden": 4096}),
  (
    "bert",
    16,
    {
      "vocab_size": 512,
      "max_len": 64,
      "num_layers": 2,
      "hidden": 128,
      "mlp_dim": 256,
    },
  ),
]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  jax.config.update("jax_num_cpu_devices", FLAGS.num_workers)
  with cli.bad_input_exits():
    results = []
    for model, batch, kwargs in CASES:
      r = trainer_overhead.trainer_overhead(
        model,
        batch,
        num_workers=FLAGS.num_workers,
        rounds=FLAGS.rounds,
        model_kwargs=kwargs,
      )
      print(
        f"{model:5s} batch/worker {batch:4d}: hybrid "
        f"{r['hybrid_step_s'] * 1e3:7.2f} ms, spmd "
        f"{r['spmd_step_s'] * 1e3:7.2f} ms, ratio {r['ratio']:.3f}"
      )
      results.append(r)
    with open(FLAGS.out, "w") as f:
      json.dump(
        {"device": str(jax.devices()[0].device_kind), "cases": results},
        f,
        indent=2,
      )


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
