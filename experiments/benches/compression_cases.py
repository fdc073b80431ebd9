"""What every case of the compression benchmark shares: data, program, timing.

This module owns the pieces :mod:`experiments.benches.compression` (the
strategies) and :mod:`experiments.benches.compression_parts` (the pieces of
Global-QSGD's all-reduce) both build on: the strategies by name, the
gradient-like data every worker averages and its exact mean, the jitted
``shard_map`` all-reduce of an averager, and how a :class:`Case` is warmed
up, timed in rounds interleaved with the other cases, and turned into one
result row.

Timing: a round dispatches ``calls_per_round`` calls and waits for the last
(:func:`qsync_jax.predictor.timing.seconds_per_call`); the reported time is
the median over rounds. ``calls_per_round`` depends only on the size, as
every process of the multi-process run must make the same calls. The same
rounds also give ``cpu_s``, the timing process's CPU time per call: on a
machine with fewer cores than busy threads the wall time follows the total
CPU work, and ``cpu_s`` shows where it goes even when other load blurs
``time_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import statistics
import time
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np

from qsync_jax import cli
from qsync_jax.predictor import codec
from qsync_jax.predictor import collective_cost
from qsync_jax.predictor import communication
from qsync_jax.predictor import timing
from qsync_jax.predictor.codec import CodecCost
from qsync_jax.predictor.codec import fit_sizes

AXIS = "workers"
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
  # PyTorch DDP's comm hook baseline; rank 4 is the hook's common setting.
  "powersgd": ("powersgd", {"rank": 4}),
}
#: The headline: Global-QSGD (int8) against the float32 mean at 2**24 floats.
HEADLINE_STRATEGY = "gqsgd"
HEADLINE_SIZE = 1 << 24
# Elements per synthetic "layer": each has its own gradient magnitude.
_LAYER_SIZE = 1 << 14
# The per-worker (minibatch) noise against the shared (true) gradient.
_NOISE_STD = 2.0
#: How :func:`worker_data` makes the data, as the report states it.
DATA_DOC = (
  "worker i: mag * (g + 2 * e_i), g and e_i standard normal (g shared by "
  "all workers), mag lognormal(0, 1) per layer of 16384 elements; float32; "
  "equal weights 1/n"
)


def calls_per_round(num_elements: int) -> int:
  """Calls timed together at one size: about 4M elements' worth, at least 1."""
  return max(1, min(8, (1 << 22) // max(num_elements, 1)))


def worker_data(num_elements: int, worker: int, seed: int = 0) -> np.ndarray:
  """One worker's gradient-like float32 vector (see :data:`DATA_DOC`).

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
  mag = np.repeat(np.exp(shared.standard_normal(layers)), _LAYER_SIZE)[
    :num_elements
  ].astype(np.float32)
  g = shared.standard_normal(num_elements, dtype=np.float32)
  noise = np.random.default_rng([seed, 1, worker]).standard_normal(
    num_elements, dtype=np.float32
  )
  return mag * (g + np.float32(_NOISE_STD) * noise)


def exact_mean(
  num_elements: int, num_workers: int, seed: int = 0
) -> np.ndarray:
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
  """The first lines of an exception's message, for a result row."""
  text = f"{type(e).__name__}: {e}".strip()
  lines = [l for l in text.splitlines() if l.strip()]
  return " ".join(lines[:3])[:500]


@dataclasses.dataclass
class Case:
  """One strategy (or part) at one size: its program and what was measured.

  A case starts with ``name`` and ``args`` (and, for a part, ``fn``);
  :func:`warm_up` builds the rest, :func:`time_rounds` appends the timings
  and :func:`result_row` reports them.

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


def time_rounds(cases: Sequence[Case], repeats: int, calls: int) -> None:
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

      # The barrier above stays outside the timed block: it waits for the
      # slowest process, which is not this program's time. CPU seconds are a
      # second statistic of the same block, which the timing module does not
      # measure.
      cpu = time.process_time()
      case.rounds.append(timing.seconds_per_call(run_block, calls))
      case.cpu_rounds.append((time.process_time() - cpu) / calls)


def warm_up(case: Case, build=None) -> Any:
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


def result_row(case: Case, calls: int, **fields: Any) -> dict[str, Any]:
  """``fields`` plus the case's error or its timings."""
  if case.error is not None:
    return {**fields, "error": case.error}
  return {
    **fields,
    "time_s": statistics.median(case.rounds),
    "rounds_s": case.rounds,
    "cpu_s": statistics.median(case.cpu_rounds),
    "calls_per_round": calls,
  }


def print_row(label: str, row: dict[str, Any], detail: str = "") -> None:
  """One line of a result row: its error, or its times and ``detail``."""
  head = f"{label:12s} {row['strategy']:14s} {row['num_elements']:9d}: "
  if "error" in row:
    print(head + f"error: {row['error']}", flush=True)
  else:
    print(
      head + f"{row['time_s'] * 1e3:9.2f} ms  "
      f"(cpu {row['cpu_s'] * 1e3:8.2f} ms){detail}",
      flush=True,
    )


def copies(x: jax.Array, k: int, donate: bool) -> list[jax.Array]:
  """The inputs of ``k`` calls: ``x`` itself, or (donating) one copy each,
  made before any timer starts."""
  if not donate:
    return [x] * k
  return jax.block_until_ready([x.copy() for _ in range(k)])


def all_reduce_fn(averager, mesh, donate: bool = False):
  """The jitted shard_map: one (1, d) row per worker in, the mean out;
  ``donate`` gives the input rows' buffer to the program."""

  def body(x, w):
    return averager(x[0], w[0], AXIS)[None]

  return jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)
    ),
    donate_argnums=(0,) if donate else (),
  )


