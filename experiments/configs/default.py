"""Default config of the main job: a small CNN on digits with a mixed plan.

Run:
  python -m experiments.train --out_dir=/tmp/qsync_run
Override any field from the command line, e.g. --config.steps=100.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default main-job config."""
  config = ml_collections.ConfigDict()
  config.model = "cnn"            # built-in name or package.module:factory
  config.model_kwargs = ml_collections.ConfigDict()
  config.dataset = "digits"
  config.dataset_kwargs = ml_collections.ConfigDict()
  config.device_kind = "t4"       # the plan is validated against this kind
  # Half the layers INT8 (the convolutions); the fc layer FP16; the head
  # stays FP32 because no rule names it.
  config.plan = ml_collections.ConfigDict({
      "rules": [[r"conv\d", "int8"], ["fc", "fp16"]],
      "default": "fp32",
  })
  config.plan_file = ""            # a plan JSON file; replaces config.plan
  config.batch_size = 64
  config.steps = 400
  config.learning_rate = 3e-3
  config.seed = 0
  config.log_every = 100
  return config
