r"""Time, wire bytes and error of every gradient-averaging strategy.

Usage:
  python -m experiments.compression_bench --out=compression.json \
      [--sizes=1048576,4194304,16777216] [--repeats=11] \
      [--settings=fake_devices,multiprocess] [--num_workers=4] [--donate] \
      [--parts] [--strategies=none,gqsgd]

For each strategy of qsync_jax.parallel.averagers (none = float32 mean, fp16,
bf16, gqsgd, gqsgd_int16, gqsgd_threefry, gqsgd_exp, qsgd, powersgd) and each size, one
all-reduce of gradient-like float32 data over num_workers workers: fake CPU
devices in this process, and localhost processes with gloo collectives (see
experiments.benches.compression). Writes JSON {"settings": {...}, "results":
[{setting, strategy, num_elements, time_s, cpu_s, wire_bytes, rel_error,
time_vs_fp32, ...}], "gqsgd_vs_fp32_time_ratio_16M_<setting>": float} and
prints one line per result. The goal: gqsgd at 16M floats in <= 0.4x the
float32 mean's time in the multiprocess setting.

Under the launcher (python -m qsync_jax.distributed --num_processes=4
[--link=1gbit --topology=per_node] -- python -m experiments.compression_bench
--sizes=16777216 --out=x.json) the launched processes are the multiprocess
setting's workers (the default setting there); process 0 writes the JSON, with
the emulated link and its measured rate under settings.link, each result's
predicted_s (the comm-aware predictor: compiled bytes over the measured rate
plus the encode/decode profiled in the run) and
"predicted_vs_measured_max_rel_error" at 16M floats.

--parts also times, across the processes, the pieces of gqsgd's all-reduce
(the int8 and float32 all-reduces alone, gqsgd's passes without collectives,
one read and one read-and-write pass over the data) and writes
"gqsgd_floor": per size, how much of gqsgd's time the passes take and the
floor no implementation of gqsgd gets under on this machine (see
experiments.benches.compression_parts.floor_analysis), and "overlap": per
size, how much of the int8 all-reduce the runtime hides behind independent
compute, dispatched after it, in one program with it or run by a second
thread, and of the whole gqsgd average run by a second thread (1: all of
the shorter piece, 0: none; experiments.benches.compression_parts.
overlap_analysis).
"""

import json

from absl import app
from absl import flags
import jax

from experiments.benches import compression
from qsync_jax import cli
from qsync_jax.process import initialize

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output JSON file.")
flags.DEFINE_list(
  "sizes",
  [str(d) for d in compression.DEFAULT_SIZES],
  "Vector lengths in float32 elements.",
)
flags.DEFINE_integer(
  "repeats",
  compression.DEFAULT_REPEATS,
  "Timed rounds per case (median reported).",
)
flags.DEFINE_list(
  "settings", list(compression.SETTINGS), "Subset of fake_devices,multiprocess."
)
flags.DEFINE_integer("num_workers", 4, "Workers: fake devices or processes.")
flags.DEFINE_bool(
  "donate",
  False,
  "Each all-reduce takes its input buffer (as a training "
  "step's dead gradient), so its output may reuse it.",
)
flags.DEFINE_list(
  "strategies",
  None,
  "Strategies to measure (default: all); see "
  "experiments.benches.compression_cases.STRATEGIES.",
)
flags.DEFINE_bool(
  "parts",
  False,
  "Also time the pieces of gqsgd's all-reduce across the "
  "processes (multiprocess setting) and report its floor.",
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  settings, num_workers = FLAGS.settings, FLAGS.num_workers
  with cli.bad_input_exits():
    # Before anything starts the backend: join the launch this process is
    # one of, or make the fake_devices setting's devices.
    if initialize.initialize():
      settings = settings if FLAGS["settings"].present else ["multiprocess"]
      if not FLAGS["num_workers"].present:
        num_workers = jax.process_count()
    else:
      jax.config.update("jax_num_cpu_devices", max(num_workers, 1))
    try:
      sizes = [int(s) for s in FLAGS.sizes]
    except ValueError:
      raise ValueError(f"--sizes must be integers, got {FLAGS.sizes}") from None
    report = compression.run(
      sizes,
      FLAGS.repeats,
      settings,
      num_workers,
      FLAGS.strategies,
      donate=FLAGS.donate,
      parts=FLAGS.parts,
    )
  first = jax.process_index() == 0
  initialize.shutdown()
  if not first:
    return  # Process 0 alone writes and reports.
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=2)
  for setting in settings:
    key = f"gqsgd_vs_fp32_time_ratio_16M_{setting}"
    print(f"{key}: {report.get(key)}")
  for key, describe in (
    ("gqsgd_floor", _floor_line),
    ("overlap", _overlap_line),
  ):
    for analysis in report.get(key, []):
      print(
        describe(analysis)
        if analysis is not None
        else f"{key}: a part or strategy was not measured (see above)"
      )


def _floor_line(floor: dict) -> str:
  """The line printed for one ``floor_analysis`` (compression_parts)."""
  return (
    f"gqsgd_floor {floor['num_elements']}: passes "
    f"{floor['passes_s'] * 1e3:.1f} ms + int8 all-reduce "
    f"{floor['allreduce_int8_s'] * 1e3:.1f} ms = "
    f"{floor['parts_sum_vs_whole']:.2f}x gqsgd; floor (int8 all-reduce "
    f"+ 2 reads of {floor['read_s'] * 1e3:.1f} ms + a write pass of "
    f"{floor['write_s'] * 1e3:.1f} ms) = "
    f"{floor['floor_vs_fp32']:.2f}x the float32 mean "
    f"({floor['cpu_floor_vs_fp32']:.2f}x in CPU time)"
  )


def _overlap_line(overlap: dict) -> str:
  """The line printed for one ``overlap_analysis`` (compression_parts)."""
  return (
    f"overlap {overlap['num_elements']}: int8 all-reduce "
    f"{overlap['allreduce_int8_s'] * 1e3:.1f} ms, compute "
    f"{overlap['compute_s'] * 1e3:.1f} ms; dispatched together "
    f"{overlap['dispatched_s'] * 1e3:.1f} ms "
    f"({overlap['hidden_dispatched']:.2f} hidden), in one program "
    f"{overlap['one_program_s'] * 1e3:.1f} ms "
    f"({overlap['hidden_one_program']:.2f} hidden), from a second thread "
    f"{overlap['threaded_s'] * 1e3:.1f} ms "
    f"({overlap['hidden_threaded']:.2f} hidden); the whole gqsgd average "
    f"from a second thread {overlap['gqsgd_threaded_s'] * 1e3:.1f} ms "
    f"({_share(overlap['hidden_gqsgd_threaded'])} hidden, "
    f"{overlap['gqsgd_threaded_cpu_s'] * 1e3:.1f} ms of CPU per process)"
  )


def _share(value: float | None) -> str:
  return "?" if value is None else f"{value:.2f}"


if __name__ == "__main__":
  flags.mark_flags_as_required(["out"])
  app.run(main)
