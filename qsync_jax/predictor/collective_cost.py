"""What the collectives themselves cost on the devices at hand, measured.

This module owns :class:`CollectiveCost` and :func:`profile_collectives`:
each kind and wire type of collective (an all-reduce of int8, an all-gather
of float32, ...) run alone over the run's mesh at small sizes and fitted as
``a + b x bytes`` per worker's operand.

Why measure what the link's rate should give: where the host's CPU moves
and reduces the bytes, as XLA:CPU's gloo collectives over TCP do, the wire
is not the only cost per byte. gloo sums float16 in software, and the TCP
stack copies every byte on cores the workers share, so pricing at the link's
measured rate alone predicts such averages short. A fit
of the plain collective on the very link carries those costs, as the bus
bandwidth of NCCL's tests does on GPUs; the averager's own encode and decode
stay with :func:`~qsync_jax.predictor.codec.profile_codec`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from qsync_jax.predictor import timing
from qsync_jax.predictor.codec import AXIS
from qsync_jax.predictor.codec import CodecCost
from qsync_jax.predictor.codec import sample_data

#: HLO element types a compiled collective may move, as numpy types.
HLO_DTYPES = {
  "f32": jnp.float32,
  "f16": jnp.float16,
  "bf16": jnp.bfloat16,
  "s8": jnp.int8,
  "u8": jnp.uint8,
  "s16": jnp.int16,
  "u16": jnp.uint16,
  "s32": jnp.int32,
  "u32": jnp.uint32,
}
#: The collective kinds that can be timed.
KINDS = ("all_reduce", "all_gather", "permute", "exchange")
#: Operand bytes per worker the fits are measured at.
FIT_BYTES = (1 << 20, 1 << 22)


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  """Fitted seconds of each ``(kind, HLO type)`` of collective on a mesh.

  Attributes:
    fits: ``{(kind, dtype): CodecCost}``, each ``a + b x operand bytes``
      (``kind`` as :class:`~qsync_jax.predictor.communication.Collective`'s:
      ``"all_reduce"``, ``"all_gather"``, ``"permute"``, ``"exchange"``;
      ``dtype`` an HLO type such as ``"s8"``).
  """

  fits: Mapping[tuple[str, str], CodecCost]

  def __call__(self, collectives: Iterable[Any]) -> float:
    """Seconds of ``collectives`` (each with ``kind``, ``dtype`` and
    ``operand_bytes``), one after the other.

    Raises:
      ValueError: a kind and type that was not profiled.
    """
    total = 0.0
    for c in collectives:
      fit = self.fits.get((c.kind, c.dtype))
      if fit is None:
        raise ValueError(
          f"no measured cost for a {c.kind} of {c.dtype}; profiled: "
          f"{', '.join(f'{k} {t}' for k, t in sorted(self.fits))}"
        )
      total += fit(c.operand_bytes)
    return total

  def to_dict(self) -> dict[str, Any]:
    return {f"{k} {t}": fit.to_dict() for (k, t), fit in self.fits.items()}


def collective_program(
  kind: str, dtype: str, mesh: Mesh
) -> Callable[[jax.Array], jax.Array]:
  """A jitted program that runs one ``kind`` collective over ``mesh``.

  Its argument is the workers' operands, sharded over the mesh's one axis.

  Raises:
    ValueError: an unknown kind.
  """
  n = mesh.devices.size
  if kind not in KINDS:
    raise ValueError(
      f"cannot time a {kind!r} collective; valid: {', '.join(KINDS)}"
    )

  def body(x):
    if kind == "all_reduce":
      return jax.lax.psum(x, AXIS)
    if kind == "all_gather":  # The gathered copy's first share goes back.
      return jax.lax.all_gather(x, AXIS, tiled=True)[: x.shape[0]]
    if kind == "exchange":  # Neighbours swap; an odd one out sends nothing.
      return jax.lax.ppermute(
        x, AXIS, [(i, i ^ 1) for i in range(n) if i ^ 1 < n]
      )
    return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % n) for i in range(n)])

  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
  )


def _shard_operand(
  np_dtype: np.dtype, elements: int, sample: Any, n: int, index: Any
) -> np.ndarray:
  """:func:`_operand`, as ``make_array_from_callback`` asks for each shard."""
  del index
  return _operand(np_dtype, elements, sample, n)


def _operand(np_dtype: np.dtype, elements: int, sample, n: int) -> np.ndarray:
  """One worker's operand of a profiled collective (see
  :func:`profile_collectives`'s ``sample``)."""
  if sample is None or not jnp.issubdtype(np_dtype, jnp.floating):
    return np.ones((elements,), np_dtype)
  return (sample_data(sample, elements) / n).astype(np_dtype)


