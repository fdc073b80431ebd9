r"""QSync's headline comparison at small scale, with paper-size step times.

Usage:
  python -m experiments.qsync_study --out=runs/qsync_study \
      [--tasks=cnn,encoder] [--configs=fp32,uniform_low,qsync,...] \
      [--seeds=3] [--steps=N]

Trains four workers (v100:2,t4:2, fake CPU devices) per task (a ResNet-18 on
digits, a 4-layer encoder classifying the next byte of Python source) under
every configuration of experiments.studies.qsync.CONFIGS: all FP32, uniform
INT8 on the T4s, the allocator's greedy plan (with QSync's, the qsync_var
and a random indicator), dynamic batch sizing, and the ILP at a 60% memory
budget with four indicators. Then predicts each method's step time for
ResNet-50 / BERT-base on v100:8,t4:8 (analytic profiles).

Writes --out/study.json {"tasks": {task: {"runs": [{config, seed,
final_eval_accuracy, ...}], "accuracy": {config: {mean, std, n}},
"paper": {predicted_step_time_s, ...}}}} and --out/study.png. Compiled
programs are cached in --out/jax_cache, so reruns and later seeds compile
less.
"""

import os

from absl import app
from absl import flags

from experiments.studies import backend
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_list("tasks", ["cnn", "encoder"], "Tasks to run.")
flags.DEFINE_list("configs", None, "Configurations (default: all).")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.")
flags.DEFINE_integer("steps", None, "Override every task's training steps.")
flags.DEFINE_bool("predict", True, "Predict paper-size step times.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  backend.start_backend(FLAGS.out, num_devices=4)  # four workers
  from experiments.configs import default
  from experiments.studies import qsync

  with cli.bad_input_exits():
    result = qsync.run(
      FLAGS.out,
      default.get_config(),
      FLAGS.tasks,
      FLAGS.configs or list(qsync.CONFIGS),
      FLAGS.seeds,
      FLAGS.steps,
      FLAGS.predict,
    )
  for tname, entry in result["tasks"].items():
    for name, acc in entry["accuracy"].items():
      print(
        f"{tname:8s} {name:14s} accuracy {acc['mean']:.4f} "
        f"+- {acc['std']:.4f} (n={acc['n']})"
      )
    for name, t in (
      entry.get("paper", {}).get("predicted_step_time_s", {}).items()
    ):
      print(
        f"{tname:8s} {entry['paper']['model']} {name:14s} predicted "
        f"step {t * 1e3:.2f} ms"
      )
  print(f"wrote {os.path.join(FLAGS.out, 'study.json')}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
