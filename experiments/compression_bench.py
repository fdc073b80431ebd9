r"""Time, wire bytes and error of every gradient-averaging strategy.

Usage:
  python -m experiments.compression_bench --out=compression_bench.json \
      [--sizes=1048576,4194304,16777216] [--repeats=11] \
      [--settings=fake_devices,multiprocess] [--num_workers=4] [--donate]

For each strategy of qsync_jax.comm (none = float32 mean, fp16, bf16, gqsgd,
gqsgd_int16, gqsgd_threefry, gqsgd_exp, qsgd) and each size, one all-reduce of
gradient-like float32 data over num_workers workers: fake CPU devices in this
process, and localhost processes with gloo collectives (see
qsync_jax.compression_bench). Writes JSON {"settings": {...}, "results":
[{setting, strategy, num_elements, time_s, cpu_s, wire_bytes, rel_error,
time_vs_fp32, ...}], "gqsgd_vs_fp32_time_ratio_16M_<setting>": float} and
prints one line per result. The goal: gqsgd at 16M floats in <= 0.4x the
float32 mean's time in the multiprocess setting.
"""

import json

from absl import app
from absl import flags
import jax

from qsync_jax import cli
from qsync_jax import compression_bench

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output JSON file.")
flags.DEFINE_list("sizes", [str(d) for d in compression_bench.DEFAULT_SIZES],
                  "Vector lengths in float32 elements.")
flags.DEFINE_integer("repeats", compression_bench.DEFAULT_REPEATS,
                     "Timed rounds per case (median reported).")
flags.DEFINE_list("settings", list(compression_bench.SETTINGS),
                  "Subset of fake_devices,multiprocess.")
flags.DEFINE_integer("num_workers", 4, "Workers: fake devices or processes.")
flags.DEFINE_bool("donate", False,
                  "Each all-reduce takes its input buffer (as a training "
                  "step's dead gradient), so its output may reuse it.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Before anything starts the backend: the fake_devices setting's devices.
  jax.config.update("jax_num_cpu_devices", max(FLAGS.num_workers, 1))
  with cli.bad_input_exits():
    try:
      sizes = [int(s) for s in FLAGS.sizes]
    except ValueError:
      raise ValueError(f"--sizes must be integers, got {FLAGS.sizes}") from None
    report = compression_bench.run(sizes, FLAGS.repeats, FLAGS.settings,
                                   FLAGS.num_workers, donate=FLAGS.donate)
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=2)
  for setting in FLAGS.settings:
    key = f"gqsgd_vs_fp32_time_ratio_16M_{setting}"
    print(f"{key}: {report.get(key)}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
