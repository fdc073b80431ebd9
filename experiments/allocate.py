r"""Allocate per-device precision plans for a hybrid cluster (QSync).

Usage:
  python -m experiments.allocate --model=resnet50 \
      --model_kwargs='{"image_size": 224, "cifar_stem": false, "num_classes": 1000}' \
      --score_model_kwargs='{"width": 8, "image_size": 8, "in_channels": 1}' \
      --dataset=digits --cluster=v100:8,t4:8 --batch_size=32 \
      --indicator=qsync --out=plans/resnet50

The indicator (--indicator, default qsync_var, the method that ranks layers
best within each precision in experiments.indicator_study; qsync is QSync's
own formula) scores a model built with --score_model_kwargs (default: the
same as --model_kwargs) on the first batches of --dataset; the timing model
(--model_kwargs) is traced at --batch_size per worker and costed with the
GPU catalog's analytic profiles for every kind of --cluster. Both must have
the same layer paths. --scores=FILE.json loads scores instead (the
scores.json this binary writes, or {"values": {layer: {precision: x}}}).

Writes to --out: <kind>.json (a PrecisionPlan per device kind, usable with
`experiments.train --plan=KIND=FILE`), scores.json and summary.json
{"search_time_s", "quantized_layers": {kind: n}, "indicator_sum": {kind: x},
"predicted_step_time_s": {"qsync", "fp32", "uniform_low", "dynamic_batch",
"training_only", "qsync_shuffled"}, "predicted_memory_bytes": {same keys:
{kind: bytes}}, "baselines": {name: {"quantized_layers", "indicator_sum",
...}}, "optimizer_update_s": {kind: seconds}, ...},
and prints a per-layer table. With --link=1gbit [--latency=1ms]
[--topology=per_node|shared] it also predicts, for the cluster on that link,
the step time of each sync method (dp every step; local SGD and QSR
amortized over their periods, --sync_period, --total_steps) with each
averager (none, fp16, gqsgd, gqsgd_exp, qsgd, powersgd), prints the table
and the fastest, and writes them to summary.json under "sync" (accuracy is
not modelled). --optimizer_state_copies sets the optimizer the
predictor costs (2: Adam, 1: SGD with momentum, 0: plain SGD).

Bad input (a malformed or wrongly shaped --scores file, a batch size below 1,
an existing file as --out, ...) ends the binary with one line `error: ...`
and exit status 1 before anything is computed. So does a size this host's
memory cannot hold (a built-in dataset's arrays, --total_steps with --link,
the scored model's step from its shapes), checked before it is allocated.
"""

import math
import sys

from absl import app
from absl import flags
from flax import nnx

from experiments import config_fields
from qsync_jax import cli
from qsync_jax import data as data_lib
from qsync_jax import host_memory
from qsync_jax import models as models_lib
from qsync_jax import rundir
from qsync_jax import sensitivity
from qsync_jax.allocation import pipeline
from qsync_jax.allocation import sync_methods
from qsync_jax.data import sizes as data_sizes
from qsync_jax.launch import links
from qsync_jax.models import sizes as model_sizes
from qsync_jax.numerics.precision import Precision
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.predictor import communication
from qsync_jax.predictor import host_limits

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "resnet50", "Built-in model or module:factory.")
flags.DEFINE_string("model_kwargs", "{}", "JSON config of the timing model.")
flags.DEFINE_string(
  "score_model_kwargs",
  None,
  "JSON config of the model the indicator scores (default: --model_kwargs).",
)
flags.DEFINE_string("dataset", "digits", "Dataset for the indicator.")
flags.DEFINE_string("dataset_kwargs", "{}", "JSON dataset arguments.")
flags.DEFINE_string("cluster", "v100:8,t4:8", "Cluster, kind:count,...")
flags.DEFINE_integer("batch_size", 32, "Per-worker batch of the timing model.")
flags.DEFINE_string(
  "indicator",
  sensitivity.DEFAULT_METHOD,
  "Indicator method (qsync_jax.sensitivity.METHODS); qsync is QSync's.",
)
flags.DEFINE_enum(
  "method", "greedy", ["greedy", "memory", "ilp"], "Allocator search."
)
flags.DEFINE_list(
  "candidates", ["int8", "fp16", "fp32"], "Precisions the weak kinds may use."
)
flags.DEFINE_list(
  "memory_limit", [], "KIND=GiB limits (default: the catalog's device memory)."
)
flags.DEFINE_float(
  "compression",
  None,
  "Instead of --memory_limit: save this "
  "fraction of the weak kinds' FP32 residual bytes.",
)
flags.DEFINE_integer("num_batches", 4, "Indicator batches.")
flags.DEFINE_integer("score_batch_size", 32, "Indicator batch size.")
flags.DEFINE_string("scores", None, "Load indicator scores from this JSON.")
flags.DEFINE_integer(
  "optimizer_state_copies",
  2,
  "Float32 copies of the parameters the optimizer keeps: "
  "2 for Adam(W) (QSync trains BERT with AdamW), 1 for "
  "SGD with momentum (QSync's CNNs), 0 for plain SGD.",
)
flags.DEFINE_integer("seed", 0, "Model and indicator seed.")
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_string(
  "link",
  None,
  "Link rate between workers (1gbit, "
  "100mbit): also compare sync methods and averagers.",
)
flags.DEFINE_string(
  "latency", "0ms", "With --link: one-way delay from a worker to the switch."
)
flags.DEFINE_enum(
  "topology",
  "per_node",
  list(links.TOPOLOGIES),
  "With --link: a link each or one shared link.",
)
flags.DEFINE_integer(
  "sync_period", 8, "With --link: local SGD's period and QSR's smallest one."
)
flags.DEFINE_integer(
  "total_steps",
  1000,
  "With --link: training steps (QSR's "
  "periods grow as the cosine learning rate decays).",
)


