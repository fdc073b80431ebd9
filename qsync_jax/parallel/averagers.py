"""Averaging strategies run inside ``shard_map`` over the workers' axis.

This module owns how worker arrays are combined on the wire: the weighted
mean ``sum_i w_i x_i`` (``sum_i w_i = 1``: equal weights for plain data
parallelism, ``b_i / sum(b)`` for dynamic batch sizing), the number formats
and collectives used for it, and the byte count each worker sends. It is the
entry point: :func:`make_averager` builds every strategy by name.

Every strategy is a frozen dataclass meeting
:class:`~qsync_jax.parallel.wire.Averager`:

* ``__call__(x, weight, axis_name, key=None) -> mean``: run inside
  ``jax.shard_map`` (or ``jax.vmap(..., axis_name=...)``) with this worker's
  array ``x`` and scalar ``weight``; every worker gets the same ``mean``;
* ``reduce(x, weight, axis_name, key=None) -> (mean, sent)``: also returns
  ``sent``, the decoded value of what this worker put on the wire (its
  compressed ``w_i x_i``), which error feedback needs;
* ``wire_bytes(num_elements, num_workers) -> float``: bytes each worker
  sends per call;
* ``name``.

A stateful strategy (PowerSGD's warm start) also meets
:class:`~qsync_jax.parallel.wire.Stateful`: ``init_state(num_elements)`` and
``reduce_with_state(x, weight, axis_name, key, state) -> (mean, sent,
state)``. :func:`init_state` gives any averager's initial state (None for a
stateless one) and :func:`average` runs one average threading it and the
error-feedback residual.

Strategies: :class:`MeanAverager` (float32 ``psum``), :class:`CastAverager`
(fp16 / bf16 ``psum``), :class:`QSGD` (per-worker scale and
``all_gather``), here; :class:`~qsync_jax.parallel.global_qsgd.GlobalQSGD`
(standard dithering with a global scale and an integer ``psum``) and
:class:`~qsync_jax.parallel.global_qsgd.GlobalQSGDExp` (exponential
dithering merged pairwise over ``ppermute``) in
:mod:`qsync_jax.parallel.global_qsgd`;
:class:`~qsync_jax.parallel.powersgd.PowerSGD` (rank-``r`` factors, two
float32 ``psum``) in :mod:`qsync_jax.parallel.powersgd`; plus
:func:`compress_with_feedback` (error feedback), :func:`average` (error
feedback and the averager's state) and :func:`average_tree` (any averager
over a pytree).
The quantizers' buckets and rounding noise (the ``key``, ``seed`` and
``noise`` arguments) are described in
:mod:`qsync_jax.parallel.buckets`.

Weights and unbiasedness. Every quantizer compresses the weighted
contribution ``y_i = w_i x_i``, never ``x_i`` with the weight applied later:
an integer ``psum`` mixes the codes of all workers, so a per-worker weight
cannot be applied after it, and a scale taken from ``max |x|`` with codes
``n w_i x_i / scale`` would overflow for any ``w_i > 1/n``. With the scale
taken from ``max_i max |y_i|`` the codes stay unbiased
(``E[q_i] scale = w_i x_i``) and bounded (``|q_i| <= s``) for any weights.

Non-finite inputs (an overflowing loss-scaled FP16 gradient) stay non-finite
in the mean, so the trainer's finiteness check still skips the step: the
quantizers, which would otherwise turn ``inf`` into finite codes, set every
affected bucket to NaN.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any, cast

import jax
from jax import flatten_util
from jax import lax
import jax.numpy as jnp

from qsync_jax.parallel import buckets

# Re-exported: callers know the whole family by this module's name.
from qsync_jax.parallel.global_qsgd import GlobalQSGD
from qsync_jax.parallel.global_qsgd import GlobalQSGDExp
from qsync_jax.parallel.powersgd import PowerSGD
from qsync_jax.parallel.wire import Averager
from qsync_jax.parallel.wire import Reducing
from qsync_jax.parallel.wire import ring_allgather_bytes
from qsync_jax.parallel.wire import ring_allreduce_bytes
from qsync_jax.parallel.wire import Stateful


@dataclasses.dataclass(frozen=True)
class MeanAverager(Reducing):
  """Weighted mean in float32: one ``psum`` of ``w_i * x_i``."""

  name: str = "mean"

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, w_i x_i)``; ``key`` is unused (exact arithmetic)."""
    del key
    y = x.astype(jnp.float32) * weight
    return lax.psum(y, axis_name), y

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Bytes per worker for one average of ``num_elements`` floats."""
    return ring_allreduce_bytes(4.0 * num_elements, num_workers)


@dataclasses.dataclass(frozen=True)
class CastAverager(Reducing):
  """Weighted mean with a float16 or bfloat16 wire format.

  Each worker casts ``w_i x_i`` to ``dtype`` and the ``psum`` runs in that
  dtype, as PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook`` do
  (weighting before the cast plays the role of their pre-division by the
  world size, keeping the sum in range). The all-reduce must really run in
  the low dtype to model the wire (jax#27496: where the cast sits decides
  the reduction's precision), so the cast comes before the ``psum`` and the
  result is cast back afterwards. JAX emits the all-reduce in ``dtype``;
  XLA:CPU keeps float16 but promotes a bfloat16 all-reduce to float32 (one
  rounding of the exact sum), while NCCL on GPU sums bfloat16 natively.

  Precision: each contribution is rounded once (relative error <= 2**-11 for
  float16, 2**-8 for bfloat16) and every partial sum of the all-reduce is
  rounded again, so the error grows with the number of workers. float16
  overflows beyond 65504: with dynamic loss scaling an overflow shows up as
  ``inf`` and the step is skipped, as for an FP16 gradient.

  Attributes:
    dtype: ``"float16"`` or ``"bfloat16"``.
    name: defaults to ``"fp16"`` / ``"bf16"``.
  """

  dtype: str = "float16"
  name: str = ""

  def __post_init__(self):
    names = {"float16": "fp16", "bfloat16": "bf16"}
    if self.dtype not in names:
      raise ValueError(
        f"CastAverager dtype must be one of {sorted(names)}, got {self.dtype!r}"
      )
    if not self.name:
      object.__setattr__(self, "name", names[self.dtype])

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``; ``key`` is unused (rounding to nearest)."""
    del key
    low = (x.astype(jnp.float32) * weight).astype(self.dtype)
    return (
      lax.psum(low, axis_name).astype(jnp.float32),
      low.astype(jnp.float32),
    )

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Ring all-reduce bytes at 2 bytes per element."""
    return ring_allreduce_bytes(2.0 * num_elements, num_workers)


def _code_dtype(levels: int) -> str:
  """The narrowest integer type holding codes in ``[-levels, levels]``."""
  return "int8" if levels <= 127 else "int16" if levels <= 32767 else "int32"


@dataclasses.dataclass(frozen=True)
class QSGD(Reducing):
  """QSGD baseline: per-worker scales, so codes are gathered, not summed.

  Each worker scales each bucket of ``w_i x_i`` by its own norm, rounds
  ``s |y| / norm`` stochastically to an integer (unbiased, ``|q| <= s``),
  and ``all_gather`` sends the codes (int8 for ``s <= 127``) and the float32
  norms to every worker, which dequantizes and sums them in worker order
  (so the replicas agree bit for bit). Without Elias coding, as in the
  Global-QSGD authors' ``qsgd_hook``.

  References:
    Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient
    SGD via Gradient Quantization and Encoding", arXiv 1610.02132.

  Attributes:
    levels: ``s``, the number of positive levels (1 to 2**24).
    norm: ``"l2"`` (the paper's) or ``"linf"`` (the Global-QSGD baseline's).
    bucket_size: elements sharing one norm (``None``: one per call).
    seed: seeds the rounding noise when no ``key`` is passed.
    noise: ``"hash"`` or ``"threefry"`` (:mod:`qsync_jax.parallel.buckets`).
    name: the strategy's name.
  """

  levels: int = 127
  norm: str = "l2"
  bucket_size: int | None = 512
  seed: int = 0
  noise: str = "hash"
  name: str = "qsgd"

  def __post_init__(self):
    if not 1 <= self.levels <= buckets.MAX_LEVELS:
      raise ValueError(
        f"QSGD levels must be in [1, {buckets.MAX_LEVELS}], got {self.levels}"
      )
    if self.norm not in ("l2", "linf"):
      raise ValueError(f"QSGD norm must be 'l2' or 'linf', got {self.norm!r}")
    buckets.check_bucket_size(self.bucket_size)
    buckets.check_noise(self.noise)

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``, ``sent`` this worker's decoded codes.

    Arguments as for :meth:`qsync_jax.parallel.wire.Averager.reduce`.
    """
    x = x.astype(jnp.float32)
    xb = buckets.to_buckets(x, self.bucket_size)
    yb = xb * weight
    if self.norm == "l2":
      norm = jnp.sqrt(jnp.sum(yb * yb, axis=1))
    else:
      norm = buckets.absmax(x, self.bucket_size, weight)
    # A non-finite bucket has a non-finite norm (a NaN or inf element makes
    # the sum of squares or the max non-finite); a NaN norm makes every
    # decoded value of that bucket NaN on all workers.
    norm = jnp.where(jnp.isfinite(norm), norm, jnp.nan)
    scale = (jnp.where(norm == 0, 1.0, norm) / self.levels)[:, None]
    # No shared value exists before the gather: the local norms vary the
    # default key per step and fold_in(axis_index) separates the workers.
    v = yb / scale
    u = buckets.worker_uniform(
      buckets.base_key(key, self.seed, norm), axis_name, yb.shape, self.noise, v
    )
    q = jnp.clip(jnp.floor(v + u), -self.levels, self.levels)
    codes = lax.all_gather(q.astype(_code_dtype(self.levels)), axis_name)
    scales = lax.all_gather(scale, axis_name)
    mean = jnp.sum(codes.astype(jnp.float32) * scales, axis=0)
    return buckets.from_buckets(mean, x), buckets.from_buckets(q * scale, x)

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """All-gather of the codes and one float32 norm per bucket."""
    code_bytes = jnp.dtype(_code_dtype(self.levels)).itemsize
    payload = code_bytes * num_elements + 4.0 * buckets.num_buckets(
      num_elements, self.bucket_size
    )
    return ring_allgather_bytes(payload, num_workers)


def init_state(averager: Averager | None, num_elements: int) -> Any:
  """The state ``averager`` carries into its first call, or None.

  Args:
    averager: any :class:`~qsync_jax.parallel.wire.Averager` (None: no
      averager, no state).
    num_elements: the length of the vectors it will average.

  Returns:
    ``averager.init_state(num_elements)`` for a
    :class:`~qsync_jax.parallel.wire.Stateful` averager (None where that
    instance carries none, e.g. PowerSGD without warm start); None for any
    other.
  """
  init = getattr(averager, "init_state", None)
  return None if init is None else init(num_elements)


def average(
  averager: Averager,
  x: jax.Array,
  weight: jax.Array,
  axis_name: str,
  key: jax.Array | None = None,
  residual: jax.Array | None = None,
  state: Any = None,
) -> tuple[jax.Array, jax.Array | None, Any]:
  """One ``sum_i w_i x_i``, with error feedback and the averager's state.

  With a ``residual`` the worker sends ``p = w_i x_i + residual`` (with
  weight 1) and keeps ``p - sent``, as :func:`compress_with_feedback`
  describes. With a ``state`` (from :func:`init_state`) the averager's
  ``reduce_with_state`` reads and updates it. Without either this is
  ``averager(x, weight, axis_name, key)``.

  Args:
    averager: any :class:`~qsync_jax.parallel.wire.Averager`.
    x: this worker's array.
    weight: this worker's weight.
    axis_name: the workers' axis.
    key: optional PRNG key, as for the averager.
    residual: this worker's error-feedback residual, or None without
      feedback.
    state: the averager's state from the previous call, or None.

  Returns:
    ``(mean, new_residual, new_state)``; each of the last two None when
    passed None.
  """
  if residual is None and state is None:
    return averager(x, weight, axis_name, key), None, None
  if residual is not None:
    x = x.astype(jnp.float32) * weight + residual
    weight = jnp.float32(1)
  if state is None:
    mean, sent = averager.reduce(x, weight, axis_name, key)
  else:
    # A state comes from init_state: the averager is Stateful.
    mean, sent, state = cast(Stateful, averager).reduce_with_state(
      x, weight, axis_name, key, state
    )
  return mean, None if residual is None else x - sent, state


def compress_with_feedback(
  averager: Averager,
  x: jax.Array,
  residual: jax.Array,
  weight: jax.Array,
  axis_name: str,
  key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Averages with error feedback: re-sends what compression dropped.

  The worker sends ``p = w_i x_i + residual`` (through ``averager`` with
  weight 1) and keeps ``p - sent`` for the next call, so the compression
  error telescopes instead of accumulating: over ``T`` calls the sum of the
  means differs from the sum of the exact means by the final residuals only.
  Only the local compression error is fed back (the exponential merges' and
  the low-precision partial sums' errors are shared and not attributable).
  The residual is per-worker state in units of ``w_i x_i``; the caller (the
  trainer) carries it between steps, starting from zeros. A stateful
  averager runs without its state here; :func:`average` threads both.

  References:
    Seide et al., "1-Bit Stochastic Gradient Descent ..." (Interspeech
    2014); Karimireddy et al., "Error Feedback Fixes SignSGD ...",
    arXiv 1901.09847.

  Args:
    averager: any :class:`~qsync_jax.parallel.wire.Averager`.
    x: this worker's array.
    residual: this worker's residual from the previous call.
    weight: this worker's weight.
    axis_name: the workers' axis.
    key: optional PRNG key, as for the averager.

  Returns:
    ``(mean, new_residual)``.
  """
  mean, new_residual, _ = average(averager, x, weight, axis_name, key, residual)
  assert new_residual is not None  # a residual in, a residual out
  return mean, new_residual


_FACTORIES: dict[str, Callable[..., Any]] = {
  "none": MeanAverager,
  "fp32": MeanAverager,
  "mean": MeanAverager,
  "fp16": functools.partial(CastAverager, "float16"),
  "bf16": functools.partial(CastAverager, "bfloat16"),
  "gqsgd": GlobalQSGD,
  "gqsgd_exp": GlobalQSGDExp,
  "qsgd": QSGD,
  "powersgd": PowerSGD,
}


def make_averager(name: str, **kwargs: Any) -> Averager:
  """Builds an averaging strategy by name.

  Args:
    name: one of none, fp32, mean (float32 mean), fp16, bf16, gqsgd,
      gqsgd_exp, qsgd, powersgd.
    **kwargs: the strategy's dataclass fields (e.g. ``wire="int16"``,
      ``rank=4``).

  Returns:
    The strategy.

  Raises:
    ValueError: an unknown name, or a field out of its range.
    TypeError: a keyword that is not one of the strategy's fields (the
      message lists them).

  Example:
    >>> import qsync_jax as qs
    >>> averager = qs.make_averager("gqsgd", wire="int16")
    >>> averager.wire
    'int16'
    >>> n = 1 << 20  # bytes each of 4 workers sends: int8 codes vs float32
    >>> qs.make_averager("gqsgd").wire_bytes(n, 4) < qs.make_averager(
    ...   "none"
    ... ).wire_bytes(n, 4) / 3
    True
  """
  if name not in _FACTORIES:
    raise ValueError(
      f"unknown averager {name!r}; valid: {', '.join(_FACTORIES)}"
    )
  factory = _FACTORIES[name]
  cls = factory.func if isinstance(factory, functools.partial) else factory
  fields = [f.name for f in dataclasses.fields(cast(Any, cls)) if f.init]
  if isinstance(factory, functools.partial):
    fields = fields[len(factory.args) :]  # the dtype the name fixes
  unknown = sorted(set(kwargs) - set(fields))
  if unknown:
    shown = [f for f in fields if f != "name"]
    raise TypeError(
      f"make_averager({name!r}) takes no {', '.join(unknown)}; it takes "
      f"{', '.join(shown) or 'no keyword arguments'}"
    )
  return factory(**kwargs)


def ravel_floats(tree: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
  """Ravels a pytree of floating-point arrays into one vector.

  Args:
    tree: a pytree whose leaves are all floating-point arrays.

  Returns:
    ``(flat, unravel)`` as :func:`jax.flatten_util.ravel_pytree` gives them:
    ``flat`` in the leaves' promoted float dtype; ``unravel`` takes a vector
    of that dtype and restores each leaf's shape and dtype.

  Raises:
    ValueError: a leaf is not a floating-point array (an integer step
      counter, a PRNG key, a boolean mask), named by its path.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
        "averaging needs floating-point leaves, got "
        f"{dtype or type(leaf).__name__} at "
        f"{jax.tree_util.keystr(path) or 'the root'}"
      )
  return flatten_util.ravel_pytree(tree)


def average_tree(
  averager: Averager,
  tree: Any,
  weight: jax.Array,
  axis_name: str,
  key: jax.Array | None = None,
) -> Any:
  """``sum_i w_i x_i`` of a pytree: one averager call on its raveled leaves.

  The float leaves are raveled into one vector (so the averager's buckets
  span leaf boundaries and one collective carries the whole tree), averaged,
  and unraveled. Run it where the averager runs: inside ``jax.shard_map``
  (or ``jax.vmap(..., axis_name=...)``) over ``axis_name``.

  Args:
    averager: any :class:`~qsync_jax.parallel.wire.Averager`.
    tree: this worker's pytree of floating-point arrays.
    weight: this worker's scalar weight (``1 / n`` for a plain mean).
    axis_name: the workers' axis.
    key: optional PRNG key, the same on every worker, as for the averager.

  Returns:
    The averaged tree, the same on every worker, each leaf in its own dtype.

  Raises:
    ValueError: a leaf is not a floating-point array.
  """
  flat, unravel = ravel_floats(tree)
  if flat.size == 0:
    return tree
  mean = averager(flat, weight, axis_name, key)
  return unravel(mean.astype(flat.dtype))
