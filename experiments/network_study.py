r"""Time to target accuracy over an emulated slow network (root only).

Usage:
  python -m experiments.network_study --out=results/network_study \
      [--configs=dp,qsr_gqsgd,...] [--seeds=3] [--target=0.95] \
      [--link=1gbit] [--topology=per_node] [--steps=N]
  python -m experiments.network_study --out=results/network_study --predict_only

Each run is four processes, each in its own network namespace behind an
emulated link of --link (python -m qsync_jax.distributed --link), training
the wide CNN of experiments.studies.network on digits under one
configuration of experiments.studies.network.RUNS: data parallel with
float32, Global-QSGD and PowerSGD averaging, local SGD, QSR, QSR with
Global-QSGD, DiLoCo, and data parallel against dynamic batch sizing with two
processes CPU-throttled. Finished runs (their summary.json) are reused.

Writes --out/summary.json {"time_to_target_ratio_qsr_gqsgd_vs_dp",
"final_accuracy_gap_qsr_gqsgd_vs_dp_points", "configs": {name:
{time_to_target_mean_s, final_accuracy_mean, bytes_sent_per_worker,
step_time_mean_s, ...}}, "runs": [...]}, --out/time_to_accuracy.png and
--out/time_to_accuracy_hetero.png.
"""

import functools
import json

from absl import app
from absl import flags

from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_list("configs", None, "Configurations (default: all).")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.")
flags.DEFINE_float("target", 0.95, "Target eval accuracy.")
flags.DEFINE_string("link", "1gbit", "Each process's emulated link rate.")
flags.DEFINE_enum(
  "topology",
  "per_node",
  ["per_node", "shared"],
  "A link per process, or one shared bottleneck.",
)
flags.DEFINE_integer("steps", None, "Override the training steps.")
flags.DEFINE_string(
  "model_kwargs",
  None,
  "The CNN's arguments as JSON "
  "instead of the study's wide CNN, e.g. a small one for a "
  'quick check: \'{"widths": [8, 16], "hidden": 64}\'.',
)
flags.DEFINE_bool(
  "predict",
  True,
  "Add the predictor's step time of each "
  "homogeneous configuration (profiles this host).",
)
flags.DEFINE_bool(
  "predict_only",
  False,
  "Run nothing: price the study "
  "already in --out (its summary.json) again with this "
  "predictor, e.g. after changing it. Needs no root.",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  import jax

  # The predictor profiles the four workers sharing this host's cores.
  jax.config.update("jax_num_cpu_devices", 4)
  from experiments.studies import network
  from experiments.studies import network_prediction

  try:
    model_kwargs = (
      None if FLAGS.model_kwargs is None else json.loads(FLAGS.model_kwargs)
    )
  except json.JSONDecodeError as e:
    raise SystemExit(f"error: --model_kwargs is not JSON: {e}") from None
  if FLAGS.predict_only:
    if not FLAGS.predict:
      raise app.UsageError("--predict_only with --nopredict has nothing to do")
    with cli.bad_input_exits():
      result = network_prediction.repredict(FLAGS.out)
    for name, s in result["configs"].items():
      if "predicted_step_s" in s:
        print(
          f"{name:15s} step {s['step_time_mean_s'] * 1e3:6.1f} ms, "
          f"predicted {s['predicted_step_s'] * 1e3:6.1f} ms "
          f"({s['predicted_vs_measured_step']:+.1%})"
        )
    return
  try:
    with cli.bad_input_exits():
      result = network.run(
        FLAGS.out,
        names=FLAGS.configs or list(network.RUNS),
        seeds=FLAGS.seeds,
        target=FLAGS.target,
        link=FLAGS.link,
        topology=FLAGS.topology,
        steps=FLAGS.steps,
        predictions=(
          functools.partial(
            network_prediction.add_predictions, model_kwargs=model_kwargs
          )
          if FLAGS.predict
          else None
        ),
        model_kwargs=model_kwargs,
      )
  except RuntimeError as e:  # a failed run, or the link is unavailable
    raise SystemExit(f"error: {e}") from None
  for name, s in result["configs"].items():
    t = s["time_to_target_mean_s"]
    print(
      f"{name:15s} to {FLAGS.target}: "
      f"{'not reached' if t is None else f'{t:6.1f} s'} "
      f"({s['reached_target']}/{s['seeds']})  final "
      f"{s['final_accuracy_mean']:.4f} +- {s['final_accuracy_std']:.4f}"
      f"  step {s['step_time_mean_s'] * 1e3:6.1f} ms"
      + (
        f" (predicted {s['predicted_step_s'] * 1e3:6.1f})"
        if "predicted_step_s" in s
        else ""
      )
      + "  sent "
      f"{s['bytes_sent_per_worker'] / 1e6:8.1f} MB"
    )
  key = network.KEY_RATIO[0]
  print(f"{key}: {result[key]}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
