"""Weight gradients of plain matmuls as library GEMMs on XLA:CPU.

This module owns :func:`gemm_gradients`, a trace-time switch under which the
FP32 and TF32 ``dot_general`` of :mod:`.ops` computes the gradient of its
second operand (a layer's weight) as a GEMM that XLA:CPU's library runs, and
:func:`dot_general`, that contraction.

Why: XLA:CPU hands a ``dot`` to its GEMM library (YNNPACK) only when the
first operand contracts its last dimension. The weight gradient of ``x @ w``
contracts the batch, ``x``'s *first* dimension, so XLA:CPU runs it through
Eigen's generic contraction, whose operand packing costs more than the
product itself at a transformer's sizes (a BERT-style encoder step of the
trainer spent a seventh of its CPU time packing). A data-parallel SPMD
program escapes this by accident (the partitioner's all-reduce sits between
the product and its transpose); the trainer's per-worker gradient functions
do not. Here the operand that contracts its first dimension is transposed
into a buffer of its own (``x``, or for ``x @ w.T`` the cotangent) behind
``lax.optimization_barrier``, which keeps XLA from folding the transpose back
into the product, and the product contracts that buffer's last dimension.

The forward product is ``lax.dot_general``'s, bit for bit. The gradients are
the same sums computed by other GEMMs (and fused differently around them), so
they can differ from plain autodiff's in the last bits. Elsewhere (another
backend, outside :func:`gemm_gradients`, a contraction with batch dimensions
or of another form, other dtypes) nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import contextvars
import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "qsync_cpu_gemm_gradients", default=False
)


@contextlib.contextmanager
def gemm_gradients() -> Iterator[None]:
  """Contractions traced in this block take :func:`dot_general`'s weight
  gradient where :func:`applies` (on XLA:CPU).

  The switch is read when an op is traced: a function jitted elsewhere
  keeps what it was traced with. The trainer's gradient function
  (:func:`qsync_jax.train.step.grad_function`) traces its step under it.
  """
  token = _ENABLED.set(True)
  try:
    yield
  finally:
    _ENABLED.reset(token)


class _Matmul(NamedTuple):
  """A plain matmul's 2-D view: ``lhs`` as ``(m, k)``; ``rhs`` as
  ``(k, n)``, or ``(n, k)`` where it contracts its trailing dimensions
  (``x @ w.T``, a tied embedding's head)."""

  m: int
  k: int
  n: int
  rhs_trailing: bool


def _plain_matmul(lhs: Any, rhs: Any, dimension_numbers: Any) -> _Matmul | None:
  """The 2-D view of a contraction of ``lhs``'s trailing dimensions with
  ``rhs``'s leading or trailing ones, in order and without batch
  dimensions; else None."""
  (lc, rc), (lb, rb) = dimension_numbers
  k = len(lc)
  if lb or rb or not k or len(rc) != k or lhs.ndim == k or rhs.ndim == k:
    return None
  if tuple(lc) != tuple(range(lhs.ndim - k, lhs.ndim)):
    return None
  if tuple(rc) == tuple(range(k)):
    trailing = False
  elif tuple(rc) == tuple(range(rhs.ndim - k, rhs.ndim)):
    trailing = True
  else:
    return None
  contract = math.prod(lhs.shape[lhs.ndim - k :])
  return _Matmul(lhs.size // contract, contract, rhs.size // contract, trailing)


def applies(
  lhs: Any, rhs: Any, dimension_numbers: Any, preferred_element_type: Any
) -> bool:
  """Whether :func:`dot_general` computes this contraction: inside
  :func:`gemm_gradients`, on the CPU backend, float32 operands (and result),
  and a plain matmul (``lhs``'s trailing dimensions contracted with
  ``rhs``'s leading or trailing ones, no batch dimensions)."""
  if not _ENABLED.get() or jax.default_backend() != "cpu":
    return False
  if lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32:
    return False
  if preferred_element_type not in (None, jnp.float32):
    return False
  return _plain_matmul(lhs, rhs, dimension_numbers) is not None


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _dot(lhs, rhs, dimension_numbers, precision):
  return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)


def _rhs_term(lhs, d_rhs, mm: _Matmul, precision) -> jax.Array:
  """The product's tangent in ``rhs``, ``(m, n)``, written so that its
  transpose (the weight gradient) contracts a buffer's last dimension with
  another's first: ``lhs^T`` behind a barrier (``rhs`` as ``(k, n)``), or
  the cotangent transposed behind one (``rhs`` as ``(n, k)``: the barrier
  of a tangent is one on its cotangent)."""
  if not mm.rhs_trailing:
    lhs_t = lax.optimization_barrier(lhs.reshape(mm.m, mm.k).T)
    return lax.dot_general(
      lhs_t.T,
      d_rhs.reshape(mm.k, mm.n),
      (((1,), (0,)), ((), ())),
      precision=precision,
    )
  t = lax.dot_general(
    d_rhs.reshape(mm.n, mm.k),
    lhs.reshape(mm.m, mm.k),
    (((1,), (1,)), ((), ())),
    precision=precision,
  )
  return lax.optimization_barrier(t).T


def _dot_jvp(dimension_numbers, precision, primals, tangents):
  lhs, rhs = primals
  d_lhs, d_rhs = tangents
  out = lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)
  terms = []
  if not isinstance(d_lhs, SymbolicZero):
    # Transposed by autodiff into the usual input gradient.
    terms.append(
      lax.dot_general(d_lhs, rhs, dimension_numbers, precision=precision)
    )
  if not isinstance(d_rhs, SymbolicZero):
    mm = _plain_matmul(lhs, rhs, dimension_numbers)
    assert mm is not None  # applies() admitted the contraction
    # Transposed, this barrier keeps the weight gradient's GEMM output in its
    # own buffer: a transpose the caller took of the weight (a tied head's
    # ``embedding.T``) is not folded back into the GEMM.
    d_rhs = lax.optimization_barrier(d_rhs)
    terms.append(_rhs_term(lhs, d_rhs, mm, precision).reshape(out.shape))
  if not terms:
    return out, jnp.zeros_like(out)
  return out, functools.reduce(lax.add, terms)


_dot.defjvp(_dot_jvp, symbolic_zeros=True)


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  precision: lax.Precision | Sequence[lax.Precision] | None = None,
) -> jax.Array:
  """``lax.dot_general`` of a plain matmul whose ``rhs`` gradient is a GEMM
  contracting the last dimension of a transposed copy (see the module
  docstring).

  Args:
    lhs: float32, its trailing dimensions contracted.
    rhs: float32, its leading or its trailing dimensions contracted.
    dimension_numbers: as ``lax.dot_general`` takes them, hashable, of a
      contraction :func:`applies` accepts.
    precision: ``lax.dot_general``'s precision, used for every product.

  Returns:
    The product, as ``lax.dot_general`` computes it.
  """
  return _dot(lhs, rhs, dimension_numbers, precision)