def first_row(out: jax.Array) -> np.ndarray:
  """This process's first row of the (n, d) output (all rows agree)."""
  return np.asarray(out.addressable_shards[0].data)[0]


@dataclasses.dataclass
class PredictionParts:
  """What the predictor times for the cases of one size, as part cases.

  Attributes:
    compiled: ``{case name: its compiled collectives}``.
    codecs: ``{case name: [its encode/decode part case at each fit size]}``.
    collectives: ``{(kind, HLO type): [its part case at each fit size]}``.
    codec_sizes, collective_sizes: the fit sizes (elements; operand bytes).
  """

  compiled: dict[str, list[Any]]
  codecs: dict[str, list[Case]]
  codec_sizes: list[int]
  collectives: dict[tuple[str, str], list[Case]]
  collective_sizes: dict[tuple[str, str], list[int]]

  def cases(self) -> list[Case]:
    """Every part case, for :func:`time_rounds`."""
    return [c for cs in self.codecs.values() for c in cs] + [
      c for cs in self.collectives.values() for c in cs
    ]


def _part(name: str, fn, args: tuple) -> Case:
  return Case(name, fn=fn, args=lambda k: [args] * k, barrier=True)


def priced(collectives: Sequence[Any]) -> list[Any]:
  """The collectives priced apart from the encode/decode: those its mesh
  program does not already time (:func:`qsync_jax.predictor.codec.
  timed_in_codec`)."""
  return [c for c in collectives if not codec.timed_in_codec(c.operand_bytes)]


def prediction_parts(
  cases: Sequence[Case],
  num_elements: int,
  devices: Sequence[jax.Device],
  sample=None,
) -> PredictionParts:
  """The parts of every case that ran, built to be timed with the cases.

  Each case's encode/decode (:func:`qsync_jax.predictor.codec.
  codec_programs` over the mesh of ``devices``: the workers meet where
  the collectives are, so the wait for the slowest is in it) at the size
  and a quarter of it, and each kind and type of collective its compiled
  program issues (:func:`qsync_jax.predictor.collective_cost.
  collective_programs`) at the largest operand it has here and a quarter of
  it. ``sample``, this worker's data, is what they run on: their speed on a
  CPU depends on the values.

  :func:`time_rounds` then times the parts in the same rounds as the
  cases, in blocks of as many calls. A host's speed drifts by more than
  the predictor's goal within one run, and a lone call pays its dispatch
  and start-up where back-to-back calls hide them: profiled after the
  measurement in blocks of three, the parts at 10 Gbit/s summed to 13-18%
  off the whole in either direction.
  """
  mesh = Mesh(np.array(list(devices)), (AXIS,))
  ran = [case for case in cases if case.fn is not None]
  compiled = {
    case.name: communication.compiled_collectives(
      case.averager, num_elements, devices
    )
    for case in ran
  }
  codec_sizes = fit_sizes(num_elements)
  codecs = {
    case.name: [
      _part(f"{case.name} codec {d}", fn, args)
      for d, (fn, args) in zip(
        codec_sizes,
        codec.codec_programs(
          case.averager, codec_sizes, mesh=mesh, sample=sample
        ),
      )
    ]
    for case in ran
  }
  # Each kind and type is fitted at the largest operand it is used at and a
  # quarter of it: fitted further below, the line missed what the host's
  # caches stop holding (the float32 mean fitted at 1/16 and 1/4 of 64 MiB
  # came out 8% short at 1 Gbit/s, float16's 32%).
  largest: dict[tuple[str, str], float] = {}
  for c in (c for cs in compiled.values() for c in priced(cs)):
    key = (c.kind, c.dtype)
    largest[key] = max(largest.get(key, 0.0), c.operand_bytes)
  sizes = {
    key: fit_sizes(max(int(top), 1 << 14))
    for key, top in sorted(largest.items())
  }
  collectives = {
    key: [
      _part(f"{key[0]} {key[1]} {b}", fn, args)
      for b, (fn, args) in zip(
        sizes[key],
        collective_cost.collective_programs(*key, devices, sizes[key], sample),
      )
    ]
    for key in sizes
  }
  return PredictionParts(compiled, codecs, codec_sizes, collectives, sizes)


