"""Values the processes of a run share before any collective.

This module owns how processes exchange small host values (settings,
profiles, plans) through the ``jax.distributed`` coordination service's
key-value store: :func:`gather` (every process's value, in process order) and
:func:`share` (one process's value to all). The store needs no device and no
collective, so it works before the devices are known to agree, and a process
that fails can still tell the others why: :func:`share` carries an error in
place of the value, and every receiver raises it as its own, so the whole run
ends with the same one line instead of waiting out a timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
from typing import Any


class CoordinationError(RuntimeError):
  """A process did not report in time, or reported that it failed."""


def client() -> Any:
  """The coordination service's key-value client (``jax.distributed``'s).

  Returns:
    The client (``key_value_set``, ``blocking_key_value_get``).
  """
  # Orbax's public accessor; jax itself exposes the client only privately.
  from orbax.checkpoint import multihost  # local: only multi-process runs

  return multihost.get_jax_distributed_client()


def _get(
  store: Any, key: str, timeout_s: float, missing: str, waiter: int
) -> str:
  try:
    return store.blocking_key_value_get(key, int(timeout_s * 1000))
  except Exception:  # pylint: disable=broad-except
    # The store raises a runtime error (DEADLINE_EXCEEDED) on timeout.
    raise CoordinationError(
      f"{missing} within {timeout_s:g} s (process {waiter} waited)"
    ) from None


def gather(
  store: Any,
  value: Mapping[str, Any],
  process_index: int,
  process_count: int,
  *,
  prefix: str,
  timeout_s: float = 60,
  what: str = "its settings",
) -> list[dict[str, Any]]:
  """Every process's ``value`` through the key-value store ``store``.

  Every process calls it with the same ``prefix``.

  Args:
    store: The store (``key_value_set``, ``blocking_key_value_get``).
    value: This process's value (JSON-able).
    process_index: This process's index.
    process_count: How many processes report.
    prefix: The keys' prefix, the same on every process.
    timeout_s: The longest wait for another process's value.
    what: What the value is, for the timeout message.

  Returns:
    The values in process order.

  Raises:
    CoordinationError: A process did not report within ``timeout_s``.
  """
  store.key_value_set(f"{prefix}/{process_index}", json.dumps(dict(value)))
  table = []
  for k in range(process_count):
    if k == process_index:
      table.append(dict(value))
      continue
    table.append(
      json.loads(
        _get(
          store,
          f"{prefix}/{k}",
          timeout_s,
          f"process {k} did not report {what}",
          process_index,
        )
      )
    )
  return table


def share(
  store: Any,
  key: str,
  value: Any = None,
  *,
  source: int,
  process_index: int,
  timeout_s: float = 60,
  what: str = "a value",
  error: str | None = None,
) -> Any:
  """Process ``source``'s ``value``, on every process.

  The source puts ``value`` (or ``error``) under ``key``; the others wait for
  it. Every process, the source included, raises the source's ``error``.

  Args:
    store: The store (``key_value_set``, ``blocking_key_value_get``).
    key: The value's key, the same on every process.
    value: The value (JSON-able); read only on the source.
    source: The index of the process that has the value.
    process_index: This process's index.
    timeout_s: The longest wait for the source.
    what: What the value is, for the timeout message.
    error: On the source, instead of a value: why it has none.

  Returns:
    The source's value.

  Raises:
    CoordinationError: The source reported ``error`` (its text is the
      message), or did not report within ``timeout_s``.
  """
  if process_index == source:
    store.key_value_set(key, json.dumps({"value": value, "error": error}))
    if error is not None:
      raise CoordinationError(error)
    return value
  got = json.loads(
    _get(
      store,
      key,
      timeout_s,
      f"process {source} did not share {what}",
      process_index,
    )
  )
  if got["error"] is not None:
    raise CoordinationError(got["error"])
  return got["value"]
