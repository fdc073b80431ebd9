"""Precision-aware ``dot_general``, ``conv_general_dilated`` and ``einsum``.

Each op is a small frozen dataclass (hashable, so it can sit in a Flax module
as static data) with the signature of its ``lax`` / ``jnp`` counterpart. It
accepts and ignores extra keyword arguments such as the ``out_sharding`` that
NNX layers pass. Numerics per precision (after QSync's LP-PyTorch backend,
arXiv 2407.02327; QSync's official code, bytedance/QSync,
``qsync/LpTorch/ops.py``):

* ``int8``: both operands quantized (symmetric absmax scales, per tensor or
  per channel), int8 x int8 contraction accumulated in int32, dequantized to
  a float32 output. The backward pass runs in float16 from the saved int8
  operands (dequantized): the input gradient is computed in float16 and the
  weight gradient is accumulated and returned in float32.
* ``fp16`` / ``bf16``: operands cast, the contraction and the input gradient
  in that dtype, weight gradient accumulated in float32. Output in the
  low-precision dtype.
* ``fp8``: e4m3 operands with absmax scaling, float32 accumulation; the
  incoming gradient is quantized to e5m2 (scaled) and both gradients are
  accumulated in float32 from the fp8 values.
* ``tf32`` / ``fp32``: the plain ``lax`` op at ``Precision.DEFAULT`` (TF32 on
  Ampere and later) or ``Precision.HIGHEST`` (true FP32); autodiff as usual,
  except that under :func:`.cpu_gemm.gemm_gradients` on XLA:CPU (the
  trainer's gradient function) a plain matmul's weight gradient contracts a
  transposed copy of its input (:mod:`.cpu_gemm`).

Gradients always come back in the primal dtype (float32 master weights), so
every worker's gradient has the same shapes and dtype whatever its plan.
Inside ``jax.shard_map`` (``check_vma=True`` too) each also has its operand's
varying manual axes: a per-worker operand's gradient stays per worker, a
replicated one's is summed over the workers in float32, as jax's autodiff
of the ``lax`` op gives.

Kernel dispatch. The forward contraction of an INT8 or FP8
``dot_general`` (and so of ``Einsum``) can run as a Pallas kernel from
:mod:`pallas_kernels` (``int8_matmul`` / ``fp8_matmul``: GEMM with the
dequantize epilogue fused) instead of XLA's dot. The backend is
:func:`get_kernel_backend`: :func:`set_kernel_backend` or the
:func:`kernel_backend` context manager, else the ``QSYNC_KERNELS``
environment variable, else ``"auto"``:

* ``"xla"``: never the kernel.
* ``"auto"``: the kernel when the default backend is a CUDA GPU of compute
  capability sm_80+ (int8) or sm_89+ (fp8), the Triton floor, but below
  sm_90, and the contraction reduces to GEMMs with M, N and K all >= 16
  (smaller ones would mostly be padding); XLA otherwise, so the same plan
  runs everywhere. From Hopper (sm_90) on XLA's own INT8 and FP8 dots are
  faster than the kernels.
* ``"pallas"``: the kernel for every INT8 / FP8 ``dot_general`` whatever its
  shape (interpret mode off GPU; slow, for checking numerics); a GPU below
  the Triton floor raises ``ValueError``.

Any ``dot_general`` qualifies: operands are transposed and reshaped to
(batch, M, K) x (batch, K, N), batch dimensions ``vmap`` the kernel (one more
grid axis), per-channel scales become per-row / per-column epilogue scales.
Rules that hold under every setting: convolutions always run through XLA (no
conv kernel; forcing ``"pallas"`` does not make a conv plan fail); FP16,
BF16, TF32 and FP32 layers always run through XLA; the backward pass is
unchanged (XLA, from the saved int8 / fp8 operands). The int8 kernel's output
equals XLA's bit for bit (exact int32 accumulation, same epilogue
association); fp8 differs only by float32 summation order. The setting is
read when an op is traced: functions already jitted keep their choice.

Safe paths. A signature (precision, op, path) that the numerics self-check
(:mod:`.selfcheck`) found wrong on this process's device is switched in
:mod:`.safe_paths`: its forward contraction then runs there (the kernel's
on XLA, or the quantized operands' exact values contracted in float16 or
float32 with float32 accumulation), with the same epilogue and backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import contextlib
import dataclasses
import math
import os
from typing import Any, ClassVar

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import _common as kernel_common
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.int8_matmul import int8_matmul
from qsync_jax.numerics import cpu_gemm
from qsync_jax.numerics import quant as q
from qsync_jax.numerics import safe_paths
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import Granularity
from qsync_jax.numerics.quant import QuantConfig

_LOW_FLOAT = {Precision.FP16: jnp.float16, Precision.BF16: jnp.bfloat16}
_LAX_PRECISION = {
  Precision.FP32: lax.Precision.HIGHEST,
  Precision.TF32: lax.Precision.DEFAULT,
}


# --------------------------------------------------------------------------
# Contraction specs: one per op kind. A spec knows how to run the op with a
# given accumulator type, which operand axes are contracted (the axes a
# per-channel scale reduces over), and how operand scales map onto the output.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DotSpec:
  dimension_numbers: Any
  op: ClassVar[str] = "dot_general"

  def apply(self, lhs, rhs, preferred_element_type=None, precision=None):
    return lax.dot_general(
      lhs,
      rhs,
      self.dimension_numbers,
      precision=precision,
      preferred_element_type=preferred_element_type,
    )

  def reduce_axes(self, ndim_lhs: int, ndim_rhs: int):
    (lc, rc), _ = self.dimension_numbers
    return tuple(lc), tuple(rc)

  def out_scale(self, s_lhs, s_rhs, ndim_lhs: int, ndim_rhs: int):
    if s_lhs.ndim == 0:
      return s_lhs * s_rhs
    # Output layout of dot_general: (batch dims, lhs free dims, rhs free dims).
    (lc, rc), (lb, rb) = self.dimension_numbers
    lfree = [d for d in range(ndim_lhs) if d not in lc and d not in lb]
    rfree = [d for d in range(ndim_rhs) if d not in rc and d not in rb]
    sl = jnp.transpose(s_lhs, (*lb, *lfree, *lc))
    sl = sl.reshape(sl.shape[: len(lb) + len(lfree)] + (1,) * len(rfree))
    sr = jnp.transpose(s_rhs, (*rb, *rc, *rfree))
    sr = sr.reshape(
      sr.shape[: len(rb)] + (1,) * len(lfree) + sr.shape[len(rb) + len(rc) :]
    )
    return sl * sr


@dataclasses.dataclass(frozen=True)
class _ConvSpec:
  window_strides: tuple
  padding: Any
  lhs_dilation: Any
  rhs_dilation: Any
  dimension_numbers: lax.ConvDimensionNumbers
  feature_group_count: int
  batch_group_count: int
  op: ClassVar[str] = "conv_general_dilated"

  def apply(self, lhs, rhs, preferred_element_type=None, precision=None):
    return lax.conv_general_dilated(
      lhs,
      rhs,
      self.window_strides,
      self.padding,
      lhs_dilation=self.lhs_dilation,
      rhs_dilation=self.rhs_dilation,
      dimension_numbers=self.dimension_numbers,
      feature_group_count=self.feature_group_count,
      batch_group_count=self.batch_group_count,
      precision=precision,
      preferred_element_type=preferred_element_type,
    )

  def reduce_axes(self, ndim_lhs: int, ndim_rhs: int):
    # One scale per example of the input and per output channel of the kernel.
    lhs_spec, rhs_spec, _ = self.dimension_numbers
    return (
      tuple(d for d in range(ndim_lhs) if d != lhs_spec[0]),
      tuple(d for d in range(ndim_rhs) if d != rhs_spec[0]),
    )

  def out_scale(self, s_lhs, s_rhs, ndim_lhs: int, ndim_rhs: int):
    if s_lhs.ndim == 0:
      return s_lhs * s_rhs
    lhs_spec, rhs_spec, out_spec = self.dimension_numbers
    nd = len(out_spec)
    shape_l = [1] * nd
    shape_l[out_spec[0]] = s_lhs.shape[lhs_spec[0]]
    shape_r = [1] * nd
    shape_r[out_spec[1]] = s_rhs.shape[rhs_spec[0]]
    return s_lhs.reshape(shape_l) * s_rhs.reshape(shape_r)


def _hashable(x):
  if isinstance(x, (list, tuple)):
    return tuple(_hashable(v) for v in x)
  return x


# --------------------------------------------------------------------------
# Kernel dispatch: Pallas int8 / fp8 GEMMs for dot_general (module docstring).
# --------------------------------------------------------------------------

#: The kernel backends ``QSYNC_KERNELS`` and :func:`set_kernel_backend` take.
KERNEL_BACKENDS = ("auto", "pallas", "xla")
_KERNEL_ENV = "QSYNC_KERNELS"
_kernel_backend: str | None = None  # None: QSYNC_KERNELS, else "auto"
# Triton's floor: sm_80 for int8 mma, sm_89 for fp8 (Ada / Hopper).
_MIN_CAPABILITY = {Precision.INT8: (8, 0), Precision.FP8: (8, 9)}
_MIN_GEMM_DIM = 16
# Auto leaves the GEMMs to XLA from here on (module docstring).
_XLA_FASTER_FROM = (9, 0)


def _check_backend(name: str, source: str) -> str:
  if name not in KERNEL_BACKENDS:
    raise ValueError(
      f"{source} must be one of {', '.join(KERNEL_BACKENDS)}, got {name!r}"
    )
  return name


def kernel_backend_from_env(environ: Mapping[str, str] | None = None) -> str:
  """The backend ``$QSYNC_KERNELS`` names (``"auto"`` when unset).

  Every binary calls it at start (:func:`qsync_jax.cli.start_binary`), so
  a typo fails there, not at the first INT8 or FP8 layer.

  Raises:
    ValueError: a value not in :data:`KERNEL_BACKENDS`, naming the variable,
      the value and the valid ones.
  """
  environ = os.environ if environ is None else environ
  env = environ.get(_KERNEL_ENV, "").strip().lower()
  return _check_backend(env, _KERNEL_ENV) if env else "auto"


def get_kernel_backend() -> str:
  """The kernel backend in force: set, else ``$QSYNC_KERNELS``, else auto."""
  if _kernel_backend is not None:
    return _kernel_backend
  return kernel_backend_from_env()


def set_kernel_backend(name: str | None) -> None:
  """Sets ``"auto"``, ``"pallas"`` or ``"xla"``; ``None`` defers to the env.

  Raises:
    ValueError: an unknown name.
  """
  global _kernel_backend
  _kernel_backend = (
    None if name is None else _check_backend(name, "kernel backend")
  )


@contextlib.contextmanager
def kernel_backend(name: str) -> Iterator[None]:
  """Context manager form of :func:`set_kernel_backend` (restores on exit)."""
  global _kernel_backend
  previous = _kernel_backend
  set_kernel_backend(name)
  try:
    yield
  finally:
    _kernel_backend = previous


def _gpu_capability() -> tuple[int, int] | None:
  """(major, minor) of the default CUDA device, None off CUDA GPUs."""
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None  # ROCm and others: no CUDA capability, use XLA in auto


def _gemm_dims(spec, lhs, rhs) -> tuple[int, int, int]:
  """(M, N, K) of the GEMMs a dot_general reduces to."""
  (lc, _), (lb, _) = spec.dimension_numbers
  k = math.prod(lhs.shape[d] for d in lc)
  per_gemm = max(k * math.prod(lhs.shape[d] for d in lb), 1)
  return lhs.size // per_gemm, rhs.size // per_gemm, k


def _use_kernel(spec, compute: Precision, ql, qr) -> bool:
  """Whether this forward contraction runs as a Pallas kernel."""
  if not isinstance(spec, _DotSpec):
    return False
  paths = dot_paths(compute)
  if paths == ("pallas",):
    return True
  return "pallas" in paths and min(_gemm_dims(spec, ql, qr)) >= _MIN_GEMM_DIM


def dot_paths(compute: Precision | str) -> tuple[str, ...]:
  """The forward paths an INT8 / FP8 ``dot_general`` can take here.

  Under the kernel backend in force on this process's default device:
  ``("xla",)`` where the kernel is never chosen, ``("pallas", "xla")``
  where ``"auto"`` chooses it for GEMMs of sides >= 16 (smaller ones stay
  on XLA), ``("pallas",)`` under ``"pallas"``. Other precisions:
  ``("xla",)``.

  Raises:
    ValueError: ``"pallas"`` on a GPU below the kernel's Triton floor.
  """
  compute = Precision.parse(compute)
  backend = get_kernel_backend()
  if compute not in _MIN_CAPABILITY or backend == "xla":
    return ("xla",)
  if backend == "pallas":
    cc = _gpu_capability()
    floor = _MIN_CAPABILITY[compute]
    if jax.default_backend() == "gpu" and (cc is None or cc < floor):
      raise ValueError(
        f"QSYNC_KERNELS=pallas: the Triton {compute.value} kernel needs a "
        f"CUDA GPU of capability sm_{floor[0]}{floor[1]}+, this device has "
        f"{cc}; use 'auto' or 'xla'"
      )
    return ("pallas",)
  cc = _gpu_capability()
  if cc is None or cc < _MIN_CAPABILITY[compute] or cc >= _XLA_FASTER_FROM:
    return ("xla",)
  return ("pallas", "xla")


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (``shard_map``'s vma type).

  Reads ``jax.typeof(x).vma`` where jax has it, else the
  ``manual_axis_type`` that jax 0.10 keeps it in.

  Args:
    x: an array or tracer.

  Returns:
    The axis names; empty outside ``shard_map`` and under
    ``check_vma=False``.
  """
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "manual_axis_type", None)
    vma = frozenset() if mat is None else mat.varying
  return frozenset(vma)


