"""Helpers that inspect jaxprs: which contractions run at which dtypes, and
how often each primitive appears."""

from __future__ import annotations

import jax

CONTRACTIONS = ("dot_general", "conv_general_dilated")


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (list, tuple)) else [value]:
      if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # ClosedJaxpr
        yield v.jaxpr
      elif hasattr(v, "eqns"):  # Jaxpr
        yield v


def contractions(jaxpr) -> list[tuple[str, tuple[str, ...], str]]:
  """Returns (primitive, operand dtypes, output dtype) of every contraction.

  Recurses into sub-jaxprs (pjit, custom_vjp, scan, ...).
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in CONTRACTIONS:
      found.append(
        (
          eqn.primitive.name,
          tuple(str(v.aval.dtype) for v in eqn.invars),
          str(eqn.outvars[0].aval.dtype),
        )
      )
    for sub in _sub_jaxprs(eqn):
      found.extend(contractions(sub))
  return found


def contractions_of(fn, *args) -> list[tuple[str, tuple[str, ...], str]]:
  """Returns the contractions of ``jax.make_jaxpr(fn)(*args)``."""
  return contractions(jax.make_jaxpr(fn)(*args))


def primitive_counts(jaxpr) -> dict[str, int]:
  """``{primitive name: occurrences}`` in ``jaxpr`` and its sub-jaxprs."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  counts: dict[str, int] = {}
  for eqn in jaxpr.eqns:
    counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    for sub in _sub_jaxprs(eqn):
      for name, n in primitive_counts(sub).items():
        counts[name] = counts.get(name, 0) + n
  return counts
