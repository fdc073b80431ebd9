"""The pieces of Global-QSGD's all-reduce, the floor they put under it, and
whether an all-reduce runs alongside compute.

This module owns the ``--parts`` analysis of the compression benchmark:
:func:`bench_parts` times, across the processes of the multi-process
setting, the :data:`PARTS` of the headline strategy's all-reduce (the int8
and float32 all-reduces alone, Global-QSGD's own passes without any
collective, and a read and a read-and-write pass over the data), and
:func:`floor_analysis` turns them into a floor under Global-QSGD's time on
the machine at hand; :func:`overlap_analysis` says how much of an
all-reduce the runtime hides behind independent compute.
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from experiments.benches.compression_cases import all_reduce_fn
from experiments.benches.compression_cases import AXIS
from experiments.benches.compression_cases import calls_per_round
from experiments.benches.compression_cases import Case
from experiments.benches.compression_cases import check_arguments
from experiments.benches.compression_cases import copies
from experiments.benches.compression_cases import HEADLINE_SIZE
from experiments.benches.compression_cases import HEADLINE_STRATEGY
from experiments.benches.compression_cases import print_row
from experiments.benches.compression_cases import result_row
from experiments.benches.compression_cases import STRATEGIES
from experiments.benches.compression_cases import time_rounds
from experiments.benches.compression_cases import warm_up
from experiments.benches.compression_cases import worker_data
from qsync_jax.parallel import averagers
from qsync_jax.parallel import buckets

#: The pieces of the headline strategy's all-reduce, timed with ``parts``
#: (multiprocess setting): a ``psum`` of the float32 data alone and of int8
#: codes alone; Global-QSGD over a one-worker mesh of each process's own
#: device, which keeps its bucket max, encode and decode passes and drops its
#: collectives; the bucket max alone, one read of the float32 data at the
#: speed XLA:CPU reads it (:func:`qsync_jax.parallel.buckets.bucket_absmax`);
#: and ``2 x``, one read and one write of it, into a fresh buffer or
#: (donating) in place, as the decode's output is. Then whether an average
#: runs alongside compute (:func:`overlap_analysis`): ``compute``, a chain
#: of matrix products on each process's own devices; the int8 ``psum``
#: dispatched and that compute dispatched after it, both awaited together;
#: the two in one program, neither reading the other's output; the
#: ``psum`` run by a second thread while this one dispatches the compute
#: (XLA:CPU runs a program dispatched from one thread after the programs
#: dispatched before it, unless it is cheap enough to run inline); and the
#: whole Global-QSGD average from a second thread beside the compute.
PARTS = (
  "allreduce_f32",
  "allreduce_int8",
  "gqsgd_passes",
  "bucket_absmax",
  "scale_f32",
  "compute",
  "allreduce_int8_then_compute",
  "allreduce_int8_with_compute",
  "allreduce_int8_beside_compute",
  "gqsgd_beside_compute",
)
#: The ``compute`` part: this many products of a (side, side) float32 block.
COMPUTE_MATMULS = 24
COMPUTE_SIDE = 512


def _matmuls(a: jax.Array) -> jax.Array:
  """The ``compute`` part's work on one (side, side) block."""
  for _ in range(COMPUTE_MATMULS):
    a = jnp.tanh(a @ a)
  return a


def _psum_fn(mesh, donate: bool):
  """The jitted shard_map of a bare ``psum``: one (1, d) row per worker."""
  return jax.jit(
    jax.shard_map(
      lambda x: jax.lax.psum(x[0], AXIS)[None],
      mesh=mesh,
      in_specs=P(AXIS),
      out_specs=P(AXIS),
    ),
    donate_argnums=(0,) if donate else (),
  )


def _beside(pool, average, compute, *args):
  """``average(*args[:-1])`` run by a thread of ``pool`` while this thread
  dispatches ``compute(args[-1])``: both outputs, the average's once it has
  finished."""
  pending = pool.submit(lambda: jax.block_until_ready(average(*args[:-1])))
  out = compute(args[-1])
  return pending.result(), out


def _part_programs(
  mesh: Mesh,
  local_mesh: Mesh,
  gqsgd: Any,
  donate: bool,
  pool: concurrent.futures.ThreadPoolExecutor,
) -> dict[str, Any]:
  """Each of the :data:`PARTS`' functions: over all workers (``mesh``) or
  this process's own (``local_mesh``); ``pool`` runs the averages that go
  beside compute."""
  psum = _psum_fn(mesh, donate)
  compute = jax.jit(
    jax.shard_map(
      _matmuls, mesh=local_mesh, in_specs=P(AXIS), out_specs=P(AXIS)
    )
  )
  return {
    "allreduce_f32": psum,
    "allreduce_int8": psum,
    "gqsgd_passes": all_reduce_fn(gqsgd, local_mesh, donate),
    # As Global-QSGD reads its bucket maxima.
    "bucket_absmax": jax.jit(lambda x: buckets.absmax(x[0], gqsgd.bucket_size)),
    "scale_f32": jax.jit(
      lambda x: 2 * x, donate_argnums=(0,) if donate else ()
    ),
    "compute": compute,
    "allreduce_int8_then_compute": lambda c, a: (psum(c), compute(a)),
    "allreduce_int8_beside_compute": functools.partial(
      _beside, pool, psum, compute
    ),
    "gqsgd_beside_compute": functools.partial(
      _beside, pool, all_reduce_fn(gqsgd, mesh, donate), compute
    ),
    "allreduce_int8_with_compute": jax.jit(
      jax.shard_map(
        lambda c, a: (jax.lax.psum(c[0], AXIS)[None], _matmuls(a)),
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), P(AXIS)),
      ),
      donate_argnums=(0,) if donate else (),
    ),
  }