def pvary_to(x, axes) -> jax.Array:
  """``x`` typed as varying over ``axes`` too (``lax.pcast``, no data moves).

  Args:
    x: an array or tracer inside ``shard_map`` (or anywhere, if ``axes`` adds
      nothing to what it varies over).
    axes: manual axis names.

  Returns:
    ``x``, varying over ``axes`` and the axes it already varied over.
  """
  missing = frozenset(axes) - varying_axes(x)
  return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def outside_vma_check(fn, *args):
  """``fn(*args)`` with ``shard_map``'s varying-axes checks off for ``fn``.

  Inside a ``shard_map`` with ``check_vma=True`` a ``pallas_call`` needs its
  ``out_shape`` typed with manual axes, and off GPU its interpreter mixes
  invariant literals with varying blocks, which the check refuses (jax
  0.10). A nested ``shard_map`` over no new axes with ``check_vma=False``
  runs the kernel unchecked; every output is typed back as varying over the
  union of the arguments' axes (the kernels are elementwise in the workers:
  each worker computes from its own blocks). Outside ``shard_map`` it is a
  plain call.

  Args:
    fn: the function (a pytree of arrays in, a pytree of arrays out).
    *args: its array arguments.

  Returns:
    ``fn(*args)``, typed as varying over the arguments' manual axes.
  """
  if not jax.sharding.get_abstract_mesh().manual_axes:
    return fn(*args)
  axes = frozenset().union(*(varying_axes(a) for a in args))
  out = jax.shard_map(
    fn, in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False
  )(*args)
  return jax.tree.map(lambda o: pvary_to(o, axes), out)


