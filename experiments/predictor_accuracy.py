r"""Predicted against measured step time and memory on the device at hand.

Usage:
  python -m experiments.predictor_accuracy --out=predictor_accuracy.json
  python -m experiments.predictor_accuracy --model=mypkg.models:make_net \
      --out=mine.json
  python -m experiments.predictor_accuracy --model=examples.gpt:make_gpt \
      --datasets='{"examples.gpt:make_gpt": "text"}' --out=gpt.json

For each model (default: the small CNN, the BERT-style encoder and a
ResNet-18 that nothing was tuned on) and each of 8 plans (uniform FP32, BF16,
FP16, INT8 and 4 mixed ones), profiles the model's pieces on this host,
predicts the HybridTrainer step with 1 and 4 workers (fake devices of this
host) and measures those steps in the same interleaved timing rounds (one
phase per worker count and --plans_per_phase plans).

--model takes built-in names or package.module:factory specs (a callable
taking rngs and the --model_kwargs entry of that spec, returning a model).
A model named in --datasets (a built-in dataset or package.module:factory, as
the main job's --config.dataset) is sized for that data, as the main job
sizes it, and steps on its first training examples with the loss of
--loss_fns (default cross-entropy): it needs no special method. Any other
model needs input_spec(batch_size) (and a `task` attribute for language
modelling) and steps on a random batch.

Writes --out (JSON): {"cases": [{"model", "plan", "workers", "predicted_s",
"measured_s", "rel_error", "predicted_memory_bytes", "measured_memory_bytes",
"memory_rel_error", "uniform", "fitted", "steal_fraction"}],
"mean_abs_rel_error", "max_abs_rel_error", "unfitted_mean_abs_rel_error",
"unfitted_max_abs_rel_error" (the mixed plans: the profile times the
uniform steps, for the step's fixed part and the host work a pass hides),
"max_abs_memory_rel_error", "steal_fraction",
"simulation_speed": {"simulate_ms", ...}, ...}
and, next to it, a PNG
scatter of predicted against measured step times.
"""

import json
import os

from absl import app
from absl import flags
import jax

from experiments.studies import predictor_accuracy
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_list(
  "model",
  ["cnn", "bert", "resnet18"],
  "Built-in models or package.module:factory specs.",
)
flags.DEFINE_string(
  "model_kwargs",
  "{}",
  "JSON {model spec: config overrides} (merged over the built-in defaults).",
)
flags.DEFINE_string("batch_sizes", "{}", "JSON {model spec: batch size}.")
flags.DEFINE_string(
  "datasets",
  "{}",
  "JSON {model spec: dataset}: a built-in dataset or package.module:factory "
  "the model is sized for and steps on.",
)
flags.DEFINE_string(
  "dataset_kwargs", "{}", "JSON {model spec: the dataset's keyword arguments}."
)
flags.DEFINE_string(
  "loss_fns",
  "{}",
  "JSON {model spec: package.module:fn}, the loss (default cross-entropy).",
)
flags.DEFINE_list("workers", ["1", "4"], "Worker counts (fake devices).")
flags.DEFINE_integer("rounds", 15, "Interleaved timing rounds.")
flags.DEFINE_integer("burst", 5, "Calls per burst (the fastest counts).")
flags.DEFINE_integer(
  "plans_per_phase",
  4,
  "Real steps timed alongside one profile (fewer: fewer "
  "executables alive at once).",
)
flags.DEFINE_string(
  "speed_model",
  "resnet50",
  "Also time simulating one plan of this model on v100:8,t4:8 (empty: skip).",
)
flags.DEFINE_string("out", None, "Output JSON path.")
flags.mark_flag_as_required("out")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  with cli.bad_input_exits():
    workers = [int(w) for w in FLAGS.workers]
    jax.config.update("jax_num_cpu_devices", max(workers))
    result = predictor_accuracy.evaluate(
      FLAGS.model,
      model_kwargs=json.loads(FLAGS.model_kwargs),
      batch_sizes=json.loads(FLAGS.batch_sizes),
      datasets=json.loads(FLAGS.datasets),
      dataset_kwargs=json.loads(FLAGS.dataset_kwargs),
      loss_fns=json.loads(FLAGS.loss_fns),
      workers=workers,
      rounds=FLAGS.rounds,
      burst=FLAGS.burst,
      plans_per_phase=FLAGS.plans_per_phase,
    )
    if FLAGS.speed_model:
      result["simulation_speed"] = predictor_accuracy.simulation_speed(
        FLAGS.speed_model
      )
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=1)
  predictor_accuracy.plot(result, os.path.splitext(FLAGS.out)[0] + ".png")
  unfitted = (
    ""
    if result["unfitted_mean_abs_rel_error"] is None
    else f"; mixed plans alone (unfitted): mean "
    f"{result['unfitted_mean_abs_rel_error']:.4f}, max "
    f"{result['unfitted_max_abs_rel_error']:.4f}"
  )
  print(
    f"mean |rel error| {result['mean_abs_rel_error']:.4f}, max "
    f"{result['max_abs_rel_error']:.4f}{unfitted}, max memory "
    f"|rel error| "
    f"{result['max_abs_memory_rel_error']:.4f}; the hypervisor stole "
    f"{result['steal_fraction']:.1%} of the CPU while timing"
  )
  if "simulation_speed" in result:
    speed = result["simulation_speed"]
    print(
      f"simulating one plan of {speed['model']} ({speed['layers']} "
      f"layers) on {speed['cluster']}: {speed['simulate_ms']:.3f} ms"
    )


if __name__ == "__main__":
  app.run(main)
