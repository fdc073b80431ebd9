"""Which low-precision contractions run on a safe path instead of their own.

A low-precision contraction of :mod:`qsync_jax.numerics.ops` has a
*signature*: its precision (int8, fp8, fp16, bf16), its op
(``dot_general`` or ``conv_general_dilated``) and the path its forward
contraction takes (``pallas``: the Pallas GEMM kernel; ``xla``: XLA's own
dot or convolution). A device and compiler version can compute one of them
wrong (an H200 with jax 0.11.2 returns garbage from XLA's INT8 dot under
``jax.jit``); the numerics self-check (:mod:`.selfcheck`) finds such a
signature and switches it here to a path that it has checked to be right on
that device:

* ``"xla"`` (a ``pallas`` signature only): XLA's contraction instead of the
  kernel;
* ``"f16"``: the quantized operands' exact values (int8 codes, fp8 values)
  contracted as float16 with float32 accumulation; for int8 and fp8 every
  product is exact, so this equals the int8 / fp8 contraction up to float32
  summation order;
* ``"f32"``: the same values as float32 at ``Precision.HIGHEST`` (for fp16
  and bf16: the cast operands contracted in float32, the output cast back).

The switches hold for this process: the ops read them when they are traced,
and a switch clears jax's caches of traced functions, so that every step
traced after it (the trainer's and the predictor's) takes the safe path.
The dequantize epilogue and the backward pass are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import contextlib
import dataclasses

import jax

from qsync_jax.numerics.precision import Precision

#: The contractions a signature names.
OPS = ("dot_general", "conv_general_dilated")
#: The forward paths of a contraction.
PATHS = ("pallas", "xla")
#: The safe paths, in the order the self-check tries them (fastest first).
SAFE_PATHS = ("xla", "f16", "f32")
#: The precisions with a signature: the quantized ones and the 16-bit casts.
CHECKED_PRECISIONS = (
  Precision.INT8,
  Precision.FP8,
  Precision.FP16,
  Precision.BF16,
)


@dataclasses.dataclass(frozen=True, order=True)
class Signature:
  """One low-precision contraction: precision, op and forward path.

  Attributes:
    precision: the precision's name (``"int8"``, ``"fp8"``, ``"fp16"``,
      ``"bf16"``).
    op: ``"dot_general"`` or ``"conv_general_dilated"``.
    path: ``"pallas"`` or ``"xla"``.
  """

  precision: str
  op: str
  path: str

  def __post_init__(self):
    if Precision.parse(self.precision) not in CHECKED_PRECISIONS:
      raise ValueError(
        f"no signature for {self.precision!r}: the checked precisions are "
        f"{', '.join(p.value for p in CHECKED_PRECISIONS)}"
      )
    if self.op not in OPS or self.path not in PATHS:
      raise ValueError(
        f"a signature's op is one of {OPS} and its path one of {PATHS}, got "
        f"{self.op!r} via {self.path!r}"
      )
    if self.path == "pallas" and (
      self.op != "dot_general"
      or Precision.parse(self.precision) not in (Precision.INT8, Precision.FP8)
    ):
      raise ValueError(
        "only int8 and fp8 dot_general have a Pallas path, got "
        f"{self.precision} {self.op}"
      )

  def __str__(self) -> str:
    return f"{self.precision} {self.op} via {self.path}"

  def safe_paths(self) -> tuple[str, ...]:
    """The safe paths this signature can switch to, in order."""
    if Precision.parse(self.precision) in (Precision.FP16, Precision.BF16):
      return ("f32",)
    return SAFE_PATHS if self.path == "pallas" else SAFE_PATHS[1:]


_switched: dict[Signature, str] = {}


def switch(signature: Signature, to: str) -> None:
  """Runs ``signature`` on the safe path ``to`` from now on (this process).

  Clears jax's caches of traced functions, so that nothing traced before
  keeps the old path.

  Raises:
    ValueError: ``to`` is not one of ``signature.safe_paths()``.
  """
  if to not in signature.safe_paths():
    raise ValueError(
      f"{signature} can switch to {', '.join(signature.safe_paths())}, "
      f"not {to!r}"
    )
  _switched[signature] = to
  jax.clear_caches()


def safe_path(signature: Signature) -> str | None:
  """The safe path ``signature`` is switched to, or None."""
  return _switched.get(signature)


def switched() -> dict[Signature, str]:
  """Every switch in force: ``{signature: safe path}``."""
  return dict(_switched)


def reset() -> None:
  """Undoes every switch (and clears jax's caches of traced functions)."""
  if _switched:
    _switched.clear()
    jax.clear_caches()


@contextlib.contextmanager
def switches(mapping: Mapping[Signature, str]) -> Iterator[None]:
  """Context manager: the switches in ``mapping`` added, the previous
  switches restored on exit (traced functions' caches cleared both ways)."""
  previous = dict(_switched)
  try:
    for signature, to in mapping.items():
      switch(signature, to)
    yield
  finally:
    if _switched != previous:
      _switched.clear()
      _switched.update(previous)
      jax.clear_caches()