def _kernel_contract(spec, compute: Precision, ql, sl, qr, sr):
  """The forward contraction through ``pallas_kernels`` (float32 output)."""
  (lc, rc), (lb, rb) = spec.dimension_numbers
  lfree = [d for d in range(ql.ndim) if d not in lc and d not in lb]
  rfree = [d for d in range(qr.ndim) if d not in rc and d not in rb]
  bshape = [ql.shape[d] for d in lb]
  b = math.prod(bshape)
  k = math.prod(ql.shape[d] for d in lc)
  m = math.prod(ql.shape[d] for d in lfree)
  n = math.prod(qr.shape[d] for d in rfree)
  x = jnp.transpose(ql, (*lb, *lfree, *lc)).reshape(b, m, k)
  w = jnp.transpose(qr, (*rb, *rc, *rfree)).reshape(b, k, n)
  per_tensor = sl.ndim == 0
  if per_tensor:
    sx, sw = sl, sr
  else:  # per channel: size 1 along the contracting axes
    sx = jnp.transpose(sl, (*lb, *lfree, *lc)).reshape(b, m)
    sw = jnp.transpose(sr, (*rb, *rc, *rfree)).reshape(b, n)
  kernel = int8_matmul if compute is Precision.INT8 else fp8_matmul
  bm, bn, bk = (kernel_common.pick_block(d) for d in (m, n, k))
  gemm = lambda x, w, sx, sw: kernel(
    x, w, sx, sw, block_m=bm, block_n=bn, block_k=bk
  )
  if not lb:
    y = gemm(
      x[0], w[0], sx if per_tensor else sx[0], sw if per_tensor else sw[0]
    )
  else:
    scale_axis = None if per_tensor else 0
    y = jax.vmap(gemm, in_axes=(0, 0, scale_axis, scale_axis))(x, w, sx, sw)
  return y.reshape(
    *bshape, *(ql.shape[d] for d in lfree), *(qr.shape[d] for d in rfree)
  )