# Integer flags and their least value.
_LEAST = {
  "batch_size": 1,
  "score_batch_size": 1,
  "num_batches": 1,
  "optimizer_state_copies": 0,
  "seed": 0,
  "sync_period": 1,
  "total_steps": 1,
}
_SCORES_SHAPE = (
  'expected {layer: {precision: number}} or {"values": '
  '{layer: {precision: number}}, "method": name}'
)


def _check_numeric_flags():
  """Raises ``ValueError`` naming the first numeric flag out of range."""
  for name, least in _LEAST.items():
    if getattr(FLAGS, name) < least:
      raise ValueError(
        f"--{name} must be >= {least}, got {getattr(FLAGS, name)}"
      )
  c = FLAGS.compression
  if c is not None and not (math.isfinite(c) and 0 <= c <= 1):
    raise ValueError(f"--compression must be a fraction in [0, 1], got {c}")


# Flags that only take effect with another: (flag, the flag it needs, why).
_NEEDS = (
  ("latency", "link", "it is the link's delay"),
  ("topology", "link", "it is the link's layout"),
  ("sync_period", "link", "only the sync-method comparison reads it"),
  ("total_steps", "link", "only the sync-method comparison reads it"),
)
# Flags that only shape the scores the binary computes: --scores loads them.
_SCORING = ("score_model_kwargs", "num_batches", "score_batch_size")


def _check_flag_combinations():
  """Raises ``ValueError`` for a flag that needs a flag not given, and for
  --cluster=auto (a run's devices; this binary plans named kinds); says in
  one warning line which flags --scores makes this binary ignore."""
  for name, needs, why in _NEEDS:
    if FLAGS[name].present and getattr(FLAGS, needs) is None:
      raise ValueError(f"--{name} needs --{needs} ({why}); add --{needs}")
  if FLAGS.scores is not None:
    given = [f"--{n}" for n in _SCORING if FLAGS[n].present]
    if given:
      print(
        f"warning: {', '.join(given)} not used: "
        + ("it shapes" if len(given) == 1 else "they shape")
        + " the scores this binary computes, and --scores loads them",
        file=sys.stderr,
      )
  if FLAGS.cluster.strip().lower() == "auto":
    raise ValueError(
      "--cluster=auto (the devices a run sees) is experiments.train's; "
      "name the kinds to plan for, e.g. --cluster=v100:8,t4:8"
    )


def _kwargs_flag(name):
  """The JSON object of flag ``--name``: keyword arguments."""
  value = config_fields.read_json(getattr(FLAGS, name), f"--{name}")
  if not isinstance(value, dict):
    raise ValueError(
      f"--{name} must be a JSON object of keyword arguments, "
      f"got a {type(value).__name__}"
    )
  return value


