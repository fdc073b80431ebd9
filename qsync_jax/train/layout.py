"""The stacked per-worker layout of the trainer's state.

This module owns how per-worker values live on the mesh: every stacked value
is a global ``(num_workers, ...)`` array sharded over the :data:`AXIS` mesh
axis, one ``(1, ...)`` row per worker on that worker's device. The helpers
here move between the global arrays and their per-device rows without
copying, so a step pays a few host operations, not one per worker and leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np

#: The mesh axis the workers lie along.
AXIS = "workers"


def stack_local(
  rows: Mapping[jax.Device, jax.Array],
  shape: tuple[int, ...],
  sharding: NamedSharding,
) -> jax.Array:
  """Assembles per-device ``(1, ...)`` rows into a global ``(n, ...)`` array.

  Args:
    rows: ``{device: row}`` for every device of ``sharding`` this process
      addresses; each row already lies on its device.
    shape: the global shape.
    sharding: the global array's sharding over the workers.

  Returns:
    The global array (no data is copied).
  """
  return jax.make_array_from_single_device_arrays(
    shape, sharding, [rows[d] for d in sharding.addressable_devices]
  )


def put_rows(
  values: Mapping[jax.Device, Any],
  shape: tuple[int, ...],
  sharding: NamedSharding,
) -> jax.Array:
  """Like :func:`stack_local`, putting each host row on its device first."""
  return stack_local(
    {d: jax.device_put(v, d) for d, v in values.items()}, shape, sharding
  )


def rows(x: jax.Array) -> dict[jax.Device, jax.Array]:
  """Returns the per-device ``(1, ...)`` rows of a stacked global array."""
  return {s.device: s.data for s in x.addressable_shards}


def local_scalar(x: jax.Array) -> Any:
  """The value of a stacked per-worker scalar (identical on all workers).

  Read on the host: indexing the device array would compile a program,
  at the first read, inside whatever the caller is timing.
  """
  return np.asarray(x.addressable_shards[0].data).reshape(-1)[0].item()


def is_key(a: Any) -> bool:
  """Whether ``a`` is an array of typed PRNG keys."""
  dtype = getattr(a, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _key_data(a: Any) -> Any:
  # Typed PRNG keys (a Dropout's own stream) cannot be assembled into global
  # arrays or checkpointed as they are; their raw uint32 data can.
  return jax.random.key_data(a) if is_key(a) else a


def stack_trees(
  trees: Mapping[jax.Device, Any], num_workers: int, sharding: NamedSharding
) -> Any:
  """Stacks per-device pytrees of equal structure into global arrays.

  Typed PRNG keys are stacked as their raw ``key_data``;
  :func:`unstack_tree` wraps them back given the original tree.

  Args:
    trees: ``{device: pytree}``, each on its device.
    num_workers: the number of workers (the leading global dimension).
    sharding: the global arrays' sharding.

  Returns:
    One pytree whose leaves are ``(num_workers, *leaf.shape)`` arrays.
  """
  trees = {d: jax.tree.map(_key_data, t) for d, t in trees.items()}
  per_device = {d: jax.tree.leaves(t) for d, t in trees.items()}
  leaves, treedef = jax.tree.flatten(next(iter(trees.values())))
  stacked = [
    stack_local(
      {d: per_device[d][k][None] for d in trees},
      (num_workers, *leaf.shape),
      sharding,
    )
    for k, leaf in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, stacked)


def unstack_tree(tree: Any, device: jax.Device, like: Any = None) -> Any:
  """The row of ``device`` of every stacked leaf of ``tree`` (unbatched).

  Args:
    tree: stacked global arrays (:func:`stack_trees`).
    device: whose row.
    like: a tree of the original structure; where it holds a typed PRNG
      key, the row's raw key data is wrapped back into a key of its kind.
  """
  out = jax.tree.map(lambda a: rows(a)[device][0], tree)
  if like is None:
    return out
  return jax.tree.map(
    lambda a, ref: (
      jax.random.wrap_key_data(a, impl=jax.random.key_impl(ref))
      if is_key(ref)
      else a
    ),
    out,
    like,
  )


def zeros_like(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Zeros shaped and sharded like the stacked array ``x``."""
  # out_shardings: an output that reads no input would land on one device.
  return jax.jit(jnp.zeros_like, out_shardings=sharding)(x)


def stacked_constant(
  values: np.ndarray, devices: Mapping[int, jax.Device], sharding: NamedSharding
) -> jax.Array:
  """Worker ``i``'s entry of ``values`` as its row of a stacked array.

  Args:
    values: one value per worker, ``(num_workers, ...)``.
    devices: ``{worker index: device}`` of this process's workers.
    sharding: the stacked array's sharding.
  """
  return put_rows(
    {d: values[i : i + 1] for i, d in devices.items()}, values.shape, sharding
  )
