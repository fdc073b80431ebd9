"""The agreement check: every process of a run has the same settings.

This module owns what processes compare before their first collective and how.
Processes that disagree on library versions, the config, the initial
parameters, the data order or ``XLA_FLAGS`` would train different models or
hang in a collective (NCCL on mixed nodes hangs rather than fails). So each
process puts its :func:`local_facts` in the ``jax.distributed`` coordination
service's key-value store, which needs no collective and no device, and reads
every other process's; all compare the same table, so all fail together, with
the same one line naming the first process and field that differ from
process 0's. A field may come with details, ``field.sub`` entries (the
config's, one per setting, each bounded in size): where the field differs,
the line names its first differing detail and both values instead of two
digests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import hashlib
import itertools
import json
import os
from typing import Any

import flax
import jax
import jaxlib
import numpy as np

from qsync_jax.process import coordination

#: The compared fields, in the order a mismatch is reported.
FIELDS = (
  "jax",
  "jaxlib",
  "flax",
  "XLA_FLAGS",
  "config",
  "param_count",
  "params",
  "data_seed",
)

# A unique key prefix per check within one process (all processes call the
# checks in the same order, so the n-th calls share their keys).
_CALLS = itertools.count()
_SHOWN = 48  # Longest value quoted in the error line.
# Bounds on a field's details: how many, and a key's length (the values are
# bounded by _SHOWN plus a digest).
_MAX_DETAILS = 256
_MAX_KEY = 120


class AgreementError(coordination.CoordinationError):
  """The processes of a run disagree on a field, or one never reported."""


def tree_digest(tree: Any) -> str:
  """SHA-256 over a pytree's leaf paths, dtypes, shapes and bytes.

  Args:
    tree: A pytree of arrays (host or device).

  Returns:
    The hex digest.
  """
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    data = np.ascontiguousarray(np.asarray(leaf))
    h.update(
      f"{jax.tree_util.keystr(path)}:{data.dtype}:{data.shape};".encode()
    )
    h.update(data.tobytes())
  return h.hexdigest()


def json_digest(value: Any) -> str:
  """SHA-256 of ``value`` as JSON with sorted keys (non-JSON values by repr)."""
  text = json.dumps(value, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()


def _detail(value: Any) -> str:
  """``value`` as JSON, cut to :data:`_SHOWN` characters plus a digest of the
  whole (so values that differ past the cut still differ)."""
  text = json.dumps(value, sort_keys=True, default=repr)
  if len(text) <= _SHOWN:
    return text
  digest = hashlib.sha256(text.encode()).hexdigest()[:8]
  return f"{text[: _SHOWN - 12]}...#{digest}"


def details(field: str, value: Any) -> dict[str, str]:
  """``{field.path: value}`` of every setting in ``value``, bounded.

  The entries a field's mismatch is explained by (:func:`first_mismatch`):
  nested mappings give dotted paths, lists ``[i]``; at most
  :data:`_MAX_DETAILS` entries, each value cut to about :data:`_SHOWN`
  characters (with a digest of the rest).

  Args:
    field: the compared field (``"config"``).
    value: its plain JSON-able value.

  Returns:
    The entries, in the value's order.
  """
  out: dict[str, str] = {}

  def walk(node: Any, path: str) -> None:
    if len(out) >= _MAX_DETAILS:
      return
    if isinstance(node, Mapping) and node:
      for k, v in node.items():
        walk(v, f"{path}.{k}")
    elif isinstance(node, (list, tuple)) and node:
      for i, v in enumerate(node):
        walk(v, f"{path}[{i}]")
    else:
      out[path[:_MAX_KEY]] = _detail(node)

  walk(value, field)
  return out


def local_facts(
  *,
  config: Any,
  params: Any,
  data_seed: int,
  environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
  """What this process compares with the others.

  Args:
    config: The run's config as plain JSON-able data, without the fields
      that may differ per process.
    params: The initial parameters (a pytree of arrays).
    data_seed: The seed of the data order.
    environ: The environment ``XLA_FLAGS`` is read from; None: os.environ.

  Returns:
    ``{field: value}`` over :data:`FIELDS`, each a string, and the config's
    :func:`details`.
  """
  environ = os.environ if environ is None else environ
  leaves = jax.tree.leaves(params)
  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "flax": flax.__version__,
    "XLA_FLAGS": environ.get("XLA_FLAGS", ""),
    "config": json_digest(config),
    "param_count": str(sum(int(np.size(x)) for x in leaves)),
    "params": tree_digest(params),
    "data_seed": str(data_seed),
    **details("config", config),
  }


def _short(value: str) -> str:
  value = repr(value)
  return value if len(value) <= _SHOWN else value[: _SHOWN - 3] + "..."


def first_mismatch(table: Sequence[Mapping[str, str]]) -> str | None:
  """The message for the first process and field differing from process 0.

  Args:
    table: Every process's facts, in process order.

  Returns:
    One line, or None when every process agrees.
  """
  reference = table[0]
  # FIELDS in their order, then any other field a caller compares; a
  # field's details ("field.sub", "field[i]") explain it, not count alone.
  names = set(reference).union(*table[1:])
  top = {n for n in names if not _detail_of(n, names)}
  fields = [f for f in FIELDS if f in top] + sorted(top - set(FIELDS))
  for k, facts in enumerate(table[1:], start=1):
    for field in fields:
      if facts.get(field) != reference.get(field):
        return _explained(k, field, facts, reference)
  return None


def _detail_of(name: str, names: set[str]) -> bool:
  """Whether ``name`` is a detail (``field.sub``, ``field[i]``) of a field
  in ``names``."""
  for i, c in enumerate(name):
    if c in ".[" and name[:i] in names:
      return True
  return False


def _explained(
  k: int, field: str, facts: Mapping[str, str], reference: Mapping[str, str]
) -> str:
  """The line for process ``k`` differing on ``field``: its first differing
  detail and both values where it has details, else the field's own."""
  keys = [
    key
    for key in dict.fromkeys([*reference, *facts])
    if key.startswith((f"{field}.", f"{field}[")) and key != field
  ]
  for key in keys:
    mine, theirs = facts.get(key), reference.get(key)
    if mine != theirs:
      return (
        f"process {k} disagrees with process 0 on {key}: "
        f"{_plain(mine)} vs {_plain(theirs)}"
      )
  return (
    f"process {k} disagrees with process 0 on {field}: "
    f"{_short(facts.get(field, '<missing>'))} vs "
    f"{_short(reference.get(field, '<missing>'))}"
  )


