"""Cast costs: time = a * numel + b per (source, destination) dtype.

This module owns :class:`CastModel` and the two ways to get one: fitted on the
device at hand from micro-benchmarks (:func:`fit_cast_model`, with
``scipy.optimize.curve_fit``, as QSync's official code does in bytedance/QSync,
``Predictor/casting_cost.py``) or derived from a GPU's memory bandwidth
(:func:`analytic_cast_model`). Besides float-to-float casts it covers
quantization to int8 (an absmax reduction plus a rounding pass) and
dequantization.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qsync_jax.numerics import quant
from qsync_jax.plan.devices import DeviceSpec
from qsync_jax.predictor import roofline
from qsync_jax.predictor import timing

FLOATS = ("float32", "float16", "bfloat16")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
#: Element counts the fit samples (conv- and transformer-sized tensors).
DEFAULT_SIZES = (2**14, 2**16, 2**18, 2**20, 2**21)


def cast_pairs() -> list[tuple[str, str]]:
  """Every (src, dst) pair a model covers."""
  pairs = [(s, d) for s in FLOATS for d in FLOATS if s != d]
  pairs += [(s, "int8") for s in ("float32", "float16")]
  pairs += [("int8", d) for d in ("float32", "float16")]
  return pairs


@dataclasses.dataclass(frozen=True)
class CastModel:
  """Linear cast costs.

  Attributes:
    coefficients: ``{"src->dst": (a seconds per element, b seconds)}``.
  """

  coefficients: Mapping[str, tuple[float, float]]

  def time(self, src: str, dst: str, numel: float) -> float:
    """Seconds to cast ``numel`` elements from ``src`` to ``dst`` (0 if same).

    Raises:
      KeyError: the pair is not modelled.
    """
    if src == dst or numel <= 0:
      return 0.0
    a, b = self.coefficients[f"{src}->{dst}"]
    return max(a * numel + b, 0.0)

  def to_dict(self) -> dict[str, list[float]]:
    return {k: list(v) for k, v in self.coefficients.items()}

  @classmethod
  def from_dict(cls, d: Mapping[str, Sequence[float]]) -> CastModel:
    return cls({k: (float(v[0]), float(v[1])) for k, v in d.items()})


def _cast_fn(src: str, dst: str):
  if dst == "int8":
    return lambda x: quant.quantize(x)
  if src == "int8":
    # Dequantization: int8 codes times a float32 scale, to the target dtype.
    return lambda x: (x.astype(jnp.float32) * 0.5).astype(dst)
  return lambda x: x.astype(dst)


def fit_cast_model(
  device: jax.Device | None = None,
  sizes: Sequence[int] = DEFAULT_SIZES,
  pairs: Sequence[tuple[str, str]] | None = None,
) -> CastModel:
  """Fits ``a * numel + b`` per cast on ``device`` (default: the first).

  Each point is the median time of a jitted cast of a random tensor
  (:func:`qsync_jax.predictor.timing.median_seconds`, dispatch overhead
  removed); the fit is least squares with non-negative slope.
  """
  device = device or jax.devices()[0]
  from scipy import optimize  # local: 0.4 s to import, needed only here

  rng = np.random.default_rng(0)
  coefficients = {}
  for src, dst in pairs or cast_pairs():
    xs, ts = [], []
    for n in sizes:
      if src == "int8":
        x = rng.integers(-127, 128, n).astype(np.int8)
      else:
        x = rng.standard_normal(n).astype(np.float32)
      x = jax.device_put(jnp.asarray(x).astype(src), device)
      ts.append(
        timing.median_seconds(jax.jit(_cast_fn(src, dst)), x, device=device)
      )
      xs.append(float(n))
    (a, b), _ = optimize.curve_fit(
      lambda n, a, b: a * n + b,
      np.array(xs),
      np.array(ts),
      p0=(ts[-1] / xs[-1], 0.0),
      bounds=((0.0, -np.inf), (np.inf, np.inf)),
    )
    coefficients[f"{src}->{dst}"] = (float(a), float(b))
  return CastModel(coefficients)


def analytic_cast_model(spec: DeviceSpec) -> CastModel:
  """Cast costs of a GPU from its memory bandwidth.

  A cast reads the source and writes the destination once; quantization
  reads the source twice (absmax, then rounding). Each launches one kernel
  (two for quantization).
  """
  coefficients = {}
  bandwidth = roofline.sustained_bandwidth(spec)
  for src, dst in cast_pairs():
    passes = 2 if dst == "int8" else 1
    per_elem = (passes * _ITEMSIZE[src] + _ITEMSIZE[dst]) / bandwidth
    coefficients[f"{src}->{dst}"] = (
      per_elem,
      passes * roofline.KERNEL_LAUNCH_S,
    )
  return CastModel(coefficients)
