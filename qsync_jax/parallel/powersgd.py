"""PowerSGD: a rank-``r`` approximation of the mean, sent as two thin factors.

This module owns :class:`PowerSGD`, the low-rank averager PyTorch DDP ships as
``powerSGD_hook`` (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank
Gradient Compression for Distributed Optimization", arXiv 1905.13727). It meets
:class:`~qsync_jax.parallel.wire.Averager` like the other strategies of
:mod:`qsync_jax.parallel.averagers`, which builds it as ``"powersgd"``.

One call, on this worker's flat float32 array ``x`` with weight ``w_i``:

1. ``M_i``: ``w_i x_i`` zero-padded and reshaped into a ``(rows, cols)``
   matrix (see :meth:`PowerSGD.matrix_shape`);
2. ``P = sum_i M_i Q`` (one all-reduce of ``rows x r`` floats), with ``Q``
   the ``(cols, r)`` starting matrix, the same on every worker: the previous
   call's ``Q`` (warm start, below) or a Gaussian one drawn from the call's
   key;
3. ``P_hat``: an orthonormal basis of ``P`` (Householder QR, so a
   rank-deficient ``P`` still gives orthonormal columns);
4. ``Q = sum_i M_i^T P_hat`` (one all-reduce of ``cols x r`` floats);
5. the mean ``P_hat Q^T = P_hat P_hat^T sum_i M_i``, the projection of the
   exact weighted sum onto the column space found in step 2.

What a worker sent (for error feedback,
:func:`~qsync_jax.parallel.averagers.compress_with_feedback`) is its own
share ``P_hat P_hat^T M_i``: the shares sum to the mean, and the residual is
the paper's local error ``M_i - decompress(compress(M_i))`` (Algorithm 2).
PyTorch's hook instead keeps ``input - mean``, which does not telescope per
worker; the paper's form is the one the generic error feedback expects.

Warm start (``warm_start=True``, the default, as in the paper's Algorithm 1
and PyTorch's ``PowerSGDState(warm_start=True)``). Each call starts from the
all-reduced ``Q`` of step 4 of the previous call, so successive calls run
subspace iteration (one power step ``M M^T`` per call) on the slowly changing
gradients instead of a one-shot randomized range finder, and capture more of
their spectrum at the same rank and bytes: on a fixed input the mean converges
to the best rank-``r`` approximation. That ``Q`` is the averager's state
(:class:`~qsync_jax.parallel.wire.Stateful`): :meth:`PowerSGD.init_state`
gives ``(cols, r)`` zeros and :meth:`PowerSGD.reduce_with_state` returns the
new ``Q``; the trainer carries it beside the error-feedback residual and
checkpoints it, and :func:`~qsync_jax.parallel.transform.averaged` keeps it in
its state. It is an all-reduced sum, so it is the same on every worker. As
PyTorch's hook does, the reused ``Q`` is orthonormalized (QR) before step 2:
the column space of ``P`` stays as it is, but its columns scale with the
singular values of ``M`` rather than their squares, whose spread would cost
the weaker directions their float32 precision. A state of zeros
(the first call, or an input of zeros) draws ``Q`` from the key, as does a
call without state (``reduce``, or ``warm_start=False``: a fresh random
start every call, exact for inputs of rank ``<= r``). A non-finite input
gives a zero state, so the next call starts afresh. Without a key ``Q`` comes
from ``seed``.

Error feedback. The residual builds up to about ``1 / (captured fraction)``
steps of gradient, and a stale update that large can destabilize momentum SGD;
warm start captures more and so helps, but at a low rank not enough. Raise the
rank before turning error feedback on: the reshaped flat vector is not the
per-layer matrices the paper compresses, and its spectrum decays slowly.

Matrix shape. The protocol hands over one flat vector (the whole model's
parameters or gradients, raveled), not per-layer matrices as PyTorch's hook
sees them, so the matrix is a reshape: by default nearly square
(``cols = ceil(sqrt(N))``), which sends the fewest bytes for a rank
(``2 r sqrt(N)`` floats instead of ``N``); ``cols`` fixes the width instead
(e.g. a common layer width, so that rows of the matrix are rows of the
layers' kernels). A rank above ``min(rows, cols)`` is clamped to it.

Matmuls run at ``HIGHEST`` precision, so GPUs that default to TF32 for
float32 dots do not round the factors to 10-bit mantissas. Non-finite inputs
give a NaN mean (the QR of a non-finite ``P``), so the trainer's finiteness
check skips the step.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
from jax import lax
import jax.numpy as jnp

from qsync_jax.parallel.wire import Reducing
from qsync_jax.parallel.wire import ring_allreduce_bytes

_HIGHEST = lax.Precision.HIGHEST


def _is_count(value) -> bool:
  """Whether ``value`` is an integer >= 1 (not a bool)."""
  return (
    isinstance(value, numbers.Integral)
    and not isinstance(value, bool)
    and int(value) >= 1
  )


@dataclasses.dataclass(frozen=True)
class PowerSGD(Reducing):
  """Rank-``r`` PowerSGD averaging (module docstring).

  Attributes:
    rank: ``r``, the rank of the approximation (at least 1).
    cols: the matrix width; ``None`` for a nearly square matrix.
    seed: seeds ``Q`` when no ``key`` is passed.
    warm_start: start each call from the previous call's ``Q`` (carried as
      state, :meth:`init_state`); False: a fresh random ``Q`` every call.
    name: the strategy's name.
  """

  rank: int = 4
  cols: int | None = None
  seed: int = 0
  warm_start: bool = True
  name: str = "powersgd"

  def __post_init__(self):
    if not _is_count(self.rank):
      raise ValueError(
        f"PowerSGD rank must be an integer >= 1, got {self.rank!r}"
      )
    if self.cols is not None and not _is_count(self.cols):
      raise ValueError(
        f"PowerSGD cols must be None or an integer >= 1, got {self.cols!r}"
      )
    if not isinstance(self.warm_start, bool):
      raise ValueError(
        f"PowerSGD warm_start must be a bool, got {self.warm_start!r}"
      )

  def matrix_shape(self, num_elements: int) -> tuple[int, int, int]:
    """The matrix a vector of ``num_elements`` is reshaped into.

    Args:
      num_elements: the vector's length (at least 1).

    Returns:
      ``(rows, cols, rank)``: ``rows * cols >= num_elements`` (the rest is
      zero padding) and the rank actually used, ``min(rank, rows, cols)``.
    """
    cols = self.cols or math.isqrt(num_elements - 1) + 1
    cols = min(cols, num_elements)
    rows = -(-num_elements // cols)
    return rows, cols, min(self.rank, rows, cols)

  def init_state(self, num_elements: int) -> jax.Array | None:
    """The warm start's ``Q`` before the first call.

    Args:
      num_elements: the length of the vectors to average.

    Returns:
      ``(cols, r)`` float32 zeros (the first call draws ``Q`` from its
      key); None without warm start or for an empty vector.
    """
    if not self.warm_start or num_elements <= 0:
      return None
    _, cols, r = self.matrix_shape(num_elements)
    return jnp.zeros((cols, r), jnp.float32)

  def reduce(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Returns ``(mean, sent)``: the rank-``r`` mean and this worker's share.

    Arguments as for :meth:`qsync_jax.parallel.wire.Averager.reduce`; ``key``
    (the same on every worker) draws ``Q``: a cold start, whatever
    ``warm_start`` says.
    """
    return self.reduce_with_state(x, weight, axis_name, key, None)[:2]

  def reduce_with_state(
    self,
    x: jax.Array,
    weight: jax.Array,
    axis_name: str,
    key: jax.Array | None,
    state: jax.Array | None,
  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """:meth:`reduce` started from the previous call's ``Q``.

    Args:
      x, weight, axis_name, key: as for :meth:`reduce`.
      state: the previous call's ``Q`` (:meth:`init_state` before the
        first); zeros or None draw ``Q`` from ``key``.

    Returns:
      ``(mean, sent, q)``: ``q`` the all-reduced ``(cols, r)`` ``Q`` of this
      call (zeros if it is not finite), the same on every worker; None
      for a None ``state``.

    Raises:
      ValueError: a ``state`` of another shape than :meth:`init_state`'s.
    """
    y = x.astype(jnp.float32).reshape(-1) * weight
    n = y.size
    if n == 0:
      return y.reshape(x.shape), y.reshape(x.shape), state
    rows, cols, r = self.matrix_shape(n)
    m = jnp.pad(y, (0, rows * cols - n)).reshape(rows, cols)
    key = jax.random.key(self.seed) if key is None else key
    q = jax.random.normal(key, (cols, r), jnp.float32)
    if state is not None:
      if state.shape != (cols, r):
        raise ValueError(
          f"PowerSGD state of shape {state.shape} for a "
          f"{rows} x {cols} matrix of rank {r}; expected "
          f"{(cols, r)} (init_state({n}))"
        )
      q = jnp.where(
        jnp.any(state != 0), jnp.linalg.qr(state, mode="reduced")[0], q
      )
    p = lax.psum(jnp.matmul(m, q, precision=_HIGHEST), axis_name)
    p_hat = jnp.linalg.qr(p, mode="reduced")[0]
    q_local = jnp.matmul(m.T, p_hat, precision=_HIGHEST)
    q_sum = lax.psum(q_local, axis_name)

    def unpad(a):
      return a.reshape(-1)[:n].reshape(x.shape)

    mean = jnp.matmul(p_hat, q_sum.T, precision=_HIGHEST)
    sent = jnp.matmul(p_hat, q_local.T, precision=_HIGHEST)
    if state is not None:
      state = jnp.where(jnp.all(jnp.isfinite(q_sum)), q_sum, 0.0)
    return unpad(mean), unpad(sent), state

  def wire_bytes(self, num_elements: int, num_workers: int) -> float:
    """Two float32 ring all-reduces: ``P`` (``rows x r``), ``Q``
    (``cols x r``)."""
    if num_elements <= 0:
      return 0.0
    rows, cols, r = self.matrix_shape(num_elements)
    return ring_allreduce_bytes(4.0 * (rows + cols) * r, num_workers)
