"""Precision plans: which precision each layer of a model computes at.

This module owns :class:`PrecisionPlan` and :class:`PlanError`. A plan maps
layer paths (see :func:`qsync_jax.layer_paths`) to a
:class:`~qsync_jax.numerics.precision.Precision` with ordered regex rules,
first match wins, and a default. Plans are plain data: they round-trip through
JSON and are validated against a device kind's precisions
(:mod:`qsync_jax.plan.devices`) before a step function is built from them.

Python's ``re`` backtracks, so some short rules take time exponential or
high-polynomial in a layer path's length (``([a-z0-9/]+)+!`` took 20 s over
35 paths). A plan refuses the shapes that cause it when it is built; see
:func:`check_rule_complexity`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import dataclasses
import json
import re

# Python >= 3.11, like the parser; typeshed has no stubs for these modules.
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]

from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan.devices import supported_precisions


class PlanError(ValueError):
  """A precision plan is malformed or does not fit a model or a device."""


#: The most repeats (``*``, ``+``, ``{m,n}`` with n > 1) one rule may hold.
#: Each repeat next to another over the same characters multiplies the
#: backtracking by a layer path's length: 8 ``.*`` took 9 s on one 60-char
#: path, 4 take under a millisecond.
MAX_RULE_REPEATS = 4

_REPEATS = (
  sre_constants.MAX_REPEAT,
  sre_constants.MIN_REPEAT,
  sre_constants.POSSESSIVE_REPEAT,
)


def _subpatterns(value):
  """Yields the parsed sub-patterns nested in one node's argument."""
  if isinstance(value, sre_parse.SubPattern):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _subpatterns(item)


def _nodes(pattern):
  """Yields every ``(op, arg)`` node of a parsed pattern, depth first."""
  for op, arg in pattern:
    yield op, arg
    for sub in _subpatterns(arg):
      yield from _nodes(sub)


def check_rule_complexity(pattern: str) -> None:
  """Refuses a regex whose matching time can blow up with the input length.

  Refused: a repeated group that holds another quantifier (``(a+)+``,
  ``(a?)*``) or an alternation (``(a|aa)+``); either lets the backtracking
  engine split a path in exponentially many ways. Also refused: more than
  ``MAX_RULE_REPEATS`` repeats in one rule (``.*.*.*.*.*``), polynomial of
  that degree. Repeats of single characters or fixed strings (``\\d+``,
  ``.*``, ``(?:ab)+``) are fine.

  Args:
    pattern: A regex that ``re.compile`` accepts.

  Raises:
    PlanError: The pattern has one of the shapes above; the message names it.
  """
  parsed = sre_parse.parse(pattern)
  repeats = 0
  for op, arg in _nodes(parsed):
    if op not in _REPEATS:
      continue
    _, high, body = arg
    if high <= 1:  # `?` and `{0,1}` try at most two ways.
      continue
    repeats += 1
    for inner, _ in _nodes(body):
      if inner in _REPEATS or inner is sre_constants.BRANCH:
        what = "a quantifier" if inner in _REPEATS else "an alternation"
        raise PlanError(
          f"regex {pattern!r} repeats a group that holds {what}; its "
          "matching time grows exponentially with the layer path's length "
          "(write the repeat over single characters, e.g. '[a-z0-9/]+')"
        )
  if repeats > MAX_RULE_REPEATS:
    raise PlanError(
      f"regex {pattern!r} has {repeats} repeats, more than "
      f"{MAX_RULE_REPEATS}; adjacent repeats make matching time grow as a "
      f"power of the layer path's length"
    )


