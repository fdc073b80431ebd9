r"""The device report: one command for a GPU's few minutes.

Usage:
  python -m experiments.device_report --out=DIR [--platform=gpu|cpu] \
      [--budget_s=480] [--sections=gpu_tests,numerics,...]

Runs the ``gpu`` tests, every low-precision contraction compiled against op
by op (and what isolates a wrong one), GEMM and convolution throughput per
precision at the sizes of real layers, the predictor's step-time error for
ResNet-18 and the GPT example, and the main job's planned step against
all-FP32 and all-BF16, each section within its share of ``--budget_s``
(experiments.benches.device_report). Writes DIR/report.json and
DIR/report.md (the tables for the results page) after every section.
``--platform=cpu`` is the dry run: tiny sizes on the CPU.
"""

from absl import app
from absl import flags
import jax

from experiments.benches import device_report
from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "The report's directory.")
flags.DEFINE_enum(
  "platform", "gpu", ["gpu", "cpu"], "gpu: real sizes; cpu: a dry run."
)
flags.DEFINE_float("budget_s", 480.0, "Seconds the whole report may take.")
flags.DEFINE_list("sections", None, "A subset of the sections (default all).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.platform == "cpu":  # before the backend starts: a dry run
    jax.config.update("jax_platforms", "cpu")
  cli.start_binary()
  with cli.bad_input_exits():
    device_report.run(
      FLAGS.out,
      platform=FLAGS.platform,
      budget_s=FLAGS.budget_s,
      sections=FLAGS.sections,
    )


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
