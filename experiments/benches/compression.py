"""Gradient-compression benchmark: every averager of :mod:`qsync_jax.parallel.averagers`.

This module owns the measurement behind ``experiments/compression_bench.py``:
for each strategy of :func:`qsync_jax.parallel.averagers.make_averager` (float32 mean,
fp16, bf16, Global-QSGD with int8 and int16 wires, Global-QSGD with
exponential dithering, QSGD) and each size of the all-reduced gradient bucket
(float32 elements per worker; not the quantizers' ``bucket_size``, the
elements sharing one scale, which keep their defaults), the time of one
all-reduce (a jitted ``jax.shard_map`` over the workers' mesh calling the
averager, which returns the float32 mean on every worker), the
bytes each worker sends (the averager's ``wire_bytes``) and the relative
error ``||avg - exact|| / ||exact||`` against the exact (float64) mean of
gradient-like data. It runs in two settings:

* ``fake_devices``: this process, over ``num_workers`` CPU devices
  (``jax_num_cpu_devices``); the collectives are XLA:CPU's in-process ones.
* ``multiprocess``: ``num_workers`` localhost processes started by
  :func:`qsync_jax.parallel.distributed.launch`, one CPU device each, gloo
  collectives over TCP. Each process runs the same program over the global
  mesh; process 0 writes its timings to a file this process reads.

A strategy that fails in a setting (it cannot be built, compiled or run
there) is recorded with an ``error`` field and the run goes on.

Timing: for each size every strategy is compiled and run once (warm-up; its
output gives the error), then ``repeats`` rounds interleave the strategies,
so machine noise hits all of them alike. A round dispatches
``calls_per_round`` calls and waits for the last
(:func:`experiments.benches.trainer.seconds_per_call`); the reported time is the
median over rounds. ``calls_per_round`` depends only on the size, as every
process of the multi-process run must make the same calls. The same rounds
also give ``cpu_s``, the timing process's CPU time per call: on a machine
with fewer cores than busy threads the wall time follows the total CPU work,
and ``cpu_s`` shows where it goes even when other load blurs ``time_s``.

With ``donate`` the program takes its input buffer (``donate_argnums``), as
a training step does with a gradient that is dead after averaging, so XLA
may write the result into it instead of a fresh allocation; each call then
gets its own copy of the data, made before the round's timer starts.

With ``parts`` the multi-process run also times the pieces of Global-QSGD's
all-reduce (:data:`PARTS`, :func:`bench_parts`): the int8 and float32
all-reduces alone, Global-QSGD's own passes without any collective, and a
read and a read-and-write pass over the data. :func:`floor_analysis` turns
them into a floor under Global-QSGD's time on the machine at hand.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from experiments.benches import trainer
from qsync_jax import cli
from qsync_jax.parallel import averagers
from qsync_jax.parallel import distributed

AXIS = "workers"
SETTINGS = ("fake_devices", "multiprocess")
DEFAULT_SIZES = (1 << 20, 1 << 22, 1 << 24)
DEFAULT_REPEATS = 11
#: Bench name -> (``averagers.make_averager`` name, keyword arguments).
STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "gqsgd": ("gqsgd", {}),
    "gqsgd_int16": ("gqsgd", {"wire": "int16"}),
    # Global-QSGD's rounding noise from jax.random (threefry), its default
    # before the counter hash: what the hash saves.
    "gqsgd_threefry": ("gqsgd", {"noise": "threefry"}),
    "gqsgd_exp": ("gqsgd_exp", {}),
    "qsgd": ("qsgd", {}),
}
#: The pieces of the headline strategy's all-reduce, timed with ``parts``
#: (multiprocess setting): a ``psum`` of the float32 data alone and of int8
#: codes alone; Global-QSGD over a one-worker mesh of each process's own
#: device, which keeps its bucket max, encode and decode passes and drops its
#: collectives; the bucket max alone, one read of the float32 data at the
#: speed XLA:CPU reads it (``averagers._bucket_absmax``); and ``2 x``, one read and
#: one write of it, into a fresh buffer or (donating) in place, as the
#: decode's output is.
PARTS = ("allreduce_f32", "allreduce_int8", "gqsgd_passes", "bucket_absmax",
         "scale_f32")
#: The headline: Global-QSGD (int8) against the float32 mean at 2**24 floats.
HEADLINE_STRATEGY = "gqsgd"
HEADLINE_SIZE = 1 << 24
# Elements per synthetic "layer": each has its own gradient magnitude.
_LAYER_SIZE = 1 << 14
# The per-worker (minibatch) noise against the shared (true) gradient.
_NOISE_STD = 2.0
_DATA_DOC = (
    "worker i: mag * (g + 2 * e_i), g and e_i standard normal (g shared by "
    "all workers), mag lognormal(0, 1) per layer of 16384 elements; float32; "
    "equal weights 1/n")


def calls_per_round(num_elements: int) -> int:
  """Calls timed together at one size: about 4M elements' worth, at least 1."""
  return max(1, min(8, (1 << 22) // max(num_elements, 1)))


def worker_data(num_elements: int, worker: int, seed: int = 0) -> np.ndarray:
  """One worker's gradient-like float32 vector (see ``_DATA_DOC``).

  Every worker shares a component ``g`` (the true gradient) and adds its own
  noise (its minibatch's); both are scaled by a per-layer magnitude, as real
  gradients differ in scale from layer to layer, so a bucket's max-abs scale
  does not fit all of its elements equally.

  Args:
    num_elements: the vector's length.
    worker: the worker's index (selects its noise).
    seed: the data seed.
  """
  shared = np.random.default_rng([seed, 0])
  layers = -(-num_elements // _LAYER_SIZE)
  mag = np.repeat(np.exp(shared.standard_normal(layers)),
                  _LAYER_SIZE)[:num_elements].astype(np.float32)
  g = shared.standard_normal(num_elements, dtype=np.float32)
  noise = np.random.default_rng([seed, 1, worker]).standard_normal(
      num_elements, dtype=np.float32)
  return mag * (g + np.float32(_NOISE_STD) * noise)


def exact_mean(num_elements: int, num_workers: int,
               seed: int = 0) -> np.ndarray:
  """The float64 mean of the workers' :func:`worker_data`."""
  total = np.zeros(num_elements, np.float64)
  for i in range(num_workers):
    total += worker_data(num_elements, i, seed)
  return total / num_workers


def relative_error(avg: np.ndarray, exact: np.ndarray) -> float:
  """``||avg - exact|| / ||exact||`` in float64 (NaN stays NaN)."""
  avg = np.asarray(avg, np.float64).reshape(-1)
  return float(np.linalg.norm(avg - exact) / np.linalg.norm(exact))


def _error_text(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}".strip()
  lines = [l for l in text.splitlines() if l.strip()]
  return " ".join(lines[:3])[:500]


@dataclasses.dataclass
class _Case:
  """One strategy (or part) at one size: its program and what was measured.

  ``args(k)`` gives the arguments of ``k`` calls of ``fn``, one tuple each.
  With ``barrier`` every process waits for the others before the case's
  timer starts (a program without collectives does not keep them in step).
  """
  name: str
  averager: Any = None
  fn: Any = None
  args: Any = None
  barrier: bool = False
  rel_error: float | None = None
  rounds: list[float] = dataclasses.field(default_factory=list)
  cpu_rounds: list[float] = dataclasses.field(default_factory=list)
  error: str | None = None


def _time_rounds(cases: Sequence[_Case], repeats: int, calls: int) -> None:
  """Times ``repeats`` rounds of ``calls`` calls, cases interleaved."""
  for _ in range(repeats):
    for case in cases:
      if case.fn is None:
        continue
      args = case.args(calls)
      if case.barrier:
        multihost_utils.sync_global_devices(f"compression_bench {case.name}")

      def run_block(k, case=case, args=args):
        out = None
        for i in range(k):
          out = case.fn(*args[i])
        jax.block_until_ready(out)

      cpu = time.process_time()
      case.rounds.append(trainer.seconds_per_call(run_block, calls))
      case.cpu_rounds.append((time.process_time() - cpu) / calls)


def _warm_up(case: _Case, build=None) -> Any:
  """Builds the case (``build(case)``, which sets ``fn`` and ``args``) and
  runs it once (compile, warm up); returns the output, or None with
  ``case.error`` set. Every process fails alike (same program), so all skip
  a failed case."""
  try:
    if build is not None:
      build(case)
    return jax.block_until_ready(case.fn(*case.args(1)[0]))
  except Exception as e:  # pylint: disable=broad-except
    case.error = _error_text(e)
    case.fn = None
    return None


def _result_row(case: _Case, calls: int, **fields: Any) -> dict[str, Any]:
  """``fields`` plus the case's error or its timings."""
  if case.error is not None:
    return {**fields, "error": case.error}
  return {**fields, "time_s": statistics.median(case.rounds),
          "rounds_s": case.rounds,
          "cpu_s": statistics.median(case.cpu_rounds),
          "calls_per_round": calls}


def _print_row(label: str, row: dict[str, Any], detail: str = "") -> None:
  """One line of a result row: its error, or its times and ``detail``."""
  head = f"{label:12s} {row['strategy']:14s} {row['num_elements']:9d}: "
  if "error" in row:
    print(head + f"error: {row['error']}", flush=True)
  else:
    print(head + f"{row['time_s'] * 1e3:9.2f} ms  "
          f"(cpu {row['cpu_s'] * 1e3:8.2f} ms){detail}", flush=True)


def _copies(x: jax.Array, k: int, donate: bool) -> list[jax.Array]:
  """The inputs of ``k`` calls: ``x`` itself, or (donating) one copy each,
  made before any timer starts."""
  if not donate:
    return [x] * k
  return jax.block_until_ready([x.copy() for _ in range(k)])


def _all_reduce_fn(averager, mesh, donate: bool = False):
  """The jitted shard_map: one (1, d) row per worker in, the mean out;
  ``donate`` gives the input rows' buffer to the program."""

  def body(x, w):
    return averager(x[0], w[0], AXIS)[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                               out_specs=P(AXIS)),
                 donate_argnums=(0,) if donate else ())


def _first_row(out: jax.Array) -> np.ndarray:
  """This process's first row of the (n, d) output (all rows agree)."""
  return np.asarray(out.addressable_shards[0].data)[0]


def _check_arguments(sizes: Sequence[int], repeats: int,
                     strategies: Sequence[str] | None) -> list[str]:
  """Validates the shared arguments; returns the strategy names to run."""
  names = list(STRATEGIES) if strategies is None else list(strategies)
  cli.check_names("strategy", names, STRATEGIES)
  if not sizes or min(int(d) for d in sizes) < 1:
    raise ValueError(f"sizes must be positive, got {list(sizes)}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  return names


def bench_mesh(sizes: Sequence[int], repeats: int, setting: str,
               strategies: Sequence[str] | None = None, *,
               devices: Sequence[jax.Device] | None = None, seed: int = 0,
               report: bool = True, on_size=None,
               donate: bool = False) -> list[dict[str, Any]]:
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
    report: print one line per result (from process 0 only).
    on_size: called with the results so far after each size.
    donate: each call takes (a fresh copy of) its input buffer (module
      docstring).

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
  names = _check_arguments(sizes, repeats, strategies)
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  local = [i for i, d in enumerate(devices)
           if d.process_index == jax.process_index()]
  say = report and jax.process_index() == 0
  results = []
  for d in map(int, sizes):
    rows = np.stack([worker_data(d, i, seed) for i in local])
    x = jax.make_array_from_process_local_data(sharding, rows, (n, d))
    w = jax.make_array_from_process_local_data(
        sharding, np.full(len(local), 1.0 / n, np.float32), (n,))
    del rows

    def args(k, x=x, w=w):
      return [(xi, w) for xi in _copies(x, k, donate)]

    exact = exact_mean(d, n, seed) if jax.process_index() == 0 else None
    calls = calls_per_round(d)
    cases = []
    for name in names:
      case = _Case(name, args=args)
      cases.append(case)
      factory, kwargs = STRATEGIES[name]

      def build(case, factory=factory, kwargs=kwargs):
        case.averager = averagers.make_averager(factory, **kwargs)
        case.fn = _all_reduce_fn(case.averager, mesh, donate)

      out = _warm_up(case, build)
      if out is not None and exact is not None:
        case.rel_error = relative_error(_first_row(out), exact)
      del out
    _time_rounds(cases, repeats, calls)
    for case in cases:
      result = _result_row(case, calls, setting=setting, strategy=case.name,
                           num_elements=d, num_workers=n)
      if "error" not in result:
        result.update(wire_bytes=float(case.averager.wire_bytes(d, n)),
                      rel_error=case.rel_error)
      if say:
        _print_row(setting, result, "" if "error" in result else (
            f"  {result['wire_bytes'] / 2**20:8.2f} MiB/worker  "
            f"rel err {result['rel_error']:.3e}"))
      results.append(result)
    del x, w, cases
    if on_size is not None:
      on_size(results)
  return results


def _psum_fn(mesh, donate: bool):
  """The jitted shard_map of a bare ``psum``: one (1, d) row per worker."""
  return jax.jit(jax.shard_map(lambda x: jax.lax.psum(x[0], AXIS)[None],
                               mesh=mesh, in_specs=P(AXIS),
                               out_specs=P(AXIS)),
                 donate_argnums=(0,) if donate else ())


def _codes(rows: np.ndarray, levels: int) -> np.ndarray:
  """int8 codes of ``rows`` on ``levels`` levels (round to nearest)."""
  scale = np.abs(rows).max(axis=1, keepdims=True) / levels
  return np.clip(np.round(rows / scale), -levels, levels).astype(np.int8)


def _part_args(data: jax.Array, rest: tuple, donate: bool,
               k: int) -> list[tuple]:
  """The arguments of ``k`` calls: ``(data copy, *rest)`` each."""
  return [(a, *rest) for a in _copies(data, k, donate)]


def bench_parts(sizes: Sequence[int], repeats: int, *, seed: int = 0,
                donate: bool = False, report: bool = True,
                on_size=None) -> list[dict[str, Any]]:
  """Times the :data:`PARTS` of the headline strategy's all-reduce.

  Every process of a multi-process run calls this with the same arguments.
  The all-reduces run over all of ``jax.devices()``; the local parts run on
  each process's own devices, all processes at once, so they meet the same
  contention for the host's cores as the whole all-reduce does; a barrier
  before each local part's timer keeps the processes in step.

  Args:
    sizes: vector lengths (float32 elements).
    repeats: timed rounds per part and size (median reported).
    seed: the data seed.
    donate: every call takes a fresh copy of its input (as in
      :func:`bench_mesh`); the bucket max reads its input and never takes it.
    report: print one line per part (from process 0 only).
    on_size: called with the rows so far after each size.

  Returns:
    One dict per (size, part): {setting: "multiprocess", strategy (the
    part's name), part: True, num_elements, num_workers, time_s, rounds_s,
    cpu_s, calls_per_round}, or an ``error`` instead of the timings.

  Raises:
    ValueError: a size below 1 or ``repeats`` below 1.
  """
  _check_arguments(sizes, repeats, [])
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  local = [i for i, dev in enumerate(devices)
           if dev.process_index == jax.process_index()]
  local_mesh = Mesh(np.array([devices[i] for i in local]), (AXIS,))
  local_sharding = NamedSharding(local_mesh, P(AXIS))
  factory, kwargs = STRATEGIES[HEADLINE_STRATEGY]
  gqsgd = averagers.make_averager(factory, **kwargs)
  say = report and jax.process_index() == 0
  psum = _psum_fn(mesh, donate)
  programs = {
      "allreduce_f32": psum,
      "allreduce_int8": psum,
      "gqsgd_passes": _all_reduce_fn(gqsgd, local_mesh, donate),
      "bucket_absmax": jax.jit(lambda x: averagers._bucket_absmax(  # pylint: disable=protected-access
          averagers._to_buckets(x[0], gqsgd.bucket_size))),  # pylint: disable=protected-access
      "scale_f32": jax.jit(lambda x: 2 * x,
                           donate_argnums=(0,) if donate else ()),
  }
  rows_out = []
  for d in map(int, sizes):
    rows = np.stack([worker_data(d, i, seed) for i in local])
    x = jax.make_array_from_process_local_data(sharding, rows, (n, d))
    codes = jax.make_array_from_process_local_data(
        sharding, _codes(rows, gqsgd.levels(n)), (n, d))
    x_local = jax.device_put(rows, local_sharding)
    w_local = jax.device_put(np.full(len(local), 1.0 / n, np.float32),
                             local_sharding)
    del rows
    # Each call's arguments: (copies of) the float32 rows or the int8
    # codes of all workers, or this process's own rows.
    args = {
        "allreduce_f32": functools.partial(_part_args, x, (), donate),
        "allreduce_int8": functools.partial(_part_args, codes, (), donate),
        "gqsgd_passes": functools.partial(_part_args, x_local, (w_local,),
                                          donate),
        "bucket_absmax": functools.partial(_part_args, x_local, (), False),
        "scale_f32": functools.partial(_part_args, x_local, (), donate),
    }
    calls = calls_per_round(d)
    cases = []
    for name in PARTS:
      case = _Case(name, fn=programs[name], args=args[name],
                   barrier=not name.startswith("allreduce"))
      cases.append(case)
      _warm_up(case)
    _time_rounds(cases, repeats, calls)
    for case in cases:
      row = _result_row(case, calls, setting="multiprocess",
                        strategy=case.name, part=True, num_elements=d,
                        num_workers=n)
      if say:
        _print_row("part", row)
      rows_out.append(row)
    del x, codes, x_local, cases
    if on_size is not None:
      on_size(rows_out)
  return rows_out


def floor_analysis(results: Sequence[dict[str, Any]],
                   num_elements: int = HEADLINE_SIZE) -> dict[str, Any] | None:
  """What the parts say about the headline strategy at one size.

  ``passes_s`` is Global-QSGD's passes without collectives and
  ``parts_sum_s`` adds the int8 all-reduce: the two together should come
  close to the whole (``parts_sum_vs_whole``). ``floor_s`` is the int8
  all-reduce, two reads of the float32 data at the speed of the bucket max
  (the fastest pass XLA:CPU makes over it) and one read-and-write pass
  (``scale_f32``): Global-QSGD must read the data once for the scales and
  once to encode it, and write as much when it decodes, so no
  implementation of it, however its passes are written, takes less on this
  machine. ``floor_vs_fp32`` is that floor over the float32 mean's time.
  ``cpu_floor_vs_fp32`` is the same ratio of CPU times (``cpu_s``), which
  wall time follows where the processes outnumber the cores and which other
  load on the machine blurs less.

  Returns:
    {num_elements, passes_s, allreduce_int8_s, allreduce_f32_s, read_s,
    write_s, parts_sum_s, parts_sum_vs_whole, floor_s, floor_vs_fp32,
    cpu_floor_vs_fp32}, or None if a needed multiprocess row is missing or
    failed.
  """
  rows = {r["strategy"]: r for r in results
          if r["setting"] == "multiprocess"
          and r["num_elements"] == num_elements}
  need = (*PARTS, HEADLINE_STRATEGY, "none")
  if any("time_s" not in rows.get(name, {}) for name in need):
    return None
  t = {name: rows[name]["time_s"] for name in need}
  cpu = {name: rows[name]["cpu_s"] for name in need}

  def floor(v):
    return v["allreduce_int8"] + 2 * v["bucket_absmax"] + v["scale_f32"]

  parts_sum = t["gqsgd_passes"] + t["allreduce_int8"]
  return {"num_elements": num_elements, "passes_s": t["gqsgd_passes"],
          "allreduce_int8_s": t["allreduce_int8"],
          "allreduce_f32_s": t["allreduce_f32"],
          "read_s": t["bucket_absmax"], "write_s": t["scale_f32"],
          "parts_sum_s": parts_sum,
          "parts_sum_vs_whole": parts_sum / t[HEADLINE_STRATEGY],
          "floor_s": floor(t), "floor_vs_fp32": floor(t) / t["none"],
          "cpu_floor_vs_fp32": floor(cpu) / cpu["none"]}


def run_fake_devices(sizes: Sequence[int], repeats: int, num_workers: int,
                     strategies: Sequence[str] | None = None, *,
                     seed: int = 0,
                     donate: bool = False) -> list[dict[str, Any]]:
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
        f"'jax_num_cpu_devices', {num_workers}) before JAX starts")
  return bench_mesh(sizes, repeats, "fake_devices", strategies,
                    devices=devices[:num_workers], seed=seed,
                    donate=donate)


def _worker_main(spec_path: str) -> None:
  """One process of the ``multiprocess`` setting (see :func:`run_multiprocess`).

  Joins the run, benchmarks over every process's device and, on process 0,
  writes the results to ``spec["out"]`` after each size (so a run cut short
  still leaves what it measured).
  """
  with open(spec_path) as f:
    spec = json.load(f)
  if not distributed.initialize():
    raise RuntimeError("compression_bench worker started outside a "
                       "multi-process launch")

  def write(results):
    if jax.process_index() != 0:
      return
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"results": results,
                 "device": str(jax.devices()[0].device_kind),
                 "backend": jax.default_backend()}, f)
    os.replace(tmp, spec["out"])

  donate = spec.get("donate", False)
  results = bench_mesh(spec["sizes"], spec["repeats"], "multiprocess",
                       spec["strategies"], seed=spec["seed"], on_size=write,
                       donate=donate)
  if spec.get("parts", False):
    bench_parts(spec["sizes"], spec["repeats"], seed=spec["seed"],
                donate=donate, on_size=lambda rows: write(results + rows))
  distributed.shutdown()