def _load_scores(path):
  """The ``{layer: {precision: score}}`` table of a scores file and its method.

  Raises:
    FileNotFoundError: no such file.
    ValueError: malformed JSON or not the scores' shape.
  """
  what = f"--scores file {path!r}"
  loaded = config_fields.read_json(
    config_fields.read_file(path, "--scores file"), what
  )
  if not isinstance(loaded, dict):
    raise ValueError(f"{what} holds a {type(loaded).__name__}; {_SCORES_SHAPE}")
  values = loaded.get("values", loaded)
  method = loaded.get("method", FLAGS.indicator)
  if not isinstance(values, dict) or not values:
    raise ValueError(f"{what} has no layers; {_SCORES_SHAPE}")
  if not isinstance(method, str):
    raise ValueError(
      f"{what}: its method is a {type(method).__name__}, not a name"
    )
  for layer, row in values.items():
    if not isinstance(row, dict) or not row:
      raise ValueError(
        f"{what}: layer {layer!r} maps to a "
        f"{type(row).__name__}, not {{precision: number}}; "
        f"{_SCORES_SHAPE}"
      )
    for precision, x in row.items():
      try:
        Precision.parse(precision)
      except ValueError as e:
        raise ValueError(f"{what}: layer {layer!r}: {e}") from None
      if not (
        isinstance(x, (int, float))
        and not isinstance(x, bool)
        and math.isfinite(x)
      ):
        raise ValueError(
          f"{what}: the score of layer {layer!r} at "
          f"{precision} is {x!r}, not a finite number"
        )
  return values, method


def _memory_limits(values):
  limits = {}
  for value in values:
    kind, sep, gib = value.partition("=")
    if kind.strip().lower() in limits:
      raise ValueError(
        f"--memory_limit gives {kind.strip().lower()} two limits; give one"
      )
    try:
      gib = float(gib)
    except ValueError:
      sep = ""
    if not sep:
      raise ValueError(
        f"--memory_limit={value!r}: expected KIND=GiB, e.g. t4=12"
      )
    if not (math.isfinite(gib) and gib > 0):
      raise ValueError(
        f"--memory_limit={value!r}: the limit must be a positive number of GiB"
      )
    limits[kind.strip().lower()] = gib * 2**30
  return limits


def _check_sizes(model_kwargs, score_kwargs, dataset_kwargs):
  """Checks the sizes the flags give, before anything is built.

  The models' size arguments are positive integers; the cluster names at
  most :data:`qsync_jax.parallel.cluster.MAX_WORKERS` workers; a built-in
  dataset's arrays and, with ``--link``, each sync method's table of
  ``--total_steps`` fit this host's memory; the indicator's batches fit the
  dataset.

  Raises:
    ValueError: naming the flag, what it needs and the limit.
  """
  model_sizes.check_model_kwargs(FLAGS.model, model_kwargs, "--model_kwargs")
  model_sizes.check_model_kwargs(
    FLAGS.model, score_kwargs, "--score_model_kwargs"
  )
  cluster_lib.parse_cluster(FLAGS.cluster)
  if FLAGS.link:
    host_memory.check(
      f"--total_steps={FLAGS.total_steps}",
      FLAGS.total_steps * host_limits.STEP_BYTES,
      "each sync method's table of steps, "
      f"{host_limits.STEP_BYTES} bytes a step",
    )
  if FLAGS.scores and FLAGS.model in models_lib.MODELS:
    return  # no dataset is loaded
  size = data_sizes.dataset_size(
    FLAGS.dataset, dataset_kwargs, "--dataset_kwargs"
  )
  if size is None:
    return
  host_memory.check(
    f"--dataset={FLAGS.dataset} with {dataset_kwargs or 'its defaults'}",
    size.bytes,
    "its arrays while the loader makes them",
  )
  need = FLAGS.num_batches * FLAGS.score_batch_size
  if not FLAGS.scores and need > size.train:
    raise ValueError(
      f"--num_batches={FLAGS.num_batches} of --score_batch_size="
      f"{FLAGS.score_batch_size} need {need} training examples, more than "
      f"the {size.train} of dataset {FLAGS.dataset!r}"
    )


