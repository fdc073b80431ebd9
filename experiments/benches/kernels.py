"""Throughput of the Pallas kernels against XLA's dots.

For each square size ``n`` :func:`run` times

* the kernels: ``int8_matmul`` (per-row / per-column scales, float32 out),
  ``fp8_matmul`` (e4m3 x e4m3), ``quantize`` (per row, stochastic) and
  ``gqsgd_encode`` (n buckets of n, 31 levels);
* XLA: the int8 dot (``preferred_element_type=int32``), the bfloat16 dot,
  the float32 dot at ``Precision.HIGHEST`` (true FP32, not TF32), and the
  jnp references of ``quantize`` and ``gqsgd_encode`` (what XLA fuses them
  into);

and reports seconds per call, TFLOP/s (``2 n**3`` per GEMM) or GB/s (bytes
read and written once) and the throughput ratios int8_pallas / bf16_xla,
fp8_pallas / bf16_xla and int8_pallas / int8_xla (> 1: the kernel is
faster). Off a GPU the kernels run in Pallas interpret mode: those figures
measure the interpreter, not the kernel, and the output says so.

Timing uses :func:`qsync_jax.predictor.timing.seconds_per_call` (a block of
calls timed together, then ``block_until_ready``) with the median over
rounds, the statistic the compression bench reports too.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.gqsgd_encode import gqsgd_encode
from pallas_kernels.gqsgd_encode import gqsgd_encode_reference
from pallas_kernels.int8_matmul import int8_matmul
from pallas_kernels.quantize import quantize
from pallas_kernels.quantize import quantize_reference
from qsync_jax.predictor.timing import seconds_per_call

GPU_SIZES = (1024, 2048, 4096, 8192)
CPU_SIZES = (256, 512)
INTERPRET_NOTE = "interpret-mode figures on CPU are not meaningful"
_LEVELS = 31  # floor(127 / 4): an int8 wire for 4 workers


def default_sizes() -> tuple[int, ...]:
  """1024..8192 on a GPU; 256, 512 elsewhere (interpret mode is slow)."""
  return GPU_SIZES if _common.on_gpu() else CPU_SIZES


def _gemm_params(kernel: str) -> dict[str, int]:
  """Triton tiles per kernel: the fastest of an H100 sweep (docs/RESULTS.md).

  24 tilings (block_m, block_n in 128/256, block_k 64/128, 4/8 warps, 3/4
  stages) at n = 4096 and 8192 on jax 0.11.2; the same tiling won at both.
  """
  if not _common.on_gpu():
    return dict(block_m=128, block_n=128, block_k=128)  # few interpreter steps
  if kernel == "int8":
    return dict(
      block_m=256, block_n=128, block_k=128, num_warps=8, num_stages=4
    )
  return dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)


def _time(fn: Callable, args, repeats: int, steps: int) -> float:
  """Median seconds per call of the jitted ``fn`` (compiled first)."""
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))

  def run_block(k):
    out = None
    for _ in range(k):
      out = f(*args)
    jax.block_until_ready(out)

  return statistics.median(
    seconds_per_call(run_block, steps) for _ in range(repeats)
  )


def _cases(n: int, seed: int) -> dict[str, tuple[Callable, tuple, str, float]]:
  """name -> (fn, args, unit, work): work in flops or bytes."""
  rng = np.random.default_rng(seed)
  i8 = lambda: jnp.asarray(rng.integers(-127, 128, (n, n)), jnp.int8)
  x8, w8 = i8(), i8()
  xf = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
  wf = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
  sx = jnp.asarray(rng.uniform(0.001, 0.01, n), jnp.float32)
  sw = jnp.asarray(rng.uniform(0.001, 0.01, n), jnp.float32)
  e4x, e4w = xf.astype(jnp.float8_e4m3fn), wf.astype(jnp.float8_e4m3fn)
  bx, bw = xf.astype(jnp.bfloat16), wf.astype(jnp.bfloat16)
  m = jnp.max(jnp.abs(xf), axis=1)
  flops = 2.0 * n**3
  elem_bytes = n * n * (4 + 1) + 4 * n  # f32 in, int8 out, one scale a row
  return {
    "int8_pallas": (
      functools.partial(int8_matmul, **_gemm_params("int8")),
      (x8, w8, sx, sw),
      "tflops",
      flops,
    ),
    "fp8_pallas": (
      functools.partial(fp8_matmul, **_gemm_params("fp8")),
      (e4x, e4w, sx, sw),
      "tflops",
      flops,
    ),
    "int8_xla": (
      lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32),
      (x8, w8),
      "tflops",
      flops,
    ),
    "bf16_xla": (jnp.dot, (bx, bw), "tflops", flops),
    "fp32_xla": (
      functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST),
      (xf, wf),
      "tflops",
      flops,
    ),
    "quantize_pallas": (
      lambda x, s: quantize(
        x, s, rounding="stochastic", salt=1, block_rows=32, block_cols=256
      ),
      (xf, sx),
      "gbps",
      elem_bytes,
    ),
    "quantize_xla": (
      lambda x, s: quantize_reference(x, s, rounding="stochastic", salt=1),
      (xf, sx),
      "gbps",
      elem_bytes,
    ),
    "gqsgd_encode_pallas": (
      lambda y, m: gqsgd_encode(
        y, m, _LEVELS, seed=1, block_rows=8, block_cols=512
      ),
      (xf, m),
      "gbps",
      elem_bytes,
    ),
    "gqsgd_encode_xla": (
      lambda y, m: gqsgd_encode_reference(y, m, _LEVELS, seed=1),
      (xf, m),
      "gbps",
      elem_bytes,
    ),
  }


def _ratio(kernels: dict, a: str, b: str) -> float | None:
  ta, tb = kernels[a].get("seconds"), kernels[b].get("seconds")
  return None if ta is None or tb is None else tb / ta


def run(
  sizes=None,
  repeats: int = 5,
  steps: int = 3,
  seed: int = 0,
  log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
  """Times every kernel and XLA dot at each size.

  Args:
    sizes: square sizes; ``None``: :func:`default_sizes`.
    repeats: timed rounds per case (the median is reported).
    steps: calls per timed round.
    seed: data seed.
    log: called with one line per size (``None``: silent).

  Returns:
    JSON-ready dict: device_kind, backend, jax_version, interpret_mode,
    (note), sizes, repeats, steps, results: [{size, kernels: {name:
    {seconds, tflops | gbps} or {error}}, ratios: {...}}]. A kernel that
    fails (e.g. fp8 on a GPU below sm_89) is recorded with its error.

  Raises:
    ValueError: a non-positive size, repeats or steps.
  """
  sizes = tuple(default_sizes() if sizes is None else sizes)
  if not sizes or min(sizes) < 1 or repeats < 1 or steps < 1:
    raise ValueError(
      f"sizes, repeats and steps must be positive, got "
      f"{sizes}, {repeats}, {steps}"
    )
  interpret = _common.resolve_interpret(None)
  out: dict[str, Any] = {
    "device_kind": jax.devices()[0].device_kind,
    "backend": jax.default_backend(),
    "jax_version": jax.__version__,
    "interpret_mode": interpret,
    "sizes": list(sizes),
    "repeats": repeats,
    "steps": steps,
    "results": [],
  }
  if interpret:
    out["note"] = INTERPRET_NOTE
  for n in sizes:
    kernels = {}
    for name, (fn, args, unit, work) in _cases(n, seed).items():
      try:
        t = _time(fn, args, repeats, steps)
      except Exception as e:  # pylint: disable=broad-except
        kernels[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        continue
      scale = 1e12 if unit == "tflops" else 1e9
      kernels[name] = {"seconds": t, unit: work / t / scale}
    ratios = {
      "int8_pallas_over_bf16_xla": _ratio(kernels, "int8_pallas", "bf16_xla"),
      "fp8_pallas_over_bf16_xla": _ratio(kernels, "fp8_pallas", "bf16_xla"),
      "int8_pallas_over_int8_xla": _ratio(kernels, "int8_pallas", "int8_xla"),
    }
    out["results"].append({"size": n, "kernels": kernels, "ratios": ratios})
    if log is not None:
      log(_summary_line(n, kernels, ratios, interpret))
  return out


def _summary_line(n: int, kernels: dict, ratios: dict, interpret: bool) -> str:
  parts = []
  for name, r in kernels.items():
    if "error" in r:
      parts.append(f"{name} error")
    elif "tflops" in r:
      parts.append(f"{name} {r['tflops']:.3g} TFLOP/s")
    else:
      parts.append(f"{name} {r['gbps']:.3g} GB/s")
  rs = ", ".join(f"{k} {v:.3g}" for k, v in ratios.items() if v is not None)
  tag = f" [{INTERPRET_NOTE}]" if interpret else ""
  return f"n={n}: " + "; ".join(parts) + f" | {rs}{tag}"
