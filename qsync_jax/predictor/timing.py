"""Timing jitted calls on the device at hand.

This module owns :func:`median_seconds`: the median wall time of a compiled
call, measured one blocking call at a time after warm-up, less the fixed cost
of dispatching and waiting for an empty call on the same device (which a
whole training step pays once, not once per layer); and :func:`interleaved`,
which times many calls round-robin and repeats a burst that the hypervisor
stole CPU time from (:class:`StealMeter`); and :func:`seconds_per_call`,
the throughput of a block of calls dispatched back to back, for benchmarks
that compare whole steps as training runs them, and its median over blocks
(:func:`median_block_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
import time
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

_OVERHEAD: dict[Any, float] = {}
#: The keys of the calls :func:`interleaved` times.
_K = TypeVar("_K", bound=Hashable)


#: Calls per burst; a repeat is the fastest call of its burst.
BURST = 3


def _fastest(run: Callable[[], Any], calls: int) -> float:
  """Seconds of the fastest of ``calls`` blocking calls of ``run``."""
  best = float("inf")
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(run())
    best = min(best, time.perf_counter() - t)
  return best


def burst_median(
  run: Callable[[], Any], repeats: int, min_s: float = 0.0
) -> float:
  """Median over repeats of the fastest of ``BURST`` blocking calls.

  Other work on a shared machine only ever adds time to a call; the fastest
  call of a short burst sheds most of that interference, and the median over
  bursts sheds the bursts it hit throughout. The same statistic times the
  pieces of a profile and the steps they are checked against.
  """
  jax.block_until_ready(run())  # compile
  jax.block_until_ready(run())  # warm caches
  bursts: list[float] = []
  start = time.perf_counter()
  while len(bursts) < repeats or (
    time.perf_counter() - start < min_s and len(bursts) < 20 * repeats
  ):
    bursts.append(_fastest(run, BURST))
  return float(np.median(bursts))


def _raw(
  fn: Callable[..., Any], args: tuple, repeats: int, min_s: float
) -> float:
  return burst_median(lambda: fn(*args), repeats, min_s)


def call_overhead(device: jax.Device | None = None) -> float:
  """Seconds to dispatch and wait for an (almost) empty jitted call."""
  device = device or jax.devices()[0]
  if device not in _OVERHEAD:
    x = jax.device_put(jnp.zeros((4,), jnp.float32), device)
    _OVERHEAD[device] = _raw(jax.jit(lambda v: v + 1), (x,), 60, 0.05)
  return _OVERHEAD[device]


def median_seconds(
  fn: Callable[..., Any],
  *args: Any,
  repeats: int = 7,
  min_s: float = 0.05,
  device: jax.Device | None = None,
  subtract_overhead: bool = True,
) -> float:
  """Median seconds of ``fn(*args)`` (a jitted function), compiled and warm.

  Args:
    fn: the jitted function.
    *args: its arguments (already on ``device``).
    repeats: at least this many timed calls.
    min_s: keep timing (up to ``20 * repeats`` calls) until this long passed.
    device: the device, for the dispatch overhead.
    subtract_overhead: subtract :func:`call_overhead` (floored at 0).
  """
  t = _raw(fn, args, repeats, min_s)
  if subtract_overhead:
    t = max(t - call_overhead(device), 0.0)
  return t


def seconds_per_call(run_block: Callable[[int], Any], calls: int) -> float:
  """Seconds per call of ``run_block(calls)``, with dispatch pipelined.

  Args:
    run_block: ``run_block(n)`` dispatches ``n`` calls and waits for the
      last (as a training loop does: one blocking wait per block).
    calls: how many calls the block runs.

  Returns:
    The block's wall time divided by ``calls``.
  """
  start = time.perf_counter()
  run_block(calls)
  return (time.perf_counter() - start) / calls


def median_block_seconds(
  fn: Callable[..., Any],
  args: tuple,
  repeats: int,
  calls: int,
  sync: Callable[[], Any] | None = None,
) -> float:
  """Median over ``repeats`` blocks of ``calls`` back-to-back ``fn(*args)``
  calls, in seconds per call (:func:`seconds_per_call`).

  ``sync`` (a barrier across processes) runs before each block, outside the
  timer, so processes that share a host time the same calls.
  """

  def block(k):
    out = None
    for _ in range(k):
      out = fn(*args)
    jax.block_until_ready(out)

  rounds = []
  for _ in range(repeats):
    if sync is not None:
      sync()
    rounds.append(seconds_per_call(block, calls))
  return float(np.median(rounds))


class StealMeter:
  """CPU time the hypervisor stole from this virtual machine.

  Reads the ``steal`` column of Linux's ``/proc/stat`` (all CPUs, in clock
  ticks). On a shared cloud host, stolen time lengthens a long call (a whole
  step) for sure but a short one (a layer) only sometimes, and the fastest of
  a burst of short calls escapes it, so a profile's pieces would add up to
  less than the step they are checked against. Where ``/proc/stat`` does not
  exist, :attr:`available` is False and nothing counts as stolen.
  """

  PATH = "/proc/stat"

  def __init__(self):
    self.available = self._read() is not None
    self.total_stolen = 0
    self.total_ticks = 0

  def _read(self) -> tuple[int, int] | None:
    try:
      with open(self.PATH) as f:
        fields = f.readline().split()
    except OSError:
      return None
    # cpu user nice system idle iowait irq softirq steal ...
    if len(fields) < 9:  # a kernel without the steal column
      return None
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)

  def mark(self) -> tuple[int, int] | None:
    """The counters now, for :meth:`fraction_since`."""
    return self._read() if self.available else None

  def fraction_since(self, mark: tuple[int, int] | None) -> float:
    """The share of all CPUs' time stolen since ``mark`` (0 when unknown)."""
    now = self.mark()
    if mark is None or now is None or now[1] <= mark[1]:
      return 0.0
    stolen, ticks = now[0] - mark[0], now[1] - mark[1]
    self.total_stolen += stolen
    self.total_ticks += ticks
    return stolen / ticks

  @property
  def overall_fraction(self) -> float:
    """The stolen share over every interval measured so far."""
    return self.total_stolen / self.total_ticks if self.total_ticks else 0.0


