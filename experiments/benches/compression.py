"""Gradient-compression benchmark: every averager, in two settings.

This module owns the measurement behind ``experiments/compression_bench.py``:
for each strategy of :func:`qsync_jax.parallel.averagers.make_averager`
(float32 mean, fp16, bf16, Global-QSGD with int8 and int16 wires,
Global-QSGD with exponential dithering, QSGD, PowerSGD) and each size of the
all-reduced gradient bucket (float32 elements per worker; not the
quantizers' ``bucket_size``, the elements sharing one scale, which keep
their defaults), the time of one all-reduce (a jitted ``jax.shard_map`` over
the workers' mesh calling the averager, which returns the float32 mean on
every worker), the bytes each worker sends (the averager's ``wire_bytes``)
and the relative error ``||avg - exact|| / ||exact||`` against the exact
(float64) mean of gradient-like data. It runs in two settings:

* ``fake_devices``: this process, over ``num_workers`` CPU devices
  (``jax_num_cpu_devices``); the collectives are XLA:CPU's in-process ones.
* ``multiprocess``: ``num_workers`` localhost processes started by
  :func:`qsync_jax.launch.local.launch`, one CPU device each, gloo
  collectives over TCP. Each process runs the same program over the global
  mesh; process 0 writes its timings to a file this process reads.

A strategy that fails in a setting (it cannot be built, compiled or run
there) is recorded with an ``error`` field and the run goes on.

Timing: for each size every strategy is compiled and run once (warm-up; its
output gives the error), then ``repeats`` rounds interleave the strategies,
so machine noise hits all of them alike (the data, the cases and their
timing are :mod:`experiments.benches.compression_cases`).

With ``donate`` the program takes its input buffer (``donate_argnums``), as
a training step does with a gradient that is dead after averaging, so XLA
may write the result into it instead of a fresh allocation; each call then
gets its own copy of the data, made before the round's timer starts.

With ``parts`` the multi-process run also times the pieces of Global-QSGD's
all-reduce and the floor they put under its time
(:mod:`experiments.benches.compression_parts`).

Run as ``python -m experiments.benches.compression SPEC`` this module is one
worker process of the ``multiprocess`` setting (:func:`run_multiprocess`).

Under the launcher (``python -m qsync_jax.distributed --num_processes=N
[--link=1gbit ...] -- python -m experiments.compression_bench ...``) every
process runs :func:`run` and the launch itself is the ``multiprocess``
setting; the emulated link, with the rate measured before the run, is
recorded under ``settings.link`` and the headline ratio is also reported as
``gqsgd_vs_fp32_time_ratio_16M_<topology>_<rate>``. There every result also
gets the comm-aware predictor's ``predicted_s`` (the compiled program's
collectives, each priced by the same kind and type timed alone on the link
at its largest operand and a quarter of it, ``collectives_s``, plus the
encode/decode profiled with the workers meeting where the collectives are,
``codec_s``, which also times the collectives of at most 256 KiB per worker,
``collectives_in_codec``, so they are not priced again; all these parts are
timed in the same rounds as the averagers),
and ``predicted_link_s`` (the bytes the compiled program moves,
``moved_bytes``, over the link's measured rate, its latency steps, and the
same encode/decode; :func:`~experiments.benches.compression_cases.
predict_cases`). The report
has ``predicted_vs_measured_max_rel_error``: the max over strategies of
``|predicted_s - time_s| / time_s`` at 16M floats, and
``predicted_link_vs_measured_max_rel_error`` for ``predicted_link_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import os
import sys
import tempfile
import time
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from experiments import progress

# By name: callers (the binary, the tests) reach them as compression.X too.
from experiments.benches.compression_cases import all_reduce_fn
from experiments.benches.compression_cases import AXIS
from experiments.benches.compression_cases import calls_per_round
from experiments.benches.compression_cases import Case
from experiments.benches.compression_cases import check_arguments
from experiments.benches.compression_cases import copies
from experiments.benches.compression_cases import DATA_DOC
from experiments.benches.compression_cases import exact_mean
from experiments.benches.compression_cases import first_row
from experiments.benches.compression_cases import HEADLINE_SIZE
from experiments.benches.compression_cases import HEADLINE_STRATEGY
from experiments.benches.compression_cases import predict_cases
from experiments.benches.compression_cases import prediction_parts
from experiments.benches.compression_cases import print_row
from experiments.benches.compression_cases import relative_error
from experiments.benches.compression_cases import result_row
from experiments.benches.compression_cases import STRATEGIES
from experiments.benches.compression_cases import time_rounds
from experiments.benches.compression_cases import warm_up
from experiments.benches.compression_cases import worker_data
from experiments.benches.compression_parts import bench_parts
from experiments.benches.compression_parts import floor_analysis
from experiments.benches.compression_parts import overlap_analysis
from experiments.benches.compression_parts import PARTS
from qsync_jax import cli
from qsync_jax import files
from qsync_jax import host_malloc
from qsync_jax.launch import links
from qsync_jax.launch import local as local_lib
from qsync_jax.parallel import averagers
from qsync_jax.predictor import communication
from qsync_jax.process import initialize

SETTINGS = ("fake_devices", "multiprocess")
DEFAULT_SIZES = (1 << 20, 1 << 22, 1 << 24)
DEFAULT_REPEATS = 11


def bench_mesh(
  sizes: Sequence[int],
  repeats: int,
  setting: str,
  strategies: Sequence[str] | None = None,
  *,
  devices: Sequence[jax.Device] | None = None,
  seed: int = 0,
  report: bool = True,
  on_size=None,
  donate: bool = False,
  link: communication.Link | None = None,
) -> list[dict[str, Any]]:
  """Measures the strategies over a mesh of ``devices``, one worker each.

  In a multi-process run every process calls this with the same arguments
  (and all of ``jax.devices()``); each process feeds its own workers' data,
  and only the calling process's timings and outputs are seen here.

  Args:
    sizes: vector lengths (float32 elements).
    repeats: timed rounds per strategy and size (median reported).
    setting: the setting's name, copied into every result.
    strategies: names from :data:`STRATEGIES` (default: all).
    devices: the workers' devices (default: all of ``jax.devices()``).
    seed: the data seed.
    report: print one line per result and a progress line per size
      (from process 0 only).
    on_size: called with the results so far after each size.
    donate: each call takes (a fresh copy of) its input buffer (module
      docstring).
    link: the run's link; with it every result also gets the predictor's
      ``predicted_s`` (:func:`predict_cases`), ``moved_bytes`` (what the
      compiled program moves) and its parts.

  Returns:
    One dict per (size, strategy): {setting, strategy, num_elements,
    num_workers, time_s, rounds_s, cpu_s, calls_per_round, wire_bytes,
    rel_error}, or {setting, strategy, num_elements, num_workers, error}.
    ``cpu_s`` is this process's CPU time per call (all its threads, median
    over rounds): less sensitive than ``time_s`` to other load on the
    machine. ``rel_error`` is None off process 0.

  Raises:
    ValueError: an unknown strategy, a size below 1 or ``repeats`` below 1.
  """
  names = check_arguments(sizes, repeats, strategies)
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  local = [
    i for i, d in enumerate(devices) if d.process_index == jax.process_index()
  ]
  say = report and jax.process_index() == 0
  sizes_done = progress.Progress(len(sizes)) if say else None
  results = []
  for d in map(int, sizes):
    rows = np.stack([worker_data(d, i, seed) for i in local])
    x = jax.make_array_from_process_local_data(sharding, rows, (n, d))
    w = jax.make_array_from_process_local_data(
      sharding, np.full(len(local), 1.0 / n, np.float32), (n,)
    )
    # The predictor profiles on this process's first worker's data.
    sample = rows[0] if link is not None else None
    del rows

    def args(k, x=x, w=w):
      return [(xi, w) for xi in copies(x, k, donate)]

    exact = exact_mean(d, n, seed) if jax.process_index() == 0 else None
    calls = calls_per_round(d)
    cases = []
    for name in names:
      case = Case(name, args=args)
      cases.append(case)
      factory, kwargs = STRATEGIES[name]

      def build(case, factory=factory, kwargs=kwargs):
        case.averager = averagers.make_averager(factory, **kwargs)
        case.fn = all_reduce_fn(case.averager, mesh, donate)

      out = warm_up(case, build)
      if out is not None and exact is not None:
        case.rel_error = relative_error(first_row(out), exact)
      del out
    # With a link, the predictor's parts are timed in the same rounds.
    parts = (
      None
      if link is None
      else prediction_parts(cases, d, devices, sample=sample)
    )
    time_rounds(
      cases + ([] if parts is None else parts.cases()), repeats, calls
    )
    predicted = (
      {} if parts is None else predict_cases(cases, parts, d, devices, link)
    )
    del parts
    for case in cases:
      result = result_row(
        case,
        calls,
        setting=setting,
        strategy=case.name,
        num_elements=d,
        num_workers=n,
      )
      if "error" not in result:
        result.update(
          wire_bytes=float(case.averager.wire_bytes(d, n)),
          rel_error=case.rel_error,
          **predicted.get(case.name, {}),
        )
      if say:
        print_row(
          setting,
          result,
          ""
          if "error" in result
          else (
            f"  {result['wire_bytes'] / 2**20:8.2f} MiB/worker  "
            f"rel err {result['rel_error']:.3e}"
            + (
              f"  predicted {result['predicted_s'] * 1e3:9.2f} ms"
              if "predicted_s" in result
              else ""
            )
          ),
        )
      results.append(result)
    del x, w, cases, sample
    if sizes_done is not None:
      sizes_done.done(f"compression {setting} {d} elements")
    if on_size is not None:
      on_size(results)
  return results


def run_fake_devices(
  sizes: Sequence[int],
  repeats: int,
  num_workers: int,
  strategies: Sequence[str] | None = None,
  *,
  seed: int = 0,
  donate: bool = False,
) -> list[dict[str, Any]]:
  """The ``fake_devices`` setting: this process's first ``num_workers``
  CPU devices.

  Raises:
    ValueError: fewer CPU devices than ``num_workers`` (set
      ``jax_num_cpu_devices`` before the backend starts).
  """
  devices = jax.devices("cpu")
  if len(devices) < num_workers:
    raise ValueError(
      f"the fake_devices setting needs {num_workers} CPU devices, this "
      f"process has {len(devices)}; call jax.config.update("
      f"'jax_num_cpu_devices', {num_workers}) before JAX starts"
    )
  return bench_mesh(
    sizes,
    repeats,
    "fake_devices",
    strategies,
    devices=devices[:num_workers],
    seed=seed,
    donate=donate,
  )


def _worker_main(spec_path: str) -> None:
  """One process of the ``multiprocess`` setting (see :func:`run_multiprocess`).

  Joins the run, benchmarks over every process's device and, on process 0,
  writes the results to ``spec["out"]`` after each size (so a run cut short
  still leaves what it measured).
  """
  cli.start_binary()
  with open(spec_path) as f:
    spec = json.load(f)
  if not initialize.initialize():
    raise RuntimeError(
      "compression_bench worker started outside a multi-process launch"
    )

  def write(results):
    if jax.process_index() != 0:
      return
    files.write_json(
      spec["out"],
      {
        "results": results,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
      },
    )

  donate = spec.get("donate", False)
  results = bench_mesh(
    spec["sizes"],
    spec["repeats"],
    "multiprocess",
    spec["strategies"],
    seed=spec["seed"],
    on_size=write,
    donate=donate,
  )
  if spec.get("parts", False):
    bench_parts(
      spec["sizes"],
      spec["repeats"],
      seed=spec["seed"],
      donate=donate,
      on_size=lambda rows: write(results + rows),
    )
  initialize.shutdown()


def run_multiprocess(
  sizes: Sequence[int],
  repeats: int,
  num_workers: int,
  strategies: Sequence[str] | None = None,
  *,
  seed: int = 0,
  timeout_s: float = 3600,
  donate: bool = False,
  parts: bool = False,
) -> list[dict[str, Any]]:
  """The ``multiprocess`` setting: ``num_workers`` localhost processes.

  The processes run this module (``python -m experiments.benches.compression
  SPEC``) under :func:`qsync_jax.launch.local.launch`, which relays
  their output and SIGKILLs them all if one fails or ``timeout_s`` runs out.

  Args (beyond :func:`bench_mesh`'s):
    parts: also time the :data:`PARTS` (:func:`bench_parts`), after the
      strategies.

  Returns:
    Process 0's results (then the parts' rows); every (size, strategy or
    part) the run did not measure gets an ``error`` naming the launcher's
    exit status.
  """
  names = list(STRATEGIES) if strategies is None else list(strategies)
  with tempfile.TemporaryDirectory(prefix="compression_bench_") as tmp:
    spec = {
      "sizes": [int(d) for d in sizes],
      "repeats": int(repeats),
      "strategies": names,
      "seed": int(seed),
      "donate": bool(donate),
      "parts": bool(parts),
      "out": os.path.join(tmp, "results.json"),
    }
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    env = dict(os.environ)
    # The workers import experiments and qsync_jax from wherever this
    # process did: the repository root, two levels above this file's folder.
    root = os.path.dirname(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    env["PYTHONPATH"] = os.pathsep.join(
      p for p in (root, env.get("PYTHONPATH")) if p
    )
    code = local_lib.launch(
      [sys.executable, "-m", "experiments.benches.compression", spec_path],
      num_workers,
      timeout_s=timeout_s,
      env=env,
    )
    measured = []
    if os.path.exists(spec["out"]):
      with open(spec["out"]) as f:
        measured = json.load(f)["results"]
  done = {(r["strategy"], r["num_elements"]) for r in measured}
  why = (
    "timed out"
    if code == local_lib.TIMEOUT_EXIT_CODE
    else f"exited with code {code}"
  )
  for d in spec["sizes"]:
    for name in names + (list(PARTS) if parts else []):
      if (name, d) not in done:
        measured.append(
          {
            "setting": "multiprocess",
            "strategy": name,
            "num_elements": d,
            "num_workers": num_workers,
            **({"part": True} if name in PARTS else {}),
            "error": f"the {num_workers}-process run {why} before measuring "
            "this (its output above says why)",
          }
        )
  return measured


def time_ratio(
  results: Sequence[dict[str, Any]],
  setting: str,
  strategy: str = HEADLINE_STRATEGY,
  num_elements: int = HEADLINE_SIZE,
  baseline: str = "none",
) -> float | None:
  """``time_s`` of ``strategy`` over ``baseline``'s, or None if either is
  missing or failed."""
  times = {
    r["strategy"]: r.get("time_s")
    for r in results
    if r["setting"] == setting and r["num_elements"] == num_elements
  }
  a, b = times.get(strategy), times.get(baseline)
  return None if a is None or b is None else a / b


def _loadavg() -> list[float] | None:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return None


def run(
  sizes: Sequence[int] = DEFAULT_SIZES,
  repeats: int = DEFAULT_REPEATS,
  settings: Sequence[str] = SETTINGS,
  num_workers: int = 4,
  strategies: Sequence[str] | None = None,
  *,
  seed: int = 0,
  timeout_s: float = 3600,
  donate: bool = False,
  parts: bool = False,
) -> dict[str, Any]:
  """Runs the benchmark in each setting; returns the JSON-ready report.

  Args:
    sizes: vector lengths (float32 elements).
    repeats: timed rounds per case (median reported).
    settings: a subset of :data:`SETTINGS`.
    num_workers: workers (fake devices or processes).
    strategies: names from :data:`STRATEGIES` (default: all).
    seed: the data seed.
    timeout_s: the multi-process run's time limit.
    donate: every call takes its input buffer (module docstring).
    parts: also time the :data:`PARTS` in the multiprocess setting, which
      must be among ``settings``.

  Returns:
    {"settings": {...}, "results": [...] (see :func:`bench_mesh`, then
    :func:`bench_parts`), "gqsgd_vs_fp32_time_ratio_16M_<setting>": float
    or None per setting}, and with ``parts`` "gqsgd_floor" and "overlap":
    one :func:`floor_analysis` and one :func:`overlap_analysis` per size
    (None where a row is missing). Each
    result also gets ``time_vs_fp32``, its time over the float32 mean's at
    the same size and setting.

  Raises:
    ValueError: an unknown setting or strategy, a bad size, repeat count or
      worker count, or ``parts`` without the multiprocess setting or
      without both the float32 mean and the headline strategy.
  """
  settings = list(settings)
  names = _check_run(settings, sizes, repeats, num_workers, strategies, parts)
  sizes = [int(d) for d in sizes]
  link = links.link_info_from_env()
  info = _settings_info(
    sizes,
    repeats,
    num_workers,
    names,
    link,
    seed=seed,
    donate=donate,
    parts=parts,
  )
  results = []
  for setting in settings:
    start, load = time.monotonic(), _loadavg()
    results += _run_setting(
      setting,
      sizes,
      repeats,
      num_workers,
      names,
      link,
      seed=seed,
      timeout_s=timeout_s,
      donate=donate,
      parts=parts,
    )
    info["loadavg"][setting] = {"start": load, "end": _loadavg()}
    info["wall_s"][setting] = round(time.monotonic() - start, 1)
  return _report(info, results, settings, sizes, link, parts=parts)


def _check_run(
  settings: Sequence[str],
  sizes: Sequence[int],
  repeats: int,
  num_workers: int,
  strategies: Sequence[str] | None,
  parts: bool,
) -> list[str]:
  """Checks :func:`run`'s arguments; returns the strategies' names.

  Raises:
    ValueError: as :func:`run`, or settings or a worker count other than
      the launch's under the launcher.
  """
  bad = [s for s in settings if s not in SETTINGS]
  if bad or not settings:
    raise ValueError(
      f"settings must be a non-empty subset of "
      f"{', '.join(SETTINGS)}, got {list(settings)}"
    )
  names = check_arguments(sizes, repeats, strategies)
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1, got {num_workers}")
  if parts and "multiprocess" not in settings:
    raise ValueError(
      "parts are timed in the multiprocess setting only; add "
      f"it to settings (got {list(settings)})"
    )
  if parts and not {"none", HEADLINE_STRATEGY} <= set(names):
    raise ValueError(
      f"parts are compared with the strategies 'none' and "
      f"{HEADLINE_STRATEGY!r}; include both (got {names})"
    )
  # One process of a launch: the launch's processes are the workers.
  if jax.process_count() > 1 and (
    list(settings) != ["multiprocess"] or num_workers != jax.process_count()
  ):
    raise ValueError(
      f"under the launcher only the multiprocess setting runs, with the "
      f"{jax.process_count()} launched processes as workers; got settings "
      f"{list(settings)} and {num_workers} workers"
    )
  return names


def _settings_info(
  sizes: Sequence[int],
  repeats: int,
  num_workers: int,
  names: Sequence[str],
  link: dict[str, Any] | None,
  *,
  seed: int,
  donate: bool,
  parts: bool,
) -> dict[str, Any]:
  """The report's ``settings``: the run's machine, arguments and methods.

  Its ``loadavg`` and ``wall_s`` are empty, for :func:`run` to fill per
  setting.
  """
  return {
    "jax_version": jax.__version__,
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0].device_kind),
    "cpu_count": os.cpu_count(),
    # The workers inherit it; glibc.malloc.hugetlb=1 backs big buffers
    # with transparent huge pages (see docs/RESULTS.md).
    "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    # The host allocator's mode, in this process and the workers.
    "host_malloc": host_malloc.mode_from_env(),
    "num_workers": num_workers,
    "sizes": list(sizes),
    "repeats": repeats,
    "calls_per_round": {str(d): calls_per_round(d) for d in sizes},
    "seed": seed,
    "donate": donate,
    "parts": list(PARTS) if parts else [],
    "data": DATA_DOC,
    "strategies": {
      name: repr(averagers.make_averager(f, **kw))
      for name, (f, kw) in STRATEGIES.items()
      if name in names
    },
    "timing": (
      "time_s: median over repeats of wall seconds per call, "
      "each round dispatching calls_per_round calls and waiting "
      "for the last, after one warm-up call; strategies "
      "interleaved round by round. cpu_s: the same rounds' CPU "
      "seconds per call of the timing process (all threads)"
    ),
    "rel_error": "||avg - exact|| / ||exact||, exact the float64 mean",
    "multiprocess": "one CPU device per process, gloo collectives over "
    + ("the emulated link (see link)" if link else "localhost TCP")
    + "; process 0's timings",
    "link": link,
    "notes": [
      "wire_bytes is each averager's model of its wire format; on "
      "XLA:CPU a bfloat16 all-reduce is promoted to float32 (see "
      "averagers.CastAverager), so bf16 moves 4 bytes per element here",
      "gloo adds float16 element by element through software float "
      "conversions (gloo/types.h), so fp16 is slower than float32 in "
      "the multiprocess setting",
      "gqsgd_threefry is gqsgd with jax.random (threefry) rounding "
      "noise instead of the counter hash",
    ],
    "loadavg": {},
    "wall_s": {},
  }


def _run_setting(
  setting: str,
  sizes: Sequence[int],
  repeats: int,
  num_workers: int,
  names: Sequence[str],
  link: dict[str, Any] | None,
  *,
  seed: int,
  timeout_s: float,
  donate: bool,
  parts: bool,
) -> list[dict[str, Any]]:
  """The results of one setting: on fake devices, in this launch's
  processes (under the launcher), or in processes launched for it."""
  if setting == "fake_devices":
    return run_fake_devices(
      sizes, repeats, num_workers, names, seed=seed, donate=donate
    )
  if jax.process_count() > 1:
    results = bench_mesh(
      sizes,
      repeats,
      setting,
      names,
      seed=seed,
      donate=donate,
      link=communication.Link.from_record(link) if link else None,
    )
    if parts:
      results += bench_parts(sizes, repeats, seed=seed, donate=donate)
    return results
  return run_multiprocess(
    sizes,
    repeats,
    num_workers,
    names,
    seed=seed,
    timeout_s=timeout_s,
    donate=donate,
    parts=parts,
  )


def _report(
  info: dict[str, Any],
  results: list[dict[str, Any]],
  settings: Sequence[str],
  sizes: Sequence[int],
  link: dict[str, Any] | None,
  *,
  parts: bool,
) -> dict[str, Any]:
  """:func:`run`'s report from the settings' results (see there)."""
  for r in results:
    if "time_s" in r:
      r["time_vs_fp32"] = time_ratio(
        results, r["setting"], r["strategy"], r["num_elements"]
      )
  report = {"settings": info, "results": results}
  for setting in SETTINGS:
    report[f"gqsgd_vs_fp32_time_ratio_16M_{setting}"] = (
      time_ratio(results, setting) if setting in settings else None
    )
  if link is not None and "multiprocess" in settings:
    report[
      f"gqsgd_vs_fp32_time_ratio_16M_{link['topology']}_{link['link']}"
    ] = time_ratio(results, "multiprocess")
  if any("predicted_s" in r for r in results):
    report["predicted_vs_measured_max_rel_error"] = max_rel_error(results)
    report["predicted_link_vs_measured_max_rel_error"] = max_rel_error(
      results, key="predicted_link_s"
    )
  if parts:
    report["gqsgd_floor"] = [floor_analysis(results, d) for d in sizes]
    report["overlap"] = [overlap_analysis(results, d) for d in sizes]
  return report


def max_rel_error(
  results: Sequence[dict[str, Any]],
  num_elements: int = HEADLINE_SIZE,
  key: str = "predicted_s",
) -> float | None:
  """Max over strategies of ``|r[key] - time_s| / time_s`` at
  ``num_elements`` (None if no result there has both)."""
  errors = [
    abs(r[key] - r["time_s"]) / r["time_s"]
    for r in results
    if r["num_elements"] == num_elements and key in r and "time_s" in r
  ]
  return max(errors) if errors else None


if __name__ == "__main__":
  _worker_main(sys.argv[1])
