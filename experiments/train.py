r"""The main job: synchronous training over a hybrid cluster of workers.

Usage:
  python -m experiments.train --out_dir=runs/default \
      [--config=experiments/configs/default.py] [--config.steps=200] \
      [--model=resnet18] [--cluster=v100:2,t4:2] [--plan=auto]
      [--plan=t4=t4_plan.json] [--resume]
      [--sync=dp|local|postlocal|qsr] [--h_base=4] [--alpha=0.01]
      [--compress=none|fp16|bf16|gqsgd|gqsgd_exp|qsgd|powersgd]

  --sync=qsr with --config.lr_schedule=cosine is QSR local SGD: the period
  grows as the learning rate decays. --compress quantizes what each average
  sends (gradients under dp, the parameters' change under local SGD).

  --plan=auto (the default config's plan_mode) runs the indicator, the
  predictor and the allocator before training and writes the result to
  <out_dir>/allocation/ (summary.json, scores.json, one plan per kind).

  Multi-process: started by srun, mpirun (Open MPI 4 or 5) or a Kubernetes
  indexed Job/JobSet, the same command needs no extra variables (jax.distributed
  detects the launcher; qsync_jax.parallel.launchers fills in what it cannot).
  --coordinator_address, --num_processes and --process_id override what is
  detected; config.distributed holds the timeouts and local_devices. On one
  host, for development (one device per process; the launcher SIGKILLs every
  worker if one dies):
  python -m qsync_jax.distributed --num_processes=4 -- \
      python -m experiments.train --out_dir=runs/mp
  Before training the processes check that they agree (versions, XLA_FLAGS,
  config, initial parameters, data seed); a mismatch ends every process with
  `error: process K disagrees with process 0 on FIELD: ...` and status 1.

Preemption: SIGTERM makes every process checkpoint the step they agree on and
exit 0, leaving <out_dir>/PREEMPTED; the same command then resumes from it.

Writes to --out_dir:
  summary.json: final_eval_accuracy, final_eval_loss, final_train_loss, steps,
    sync, compress, error_feedback, outer_optimizer, sync_rounds,
    comm_bytes (bytes each
    worker sent, ring all-reduce model),
    wall_time_s, examples_per_s, loss_scaling, skipped_steps, params_sha256,
    cluster, num_processes, link (the launcher's --link and its measured
    rate, or null), workers [{kind, device, batch_size, plan}],
    precisions (per worker: {layer: precision}).
  metrics.jsonl: one row per log/eval step (step, loss, accuracy,
    examples_per_s, loss_scale, H (the period of the step's round),
    sync_rounds, comm_bytes, eval_loss,
    eval_accuracy).
  plans/<kind>.json: each device kind's PrecisionPlan.
  allocation/: with --plan=auto, the allocator's summary, scores and plans.
  curves.png: training loss and accuracy, eval accuracy.
  checkpoints/: orbax checkpoints; --resume continues the newest one.

Bad input (a bad config value, a plan for a kind not in --cluster, an
existing file as --out_dir, ...) ends the run before training with one line
`error: ...` and exit status 1. So does a run whose final parameters or eval
loss are not finite; it writes no summary.json.

--model takes a built-in model (cnn, resnet18, resnet50, vgg16_bn, bert, lm,
vit_tiny) or package.module:factory: a callable taking rngs, the dataset's
facts it names (num_classes, input_shape, image_size, in_channels, max_len,
vocab_size) and the keyword arguments of --model_kwargs='{...}' (JSON), that
returns an NNX module, a Linen module or an (init, apply) pair. No special
methods are needed; --config.loss_fn=package.module:fn sets the loss.
"""

import os
import sys

from absl import app
from absl import flags
import jax
import ml_collections
from ml_collections import config_flags

from experiments import config_lib
from experiments import train_lib
from qsync_jax import cli
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.parallel import coordination
from qsync_jax.parallel import distributed

