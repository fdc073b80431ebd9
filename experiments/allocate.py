r"""Allocate per-device precision plans for a hybrid cluster (QSync).

Usage:
  python -m experiments.allocate --model=resnet50 \
      --model_kwargs='{"image_size": 224, "cifar_stem": false, "num_classes": 1000}' \
      --score_model_kwargs='{"width": 8, "image_size": 8, "in_channels": 1}' \
      --dataset=digits --cluster=v100:8,t4:8 --batch_size=32 \
      --indicator=qsync --out=plans/resnet50

The indicator scores a model built with --score_model_kwargs (default: the
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
and prints a per-layer table. --optimizer_state_copies sets the optimizer the
predictor costs (2: Adam, 1: SGD with momentum, 0: plain SGD).
"""

import json

from absl import app
from absl import flags
from flax import nnx

from qsync_jax import cli
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax.allocation import pipeline

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "resnet50", "Built-in model or module:factory.")
flags.DEFINE_string("model_kwargs", "{}", "JSON config of the timing model.")
flags.DEFINE_string("score_model_kwargs", None,
                    "JSON config of the model the indicator scores "
                    "(default: --model_kwargs).")
flags.DEFINE_string("dataset", "digits", "Dataset for the indicator.")
flags.DEFINE_string("dataset_kwargs", "{}", "JSON dataset arguments.")
flags.DEFINE_string("cluster", "v100:8,t4:8", "Cluster, kind:count,...")
flags.DEFINE_integer("batch_size", 32, "Per-worker batch of the timing model.")
flags.DEFINE_string("indicator", "qsync", "Indicator method.")
flags.DEFINE_enum("method", "greedy", ["greedy", "memory", "ilp"],
                  "Allocator search.")
flags.DEFINE_list("candidates", ["int8", "fp16", "fp32"],
                  "Precisions the weak kinds may use.")
flags.DEFINE_list("memory_limit", [], "KIND=GiB limits (default: the "
                  "catalog's device memory).")
flags.DEFINE_float("compression", None, "Instead of --memory_limit: save this "
                   "fraction of the weak kinds' FP32 residual bytes.")
flags.DEFINE_integer("num_batches", 4, "Indicator batches.")
flags.DEFINE_integer("score_batch_size", 32, "Indicator batch size.")
flags.DEFINE_string("scores", None, "Load indicator scores from this JSON.")
flags.DEFINE_integer("optimizer_state_copies", 2,
                     "Float32 copies of the parameters the optimizer keeps: "
                     "2 for Adam(W) (QSync trains BERT with AdamW), 1 for "
                     "SGD with momentum (QSync's CNNs), 0 for plain SGD.")
flags.DEFINE_integer("seed", 0, "Model and indicator seed.")
flags.DEFINE_string("out", None, "Output directory.")


def _json_flag(name):
  try:
    return json.loads(getattr(FLAGS, name))
  except json.JSONDecodeError as e:
    raise ValueError(f"--{name} is not JSON: {e}") from None


def _memory_limits(values):
  limits = {}
  for value in values:
    kind, sep, gib = value.partition("=")
    try:
      limits[kind.strip().lower()] = float(gib) * 2**30
    except ValueError:
      sep = ""
    if not sep:
      raise ValueError(f"--memory_limit={value!r}: expected KIND=GiB, e.g. "
                       "t4=12")
  return limits


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  with cli.bad_input_exits():
    factory = models_lib.load_model_factory(FLAGS.model)
    model_kwargs = _json_flag("model_kwargs")
    timing_model = factory(rngs=nnx.Rngs(FLAGS.seed), **model_kwargs)
    if FLAGS.scores:
      with open(FLAGS.scores) as f:
        loaded = json.load(f)
      scores = loaded.get("values", loaded)
      name = loaded.get("method", FLAGS.indicator)
    else:
      score_kwargs = (model_kwargs if FLAGS.score_model_kwargs is None
                      else _json_flag("score_model_kwargs"))
      score_model = factory(rngs=nnx.Rngs(FLAGS.seed), **score_kwargs)
      dataset = data_lib.load_dataset(FLAGS.dataset,
                                      **_json_flag("dataset_kwargs"))
      scores = pipeline.compute_scores(
          score_model, dataset, FLAGS.indicator,
          num_batches=FLAGS.num_batches, batch_size=FLAGS.score_batch_size,
          seed=FLAGS.seed).values
      name = FLAGS.indicator
    result = pipeline.plan_cluster(
        timing_model, FLAGS.cluster, scores, FLAGS.batch_size,
        indicator_name=name, method=FLAGS.method,
        memory_limits=_memory_limits(FLAGS.memory_limit) or None,
        compression=FLAGS.compression, candidates=FLAGS.candidates,
        optimizer_state_copies=FLAGS.optimizer_state_copies)
    summary = pipeline.write(result, FLAGS.out)
  print(result.table())
  print(f"\nsearch {summary['search_time_s']:.3f} s, {summary['trials']} "
        f"trials; quantized layers {summary['quantized_layers']}")
  if summary["training_pace_s"] is not None:
    print(f"training devices' pace (every worker a "
          f"{'/'.join(summary['training_kinds'])}): "
          f"{summary['training_pace_s'] * 1e3:.2f} ms"
          + ("; the weak kinds straggle even at their fastest plan"
             if summary["straggling"] else ""))
  for k, v in summary["predicted_step_time_s"].items():
    print(f"predicted step {k:14s} {v * 1e3:9.2f} ms")
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
