"""Default config of the main job: a small CNN on digits over v100:2,t4:2.

Run:
  python -m experiments.train --out_dir=/tmp/qsync_run
Override any field from the command line, e.g. --config.steps=100.
On a CPU-only machine the four workers are fake CPU devices, each labelled
with its kind; the T4 workers compute the precisions the allocator chose for
a T4 for real.
"""

import ml_collections

from qsync_jax import sensitivity
from qsync_jax.process import initialize


def get_config() -> ml_collections.ConfigDict:
  """Returns the default main-job config."""
  # Not type-safe: a config file's get_config() may write a whole number as
  # 1e3, or a string where a number goes; experiments.config_lib.parse
  # converts and checks every field once, naming the field that is wrong.
  config = ml_collections.ConfigDict(type_safe=False)
  config.model = "cnn"  # built-in name or package.module:factory
  config.model_kwargs = ml_collections.ConfigDict()
  # The objective: "" (classification / language modelling on (inputs,
  # labels)) or "package.module:loss_fn", a loss_fn(model, batch, rngs) ->
  # (loss, aux) or loss_fn(logits, labels) (qsync_jax.task.as_objective).
  config.loss_fn = ""
  config.dataset = "digits"
  config.dataset_kwargs = ml_collections.ConfigDict()
  config.cluster = "v100:2,t4:2"
  # Precision plans. "auto": the allocator chooses each device kind's plan
  # (QSync: indicator on the first training batches, each kind's profile
  # measured where it runs or from the GPU catalog (allocator.profiles),
  # greedy search, once for all processes); "manual": config.plans, a plan
  # per kind (a mapping, JSON text or a .json path; kinds not named train in
  # FP32). An FP16 layer turns on loss scaling.
  config.plan_mode = "auto"
  config.plans = ml_collections.ConfigDict()
  config.allocator = ml_collections.ConfigDict(type_safe=False)
  # The indicator method (qsync_jax.sensitivity.METHODS); the default,
  # "qsync_var", ranks layers best within each precision in
  # experiments.indicator_study; "qsync" is QSync's own formula.
  config.allocator.indicator = sensitivity.DEFAULT_METHOD
  config.allocator.method = "greedy"  # or "memory", "ilp"
  config.allocator.num_batches = 4
  config.allocator.compression = ml_collections.config_dict.placeholder(float)
  config.allocator.candidates = ("int8", "fp16", "fp32")
  # The step is predicted for the CNN as it would be deployed on the real
  # GPUs (CIFAR-size images, wider layers, batch 128 per worker); the
  # digits-size twin trained here has the same layers and takes its plan.
  config.allocator.timing_model_kwargs = ml_collections.ConfigDict(
    dict(image_size=32, in_channels=3, widths=(128, 256), hidden=1024)
  )
  config.allocator.timing_batch_size = 128  # 0: config.batch_size
  # Where each kind's profile comes from. "auto": measured on the first
  # device of that kind in the run (by its process; the profiles are then
  # shared with every process), the GPU catalog for a kind no device is;
  # "measured": every kind measured on its first worker's device, whatever
  # that device is; "analytic": the catalog for every kind. Measured
  # profiles are cached in profile_cache_dir when it is set.
  config.allocator.profiles = "auto"
  config.allocator.profile_repeats = 5
  config.allocator.profile_cache_dir = ""
  config.batch_size = 32  # per worker; global = batch_size * workers
  config.batch_mode = "equal"  # or "dynamic": QSync's DB baseline
  config.speeds = "v100:1.3,t4:1.0"  # relative throughput, batch_mode=dynamic
  config.steps = 400
  config.optimizer = "adam"  # or "sgd" (with config.momentum)
  config.momentum = 0.0
  config.learning_rate = 3e-3
  # The learning rate: the official QSR code's schedules. "constant";
  # or, after a linear warmup from final_learning_rate to learning_rate over
  # warmup_steps, "cosine" or "linear" decay to final_learning_rate at
  # steps, "step" (learning_rate * lr_decay_factor ** i from the i-th of
  # lr_decay_steps, e.g. --config.lr_decay_steps=300,450) or "cosine_step"
  # (the cosine rounded to the nearest power of lr_round_base; needs
  # final_learning_rate > 0). QSR reads the same schedule in float64.
  config.lr_schedule = "constant"
  config.warmup_steps = 0
  config.final_learning_rate = 0.0
  config.lr_decay_steps = ml_collections.config_dict.placeholder(tuple)
  config.lr_decay_factor = 0.1
  config.lr_round_base = 2.0
  # Synchronization (QSR, arXiv 2310.14423): "dp" averages gradients every
  # step; "local" averages parameters every h_base steps; "postlocal" is dp
  # for switch_step steps, then local; "qsr" sets each round's period to
  # max(h_base, floor((alpha / lr) ** gamma)) (gamma 1: linear rule, 3:
  # cubic), which needs a decaying lr_schedule (e.g. cosine). Local rounds
  # keep the optimizer state local. alpha unset: learning_rate *
  # h_base ** (1 / gamma), the period h_base at the peak learning rate and
  # growing as it decays (qsync_jax.parallel.schedules.default_alpha).
  config.sync = "dp"
  config.h_base = 4
  config.alpha = ml_collections.config_dict.placeholder(float)
  config.gamma = 2.0
  config.switch_step = 0
  # What goes on the wire (Global-QSGD, arXiv 2305.18627): none (float32
  # mean), fp16, bf16, gqsgd (standard dithering, int8 sums that cannot
  # wrap), gqsgd_exp (exponential dithering), qsgd (per-worker scales,
  # all-gather), powersgd (rank-r factors, PowerSGD: compress_kwargs.rank,
  # .cols, .warm_start: start from the last call's Q, default true).
  # compress_kwargs sets the strategy's fields, e.g.
  # --config.compress_kwargs.wire=int16 (gqsgd's int8 or int16 sums); the
  # known ones are declared unset (the strategy's default) so that the
  # locked config takes them from the command line.
  config.compress = "none"
  config.compress_kwargs = ml_collections.ConfigDict(
    dict(
      wire=ml_collections.config_dict.placeholder(str),
      bucket_size=ml_collections.config_dict.placeholder(int),
      levels=ml_collections.config_dict.placeholder(int),
      norm=ml_collections.config_dict.placeholder(str),
      noise=ml_collections.config_dict.placeholder(str),
      rank=ml_collections.config_dict.placeholder(int),
      cols=ml_collections.config_dict.placeholder(int),
      warm_start=ml_collections.config_dict.placeholder(bool),
    )
  )
  config.error_feedback = False
  config.seed = 0
  config.log_every = 50
  config.eval_every = 100
  # Evaluation's BatchNorm statistics (no effect without BatchNorm):
  # "reestimate" recomputes them for the evaluated (averaged) parameters on
  # bn_batches training batches split over the workers, as the official QSR
  # code does before every evaluation under every schedule; "average"
  # averages the workers' running statistics.
  config.bn_stats = "reestimate"
  config.bn_batches = 128
  # Optimizer-state fields averaged with the parameters at each sync of a
  # local schedule (the QSR code's optim_fields_to_average; default none),
  # e.g. --config.opt_fields_to_average=mu,nu (Adam) or trace (SGD momentum).
  config.opt_fields_to_average = ()
  # Outer optimizer at each parameter average of a local schedule: "none"
  # (the workers' mean) or "diloco" (DiLoCo, arXiv 2311.08105: SGD with
  # Nesterov momentum, outer_lr and outer_momentum, on anchor - mean).
  config.outer_optimizer = "none"
  config.outer_lr = 0.7
  config.outer_momentum = 0.9
  config.checkpoint_every = 100
  config.resume = False
  # The numerics self-check before training (qsync_jax.numerics.selfcheck):
  # each low-precision contraction the plans use (INT8 / FP8 dot and
  # convolution, FP16 / BF16, on the Pallas and XLA paths this device
  # takes), compiled on a device of each kind and compared with a float
  # reference within its error bound. "warn": a wrong one gets a warning
  # line and runs on a safe path (summary.json records both); "error": it
  # stops the run; "off": no check.
  config.numerics_check = "warn"
  # Multi-process runs (srun, mpirun, Kubernetes, explicit
  # --coordinator_address/--num_processes/--process_id, or python -m
  # qsync_jax.distributed): seconds to wait for every process to join, without
  # a heartbeat before a process counts as dead, at the shutdown barrier and
  # (planning_timeout_s) for another process's profile or plans;
  # local_devices "auto" (every device of a node that runs one process, else
  # one device per process), "one" or "all". Not part of the agreement check.
  # The timeouts' defaults are the library's (initialize() without them).
  config.distributed = ml_collections.ConfigDict(
    dict(
      initialization_timeout_s=initialize.INITIALIZATION_TIMEOUT_S,
      heartbeat_timeout_s=initialize.HEARTBEAT_TIMEOUT_S,
      shutdown_timeout_s=initialize.SHUTDOWN_TIMEOUT_S,
      local_devices="auto",
      # The longest wait for another process's profile or process 0's plans.
      planning_timeout_s=900,
      # The run's layout (--coordinator_address, --num_processes,
      # --process_id); unset: from the launcher.
      coordinator_address=ml_collections.config_dict.placeholder(str),
      num_processes=ml_collections.config_dict.placeholder(int),
      process_id=ml_collections.config_dict.placeholder(int),
    )
  )
  return config