# --------------------------------------------------------------------------
# The low-precision contraction with its custom backward pass.
# --------------------------------------------------------------------------


def _quantize_operands(spec, compute: Precision, config: QuantConfig, lhs, rhs):
  """Returns (lhs_q, lhs_scale, rhs_q, rhs_scale) for int8 / fp8."""
  if config.granularity is Granularity.CHANNEL:
    axes_l, axes_r = spec.reduce_axes(lhs.ndim, rhs.ndim)
  else:
    axes_l = axes_r = None
  if compute is Precision.INT8:
    ql, sl = q.quantize(lhs, axes_l, config.rounding, salt=1)
    qr, sr = q.quantize(rhs, axes_r, config.rounding, salt=2)
  else:
    ql, sl = q.quantize_fp8(lhs, q.FP8_FORWARD, axes_l)
    qr, sr = q.quantize_fp8(rhs, q.FP8_FORWARD, axes_r)
  return ql, sl, qr, sr


def _native_contract(spec, compute: Precision, ql, qr) -> jax.Array:
  """XLA's own int8 / fp8 contraction of the quantized operands: the int32
  (float32 for fp8) accumulator."""
  acc_type = jnp.int32 if compute is Precision.INT8 else jnp.float32
  if isinstance(spec, _ConvSpec) and jax.default_backend() == "gpu":
    # cuDNN's integer convolution accumulates in int32 but emits s8 or f32
    # only (XLA refuses an s32 output): take the f32 it converts to.
    acc_type = jnp.float32
  return spec.apply(ql, qr, preferred_element_type=acc_type)