def _plain(detail: str | None) -> str:
  """A :func:`_detail` as the line shows it (its digest left out)."""
  if detail is None:
    return "<missing>"
  text, sep, _ = detail.rpartition("...#")
  return f"{text}..." if sep else detail


def check(facts: Mapping[str, str], *, timeout_s: float = 60) -> None:
  """Checks that every process of the run reports the same ``facts``.

  A no-op in a single-process run. Every process must call it, before any
  collective; it uses ``jax.distributed``'s key-value store, not a device.

  Args:
    facts: This process's :func:`local_facts`, or any other ``{field:
      text}`` every process reports (the main job also compares its
      precision plans' digest this way).
    timeout_s: The longest wait for another process's facts.

  Raises:
    AgreementError: A process differs from process 0 (the message names the
      process and the field) or did not report within ``timeout_s``.
  """
  n = jax.process_count()
  if n == 1:
    return
  try:
    table = coordination.gather(
      coordination.client(),
      facts,
      jax.process_index(),
      n,
      timeout_s=timeout_s,
      prefix=f"qsync_agreement/{next(_CALLS)}",
    )
  except coordination.CoordinationError as e:
    raise AgreementError(str(e)) from None
  problem = first_mismatch(table)
  if problem is not None:
    raise AgreementError(problem)
