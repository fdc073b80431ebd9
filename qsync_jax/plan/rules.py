"""The rules every model API applies a plan by, NNX and Linen alike.

This module owns what does not depend on how a model is written: which
precision-aware op replaces each injectable attribute of a layer
(:data:`OP_FOR_ATTRIBUTE`), which dtype an embedding table is cast to
(:func:`embed_dtype`), and the forced precisions (:func:`resolve_with_forced`,
after ``map_available_bit`` and ``reject_name_list`` in QSync's official
code, bytedance/QSync):

* the classifier head (the last layer in forward order) computes in FP32
  unless a rule names it;
* embeddings and attention matmuls never go below 16 bits: the default drops
  them to FP16 at most, and a rule that names one below 16 bits is an error.

:mod:`qsync_jax.plan.policy` (NNX) and :mod:`qsync_jax.plan.linen` find the
layers; both hand them to these rules, so the two APIs cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import re
from typing import Any

import jax.numpy as jnp

from qsync_jax.numerics import ops
from qsync_jax.numerics.precision import Precision
from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan

#: The precision-aware op class that replaces each injectable attribute.
OP_FOR_ATTRIBUTE: Mapping[str, Callable[..., Any]] = {
  "dot_general": ops.DotGeneral,
  "conv_general_dilated": ops.ConvGeneralDilated,
  "einsum_op": ops.Einsum,
}

# An embedding is a lookup, not a contraction: a plan only changes the dtype
# its table is cast to, and only the 16-bit floats are a cast (the floor
# keeps it at 16 bits or more; FP32 and TF32 keep the parameter dtype).
_EMBED_DTYPE = {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16}


def embed_dtype(precision: Precision, param_dtype: Any) -> Any:
  """The dtype an embedding at ``precision`` casts its table to.

  Args:
    precision: the embedding's effective precision (16 bits or more).
    param_dtype: the table's parameter dtype, kept above 16 bits.

  Returns:
    ``float16`` / ``bfloat16`` for FP16 / BF16, else ``param_dtype``.
  """
  return _EMBED_DTYPE.get(precision, param_dtype)


def resolve_with_forced(
  paths: list[str],
  floored: set[str],
  plan: PrecisionPlan,
  *,
  soft_floored: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Precision]:
  """Resolves ``plan`` over ``paths`` and applies the forced precisions.

  Args:
    paths: layer paths in forward order (the last one is the head).
    floored: the paths that never compute below 16 bits.
    plan: the precision plan.
    soft_floored: the paths that compute below 16 bits only where a rule
      names them explicitly (the rule is the path itself): contractions of
      two activations found by interception.

  Returns:
    ``{path: Precision}``: the head is FP32 unless a rule names it; a floored
    layer that only the default puts below 16 bits gets FP16.

  Raises:
    PlanError: a rule matches no layer, or names a floored layer below 16 bits.
  """
  resolved = plan.resolve(paths)
  effective, too_low = {}, []
  for i, path in enumerate(paths):
    prec = resolved[path]
    named = any(re.fullmatch(rule, path) for rule, _ in plan.rules)
    if i == len(paths) - 1 and not named:
      prec = Precision.FP32
    if path in soft_floored and prec.bits < 16:
      explicit = any(rule in (path, re.escape(path)) for rule, _ in plan.rules)
      if not explicit:
        prec = Precision.FP16
    if path in floored and prec.bits < 16:
      if named:
        too_low.append(f"{path} ({prec.value})")
      else:
        prec = Precision.FP16
    effective[path] = prec
  if too_low:
    raise PlanError(
      "embeddings and attention matmuls compute in 16 bits or more, but the "
      f"plan's rules put {', '.join(too_low)} below that"
    )
  return effective