def _safe_contract(spec, safe: str, l, r) -> jax.Array:
  """The contraction of ``l`` and ``r``'s exact values on the safe path
  ``safe`` (:mod:`.safe_paths`): as float16 or float32 operands, float32
  accumulation at ``Precision.HIGHEST``; a float32 result."""
  dt = jnp.float16 if safe == "f16" else jnp.float32
  return spec.apply(
    l.astype(dt),
    r.astype(dt),
    preferred_element_type=jnp.float32,
    precision=lax.Precision.HIGHEST,
  )


def _forward(spec, compute, config, lhs, rhs):
  """Returns (output, residuals) of the low-precision contraction."""
  if compute in _LOW_FLOAT:
    dt = _LOW_FLOAT[compute]
    l, r = lhs.astype(dt), rhs.astype(dt)
    sig = safe_paths.Signature(compute.value, spec.op, "xla")
    if safe_paths.safe_path(sig) is None:
      return spec.apply(l, r), (l, None, r, None)
    return _safe_contract(spec, "f32", l, r).astype(dt), (l, None, r, None)
  ql, sl, qr, sr = _quantize_operands(spec, compute, config, lhs, rhs)
  path = "pallas" if _use_kernel(spec, compute, ql, qr) else "xla"
  safe = safe_paths.safe_path(
    safe_paths.Signature(compute.value, spec.op, path)
  )
  if safe == "xla":  # the kernel's signature switched to XLA's, maybe safe
    path = "xla"
    safe = safe_paths.safe_path(
      safe_paths.Signature(compute.value, spec.op, path)
    )
  if path == "pallas" and safe is None:
    y = outside_vma_check(
      lambda *a: _kernel_contract(spec, compute, *a), ql, sl, qr, sr
    )
    return y, (ql, sl, qr, sr)
  if safe is None:
    acc = _native_contract(spec, compute, ql, qr)
  else:
    acc = _safe_contract(spec, safe, ql, qr)
  y = acc.astype(jnp.float32) * spec.out_scale(sl, sr, lhs.ndim, rhs.ndim)
  return y, (ql, sl, qr, sr)


