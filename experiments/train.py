r"""The main job: synchronous training over a hybrid cluster of workers.

Usage:
  python -m experiments.train --out_dir=runs/default \
      [--config=experiments/configs/default.py] [--config.steps=200] \
      [--model=resnet18] [--cluster=v100:2,t4:2] [--plan=auto] [--resume]

Besides --out_dir and --config (with its --config.FIELD=VALUE overrides),
every flag is an alias of a config field
(experiments.flag_aliases.FLAG_ALIASES);
experiments.train_lib.main does the rest. The guide: docs/guides/main_job.md.

Exit status: 0 when the run is done; 1 for bad input or a failed run (one
``error:`` line); 75 (MEMBERSHIP_CHANGED_EXIT_CODE of
qsync_jax.process.membership) when SIGTERM made it checkpoint the step every
process agreed on: the same command resumes it, and an elastic launcher
starts its next world.
"""

import os
import signal
import sys

if __name__ == "__main__" and os.environ.get("QSYNC_ELASTIC_SLOTS"):
  # In an elastic world a reclaim notice (SIGTERM) may come while this
  # process starts, and would kill it. Blocked before any import starts a
  # thread (threads inherit the mask), it stays pending until the training
  # loop's PreemptionWatch unblocks it and takes it at the first step.
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
  # It says so at once (an empty progress file, as
  # qsync_jax.process.membership.ENV_PROGRESS describes): a notice that
  # reaches its world before any process has stepped then ends the world at
  # once, instead of waiting for its start and a checkpoint of the state it
  # restored.
  if os.environ.get("QSYNC_ELASTIC_PROGRESS"):
    try:
      open(os.environ["QSYNC_ELASTIC_PROGRESS"], "a").close()
    except OSError:
      pass

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import config_files
from experiments import flag_aliases
from experiments import train_lib
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "Run directory for outputs.")
_DEFINE = {
  "string": flags.DEFINE_string,
  "bool": flags.DEFINE_bool,
  "integer": flags.DEFINE_integer,
  "float": flags.DEFINE_float,
}
for _alias in flag_aliases.FLAG_ALIASES:
  if _alias.type == "enum":
    flags.DEFINE_enum(_alias.flag, None, list(_alias.choices), _alias.help)
  elif _alias.type == "multi_string":
    flags.DEFINE_multi_string(_alias.flag, [], _alias.help)
  else:
    _DEFINE[_alias.type](_alias.flag, None, _alias.help)
try:
  config_flags.DEFINE_config_file(
    "config",
    config_files.DEFAULT_CONFIG,
    "Path to a get_config() file.",
    lock_config=True,
  )
except (AttributeError, KeyError) as err:  # a --config.x override
  cli.exit_on_bad_override(err, sys.argv)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  train_lib.main(
    FLAGS.config,
    out_dir=FLAGS.out_dir,
    overrides={a.flag: FLAGS[a.flag].value for a in flag_aliases.FLAG_ALIASES},
  )


if __name__ == "__main__":
  flags.mark_flags_as_required(["out_dir"])
  app.run(main, flags_parser=config_files.parse_flags)