def collective_programs(
  kind: str,
  dtype: str,
  devices: Sequence[jax.Device],
  sizes: Sequence[int],
  sample=None,
) -> list[tuple[Callable[..., Any], tuple]]:
  """The programs :func:`profile_collectives` times for one kind and type,
  compiled and run once (every process alike), one ``(fn, args)`` per
  size of operand bytes; arguments as :func:`profile_collectives`'s.

  Raises:
    ValueError: an unknown kind or type.
  """
  if dtype not in HLO_DTYPES:
    raise ValueError(
      f"cannot time collectives of {dtype}; types: {', '.join(HLO_DTYPES)}"
    )
  mesh = Mesh(np.array(list(devices)), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  n = mesh.devices.size
  np_dtype = np.dtype(HLO_DTYPES[dtype])
  fn = collective_program(kind, dtype, mesh)
  programs = []
  for size in sizes:
    elements = max(int(size) // np_dtype.itemsize, 1)
    x = jax.make_array_from_callback(
      (n * elements,),
      sharding,
      functools.partial(_shard_operand, np_dtype, elements, sample, n),
    )
    jax.block_until_ready(fn(x))  # compile, in step on every process
    programs.append((fn, (x,)))
  return programs


def profile_collectives(
  keys: Iterable[tuple[str, str]],
  devices: Sequence[jax.Device],
  *,
  sizes: Sequence[int] = FIT_BYTES,
  repeats: int = 5,
  calls: int = 3,
  sync: Callable[[], Any] | None = None,
  sample=None,
) -> CollectiveCost:
  """Times each ``(kind, dtype)`` collective alone over ``devices``.

  Every process of a multi-process mesh must call this with the same
  arguments (the programs are collectives); ``sync``, a barrier, runs
  before each timed block so the processes time the same calls. The
  statistic is :func:`~qsync_jax.predictor.codec.profile_codec`'s: the
  median over ``repeats`` blocks of ``calls`` back-to-back calls.

  Args:
    keys: the ``(kind, HLO type)`` pairs to measure (e.g. those of
      :func:`~qsync_jax.predictor.communication.compiled_collectives`).
    devices: the mesh, one worker per device (all processes' devices).
    sizes: operand bytes per worker to fit at (at least two distinct).
    repeats: timed blocks per size.
    calls: calls per block.
    sync: called before each block.
    sample: representative float32 data (one worker's raveled gradient):
      floating operands are ``sample / n`` in their type, as the averagers
      send ``w_i x_i``; integer ones are ones. Without it, floating
      operands are ones too. gloo sums float16 in software, and its time
      depends on the values.

  Returns:
    The fitted :class:`CollectiveCost`.

  Raises:
    ValueError: an unknown kind or type, fewer than two sizes, or
      fewer than two devices.
  """
  keys = sorted(set(keys))
  devices = list(devices)
  if len(devices) < 2:
    raise ValueError(f"collectives need >= 2 devices, got {len(devices)}")
  if len({int(s) for s in sizes}) < 2 or min(repeats, calls) < 1:
    raise ValueError(
      f"profile_collectives needs two distinct sizes and at "
      f"least one repeat and call; got sizes {list(sizes)}, "
      f"{repeats} repeats, {calls} calls"
    )
  unknown = [t for k, t in keys if t not in HLO_DTYPES or k not in KINDS]
  if unknown:
    raise ValueError(
      f"cannot time collectives {keys}; valid kinds: "
      f"{', '.join(KINDS)}; types: {', '.join(HLO_DTYPES)}"
    )
  fits = {}
  for kind, dtype in keys:
    seconds = [
      timing.median_block_seconds(fn, args, repeats, calls, sync)
      for fn, args in collective_programs(kind, dtype, devices, sizes, sample)
    ]
    fits[(kind, dtype)] = CodecCost.fit([int(s) for s in sizes], seconds)
  return CollectiveCost(fits)