def predict_cases(
  cases: Sequence[Case],
  parts: PredictionParts,
  num_elements: int,
  devices: Sequence[jax.Device],
  link: communication.Link,
) -> dict[str, dict[str, Any]]:
  """The predictor's time for every case that ran, from its parts' rounds.

  Two predictions per case, both with the encode/decode fitted from its
  parts (:func:`prediction_parts`, timed by :func:`time_rounds`):

  * ``predicted_s``: the compiled program's collectives (their kinds and
    wire types at this size; XLA:CPU widens bfloat16), each priced by the
    line through the same kind and type timed alone: the link as these
    processes' CPUs drive it;
  * ``predicted_link_s``: the bytes the compiled program moves over the
    link's measured rate, plus its latency steps (the model that needs no
    access to the link).

  Both leave out the small collectives the encode/decode's program already
  times (:func:`priced`); ``moved_bytes`` counts every collective.

  Returns:
    ``{case name: {"predicted_s", "predicted_link_s", "moved_bytes",
    "wire_s", "latency_s", "collectives_s", "collectives_in_codec",
    "collective_fits", "codec_s", "codec_fit"}}``.
  """

  def fit(sizes, part_cases):
    return CodecCost.fit(
      sizes, [statistics.median(c.rounds) for c in part_cases]
    )

  n = len(devices)
  measured = collective_cost.CollectiveCost(
    {
      key: fit(parts.collective_sizes[key], cs)
      for key, cs in parts.collectives.items()
    }
  )
  fits = measured.to_dict()
  out: dict[str, dict[str, Any]] = {}
  for case in cases:
    if case.name not in parts.codecs:
      continue
    compiled = parts.compiled[case.name]
    apart = priced(compiled)
    traffic = communication.averager_traffic(
      case.averager, num_elements, n, devices=devices, compiled=compiled
    )
    # The bytes and ring steps of the priced collectives as compiled.
    traffic_apart = communication.traffic_of(apart, n)
    cost = fit(parts.codec_sizes, parts.codecs[case.name])
    out[case.name] = {
      "predicted_s": communication.averaging_time(
        case.averager,
        num_elements,
        n,
        link,
        cost,
        measured=measured,
        collectives=apart,
      ),
      "predicted_link_s": communication.averaging_time(
        case.averager, num_elements, n, link, cost, traffic=traffic_apart
      ),
      "moved_bytes": traffic.bytes,
      "wire_s": link.wire_time(traffic_apart.bytes, n),
      "latency_s": traffic_apart.steps * link.latency_s,
      "collectives_s": measured(apart),
      "collectives_in_codec": len(compiled) - len(apart),
      "collective_fits": {
        f"{c.kind} {c.dtype}": fits[f"{c.kind} {c.dtype}"] for c in apart
      },
      "codec_s": cost(num_elements),
      "codec_fit": cost.to_dict(),
    }
  return out


def check_arguments(
  sizes: Sequence[int], repeats: int, strategies: Sequence[str] | None
) -> list[str]:
  """Validates the shared arguments; returns the strategy names to run."""
  names = list(STRATEGIES) if strategies is None else list(strategies)
  cli.check_names("strategy", names, STRATEGIES)
  if not sizes or min(int(d) for d in sizes) < 1:
    raise ValueError(f"sizes must be positive, got {list(sizes)}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  return names
