"""Timing jitted calls on the device at hand.

This module owns :func:`median_seconds`: the median wall time of a compiled
call, measured one blocking call at a time after warm-up, less the fixed cost
of dispatching and waiting for an empty call on the same device (which a
whole training step pays once, not once per layer).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

_OVERHEAD: dict[Any, float] = {}


#: Calls per burst; a repeat is the fastest call of its burst.
BURST = 3


def burst_median(run: Callable[[], Any], repeats: int, min_s: float = 0.0
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
  while len(bursts) < repeats or (time.perf_counter() - start < min_s
                                  and len(bursts) < 20 * repeats):
    best = float("inf")
    for _ in range(BURST):
      t = time.perf_counter()
      jax.block_until_ready(run())
      best = min(best, time.perf_counter() - t)
    bursts.append(best)
  return float(np.median(bursts))


def _raw(fn: Callable[..., Any], args: tuple, repeats: int, min_s: float
         ) -> float:
  return burst_median(lambda: fn(*args), repeats, min_s)


def call_overhead(device: jax.Device | None = None) -> float:
  """Seconds to dispatch and wait for an (almost) empty jitted call."""
  device = device or jax.devices()[0]
  if device not in _OVERHEAD:
    x = jax.device_put(jnp.zeros((4,), jnp.float32), device)
    _OVERHEAD[device] = _raw(jax.jit(lambda v: v + 1), (x,), 60, 0.05)
  return _OVERHEAD[device]


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int = 7,
                   min_s: float = 0.05, device: jax.Device | None = None,
                   subtract_overhead: bool = True) -> float:
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


def interleaved(calls: Mapping[Hashable, Callable[[], Any]], rounds: int = 9,
                device: jax.Device | None = None,
                subtract_overhead: bool = True, burst: int = BURST
                ) -> dict[Hashable, float]:
  """Times many calls in round-robin: the median of each call's bursts.

  Each round runs one burst (:data:`BURST` calls, the fastest kept) of every
  call in turn, so every call samples the machine's load over the same
  stretch of time; a slow minute then shifts no call against another.

  Args:
    calls: ``{key: fn}``; ``fn()`` dispatches the (compiled) work and returns
      its output.
    rounds: bursts per call.
    device: the device, for the dispatch overhead.
    subtract_overhead: subtract :func:`call_overhead` (floored at 0).
    burst: calls per burst.

  Returns:
    ``{key: seconds}``.
  """
  for fn in calls.values():  # compile and warm every call first
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
  bursts: dict[Hashable, list[float]] = {k: [] for k in calls}
  for _ in range(rounds):
    for key, fn in calls.items():
      best = float("inf")
      for _ in range(burst):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
      bursts[key].append(best)
  overhead = call_overhead(device) if subtract_overhead else 0.0
  return {k: max(float(np.median(v)) - overhead, 0.0)
          for k, v in bursts.items()}