def _transposes(spec, l, r, g):
  """Returns (d_lhs, d_rhs) of ``spec.apply`` at operands (l, r), cotangent g.

  ``d_lhs`` (the input gradient) is computed in the operands' dtype. ``d_rhs``
  (the weight gradient) is accumulated in float32 from the same low-precision
  values: products of two fp16 / bf16 / fp8 numbers are exact in float32, so
  this equals a low-precision GEMM with a float32 accumulator.

  Inside ``shard_map`` both are computed per worker: the transposes are
  taken with every operand typed as varying over the manual axes that any
  of ``l``, ``r``, ``g`` varies over, so neither gradient is summed over
  workers here, in the low-precision dtype (:func:`_as_primal_type` sums it
  in the primal dtype).
  """
  axes = varying_axes(l) | varying_axes(r) | varying_axes(g)
  l, r = pvary_to(l, axes), pvary_to(r, axes)
  d_lhs = jax.linear_transpose(lambda a: spec.apply(a, r), jax.typeof(l))(g)[0]
  l32 = l.astype(jnp.float32)
  d_rhs = jax.linear_transpose(
    lambda b: spec.apply(l32, b), jax.typeof(r).update(dtype=jnp.float32)
  )(g.astype(jnp.float32))[0]
  return d_lhs, d_rhs


def _as_primal_type(d, dtype, axes: frozenset):
  """Gradient ``d`` cast to its primal's dtype and varying axes ``axes``.

  A custom VJP's cotangent must have its primal's type, varying manual axes
  (``shard_map``'s vma) included. A primal replicated over an axis that the
  per-worker gradient varies over was implicitly broadcast (``pvary``) to
  the workers, whose transpose is the sum over them: ``psum``, in the primal
  dtype (float32), as jax's own autodiff of ``lax.dot_general`` gives.
  """
  d = d.astype(dtype)
  extra = varying_axes(d) - axes
  if extra:
    d = lax.psum(d, tuple(sorted(extra)))
  return pvary_to(d, axes)


def _backward(spec, compute, config, res, g):
  del config
  a, sa, b, sb = res
  if compute in _LOW_FLOAT:
    dt = _LOW_FLOAT[compute]
    l, r, gl = a, b, g.astype(dt)
  elif compute is Precision.INT8:
    # QSync: INT8 forward, FP16 backward from the saved int8 operands.
    l = q.dequantize(a, sa, jnp.float16)
    r = q.dequantize(b, sb, jnp.float16)
    gl = g.astype(jnp.float16)
  else:
    # FP8: e5m2 gradient, fp8 operands; products accumulate in float32.
    g8, sg = q.quantize_fp8(g, q.FP8_GRADIENT)
    l = q.dequantize(a, sa)
    r = q.dequantize(b, sb)
    gl = q.dequantize(g8, sg)
  return _transposes(spec, l, r, gl)


def _lowp_contract(spec, compute: Precision, config: QuantConfig, lhs, rhs):
  """Runs ``spec`` at ``compute`` precision with QSync's backward pass."""

  @jax.custom_vjp
  def f(lhs, rhs):
    return _forward(spec, compute, config, lhs, rhs)[0]

  lhs_type = lhs.dtype, varying_axes(lhs)
  rhs_type = rhs.dtype, varying_axes(rhs)

  def fwd(lhs, rhs):
    return _forward(spec, compute, config, lhs, rhs)

  def bwd(res, g):
    d_lhs, d_rhs = _backward(spec, compute, config, res, g)
    return (
      _as_primal_type(d_lhs, *lhs_type),
      _as_primal_type(d_rhs, *rhs_type),
    )

  f.defvjp(fwd, bwd)
  return f(lhs, rhs)