def interleaved(
  calls: Mapping[_K, Callable[[], Any]],
  rounds: int = 9,
  device: jax.Device | None = None,
  subtract_overhead: bool = True,
  burst: int = BURST,
  max_steal: float = 0.05,
  retries: int = 3,
  meter: StealMeter | None = None,
) -> dict[_K, float]:
  """Times many calls in round-robin: the median of each call's bursts.

  Each round runs one burst (:data:`BURST` calls, the fastest kept) of every
  call in turn, so every call samples the machine's load over the same
  stretch of time; a slow minute then shifts no call against another. A burst
  during which the hypervisor stole more than ``max_steal`` of the CPUs'
  time is run again, up to ``retries`` times, and the least-stolen attempt
  counts.

  Args:
    calls: ``{key: fn}``; ``fn()`` dispatches the (compiled) work and returns
      its output.
    rounds: bursts per call.
    device: the device, for the dispatch overhead.
    subtract_overhead: subtract :func:`call_overhead` (floored at 0).
    burst: calls per burst.
    max_steal: the stolen share above which a burst is run again.
    retries: extra attempts per burst.
    meter: the :class:`StealMeter` to use (to read its totals afterwards).

  Returns:
    ``{key: seconds}``.
  """
  meter = meter or StealMeter()
  for fn in calls.values():  # compile and warm every call first
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
  bursts: dict[_K, list[float]] = {k: [] for k in calls}
  for _ in range(rounds):
    for key, fn in calls.items():
      chosen, least = float("inf"), float("inf")
      for _ in range(1 + retries):
        mark = meter.mark()
        best = _fastest(fn, burst)
        stolen = meter.fraction_since(mark)
        if stolen < least:
          chosen, least = best, stolen
        if stolen <= max_steal:
          break
      bursts[key].append(chosen)
  overhead = call_overhead(device) if subtract_overhead else 0.0
  return {
    k: max(float(np.median(v)) - overhead, 0.0) for k, v in bursts.items()
  }