def _check_score_model(dataset, score_kwargs):
  """Checks, before it is built, that the scored model's step fits this
  host's memory (its shapes from ``nnx.eval_shape``).

  Raises:
    ValueError: naming the model, its arguments and batch, the estimate
      and the limit.
  """
  model = models_lib.without_weights(
    lambda: models_lib.build_model(
      FLAGS.model,
      rngs=nnx.Rngs(FLAGS.seed),
      data_kwargs=dataset.model_kwargs(),
      sample_input=dataset.x_train[:2],
      **score_kwargs,
    )
  )
  step = host_limits.step_memory(
    model,
    (dataset.x_train[:1], dataset.y_train[:1]),
    FLAGS.score_batch_size,
    optimizer_state_copies=0,
  )
  host_memory.check(
    f"--model={FLAGS.model} with --score_model_kwargs "
    f"{score_kwargs or 'of --model_kwargs'} at --score_batch_size="
    f"{FLAGS.score_batch_size}",
    step.at(FLAGS.score_batch_size)
    + float(dataset.x_train.nbytes + dataset.x_test.nbytes),
    "the scored model's parameters, gradients and activations, and the dataset",
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  with cli.bad_input_exits():
    # Every flag is checked before the models are built.
    _check_numeric_flags()
    _check_flag_combinations()
    link = (
      communication.Link.parse(FLAGS.link, FLAGS.latency, FLAGS.topology)
      if FLAGS.link
      else None
    )
    memory_limits = _memory_limits(FLAGS.memory_limit) or None
    model_kwargs = _kwargs_flag("model_kwargs")
    score_kwargs = (
      model_kwargs
      if FLAGS.score_model_kwargs is None
      else _kwargs_flag("score_model_kwargs")
    )
    dataset_kwargs = _kwargs_flag("dataset_kwargs")
    scores, name = (
      _load_scores(FLAGS.scores) if FLAGS.scores else (None, FLAGS.indicator)
    )
    _check_sizes(model_kwargs, score_kwargs, dataset_kwargs)
    # Only the timing model's shapes are used: built without its weights.
    timing_model = models_lib.without_weights(
      lambda: models_lib.build_model(
        FLAGS.model, rngs=nnx.Rngs(FLAGS.seed), **model_kwargs
      )
    )
    # A model without input_spec is traced on the dataset's inputs
    # (resized to --batch_size), the scored one sized for the dataset.
    needs_data = scores is None or not callable(
      getattr(timing_model, "input_spec", None)
    )
    dataset = (
      data_lib.load_dataset(FLAGS.dataset, **dataset_kwargs)
      if needs_data
      else None
    )
    sample_input = (
      None
      if dataset is None or callable(getattr(timing_model, "input_spec", None))
      else dataset.x_train[:1]
    )
    if scores is None:
      _check_score_model(dataset, score_kwargs)
    rundir.make_out_dir(FLAGS.out, "--out")
    if scores is None:
      score_model = models_lib.build_model(
        FLAGS.model,
        rngs=nnx.Rngs(FLAGS.seed),
        data_kwargs=dataset.model_kwargs(),
        sample_input=dataset.x_train[:2],
        **score_kwargs,
      )
      scores = pipeline.compute_scores(
        score_model,
        dataset,
        FLAGS.indicator,
        num_batches=FLAGS.num_batches,
        batch_size=FLAGS.score_batch_size,
        seed=FLAGS.seed,
      ).values
    result = pipeline.plan_cluster(
      timing_model,
      FLAGS.cluster,
      scores,
      FLAGS.batch_size,
      indicator_name=name,
      method=FLAGS.method,
      memory_limits=memory_limits,
      compression=FLAGS.compression,
      candidates=FLAGS.candidates,
      optimizer_state_copies=FLAGS.optimizer_state_copies,
      sample_input=sample_input,
    )
    summary = pipeline.write(result, FLAGS.out)
    sync = (
      None
      if link is None
      else sync_methods.compare_for(
        result,
        link,
        period=FLAGS.sync_period,
        total_steps=FLAGS.total_steps,
        out_dir=FLAGS.out,
      )
    )
  print(result.table())
  print(
    f"\nsearch {summary['search_time_s']:.3f} s, {summary['trials']} "
    f"trials; quantized layers {summary['quantized_layers']}"
  )
  if summary["training_pace_s"] is not None:
    print(
      f"training devices' pace (every worker a "
      f"{'/'.join(summary['training_kinds'])}): "
      f"{summary['training_pace_s'] * 1e3:.2f} ms"
      + (
        "; the weak kinds straggle even at their fastest plan"
        if summary["straggling"]
        else ""
      )
    )
  for k, v in summary["predicted_step_time_s"].items():
    print(f"predicted step {k:14s} {v * 1e3:9.2f} ms")
  if sync is not None:
    print(f"\nsync methods on {FLAGS.link} {FLAGS.topology}:\n{sync.table()}")
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