def run_multiprocess(sizes: Sequence[int], repeats: int, num_workers: int,
                     strategies: Sequence[str] | None = None, *,
                     seed: int = 0, timeout_s: float = 3600,
                     donate: bool = False,
                     parts: bool = False) -> list[dict[str, Any]]:
  """The ``multiprocess`` setting: ``num_workers`` localhost processes.

  The processes run this module (``python -m experiments.benches.compression
  SPEC``) under :func:`qsync_jax.parallel.distributed.launch`, which relays their
  output and SIGKILLs them all if one fails or ``timeout_s`` runs out.

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
    spec = {"sizes": [int(d) for d in sizes], "repeats": int(repeats),
            "strategies": names, "seed": int(seed), "donate": bool(donate),
            "parts": bool(parts), "out": os.path.join(tmp, "results.json")}
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    env = dict(os.environ)
    # The workers import this package from wherever this process did.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, env.get("PYTHONPATH")) if p)
    code = distributed.launch(
        [sys.executable, "-m", "experiments.benches.compression", spec_path],
        num_workers, timeout_s=timeout_s, env=env)
    measured = []
    if os.path.exists(spec["out"]):
      with open(spec["out"]) as f:
        measured = json.load(f)["results"]
  done = {(r["strategy"], r["num_elements"]) for r in measured}
  why = ("timed out" if code == distributed.TIMEOUT_EXIT_CODE
         else f"exited with code {code}")
  for d in spec["sizes"]:
    for name in names + (list(PARTS) if parts else []):
      if (name, d) not in done:
        measured.append({
            "setting": "multiprocess", "strategy": name, "num_elements": d,
            "num_workers": num_workers,
            **({"part": True} if name in PARTS else {}),
            "error": f"the {num_workers}-process run {why} before measuring "
                     "this (its output above says why)"})
  return measured


def time_ratio(results: Sequence[dict[str, Any]], setting: str,
               strategy: str = HEADLINE_STRATEGY,
               num_elements: int = HEADLINE_SIZE,
               baseline: str = "none") -> float | None:
  """``time_s`` of ``strategy`` over ``baseline``'s, or None if either is
  missing or failed."""
  times = {r["strategy"]: r.get("time_s") for r in results
           if r["setting"] == setting and r["num_elements"] == num_elements}
  a, b = times.get(strategy), times.get(baseline)
  return None if a is None or b is None else a / b


def _loadavg() -> list[float] | None:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return None


def run(sizes: Sequence[int] = DEFAULT_SIZES,
        repeats: int = DEFAULT_REPEATS,
        settings: Sequence[str] = SETTINGS, num_workers: int = 4,
        strategies: Sequence[str] | None = None, *, seed: int = 0,
        timeout_s: float = 3600, donate: bool = False,
        parts: bool = False) -> dict[str, Any]:
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
    or None per setting}, and with ``parts`` "gqsgd_floor": one
    :func:`floor_analysis` per size (None where a row is missing). Each
    result also gets ``time_vs_fp32``, its time over the float32 mean's at
    the same size and setting.

  Raises:
    ValueError: an unknown setting or strategy, a bad size, repeat count or
      worker count, or ``parts`` without the multiprocess setting or
      without both the float32 mean and the headline strategy.
  """
  settings = list(settings)
  bad = [s for s in settings if s not in SETTINGS]
  if bad or not settings:
    raise ValueError(f"settings must be a non-empty subset of "
                     f"{', '.join(SETTINGS)}, got {settings}")
  names = _check_arguments(sizes, repeats, strategies)
  sizes = [int(d) for d in sizes]
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1, got {num_workers}")
  if parts and "multiprocess" not in settings:
    raise ValueError("parts are timed in the multiprocess setting only; add "
                     f"it to settings (got {settings})")
  if parts and not {"none", HEADLINE_STRATEGY} <= set(names):
    raise ValueError(f"parts are compared with the strategies 'none' and "
                     f"{HEADLINE_STRATEGY!r}; include both (got {names})")

  info = {
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device": str(jax.devices()[0].device_kind),
      "cpu_count": os.cpu_count(),
      # The workers inherit it; glibc.malloc.hugetlb=1 backs big buffers
      # with transparent huge pages (see docs/RESULTS.md).
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
      "num_workers": num_workers,
      "sizes": sizes,
      "repeats": repeats,
      "calls_per_round": {str(d): calls_per_round(d) for d in sizes},
      "seed": seed,
      "donate": donate,
      "parts": list(PARTS) if parts else [],
      "data": _DATA_DOC,
      "strategies": {name: repr(averagers.make_averager(f, **kw))
                     for name, (f, kw) in STRATEGIES.items()
                     if name in names},
      "timing": ("time_s: median over repeats of wall seconds per call, "
                 "each round dispatching calls_per_round calls and waiting "
                 "for the last, after one warm-up call; strategies "
                 "interleaved round by round. cpu_s: the same rounds' CPU "
                 "seconds per call of the timing process (all threads)"),
      "rel_error": "||avg - exact|| / ||exact||, exact the float64 mean",
      "multiprocess": "one CPU device per process, gloo collectives over "
                      "localhost TCP; process 0's timings",
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
  results = []
  for setting in settings:
    start, load = time.monotonic(), _loadavg()
    if setting == "fake_devices":
      results += run_fake_devices(sizes, repeats, num_workers, names,
                                  seed=seed, donate=donate)
    else:
      results += run_multiprocess(sizes, repeats, num_workers, names,
                                  seed=seed, timeout_s=timeout_s,
                                  donate=donate, parts=parts)
    info["loadavg"][setting] = {"start": load, "end": _loadavg()}
    info["wall_s"][setting] = round(time.monotonic() - start, 1)
  for r in results:
    if "time_s" in r:
      r["time_vs_fp32"] = time_ratio(results, r["setting"], r["strategy"],
                                     r["num_elements"])
  report = {"settings": info, "results": results}
  for setting in SETTINGS:
    report[f"gqsgd_vs_fp32_time_ratio_16M_{setting}"] = (
        time_ratio(results, setting) if setting in settings else None)
  if parts:
    report["gqsgd_floor"] = [floor_analysis(results, d) for d in sizes]
  return report


if __name__ == "__main__":
  _worker_main(sys.argv[1])
