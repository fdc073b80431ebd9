r"""QSR local SGD and Global-QSGD against data parallelism at small scale.

Usage:
  python -m experiments.qsr_study --out=runs/qsr_study [--tasks=cnn,lm] \
      [--configs=dp,local,qsr,...] [--seeds=3] [--steps=N] \
      [--learning_rate=LR] [--h_base=H]

Trains four workers (fake CPU devices) per task (the CNN on digits, a
2-layer byte-level LM on Python source) under every configuration of
experiments.studies.qsr.CONFIGS: data parallel, constant-H local SGD, QSR, the
linear and cubic rules, and Global-QSGD (standard and exponential dithering,
alone and under QSR). QSR's alpha is set from a sync-round budget before
training, not tuned on accuracy.

Writes --out/study.json {"runs": [{"task", "name", "sync", "compress",
"seed", "final_eval", "sync_rounds", "comm_bytes", ...}], "tasks": {task:
{"alphas", "summary": {config: {final_eval_mean, final_eval_std,
rounds_vs_dp, eval_minus_dp, ...}}, "h_curves", "eval_curves"}}}, plus
--out/h.png (H over training) and --out/eval.png (eval accuracy).
"""

import os

from absl import app
from absl import flags

from experiments.studies import backend
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_list("tasks", ["cnn", "lm"], "Tasks to run.")
flags.DEFINE_list("configs", None, "Configurations (default: all).")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.")
flags.DEFINE_integer("steps", None, "Override every task's training steps.")
flags.DEFINE_float(
  "learning_rate", None, "Override every task's peak learning rate."
)
flags.DEFINE_integer("h_base", None, "Override every task's H_base.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  backend.start_backend(FLAGS.out, num_devices=4)  # four workers
  from experiments.configs import default
  from experiments.studies import qsr

  with cli.bad_input_exits():
    result = qsr.run(
      FLAGS.out,
      default.get_config(),
      FLAGS.tasks,
      FLAGS.configs or list(qsr.CONFIGS),
      FLAGS.seeds,
      FLAGS.steps,
      FLAGS.learning_rate,
      FLAGS.h_base,
    )
  for tname, entry in result["tasks"].items():
    for name, s in entry["summary"].items():
      print(
        f"{tname:4s} {name:14s} eval {s['final_eval_mean']:.4f} "
        f"+- {s['final_eval_std']:.4f} (dp {s.get('eval_minus_dp', 0):+.4f})"
        f"  rounds {s['sync_rounds']} ({s.get('rounds_vs_dp', 1):.1%} of "
        f"dp)  bytes {s['comm_bytes']:.3g}"
      )
  print(f"wrote {os.path.join(FLAGS.out, 'study.json')}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
