r"""Step time of the hybrid trainer against a plain SPMD data-parallel step.

Usage:
  python -m experiments.trainer_bench --out=trainer_bench.json \
      [--num_workers=4] [--rounds=7] [--models=cnn,bert]

Both run 4 FP32 workers on the same (fake CPU) devices, model, optimizer and
global batch, interleaved in one process. Writes JSON
{"device": str, "cases": [{model, num_workers, batch_per_worker,
hybrid_step_s, spmd_step_s, ratio, round_ratio, hybrid_rounds_s,
spmd_rounds_s, rounds, steps_per_round, load_avg_1m}]}
and prints one line per case (``--models`` picks cases by model). The goal
is ratio <= 1.10.
"""

import json
import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments.benches import trainer_overhead
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output JSON file.")
flags.DEFINE_integer("num_workers", 4, "Workers (fake CPU devices on CPU).")
flags.DEFINE_integer("rounds", 7, "Interleaved measurement rounds.")
flags.DEFINE_list(
  "models", None, "Only the cases of these models (default: every case)."
)

# (model, batch per worker, model arguments, one example's shape and dtype
# for a model without input_spec): the main job's CNN on digits, the network
# study's wide CNN (4.26M parameters, most in one dense layer), a small
# BERT-style encoder on 64-token sequences, and the GPT example (flax's own
# layers, tied head) at its default size on 64 byte tokens.
CASES = [
  ("cnn", 32, {}, None),
  ("cnn", 128, {}, None),
  ("cnn", 16, {"widths": (32, 64), "hidden": 4096}, None),
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
    None,
  ),
  (
    "examples.gpt:make_gpt",
    16,
    {"vocab_size": 256, "max_len": 64},
    jax.ShapeDtypeStruct((64,), jnp.int32),
  ),
]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  jax.config.update("jax_num_cpu_devices", FLAGS.num_workers)
  with cli.bad_input_exits():
    results = []
    cases = [c for c in CASES if not FLAGS.models or c[0] in FLAGS.models]
    if not cases:
      raise ValueError(
        f"no case of --models={','.join(FLAGS.models)}; the cases' models: "
        f"{', '.join(sorted({c[0] for c in CASES}))}"
      )
    for model, batch, kwargs, example in cases:
      r = trainer_overhead.trainer_overhead(
        model,
        batch,
        num_workers=FLAGS.num_workers,
        rounds=FLAGS.rounds,
        model_kwargs=kwargs,
        example_spec=example,
      )
      # The host's load over the last minute: other work on a shared host
      # slows both steps, and not always alike.
      r["load_avg_1m"] = os.getloadavg()[0]
      print(
        f"{model:5s} batch/worker {batch:4d}: hybrid "
        f"{r['hybrid_step_s'] * 1e3:7.2f} ms, spmd "
        f"{r['spmd_step_s'] * 1e3:7.2f} ms, ratio {r['ratio']:.3f}, "
        f"per round {r['round_ratio']:.3f} (load {r['load_avg_1m']:.1f})"
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
