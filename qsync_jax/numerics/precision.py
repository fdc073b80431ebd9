"""The compute precisions a layer can run at.

This module owns :class:`Precision`, the names plans and JSON use for the
number formats of :mod:`qsync_jax.numerics.ops` (int8, fp8, fp16, bf16, tf32,
fp32) and their bit widths. It sits in ``numerics`` because the ops are what
give each name its arithmetic; plans (:mod:`qsync_jax.plan`) only choose one
per layer.
"""

from __future__ import annotations

import enum


class Precision(enum.Enum):
  """The compute precision of one layer.

  The value is the name used in plans and JSON. ``bits`` orders precisions
  from lowest to highest (INT8 and FP8 are both 8 bits; BF16 and FP16 both 16).

  Example:
    >>> from qsync_jax import Precision
    >>> Precision("int8"), Precision.parse("BF16")
    (<Precision.INT8: 'int8'>, <Precision.BF16: 'bf16'>)
    >>> Precision.INT8.bits < Precision.FP16.bits
    True
  """

  FP8 = "fp8"
  INT8 = "int8"
  FP16 = "fp16"
  BF16 = "bf16"
  TF32 = "tf32"
  FP32 = "fp32"

  @property
  def bits(self) -> int:
    return _BITS[self]

  @property
  def is_float(self) -> bool:
    return self is not Precision.INT8

  @classmethod
  def parse(cls, value: Precision | str) -> Precision:
    """Returns the Precision named by ``value`` (case-insensitive).

    Raises:
      ValueError: ``value`` names no precision.
    """
    if isinstance(value, Precision):
      return value
    if isinstance(value, str):
      try:
        return cls(value.strip().lower())
      except ValueError:
        pass
    raise ValueError(
      f"unknown precision {value!r}; valid precisions: "
      f"{', '.join(p.value for p in cls)}"
    )

  def __str__(self) -> str:
    return self.value


_BITS = {
  Precision.FP8: 8,
  Precision.INT8: 8,
  Precision.FP16: 16,
  Precision.BF16: 16,
  Precision.TF32: 19,
  Precision.FP32: 32,
}
