"""The numerics self-check: each low-precision contraction, compiled on its
device, against a float reference from the same quantized operands.

A device and compiler version can compute a contraction wrong where every
other one is right: on an H200 with jax 0.11.2, XLA's INT8 ``dot_general``
of a quantized pair is right op by op and garbage under ``jax.jit``
(relative error 1.0). This module runs, before training, a small
deterministic case of every signature (:class:`.safe_paths.Signature`:
precision, op, forward path) a run's plans use, compiled with ``jax.jit`` on
a device of each kind, and compares it with a float64 reference computed on
the host from the same quantized operands.

The operands are built so that their quantization is exact on any device:
int8 codes times a power of two, each row and output channel holding a
code of 127 (fp8: e4m3 values, each slice holding 448), so that the absmax
scale is that power of two and the quantized operands are the codes
themselves, whatever the device's division rounds. The bound then follows
from the formats alone, per output element ``i``::

  |y_i - ref_i| <= 2 u_out |ref_i| + (2K + 2) 2**-24 (|A| @ |B|)_i s_i

with ``K`` the contraction length, ``s_i`` the operands' scales and
``u_out`` the output's unit roundoff (0 for the float32 outputs of int8 and
fp8; 2**-11 for fp16, 2**-8 for bf16, counted twice: the accumulator's
rounding to the output and a margin for one more, such as a split-K partial
sum's). An int8 x int8 -> int32 contraction is exact, and so is every
product of two fp8, fp16 or bf16 values in float32, so the second term
(float32 summation in any order, and the dequantize epilogue) covers every
correct path; a wrong one (the H200's) is off by about ``|ref_i|``, a
hundred times the bound and more. A check's ``bound_ratio``
is the largest ratio of the error to that bound (at most 1: right);
``rel_error`` is the normwise relative error, the figure the H200 fault was
reported in.

A signature that fails (or does not compile or run there) is switched (:func:`.safe_paths.switch`) to the
first safe path that passes the same case on that device (the kernel's
XLA contraction, then the exact values in float16, then float32), with one
warning line naming the op, the device kind and the error; under mode
``"error"`` the first failure raises :class:`NumericsCheckError` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics import ops
from qsync_jax.numerics import safe_paths
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.numerics.safe_paths import Signature

#: What ``--config.numerics_check`` takes: warn and switch, stop, or skip.
MODES = ("warn", "error", "off")
_UNIT = {Precision.FP16: 2.0**-11, Precision.BF16: 2.0**-8}
_FLOAT_DTYPE = {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16}
_CONV_DIMS = ("NHWC", "HWIO", "NHWC")
_DOT_DIMS = (((2,), (0,)), ((), ()))


class NumericsCheckError(ValueError):
  """A contraction is wrong on its device and the check's mode is error."""


@dataclasses.dataclass(frozen=True)
class Case:
  """One signature's deterministic operands and their float64 reference.

  Attributes:
    signature: the contraction checked.
    lhs: the float32 input operand.
    rhs: the float32 weight operand.
    reference: the exact result of the quantized (or cast) operands.
    magnitude: ``(|A| @ |B|) * s`` per output element (the bound's scale).
    unit: the output's unit roundoff (0 for float32 outputs).
    k: the contraction length.
  """

  signature: Signature
  lhs: np.ndarray
  rhs: np.ndarray
  reference: np.ndarray
  magnitude: np.ndarray
  unit: float
  k: int

  @property
  def bound(self) -> np.ndarray:
    """The largest error a correct path makes, per output element."""
    return (
      2 * self.unit * np.abs(self.reference)
      + (2 * self.k + 2) * 2.0**-24 * self.magnitude
    )


def _codes(rng, shape, precision: Precision, peak_axis: int) -> np.ndarray:
  """Exactly quantizable values: every slice along ``peak_axis``'s other
  axes holds the format's largest code at index 0 of ``peak_axis``."""
  if precision is Precision.INT8:
    codes = rng.integers(-127, 128, shape).astype(np.float32)
    peak = 127.0
  else:
    e4m3 = jnp.float8_e4m3fn
    wide = np.clip(rng.standard_normal(shape) * 64.0, -448.0, 448.0)
    codes = np.asarray(wide.astype(np.float32).astype(e4m3), np.float32)
    peak = 448.0
  index: list[int | slice] = [slice(None)] * len(shape)
  index[peak_axis] = 0
  codes[tuple(index)] = peak
  return codes


