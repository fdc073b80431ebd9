r"""Judge sensitivity indicators against measured per-layer sensitivity.

Usage:
  python -m experiments.indicator_study --model=resnet18 --dataset=digits \
      --model_kwargs='{"width": 16, "in_channels": 1, "image_size": 8}' \
      --out=indicator_resnet18.json
  python -m experiments.indicator_study --model=bert --dataset=text \
      --model_kwargs='{"vocab_size": 256, "max_len": 64, "num_classes": 5}' \
      --dataset_kwargs='{"seq_len": 64, "max_bytes": 400000}' \
      --out=indicator_bert.json

--model takes a built-in name or package.module:factory: a callable taking
rngs (and --model_kwargs) that returns a model. It is sized for the dataset
(input shape, channels, classes go where the model takes them) and traced
on the dataset's batches; it needs no input_spec. A `task` attribute
("classification" or "lm") is optional (default classification).
A classification model on the byte-level text dataset classifies the byte
after each window (0 letter, 1 digit, 2 whitespace, 3 punctuation, 4 other).

Writes --out (JSON): {"layers": [...], "precisions": [...], "num_batches",
"train_step_s", "model", "dataset", "measured": {"grad", "loss"},
"methods": {name: {...}}} and, next to it, a PNG bar chart of the scores per
layer (one panel per method, normalized, labelled with its correlations).
Each method's entry holds:

* "spearman_vs_measured", "spearman_vs_measured_loss": the Spearman
  correlation of its scores with the measured gradient error and loss
  change over all (layer, precision) pairs below FP32. It is dominated by
  the precisions themselves: scores that rank every INT8 pair above every
  FP16 pair reach a high figure whatever their order of the layers.
* "within_precision": {precision: {"num_layers", "spearman_vs_measured",
  "spearman_vs_measured_loss", "null_reasons"}}: the same correlations over
  the layers scored at that precision only, which is what the allocator
  acts on (it chooses which layers go to a precision).
* "mean_within_vs_measured", "mean_within_vs_measured_loss": their mean
  over the precisions.
* "null_reasons": {key: reason} for the overall figures.
* "time_s", "per_batch_s": the method's wall time, compilation included,
  and its time per batch once compiled (null for the methods without a
  capture pass); "scores": {layer: {precision: score}}.

A correlation is null, never NaN, where it is undefined: fewer than 3
layers at that precision, or a constant vector; "null_reasons" (overall, and
in each within_precision entry) says which.
"""

import dataclasses
import json

from absl import app
from absl import flags
from flax import nnx
import numpy as np

from experiments.studies import indicator
from qsync_jax import cli
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import sensitivity
from qsync_jax.allocation import pipeline
from qsync_jax.task import losses

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "resnet18", "Built-in model or module:factory.")
flags.DEFINE_string("model_kwargs", "{}", "JSON config overrides.")
flags.DEFINE_string("dataset", "digits", "Dataset name (qsync_jax.data).")
flags.DEFINE_string("dataset_kwargs", "{}", "JSON dataset arguments.")
flags.DEFINE_list("precisions", ["int8", "fp16", "bf16"], "Precisions.")
flags.DEFINE_list("methods", list(sensitivity.METHODS), "Methods to judge.")
flags.DEFINE_integer("num_batches", 4, "Batches for indicators and truth.")
flags.DEFINE_integer("batch_size", 64, "Batch size.")
flags.DEFINE_integer("seed", 0, "Model and method seed.")
flags.DEFINE_string("out", None, "Output JSON path.")


def _batches(model, dataset, num_batches, batch_size):
  task = getattr(model, "task", "classification")
  if task == "classification" and dataset.task == "lm":
    dataset = dataclasses.replace(
      dataset,
      y_train=data_lib.byte_category(dataset.y_train[:, -1]),
      y_test=data_lib.byte_category(dataset.y_test[:, -1]),
    )
  return pipeline.indicator_batches(dataset, num_batches, batch_size)


def _fmt(rho) -> str:
  return "  n/a" if rho is None else f"{rho:+.2f}"


def _panel_title(r: dict, precisions: list[str]) -> str:
  """A method's overall and within-precision correlations, for its panel."""
  within = ", ".join(
    f"{p} {_fmt(r['within_precision'][p]['spearman_vs_measured'])}"
    for p in precisions
    if p in r["within_precision"]
  )
  return (
    f"Spearman vs gradient error: all pairs "
    f"{_fmt(r['spearman_vs_measured'])}; within {within}"
  )