# --------------------------------------------------------------------------
# Public ops.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DotGeneral:
  """``lax.dot_general`` at a given compute precision.

  Attributes:
    compute: the layer's precision.
    quant: operand quantization for INT8 / FP8.
  """

  compute: Precision = Precision.FP32
  quant: QuantConfig = QuantConfig()

  def __call__(
    self,
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    **unused_kwargs,
  ):
    del unused_kwargs  # e.g. out_sharding from NNX layers
    dn = _hashable(dimension_numbers)
    if self.compute in _LAX_PRECISION:
      if cpu_gemm.applies(lhs, rhs, dn, preferred_element_type):
        return cpu_gemm.dot_general(lhs, rhs, dn, _LAX_PRECISION[self.compute])
      return lax.dot_general(
        lhs,
        rhs,
        dn,
        precision=_LAX_PRECISION[self.compute],
        preferred_element_type=preferred_element_type,
      )
    y = _lowp_contract(_DotSpec(dn), self.compute, self.quant, lhs, rhs)
    return _cast_output(y, preferred_element_type)


@dataclasses.dataclass(frozen=True)
class ConvGeneralDilated:
  """``lax.conv_general_dilated`` at a given compute precision.

  Attributes:
    compute: the layer's precision.
    quant: operand quantization for INT8 / FP8.
  """

  compute: Precision = Precision.FP32
  quant: QuantConfig = QuantConfig()

  def __call__(
    self,
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
    **unused_kwargs,
  ):
    del unused_kwargs, precision
    if self.compute in _LAX_PRECISION:
      return lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=_LAX_PRECISION[self.compute],
        preferred_element_type=preferred_element_type,
      )
    spec = _ConvSpec(
      window_strides=_hashable(window_strides),
      padding=_hashable(padding),
      lhs_dilation=_hashable(lhs_dilation),
      rhs_dilation=_hashable(rhs_dilation),
      dimension_numbers=lax.conv_dimension_numbers(
        lhs.shape, rhs.shape, dimension_numbers
      ),
      feature_group_count=feature_group_count,
      batch_group_count=batch_group_count,
    )
    y = _lowp_contract(spec, self.compute, self.quant, lhs, rhs)
    return _cast_output(y, preferred_element_type)


@dataclasses.dataclass(frozen=True)
class Einsum:
  """A two-operand ``jnp.einsum`` whose contraction runs at ``compute``.

  ``jnp.einsum`` lowers to one ``dot_general`` (plus transposes and
  reshapes); this op hands it a :class:`DotGeneral` for that contraction.

  Attributes:
    compute: the layer's precision.
    quant: operand quantization for INT8 / FP8.
  """

  compute: Precision = Precision.FP32
  quant: QuantConfig = QuantConfig()

  def __call__(
    self,
    subscripts: str,
    *operands,
    precision=None,
    preferred_element_type=None,
    **unused_kwargs,
  ):
    del unused_kwargs, precision
    if len(operands) != 2:
      raise ValueError(
        f"qsync_jax.numerics.ops.Einsum takes two operands, got "
        f"{len(operands)} for {subscripts!r}"
      )
    return jnp.einsum(
      subscripts,
      *operands,
      preferred_element_type=preferred_element_type,
      _dot_general=DotGeneral(self.compute, self.quant),
    )


def _cast_output(y, preferred_element_type):
  return (
    y if preferred_element_type is None else y.astype(preferred_element_type)
  )


def dot_general(
  lhs,
  rhs,
  dimension_numbers,
  *,
  compute: Precision | str = Precision.FP32,
  quant: QuantConfig | None = None,
  **kwargs,
) -> jax.Array:
  """Functional form of :class:`DotGeneral`."""
  op = DotGeneral(Precision.parse(compute), quant or QuantConfig())
  return op(lhs, rhs, dimension_numbers, **kwargs)


def conv_general_dilated(
  lhs,
  rhs,
  window_strides,
  padding,
  *,
  compute: Precision | str = Precision.FP32,
  quant: QuantConfig | None = None,
  **kwargs,
) -> jax.Array:
  """Functional form of :class:`ConvGeneralDilated`."""
  op = ConvGeneralDilated(Precision.parse(compute), quant or QuantConfig())
  return op(lhs, rhs, window_strides, padding, **kwargs)


def einsum(
  subscripts: str,
  lhs,
  rhs,
  *,
  compute: Precision | str = Precision.FP32,
  quant: QuantConfig | None = None,
  **kwargs,
) -> jax.Array:
  """Functional form of :class:`Einsum`."""
  op = Einsum(Precision.parse(compute), quant or QuantConfig())
  return op(subscripts, lhs, rhs, **kwargs)
