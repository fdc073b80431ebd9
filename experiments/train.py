r"""The main job: train a model under a per-layer precision plan.

Usage:
  python -m experiments.train --out_dir=/tmp/qsync_run \
      [--config=experiments/configs/default.py] [--config.steps=200] \
      [--config.model=package.module:factory]

Writes to --out_dir:
  summary.json: final_eval_accuracy, final_eval_loss, final_train_loss,
    steps, wall_time_s, device_kind, precisions ({layer: precision}).
  plan.json: the precision plan (PrecisionPlan JSON).

--config.model takes a built-in model name (cnn, resnet18, resnet50, vgg16_bn,
bert, lm, vit_tiny) or package.module:factory, a callable taking rngs (and the
keyword arguments in --config.model_kwargs) that returns an NNX module with an
input_spec(batch_size) method.
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from qsync_jax import cli
from qsync_jax import training

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs",
                               "default.py")

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "Directory for summary.json and plans.")
config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG,
                                "Path to a get_config() file.",
                                lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  with cli.bad_input_exits():
    training.train_and_evaluate(FLAGS.config, FLAGS.out_dir)


if __name__ == "__main__":
  flags.mark_flags_as_required(["out_dir"])
  app.run(main)
