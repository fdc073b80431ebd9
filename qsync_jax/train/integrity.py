"""The integrity of checkpoints: checksums of every array shard and of the
metadata.

This module owns what a save records so that a restore can tell an intact
checkpoint from a damaged one: the SHA-256 of every array shard each process
writes (:func:`array_digests`, keyed by the shard's index in its global
array), of the JSON metadata (:func:`meta_digest`), and the checks a restore
makes on what it read (:func:`array_problem` for a process's own shards, by
shard index whichever process wrote them, :func:`digest_problem` for arrays
read whole on every process, as a resume onto other workers reads them).
:func:`allgather_json` shares small JSON values between the processes of a
run.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

#: The key of the integrity record in a checkpoint's JSON metadata.
INTEGRITY = "integrity"


def _index_key(index: tuple[slice, ...]) -> str:
  # Where a shard sits in its global array, e.g. "1:2,:,:".
  return ",".join(
    f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"
    for s in index
  )


def array_digests(tree: Any) -> dict[str, dict[str, str]]:
  """SHA-256 of every array shard this process holds.

  Args:
    tree: a pytree of ``jax.Array`` (e.g. :func:`state_tree` output).

  Returns:
    ``{leaf path: {shard index: hex digest}}`` over this process's
    addressable shards (a replicated shard is hashed once).
  """
  out: dict[str, dict[str, str]] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shards = out.setdefault(jax.tree_util.keystr(path), {})
    for shard in leaf.addressable_shards:
      key = _index_key(shard.index)
      if key not in shards:
        data = np.ascontiguousarray(np.asarray(shard.data))
        shards[key] = hashlib.sha256(data.tobytes()).hexdigest()
  return out


def meta_digest(meta: dict[str, Any]) -> str:
  """SHA-256 of a checkpoint's JSON metadata.

  Args:
    meta: the metadata, as JSON reads it back.

  Returns:
    The hex digest of ``meta`` without its integrity record, keys sorted.
  """
  body = {k: v for k, v in meta.items() if k != INTEGRITY}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def allgather_json(obj: Any) -> list[Any]:
  """``obj`` (JSON) from every process, in process order; a collective."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size])))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[: int(n)])) for row, n in zip(rows, sizes[:, 0])]


def array_problem(meta: dict[str, Any], tree: Any) -> str | None:
  """Why this process's shards of the arrays read do not match the checksums
  saved in ``meta``, or None.

  A save keys its checksums by the process that wrote each shard; a shard
  is the same wherever it is read, so a restore checks each of its shards
  against the checksum of the same shard index from whichever process
  saved it: a checkpoint resumes onto another split of the same workers
  into processes (two processes of one device each, one process of two
  devices).
  """
  arrays = meta[INTEGRITY].get("arrays", {})
  if not isinstance(arrays, dict) or not arrays:
    return "it holds no array checksums"
  want: dict[str, dict[str, str]] = {}
  for process in sorted(arrays):
    saved = arrays[process]
    if not isinstance(saved, dict):
      return f"its checksums of process {process} are not a JSON object"
    for key, shards in saved.items():
      if isinstance(shards, dict):
        want.setdefault(key, {}).update(shards)
  got = array_digests(tree)
  for key in sorted(set(want) | set(got)):
    saved, read = want.get(key, {}), got.get(key, {})
    if not saved or not read:
      return f"checksum mismatch in {key}"
    for index, digest in read.items():
      if index not in saved:
        return (
          f"checksum mismatch in {key} (no saved shard {index!r}: it was "
          "written with another sharding)"
        )
      if saved[index] != digest:
        return f"checksum mismatch in {key}"
  return None


def _index(key: str) -> tuple[slice, ...]:
  # The inverse of the checkpoint's shard index keys, e.g. "1:2,:,:".
  if not key:
    return ()
  out = []
  for part in key.split(","):
    start, stop = part.split(":")
    out.append(
      slice(int(start) if start else None, int(stop) if stop else None)
    )
  return tuple(out)


def digest_problem(tree: Any, arrays: Any) -> str | None:
  """Why host arrays read whole do not match their saved checksums, or None.

  A save records the SHA-256 of every shard each process wrote, keyed by its
  index in the global array. A reshard reads every array whole on every
  process, so every process checks every process's shards: the saved array
  sliced at each recorded index, hashed as the save hashed it.

  Args:
    tree: the arrays read, as numpy, in the structure the save digested.
    arrays: the integrity record's ``{process: {leaf path: {shard index:
      hex digest}}}``.

  Returns:
    ``"checksum mismatch in <leaf path>"`` for the first leaf that differs
    (or has no checksum, or one no read array has), else None.
  """
  if not isinstance(arrays, dict) or not arrays:
    return "it holds no array checksums"
  leaves = {
    jax.tree_util.keystr(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }
  for process in sorted(arrays):
    want = arrays[process]
    if not isinstance(want, dict):
      return f"its checksums of process {process} are not a JSON object"
    for key in sorted(set(want) | set(leaves)):
      shards = want.get(key)
      if key not in leaves or not isinstance(shards, dict) or not shards:
        return f"checksum mismatch in {key}"
      for index, digest in shards.items():
        try:
          data = np.ascontiguousarray(leaves[key][_index(index)])
        except (ValueError, IndexError):
          return f"checksum mismatch in {key} (no shard {index!r})"
        if hashlib.sha256(data.tobytes()).hexdigest() != digest:
          return f"checksum mismatch in {key}"
  return None