_DEFAULT_CONFIG = os.path.join(
  os.path.dirname(__file__), "configs", "default.py"
)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "Run directory for outputs.")
flags.DEFINE_string("model", None, "Overrides config.model.")
flags.DEFINE_string(
  "model_kwargs",
  None,
  "JSON object merged into "
  "config.model_kwargs (the model's keyword arguments).",
)
flags.DEFINE_string(
  "dataset_kwargs",
  None,
  "JSON object merged into "
  "config.dataset_kwargs (the dataset loader's arguments).",
)
flags.DEFINE_string("cluster", None, "Overrides config.cluster.")
flags.DEFINE_bool("resume", None, "Overrides config.resume.")
flags.DEFINE_enum(
  "sync",
  None,
  ["dp", "local", "postlocal", "qsr"],
  "Overrides config.sync: when workers average.",
)
flags.DEFINE_integer(
  "h_base",
  None,
  "Overrides config.h_base: the local-SGD period, or QSR's smallest one.",
)
flags.DEFINE_float(
  "alpha",
  None,
  "Overrides config.alpha: QSR's growth "
  "coefficient, H = max(h_base, floor((alpha / lr)^2)).",
)
flags.DEFINE_enum(
  "compress",
  None,
  ["none", "fp16", "bf16", "gqsgd", "gqsgd_exp", "qsgd", "powersgd"],
  "Overrides config.compress: what goes on the wire.",
)
flags.DEFINE_multi_string(
  "plan",
  [],
  "'auto' (the allocator chooses every kind's plan; the "
  "default config's mode) or KIND=PLAN.json: the precision plan of one "
  "device kind (repeatable; sets config.plan_mode=manual, and kinds not "
  "named train in FP32).",
)
flags.DEFINE_string(
  "coordinator_address",
  None,
  "host:port of process 0's coordination service; default: from the launcher.",
)
flags.DEFINE_integer(
  "num_processes", None, "Processes in the run; default: from the launcher."
)
flags.DEFINE_integer(
  "process_id", None, "This process's index; default: from the launcher."
)
try:
  config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Path to a get_config() file.", lock_config=True
  )
except (AttributeError, KeyError) as err:  # a --config.x override
  cli.exit_on_bad_override(err, sys.argv)


def _parse_plan_flags(values):
  plans = {}
  for value in values:
    if value == "auto":
      raise ValueError(
        "--plan=auto cannot be combined with KIND=PLAN.json plans"
      )
    kind, sep, path = value.partition("=")
    if not sep or not kind or not path:
      raise ValueError(
        f"--plan={value!r}: expected KIND=PLAN.json, e.g. "
        "--plan=t4=plans/t4.json"
      )
    plans[kind.strip().lower()] = path
  return plans


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  config = FLAGS.config
  with config.unlocked():
    for name in (
      "model",
      "cluster",
      "resume",
      "sync",
      "h_base",
      "alpha",
      "compress",
    ):
      if getattr(FLAGS, name) is not None:
        config[name] = getattr(FLAGS, name)
  with cli.bad_input_exits():
    for name in ("model_kwargs", "dataset_kwargs"):
      if getattr(FLAGS, name) is not None:
        value = config_lib.read_json(getattr(FLAGS, name), f"--{name}")
        if not isinstance(value, dict):
          raise ValueError(
            f"--{name} must be a JSON object, got {getattr(FLAGS, name)!r}"
          )
        with config.unlocked():
          config[name] = ml_collections.ConfigDict(
            {**config_lib.to_plain(config[name]), **value}
          )
    if FLAGS.plan == ["auto"]:
      with config.unlocked():
        config.plan_mode = "auto"
    elif FLAGS.plan:
      with config.unlocked():
        config.plan_mode = "manual"
        config.plans = ml_collections.ConfigDict(
          {**config_lib.to_plain(config.plans), **_parse_plan_flags(FLAGS.plan)}
        )
    # Before anything starts (train_and_evaluate checks it again, for
    # library callers).
    config_lib.validate_config(config)
    train_lib.make_out_dir(FLAGS.out_dir, "--out_dir")
    auto = config.cluster.strip().lower() == cluster_lib.AUTO
    dist = config.get("distributed", {})
    multi = distributed.initialize(
      timeout_s=dist.get("initialization_timeout_s", 300),
      heartbeat_timeout_s=dist.get("heartbeat_timeout_s", 100),
      shutdown_timeout_s=dist.get("shutdown_timeout_s", 300),
      local_devices=dist.get("local_devices", "auto"),
      coordinator_address=FLAGS.coordinator_address,
      num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id,
    )
    if not multi and not auto:
      # Single process: one fake CPU device per worker when running on CPU
      # (before the backend starts; it does not affect GPU backends).
      workers = cluster_lib.parse_cluster(config.cluster).num_workers
      jax.config.update("jax_num_cpu_devices", workers)
    try:
      train_lib.train_and_evaluate(config, FLAGS.out_dir)
    except FloatingPointError as e:  # diverged: not bad input, still a fail
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(1) from None
    except coordination.CoordinationError as e:
      # The processes disagree, or another failed while planning: the same
      # line on every process.
      print(f"error: {e}", file=sys.stderr, flush=True)
      raise SystemExit(1) from None


if __name__ == "__main__":
  flags.mark_flags_as_required(["out_dir"])
  app.run(main)