def table(result: dict) -> str:
  """The printed table: Spearman vs gradient error (vs loss change).

  One row per method: the overall figure, the figure within each precision
  and their mean, then the method's time.
  """
  within = {
    p for r in result["methods"].values() for p in r["within_precision"]
  }
  precs = [p for p in result["precisions"] if p in within]
  head = ["method", "all", *[f"within {p}" for p in precs], "mean within"]
  rows = [[*head, "time"]]
  for name, r in result["methods"].items():
    cells = [(r["spearman_vs_measured"], r["spearman_vs_measured_loss"])]
    cells += [
      (
        r["within_precision"][p]["spearman_vs_measured"],
        r["within_precision"][p]["spearman_vs_measured_loss"],
      )
      if p in r["within_precision"]
      else (None, None)
      for p in precs
    ]
    cells.append(
      (r["mean_within_vs_measured"], r["mean_within_vs_measured_loss"])
    )
    per_batch = r["per_batch_s"]
    cost = (
      ""
      if per_batch is None
      else f", {per_batch / result['train_step_s']:.2f} steps/batch"
    )
    rows.append(
      [
        name,
        *[f"{_fmt(g)} ({_fmt(l)})" for g, l in cells],
        f"{r['time_s']:.1f} s{cost}",
      ]
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
  nulls = [
    f"{name} {p}: {reason}"
    for name, r in result["methods"].items()
    for p, w in r["within_precision"].items()
    for reason in dict.fromkeys(w["null_reasons"].values())
  ]
  return "\n".join(
    [
      "Spearman vs measured gradient error (vs loss change)",
      *[l.rstrip() for l in lines],
      *[f"n/a: {n}" for n in nulls],
    ]
  )


def plot(result: dict, path: str) -> None:
  """Bar chart: each method's scores per layer (INT8 or first precision)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  layers = result["layers"]
  panels = {
    "measured (grad error)": result["measured"]["grad"]["values"],
    **{m: r["scores"] for m, r in result["methods"].items()},
  }
  fig, axes = plt.subplots(
    len(panels),
    1,
    figsize=(max(8, len(layers) * 0.4), 2.2 * len(panels)),
    sharex=True,
  )
  width = 0.8 / len(result["precisions"])
  for ax, (name, values) in zip(np.atleast_1d(axes), panels.items()):
    for k, prec in enumerate(result["precisions"]):
      v = np.array([values[l].get(prec, 0.0) for l in layers])
      top = v.max() if v.max() > 0 else 1.0
      ax.bar(np.arange(len(layers)) + k * width, v / top, width, label=prec)
    ax.set_ylabel(name, fontsize=8)
    if name in result["methods"]:
      ax.set_title(
        _panel_title(result["methods"][name], result["precisions"]),
        fontsize=8,
        loc="left",
      )
  axes[0].legend(fontsize=7)
  axes[-1].set_xticks(np.arange(len(layers)))
  axes[-1].set_xticklabels(layers, rotation=90, fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  with cli.bad_input_exits():
    try:
      model_kwargs = json.loads(FLAGS.model_kwargs)
      dataset_kwargs = json.loads(FLAGS.dataset_kwargs)
    except json.JSONDecodeError as e:
      raise ValueError(
        f"--model_kwargs/--dataset_kwargs are not JSON: {e}"
      ) from None
    dataset = data_lib.load_dataset(FLAGS.dataset, **dataset_kwargs)
    model = models_lib.build_model(
      FLAGS.model,
      rngs=nnx.Rngs(FLAGS.seed),
      data_kwargs=dataset.model_kwargs(),
      sample_input=dataset.x_train[:2],
      **model_kwargs,
    )
    batches = _batches(model, dataset, FLAGS.num_batches, FLAGS.batch_size)
    result = indicator.study(
      model,
      losses.cross_entropy,
      batches,
      FLAGS.precisions,
      FLAGS.methods,
      seed=FLAGS.seed,
    )
    result["model"], result["dataset"] = FLAGS.model, FLAGS.dataset
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
    plot(result, FLAGS.out.rsplit(".", 1)[0] + ".png")
    print(f"train step {result['train_step_s'] * 1e3:.1f} ms")
    print(table(result))


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
