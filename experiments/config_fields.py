"""Typed config fields, and what a config names that is read from files.

This module owns how one field of a config becomes a typed value: a
dataclass field made with :func:`integer`, :func:`real`, :func:`choice`,
:func:`text`, :func:`flag`, :func:`mapping`, :func:`names`,
:func:`integers` or :func:`section` carries the check that converts it (an
integer at least some value, a finite float in a range, one of some names,
...), and :func:`parse_section` builds a frozen dataclass from a config's
mapping over its defaults, refusing a field the dataclass does not have
(naming the closest one). It also owns reading what a user names in a
config: a plan (:func:`load_plan`: a mapping, JSON text or a file), a file
(:func:`read_file`) and JSON text (:func:`read_json`). The main job's
config (:mod:`experiments.config_lib`) is made of these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import difflib
import json
import math
import numbers
import os
import types
from typing import Any

import ml_collections

from qsync_jax.plan.precision import PlanError
from qsync_jax.plan.precision import PrecisionPlan

Check = Callable[[Any, str], Any]


def _field(check: Check) -> Any:
  """A dataclass field whose values ``check(value, name)`` converts."""
  return dataclasses.field(metadata={"check": check})


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(least: int, optional: bool = False) -> Any:
  """An integer field of at least ``least`` (an integral float such as
  ``1e3``, as a config file may write it, counts)."""

  def check(value: Any, name: str) -> int | None:
    if value is None and optional:
      return None
    if _is_number(value) and math.isfinite(value) and value == int(value):
      if int(value) >= least:
        return int(value)
    raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

  return _field(check)


def real(
  ok: Callable[[float], bool], words: str, optional: bool = False
) -> Any:
  """A finite float field whose value meets ``ok`` (``words`` says how)."""

  def check(value: Any, name: str) -> float | None:
    if value is None and optional:
      return None
    if _is_number(value) and math.isfinite(value) and ok(float(value)):
      return float(value)
    raise ValueError(f"{name} must be a finite number {words}, got {value!r}")

  return _field(check)


def choice(*values: str) -> Any:
  """A string field that is one of ``values``."""

  def check(value: Any, name: str) -> str:
    if value in values:
      return value
    raise ValueError(
      f"{name} must be one of {', '.join(values)}, got {value!r}"
    )

  return _field(check)


def text(optional: bool = False) -> Any:
  """A string field."""

  def check(value: Any, name: str) -> str | None:
    if value is None and optional:
      return None
    if isinstance(value, str):
      return value
    raise ValueError(f"{name} must be a string, got {value!r}")

  return _field(check)


def flag(optional: bool = False) -> Any:
  """A bool field."""

  def check(value: Any, name: str) -> bool | None:
    if value is None and optional:
      return None
    if isinstance(value, bool):
      return value
    raise ValueError(f"{name} must be true or false, got {value!r}")

  return _field(check)


def _finite_numbers(value: Any, name: str) -> None:
  """Raises if any number inside ``value`` (a JSON-like tree) is not
  finite."""
  if isinstance(value, Mapping):
    for k, v in value.items():
      _finite_numbers(v, f"{name}.{k}")
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      _finite_numbers(v, f"{name}[{i}]")
  elif _is_number(value) and not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number, got {value!r}")


def mapping() -> Any:
  """A mapping of keyword arguments (read-only once parsed)."""

  def check(value: Any, name: str) -> Mapping[str, Any]:
    value = {} if value is None else value
    if not isinstance(value, Mapping):
      raise ValueError(f"{name} must be a mapping, got {value!r}")
    _finite_numbers(value, name)
    return types.MappingProxyType(dict(value))

  return _field(check)


def names() -> Any:
  """A tuple of names; an entry with commas (``mu,nu`` from the command
  line) is split at them."""

  def check(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
      return ()
    if isinstance(value, str):
      value = (value,)
    if not isinstance(value, (list, tuple)):
      raise ValueError(f"{name} must be a list of names, got {value!r}")
    return tuple(
      part.strip()
      for entry in value
      for part in str(entry).split(",")
      if part.strip()
    )

  return _field(check)


def integers() -> Any:
  """A tuple of integers (None: empty)."""

  def check(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
      return ()
    if isinstance(value, (int, str)):
      value = (value,)
    try:
      return tuple(int(str(v).strip()) for v in value)
    except (TypeError, ValueError):
      raise ValueError(
        f"{name} must be a list of integers, got {value!r}"
      ) from None

  return _field(check)


def section(cls: type) -> Any:
  """A nested section parsed into the dataclass ``cls``."""
  return dataclasses.field(metadata={"section": cls})


def parse_section(cls: type, given: Any, defaults: Any, name: str) -> Any:
  """``cls`` from the mapping ``given`` over ``defaults``.

  Raises:
    ValueError: a field ``cls`` does not have (naming the closest one), or
      a value its check refuses.
  """
  given = {} if given is None else given
  if not isinstance(given, Mapping):
    raise ValueError(f"{name} must be a section (a mapping), got {given!r}")
  known = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(given) - set(known))
  if unknown:
    close = difflib.get_close_matches(unknown[0], list(known), n=1)
    hint = f" (did you mean {name}.{close[0]}?)" if close else ""
    raise ValueError(
      f"{name}.{unknown[0]} is not a field of the main job's config{hint}"
    )
  values = {}
  for field_name, f in known.items():
    value = given.get(field_name, defaults.get(field_name))
    full = f"{name}.{field_name}"
    if "section" in f.metadata:
      values[field_name] = parse_section(
        f.metadata["section"], value, defaults.get(field_name) or {}, full
      )
    else:
      values[field_name] = f.metadata["check"](value, full)
  return cls(**values)


def to_plain(value: Any) -> Any:
  """Converts ConfigDicts (recursively) to plain dicts and lists."""
  if isinstance(value, ml_collections.ConfigDict):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: to_plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_plain(v) for v in value]
  return value


def load_plan(spec: Any) -> PrecisionPlan:
  """Builds a plan from a JSON file path, JSON text, or a config mapping.

  Raises:
    FileNotFoundError: a path that does not exist.
    qsync_jax.PlanError: a malformed plan.
  """
  if isinstance(spec, PrecisionPlan):
    return spec
  spec = to_plain(spec)
  if isinstance(spec, Mapping):
    return PrecisionPlan.from_dict(spec)
  text, what = spec, "plan JSON"
  if isinstance(spec, str) and not spec.lstrip().startswith("{"):
    text, what = read_file(spec, "plan file"), f"plan file {spec!r}"
  try:
    return PrecisionPlan.from_json(text)
  except RecursionError:
    raise ValueError(f"{what} is nested too deeply") from None
  except ValueError as e:  # PlanError, or not JSON: say which plan
    if what == "plan JSON":
      raise
    raise (PlanError if isinstance(e, PlanError) else ValueError)(
      f"{what}: {e}"
    ) from None


def read_file(path: str, what: str) -> str:
  """The UTF-8 text of the file ``path`` a user named.

  Raises:
    FileNotFoundError: no such file.
    ValueError: ``path`` is a directory, unreadable, or not UTF-8 text
      (the message names ``what`` and ``path``).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"{what} {path!r} does not exist")
  if os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is a directory, not a JSON file")
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise ValueError(
      f"{what} {path!r} is not UTF-8 text (byte {e.start} is "
      f"{e.object[e.start : e.start + 1]!r}); expected a JSON file"
    ) from None
  except OSError as e:
    raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from None


def read_json(text: str, what: str) -> Any:
  """Parses JSON text given by the user.

  Args:
    text: the JSON.
    what: what it is, for the message (e.g. ``"--model_kwargs"``).

  Returns:
    The parsed value.

  Raises:
    ValueError: malformed JSON, or JSON nested deeper than Python's recursion
      limit (the decoder recurses per level).
  """
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{what} is not JSON: {e}") from None
  except RecursionError:
    raise ValueError(f"{what} is nested too deeply") from None
