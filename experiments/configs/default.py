"""Default config of the main job: a small CNN on digits over v100:2,t4:2.

Run:
  python -m experiments.train --out_dir=/tmp/qsync_run
Override any field from the command line, e.g. --config.steps=100.
On a CPU-only machine the four workers are fake CPU devices, each labelled
with its kind; the T4 workers compute their plan's precisions for real.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default main-job config."""
  config = ml_collections.ConfigDict()
  config.model = "cnn"            # built-in name or package.module:factory
  config.model_kwargs = ml_collections.ConfigDict()
  config.dataset = "digits"
  config.dataset_kwargs = ml_collections.ConfigDict()
  config.cluster = "v100:2,t4:2"
  # Plans per device kind (a plan mapping, JSON text or a .json path); kinds
  # not named train in FP32. Until the allocator lands the T4 plan is written
  # by hand: its two convolutions INT8, the fc layer FP16 (the head stays
  # FP32 because no rule names it). An FP16 layer turns on loss scaling.
  config.plans = ml_collections.ConfigDict({
      "t4": {"rules": [[r"conv\d", "int8"], ["fc", "fp16"]],
             "default": "fp32"},
  })
  config.batch_size = 32          # per worker; global = batch_size * workers
  config.batch_mode = "equal"     # or "dynamic": QSync's DB baseline
  config.speeds = "v100:1.3,t4:1.0"  # relative throughput, batch_mode=dynamic
  config.steps = 400
  config.learning_rate = 3e-3
  config.lr_schedule = "constant"  # or "cosine" (with warmup_steps)
  config.warmup_steps = 0
  config.seed = 0
  config.log_every = 50
  config.eval_every = 100
  config.checkpoint_every = 100
  config.resume = False
  return config