def _check_not_repeated(rules: Sequence[tuple[str, Precision]]) -> None:
  """Raises where the last of ``rules`` repeats an earlier rule's pattern
  with another precision (the first match wins: it would never apply)."""
  pattern, precision = rules[-1]
  for i, (earlier, was) in enumerate(rules[:-1]):
    if earlier == pattern and was is not precision:
      raise PlanError(
        f"rule {len(rules) - 1} ({pattern!r}, {precision.value}) repeats "
        f"rule {i}'s pattern with another precision ({was.value}); the "
        "first match wins, so it would never apply: keep one of them"
      )


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
  """Per-layer precision as ordered regex rules over layer paths.

  Each rule is ``(regex, precision)``; the regex is matched with
  ``re.fullmatch`` against a layer path such as ``"layers/0/attention/query"``.
  The first matching rule wins; layers no rule matches get ``default``.

  Attributes:
    rules: the ``(regex, Precision)`` pairs, in priority order.
    default: the precision of layers that no rule matches.
    quant: how INT8 / FP8 layers quantize (scale granularity, rounding).

  Example:
    >>> import qsync_jax as qs
    >>> plan = qs.PrecisionPlan([(r"conv\\d", "int8"), ("fc", "fp16")])
    >>> plan.precision_of("conv2"), plan.precision_of("head")
    (<Precision.INT8: 'int8'>, <Precision.FP32: 'fp32'>)
    >>> qs.PrecisionPlan.from_json(plan.to_json()) == plan
    True
  """

  rules: tuple[tuple[str, Precision], ...] = ()
  default: Precision = Precision.FP32
  quant: QuantConfig = QuantConfig()

  def __init__(
    self,
    rules: Iterable[Sequence] = (),
    default: Precision | str = Precision.FP32,
    quant: QuantConfig | None = None,
  ):
    parsed = []
    for i, rule in enumerate(rules):
      if isinstance(rule, (str, bytes)) or len(rule) != 2:
        raise PlanError(
          f"rule {i} must be a (regex, precision) pair, got {rule!r}"
        )
      pattern, precision = rule
      if not isinstance(pattern, str):
        raise PlanError(
          f"rule {i}: the pattern must be a string, got {pattern!r}"
        )
      try:
        re.compile(pattern)
      except re.error as e:
        raise PlanError(f"rule {i}: invalid regex {pattern!r}: {e}") from None
      try:
        check_rule_complexity(pattern)
      except PlanError as e:
        raise PlanError(f"rule {i}: {e}") from None
      parsed.append((pattern, Precision.parse(precision)))
      _check_not_repeated(parsed)
    object.__setattr__(self, "rules", tuple(parsed))
    object.__setattr__(self, "default", Precision.parse(default))
    object.__setattr__(
      self, "quant", quant if quant is not None else QuantConfig()
    )

  @classmethod
  def uniform(
    cls, precision: Precision | str, quant: QuantConfig | None = None
  ) -> PrecisionPlan:
    """Returns a plan that gives every layer ``precision``."""
    return cls((), default=precision, quant=quant)

  @classmethod
  def from_precisions(
    cls,
    precisions: Mapping[str, Precision | str],
    default: Precision | str = Precision.FP32,
    quant: QuantConfig | None = None,
  ) -> PrecisionPlan:
    """Returns a plan with one exact rule per layer path (allocator output)."""
    return cls(
      ((re.escape(p), v) for p, v in precisions.items()),
      default=default,
      quant=quant,
    )

  def precision_of(self, layer_path: str) -> Precision:
    """Returns the precision the plan gives ``layer_path``."""
    for pattern, precision in self.rules:
      if re.fullmatch(pattern, layer_path):
        return precision
    return self.default

  def resolve(
    self, layer_paths: Sequence[str], *, strict: bool = True
  ) -> dict[str, Precision]:
    """Maps each layer path to its precision.

    Args:
      layer_paths: the paths of the layers the plan applies to.
      strict: raise if a rule matches none of ``layer_paths`` (a typo in a
        rule would otherwise leave the layers it meant at the default).

    Returns:
      ``{path: Precision}`` in the order of ``layer_paths``.

    Raises:
      PlanError: with ``strict``, a rule matches no layer; the message lists
        the valid paths.
    """
    if strict:
      dead = [
        p
        for p, _ in self.rules
        if not any(re.fullmatch(p, path) for path in layer_paths)
      ]
      if dead:
        raise PlanError(
          f"plan rule(s) {', '.join(repr(p) for p in dead)} match no layer; "
          f"valid layer paths: {', '.join(layer_paths) or '(none)'} "
          "(contractions of integer or complex operands, and those inside "
          "jax's own functions, are not layers)"
        )
    resolved = {path: self.precision_of(path) for path in layer_paths}
    if strict:
      self._check_no_shadowed_rule(layer_paths, resolved)
    return resolved

  def _check_no_shadowed_rule(
    self, layer_paths: Sequence[str], resolved: Mapping[str, Precision]
  ) -> None:
    """Raises where a rule never applies because earlier rules take every
    layer it matches, at other precisions: the first match wins, so the
    later rule's precision would be silently dropped."""
    first: dict[str, int] = {}  # each path's first matching rule
    matches = []
    for i, (pattern, _) in enumerate(self.rules):
      matched = [p for p in layer_paths if re.fullmatch(pattern, p)]
      matches.append(matched)
      for p in matched:
        first.setdefault(p, i)
    for i, (pattern, precision) in enumerate(self.rules):
      matched = matches[i]
      if not matched or any(
        first[p] == i or resolved[p] is precision for p in matched
      ):
        continue
      taken = ", ".join(f"{p} ({resolved[p].value})" for p in matched)
      raise PlanError(
        f"plan rule {i} ({pattern!r}, {precision.value}) never applies: "
        f"earlier rules take every layer it matches ({taken}), and the "
        "first match wins; put it before them, or drop it"
      )

  def precisions(self) -> set[Precision]:
    """Returns every precision the plan can assign (rules and default)."""
    return {p for _, p in self.rules} | {self.default}

  def validate_for(
    self, device_kind: str, layer_paths: Sequence[str] | None = None
  ) -> None:
    """Checks that ``device_kind`` computes every precision the plan uses.

    Args:
      device_kind: a kind of :mod:`qsync_jax.plan.devices` (e.g. ``"t4"``).
      layer_paths: if given, only the precisions that these layers resolve
        to are checked (a rule shadowed by earlier rules does not count).

    Raises:
      PlanError: the device lacks a precision; the message names the layers
        (or rules) that ask for it.
    """
    supported = supported_precisions(device_kind)
    if layer_paths is None:
      used = {
        (f"rule {p!r}" if p else "default"): prec
        for p, prec in (*self.rules, (None, self.default))
      }
    else:
      used = self.resolve(layer_paths, strict=False)
    bad: dict[Precision, list[str]] = {}
    for where, prec in used.items():
      if prec not in supported:
        bad.setdefault(prec, []).append(where)
    if bad:
      parts = [
        f"{prec.value} (asked by {', '.join(where[:5])}"
        f"{', ...' if len(where) > 5 else ''})"
        for prec, where in bad.items()
      ]
      raise PlanError(
        f"device kind {device_kind!r} does not support "
        f"{'; '.join(parts)}; it supports "
        f"{', '.join(sorted(p.value for p in supported))}"
      )

  def to_dict(self) -> dict:
    """Returns the plan as JSON-serializable data."""
    return {
      "rules": [[p, prec.value] for p, prec in self.rules],
      "default": self.default.value,
      "quant": self.quant.to_dict(),
    }

  def to_json(self, indent: int | None = 2) -> str:
    """Returns the plan as JSON text (inverse of :meth:`from_json`)."""
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_dict(cls, data: Mapping) -> PrecisionPlan:
    """Builds a plan from :meth:`to_dict` data.

    Raises:
      PlanError: the data is not a valid plan.
    """
    if not isinstance(data, Mapping):
      raise PlanError(
        f"a plan must be a JSON object, got {type(data).__name__}"
      )
    unknown = set(data) - {"rules", "default", "quant"}
    if unknown:
      raise PlanError(
        f"unknown plan keys {sorted(unknown)}; "
        "valid keys: rules, default, quant"
      )
    rules = data.get("rules", [])
    if not isinstance(rules, list):
      raise PlanError("plan 'rules' must be a list of [regex, precision] pairs")
    try:
      quant = QuantConfig.from_dict(data.get("quant", {}))
      return cls(rules, default=data.get("default", "fp32"), quant=quant)
    except PlanError:
      raise
    except (ValueError, TypeError) as e:
      raise PlanError(f"invalid plan: {e}") from None

  @classmethod
  def from_json(cls, text: str) -> PrecisionPlan:
    """Parses a plan from JSON text.

    Raises:
      PlanError: the text is not JSON or not a valid plan.
    """
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise PlanError(f"malformed plan JSON: {e}") from None
    return cls.from_dict(data)

  def __str__(self) -> str:
    rules = ", ".join(f"{p}->{prec.value}" for p, prec in self.rules)
    return f"PrecisionPlan([{rules}], default={self.default.value})"
