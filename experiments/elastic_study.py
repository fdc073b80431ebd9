r"""Elastic pools measured: a reclaimed and returned worker, and a trace.

Usage:
  python -m experiments.elastic_study --study=reclaim \
      --out=results/elastic/reclaim [--seeds=3] [--steps=5000] \
      [--num_processes=4]
  python -m experiments.elastic_study --study=trace \
      --out=results/elastic/trace [--seeds=3] [--target=0.97] \
      [--link=1gbit] [--cpu_quota=1,1,0.3,0.3] [--fraction=0.3] \
      [--intervals=2] [--steps=300]

Every job is the main job under the elastic launcher (python -m
qsync_jax.distributed --elastic), as a subprocess; finished jobs (the same
command) are reused.

--study=reclaim: the default config's CNN on --num_processes processes
(--min_processes half of them), uninterrupted, then with the last slot
reclaimed from a third to two thirds of the uninterrupted run's wall time.
Writes --out/reclaim.json {"summary": {accuracy_difference_mean,
seed_spread_uninterrupted_std, seconds_lost_per_change, breakdown_mean_s,
steps_lost_per_change, goal_*_met, ...}, "seeds": [{uninterrupted,
reclaimed: {final_eval_accuracy, all_steps_trained, membership, ...}}]}.

--study=trace (root only): a pool behind --link with --cpu_quota (slots
below the largest quota are throttled), the network study's CNN trained to
--target three ways: the full-speed slots alone, the pool never reclaimed,
and the pool with its throttled slots reclaimed --fraction of the time in
--intervals intervals. Writes --out/trace.json {"summary": {run:
{time_to_target_mean_s, ...}, time_to_target_ratio_trace_vs_*}, "seeds":
[...]}; time to target is wall seconds since the launcher started.
"""

import json

from absl import app
from absl import flags

from qsync_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_enum("study", None, ["reclaim", "trace"], "Which study to run.")
flags.DEFINE_string("out", None, "Output directory.")
flags.DEFINE_integer("seeds", 3, "Seeds (0, 1, ...).")
flags.DEFINE_integer(
  "steps", None, "The main job's steps (default: the study's)."
)
flags.DEFINE_integer(
  "num_processes", 4, "reclaim: the pool's processes (the last is reclaimed)."
)
flags.DEFINE_string(
  "model_kwargs",
  None,
  "The CNN's arguments as JSON instead of the study's, e.g. a small one for "
  'a quick check: \'{"widths": [8, 16], "hidden": 64}\'.',
)
flags.DEFINE_float("target", None, "trace: the eval accuracy to reach.")
flags.DEFINE_string("link", None, "trace: each process's emulated link rate.")
flags.DEFINE_list(
  "cpu_quota",
  None,
  "trace: CPUs per slot; those below the largest are throttled and reclaimed.",
)
flags.DEFINE_float(
  "fraction", None, "trace: the share of the time the throttled slots are out."
)
flags.DEFINE_integer(
  "intervals", None, "trace: how many intervals they are out in."
)
flags.DEFINE_float("timeout_s", None, "The longest one job may take.")

_TRACE_ONLY = ("target", "link", "cpu_quota", "fraction", "intervals")


def _model_kwargs():
  if FLAGS.model_kwargs is None:
    return None
  try:
    value = json.loads(FLAGS.model_kwargs)
  except json.JSONDecodeError as e:
    raise ValueError(f"--model_kwargs is not JSON: {e}") from None
  if not isinstance(value, dict):
    raise ValueError("--model_kwargs must be a JSON object")
  return value


def _run_reclaim(elastic):
  cli.check_flags_need(
    [f"--{n}" for n in _TRACE_ONLY if FLAGS[n].present], "to --study=trace"
  )
  kwargs = {}
  if FLAGS.steps is not None:
    kwargs["steps"] = FLAGS.steps
  if FLAGS.timeout_s is not None:
    kwargs["timeout_s"] = FLAGS.timeout_s
  result = elastic.run_reclaim(
    FLAGS.out,
    seeds=FLAGS.seeds,
    num_processes=FLAGS.num_processes,
    model_kwargs=_model_kwargs(),
    **kwargs,
  )
  for seed in result["seeds"]:
    base, run = seed["uninterrupted"], seed["reclaimed"]
    print(
      f"seed {seed['seed']}: accuracy {base['final_eval_accuracy']:.4f} "
      f"uninterrupted, {run['final_eval_accuracy']:.4f} reclaimed; "
      f"steps {run['steps']}"
    )
    for change in run["membership"]:
      lost = change["seconds_lost"]
      print(
        f"  {change['cause']} at step {change['step']}: "
        f"{change['workers_before']} -> {change['workers_after']} workers, "
        f"{change['steps_lost']} steps and "
        f"{'?' if lost is None else f'{lost:.1f}'} s lost"
      )
  s = result["summary"]
  print(
    f"accuracy difference {s['accuracy_difference_mean']:+.4f} "
    f"(seed spread {s['seed_spread_uninterrupted_std']:.4f}); "
    f"seconds lost per change max {s['seconds_lost_max']} "
    f"(goal {s['goal_seconds_lost_per_change_s']:g}: "
    f"{'met' if s['goal_seconds_lost_met'] else 'not met'}); steps lost "
    f"{s['steps_lost_per_change']} (goal 0: "
    f"{'met' if s['goal_steps_lost_met'] else 'not met'})"
  )


def _run_trace(elastic):
  if FLAGS["num_processes"].present:
    raise ValueError(
      "--num_processes only applies to --study=reclaim; the trace's pool "
      "has one slot per --cpu_quota value"
    )
  kwargs = {
    name: FLAGS[name].value
    for name in ("steps", "target", "link", "fraction", "intervals")
    if FLAGS[name].value is not None
  }
  if FLAGS.timeout_s is not None:
    kwargs["timeout_s"] = FLAGS.timeout_s
  if FLAGS.cpu_quota is not None:
    try:
      kwargs["cpu_quota"] = [float(q) for q in FLAGS.cpu_quota]
    except ValueError:
      raise ValueError(
        f"--cpu_quota must be numbers of CPUs, got {','.join(FLAGS.cpu_quota)}"
      ) from None
  result = elastic.run_trace(
    FLAGS.out, seeds=FLAGS.seeds, model_kwargs=_model_kwargs(), **kwargs
  )
  s = result["summary"]
  for name in elastic.TRACE_RUNS:
    t = s[name]["time_to_target_mean_s"]
    print(
      f"{name:10s} to {s['target']}: "
      f"{'not reached' if t is None else f'{t:6.1f} s'}  final "
      f"{s[name]['final_eval_accuracy_mean']:.4f}"
    )
  print(
    f"trace: {s['trace']['changes']} changes, "
    f"{s['trace']['seconds_lost_total_mean']:.1f} s lost per seed"
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.start_binary()
  from experiments.studies import elastic

  try:
    with cli.bad_input_exits():
      if FLAGS.study == "reclaim":
        _run_reclaim(elastic)
      else:
        _run_trace(elastic)
  except RuntimeError as e:  # a failed job, or links cannot be emulated
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  flags.mark_flags_as_required(["study", "out"])
  app.run(main)