def _conv64(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """A stride-1 SAME NHWC x HWIO convolution in float64 (odd kernels)."""
  kh, kw = w.shape[:2]
  ph, pw = kh // 2, kw // 2
  xp = np.pad(x.astype(np.float64), ((0, 0), (ph, ph), (pw, pw), (0, 0)))
  h, wd = x.shape[1:3]
  out = np.zeros((x.shape[0], h, wd, w.shape[3]), np.float64)
  for i in range(kh):
    for j in range(kw):
      out += np.einsum(
        "nhwc,co->nhwo",
        xp[:, i : i + h, j : j + wd],
        w[i, j].astype(np.float64),
      )
  return out


def _contract64(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  if op == "dot_general":
    return np.einsum("bmk,kn->bmn", a.astype(np.float64), b.astype(np.float64))
  return _conv64(a, b)


def make_case(signature: Signature, size: int = 1, seed: int = 0) -> Case:
  """The deterministic case of ``signature`` (module docstring).

  Args:
    signature: the contraction to check.
    size: scales the operands: dot ``(2, 16s, 32s) x (32s, 32s)``, conv
      ``(2, 6s, 6s, 8s) x (3, 3, 8s, 16s)``, NHWC x HWIO, stride 1, SAME.
    seed: the operands' seed.

  Returns:
    The :class:`Case`.
  """
  rng = np.random.default_rng(seed)
  precision = Precision.parse(signature.precision)
  dot = signature.op == "dot_general"
  lshape: tuple[int, ...]
  rshape: tuple[int, ...]
  if dot:
    lshape, rshape = (2, 16 * size, 32 * size), (32 * size, 32 * size)
    k = lshape[-1]
  else:
    lshape, rshape = (
      (2, 6 * size, 6 * size, 8 * size),
      (3, 3, 8 * size, 16 * size),
    )
    k = 9 * rshape[2]
  if precision in _FLOAT_DTYPE:
    dt = _FLOAT_DTYPE[precision]
    lhs = rng.standard_normal(lshape).astype(np.float32)
    rhs = rng.standard_normal(rshape).astype(np.float32)
    a = np.asarray(lhs.astype(dt), np.float32)
    b = np.asarray(rhs.astype(dt), np.float32)
    scale, unit = 1.0, _UNIT[precision]
  else:
    # Per tensor and per channel alike: each row of the input (each example
    # of a conv input) and each output channel of the weight hold the peak.
    a = _codes(rng, lshape, precision, len(lshape) - 1 if dot else 1)
    b = _codes(rng, rshape, precision, 0)
    lhs, rhs = a * np.float32(2.0**-5), b * np.float32(2.0**-7)
    scale, unit = 2.0**-12, 0.0
  return Case(
    signature,
    lhs,
    rhs,
    _contract64(signature.op, a, b) * scale,
    _contract64(signature.op, np.abs(a), np.abs(b)) * scale,
    unit,
    k,
  )


def case_function(
  case: Case, quant: QuantConfig = QuantConfig()
) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The op of ``case.signature`` as a function of ``(lhs, rhs)``."""
  precision = Precision.parse(case.signature.precision)
  if case.signature.op == "dot_general":
    dot = ops.DotGeneral(precision, quant)
    return lambda lhs, rhs: dot(lhs, rhs, _DOT_DIMS)
  conv = ops.ConvGeneralDilated(precision, quant)
  return lambda lhs, rhs: conv(
    lhs, rhs, (1, 1), "SAME", dimension_numbers=_CONV_DIMS
  )


def measure(
  case: Case,
  device: Any,
  *,
  compiled: bool = True,
  quant: QuantConfig = QuantConfig(),
) -> dict[str, Any]:
  """Runs ``case`` on ``device`` on its signature's path and scores it.

  Args:
    case: the case.
    device: the jax device it runs on.
    compiled: under ``jax.jit`` (else op by op).
    quant: the operands' quantization (granularity, rounding).

  Returns:
    ``{"rel_error", "bound_ratio", "ok"}``: the normwise relative error, the
    largest error over its bound (non-finite output: infinity) and whether
    that is at most 1.
  """
  backend = "pallas" if case.signature.path == "pallas" else "xla"
  fn = case_function(case, quant)
  with ops.kernel_backend(backend):
    args = (jax.device_put(case.lhs, device), jax.device_put(case.rhs, device))
    y = (jax.jit(fn) if compiled else fn)(*args)
    y = np.asarray(jax.device_get(y), np.float64)
  err = np.abs(y - case.reference)
  if not np.all(np.isfinite(y)):
    ratio = rel = math.inf
  else:
    ratio = float(np.max(err / np.maximum(case.bound, 1e-300)))
    norm = max(float(np.linalg.norm(case.reference)), 1e-300)
    rel = float(np.linalg.norm(err)) / norm
  return {"rel_error": rel, "bound_ratio": ratio, "ok": ratio <= 1.0}


def signatures_for(precisions: Iterable[Precision | str]) -> list[Signature]:
  """The signatures a plan of ``precisions`` runs on this process's device:
  each checked precision's dot (on every path :func:`.ops.dot_paths` may
  choose) and convolution (XLA's)."""
  out = []
  for p in sorted({Precision.parse(p) for p in precisions}, key=str):
    if p not in safe_paths.CHECKED_PRECISIONS:
      continue
    for path in ops.dot_paths(p):
      out.append(Signature(p.value, "dot_general", path))
    out.append(Signature(p.value, "conv_general_dilated", "xla"))
  return out


def _measure_or_error(case: Case, device: Any, quant: QuantConfig) -> dict:
  """:func:`measure`, or a failed check naming the error where the case
  does not compile or run on ``device``."""
  try:
    return measure(case, device, quant=quant)
  except Exception as e:  # pylint: disable=broad-except
    error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return dict(rel_error=math.inf, bound_ratio=math.inf, ok=False, error=error)


def _choose_safe_path(
  case: Case, device: Any, quant: QuantConfig
) -> tuple[str | None, list[dict[str, Any]]]:
  """The first safe path that passes ``case`` on ``device``, and the tries."""
  tries = []
  for to in case.signature.safe_paths():
    with safe_paths.switches({case.signature: to}):
      result = _measure_or_error(case, device, quant)
    tries.append({"to": to, **result})
    if result["ok"]:
      return to, tries
  return None, tries


def _warn(line: str) -> None:
  print(f"warning: {line}", file=sys.stderr, flush=True)


def _failure_text(signature, device_kind: str, kind: str, result) -> str:
  if "error" in result:
    return (
      f"numerics check: {signature} on {device_kind} ({kind}) does not run "
      f"under jax.jit: {result['error']}"
    )
  return (
    f"numerics check: {signature} on {device_kind} ({kind}) is wrong under "
    f"jax.jit: relative error {result['rel_error']:.3g}, "
    f"{result['bound_ratio']:.3g}x its bound"
  )


def run(
  devices: Mapping[str, Any],
  signatures: Mapping[str, Sequence[Signature]],
  *,
  mode: str = "warn",
  quant: QuantConfig | Mapping[str, QuantConfig] = QuantConfig(),
  size: int = 1,
  warn: Callable[[str], None] = _warn,
) -> dict[str, Any]:
  """Checks every signature of each device kind on its device.

  A signature is measured once per jax device kind (kinds on the same
  hardware share the result). A failure is switched to a safe path for
  this process (module docstring) with one ``warn`` line, or raises.

  Args:
    devices: ``{kind: jax device}``, one device of each kind of the run.
    signatures: ``{kind: the signatures its plans use}``
      (:func:`signatures_for`).
    mode: ``"warn"``, ``"error"`` or ``"off"`` (:data:`MODES`).
    quant: the plans' operand quantization, or ``{kind: quantization}``
      (kinds not named: the default).
    size: the cases' size (:func:`make_case`).
    warn: called with each warning line.

  Returns:
    ``{"mode", "seconds", "checks": [{"kind", "device_kind", "signature",
    "rel_error", "bound_ratio", "ok"}], "switches": [{"kind",
    "device_kind", "signature", "to", "rel_error", "tries"}]}``.

  Raises:
    NumericsCheckError: under mode ``"error"``, the first wrong signature.
    ValueError: an unknown mode, or a kind without a device.
  """
  if mode not in MODES:
    raise ValueError(f"numerics_check must be one of {MODES}, got {mode!r}")
  record: dict[str, Any] = {"mode": mode, "seconds": 0.0}
  record.update(checks=[], switches=[])
  if mode == "off":
    return record
  start = time.perf_counter()
  done: dict[tuple[str, Signature, QuantConfig], dict[str, Any]] = {}
  for kind, sigs in signatures.items():
    if kind not in devices:
      raise ValueError(f"numerics check: no device for kind {kind!r}")
    device = devices[kind]
    hw = str(getattr(device, "device_kind", device.platform))
    q = quant.get(kind, QuantConfig()) if isinstance(quant, Mapping) else quant
    for sig in sigs:
      key = (hw, sig, q)
      if key not in done:
        case = make_case(sig, size)
        result = _measure_or_error(case, device, q)
        done[key] = result
        if not result["ok"]:
          text = _failure_text(sig, hw, kind, result)
          if mode == "error":
            raise NumericsCheckError(
              f"{text} (--config.numerics_check=warn runs it on a safe path)"
            )
          to, tries = _choose_safe_path(case, device, q)
          if to is not None:
            safe_paths.switch(sig, to)
          warn(f"{text}; " + (f"switched to {to}" if to else "no safe path"))
          record["switches"].append(
            dict(kind=kind, device_kind=hw, signature=str(sig), to=to)
            | {"rel_error": result["rel_error"], "tries": tries}
          )
      check = {"kind": kind, "device_kind": hw, "signature": str(sig)}
      record["checks"].append(check | done[key])
  record["seconds"] = time.perf_counter() - start
  return record