def _codes(rows: np.ndarray, levels: int) -> np.ndarray:
  """int8 codes of ``rows`` on ``levels`` levels (round to nearest)."""
  scale = np.abs(rows).max(axis=1, keepdims=True) / levels
  return np.clip(np.round(rows / scale), -levels, levels).astype(np.int8)


def _part_args(
  data: jax.Array, rest: tuple, donate: bool, k: int
) -> list[tuple]:
  """The arguments of ``k`` calls: ``(data copy, *rest)`` each."""
  return [(a, *rest) for a in copies(data, k, donate)]


def bench_parts(
  sizes: Sequence[int],
  repeats: int,
  *,
  seed: int = 0,
  donate: bool = False,
  report: bool = True,
  on_size=None,
) -> list[dict[str, Any]]:
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
      :func:`experiments.benches.compression.bench_mesh`); the bucket max
      reads its input and never takes it.
    report: print one line per part (from process 0 only).
    on_size: called with the rows so far after each size.

  Returns:
    One dict per (size, part): {setting: "multiprocess", strategy (the
    part's name), part: True, num_elements, num_workers, time_s, rounds_s,
    cpu_s, calls_per_round}, or an ``error`` instead of the timings.

  Raises:
    ValueError: a size below 1 or ``repeats`` below 1.
  """
  check_arguments(sizes, repeats, [])
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  local = [
    i
    for i, dev in enumerate(devices)
    if dev.process_index == jax.process_index()
  ]
  local_mesh = Mesh(np.array([devices[i] for i in local]), (AXIS,))
  local_sharding = NamedSharding(local_mesh, P(AXIS))
  factory, kwargs = STRATEGIES[HEADLINE_STRATEGY]
  gqsgd = averagers.make_averager(factory, **kwargs)
  say = report and jax.process_index() == 0
  # The thread that runs an average beside this one's compute.
  pool = concurrent.futures.ThreadPoolExecutor(1)
  programs = _part_programs(mesh, local_mesh, gqsgd, donate, pool)
  side = COMPUTE_SIDE
  block = np.full((side, side), 1.0 / side, np.float32)
  a_local = jax.device_put(np.tile(block, (len(local), 1)), local_sharding)
  a_all = jax.make_array_from_process_local_data(
    sharding, np.tile(block, (len(local), 1)), (n * side, side)
  )
  rows_out = []
  for d in map(int, sizes):
    rows = np.stack([worker_data(d, i, seed) for i in local])
    x = jax.make_array_from_process_local_data(sharding, rows, (n, d))
    codes = jax.make_array_from_process_local_data(
      sharding, _codes(rows, gqsgd.levels(n)), (n, d)
    )
    x_local = jax.device_put(rows, local_sharding)
    w_local = jax.device_put(
      np.full(len(local), 1.0 / n, np.float32), local_sharding
    )
    w_all = jax.make_array_from_process_local_data(
      sharding, np.full(len(local), 1.0 / n, np.float32), (n,)
    )
    del rows
    # Each call's arguments: (copies of) the float32 rows or the int8
    # codes of all workers, or this process's own rows.
    args = {
      "allreduce_f32": functools.partial(_part_args, x, (), donate),
      "allreduce_int8": functools.partial(_part_args, codes, (), donate),
      "gqsgd_passes": functools.partial(
        _part_args, x_local, (w_local,), donate
      ),
      "bucket_absmax": functools.partial(_part_args, x_local, (), False),
      "scale_f32": functools.partial(_part_args, x_local, (), donate),
      "compute": functools.partial(_part_args, a_local, (), False),
      "allreduce_int8_then_compute": functools.partial(
        _part_args, codes, (a_local,), donate
      ),
      "allreduce_int8_with_compute": functools.partial(
        _part_args, codes, (a_all,), donate
      ),
      "allreduce_int8_beside_compute": functools.partial(
        _part_args, codes, (a_local,), donate
      ),
      "gqsgd_beside_compute": functools.partial(
        _part_args, x, (w_all, a_local), donate
      ),
    }
    calls = calls_per_round(d)
    cases = []
    for name in PARTS:
      case = Case(
        name,
        fn=programs[name],
        args=args[name],
        barrier=not name.startswith("allreduce"),
      )
      cases.append(case)
      warm_up(case)
    time_rounds(cases, repeats, calls)
    for case in cases:
      row = result_row(
        case,
        calls,
        setting="multiprocess",
        strategy=case.name,
        part=True,
        num_elements=d,
        num_workers=n,
      )
      if say:
        print_row("part", row)
      rows_out.append(row)
    del x, codes, x_local, cases
    if on_size is not None:
      on_size(rows_out)
  pool.shutdown()
  return rows_out


def floor_analysis(
  results: Sequence[dict[str, Any]], num_elements: int = HEADLINE_SIZE
) -> dict[str, Any] | None:
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
  rows = {
    r["strategy"]: r
    for r in results
    if r["setting"] == "multiprocess" and r["num_elements"] == num_elements
  }
  need = (*PARTS, HEADLINE_STRATEGY, "none")
  if any("time_s" not in rows.get(name, {}) for name in need):
    return None
  t = {name: rows[name]["time_s"] for name in need}
  cpu = {name: rows[name]["cpu_s"] for name in need}

  def floor(v):
    return v["allreduce_int8"] + 2 * v["bucket_absmax"] + v["scale_f32"]

  parts_sum = t["gqsgd_passes"] + t["allreduce_int8"]
  return {
    "num_elements": num_elements,
    "passes_s": t["gqsgd_passes"],
    "allreduce_int8_s": t["allreduce_int8"],
    "allreduce_f32_s": t["allreduce_f32"],
    "read_s": t["bucket_absmax"],
    "write_s": t["scale_f32"],
    "parts_sum_s": parts_sum,
    "parts_sum_vs_whole": parts_sum / t[HEADLINE_STRATEGY],
    "floor_s": floor(t),
    "floor_vs_fp32": floor(t) / t["none"],
    "cpu_floor_vs_fp32": floor(cpu) / cpu["none"],
  }


def _hidden(alone_a: float, alone_b: float, together: float) -> float:
  """The share of the shorter of two pieces that ran alongside the other:
  1 when together they take the longer one's time, 0 when their sum."""
  return (alone_a + alone_b - together) / min(alone_a, alone_b)


def overlap_analysis(
  results: Sequence[dict[str, Any]], num_elements: int = HEADLINE_SIZE
) -> dict[str, Any] | None:
  """Whether an average runs alongside compute, at one size.

  A local-SGD average hides behind the next steps' compute only if the
  runtime runs the two at once. Each ``hidden_*`` says how much of the
  shorter piece was hidden (1: the pair took the longer piece's time
  alone; 0: the sum of both) when the int8 all-reduce and the compute
  were dispatched one after the other from one thread (``dispatched``),
  were one program with no data flowing between them (``one_program``),
  or the all-reduce ran from a second thread (``threaded``); and when the
  whole Global-QSGD average ran from a second thread (``gqsgd_threaded``,
  against the headline strategy's own row). ``gqsgd_threaded_cpu_s`` is
  that pair's CPU time per process: where the processes share a host's
  cores, their CPU time over the cores bounds the pair's wall time from
  below however well the two overlap.

  Returns:
    {num_elements, allreduce_int8_s, compute_s, dispatched_s,
    one_program_s, threaded_s, hidden_dispatched, hidden_one_program,
    hidden_threaded, gqsgd_s, gqsgd_threaded_s, hidden_gqsgd_threaded,
    gqsgd_threaded_cpu_s} (the ``gqsgd`` ones None without the headline
    strategy's row), or None if a needed part is missing or failed.
  """
  rows = {
    r["strategy"]: r
    for r in results
    if r["setting"] == "multiprocess" and r["num_elements"] == num_elements
  }
  pairs = {
    "dispatched": "allreduce_int8_then_compute",
    "one_program": "allreduce_int8_with_compute",
    "threaded": "allreduce_int8_beside_compute",
  }
  need = ("allreduce_int8", "compute", "gqsgd_beside_compute", *pairs.values())
  if any("time_s" not in rows.get(name, {}) for name in need):
    return None
  t = {name: rows[name]["time_s"] for name in need}
  ar, compute = t["allreduce_int8"], t["compute"]
  out: dict[str, Any] = {
    "num_elements": num_elements,
    "allreduce_int8_s": ar,
    "compute_s": compute,
  }
  out |= {f"{key}_s": t[part] for key, part in pairs.items()}
  out |= {
    f"hidden_{key}": _hidden(ar, compute, t[part])
    for key, part in pairs.items()
  }
  whole = rows.get(HEADLINE_STRATEGY, {}).get("time_s")
  beside = rows["gqsgd_beside_compute"]
  out |= {
    "gqsgd_s": whole,
    "gqsgd_threaded_s": beside["time_s"],
    "hidden_gqsgd_threaded": (
      None if whole is None else _hidden(whole, compute, beside["time_s"])
    ),
    "gqsgd_threaded_cpu_s": beside["cpu_s"],
  }
  return out
