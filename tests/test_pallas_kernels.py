"""Tests for pallas_kernels: interpret mode on CPU, Triton lowering for CUDA.

Every kernel runs here in Pallas's interpreter (the kernel body executed as
jnp ops), so the checks are of the kernel's arithmetic: tiling, padding,
masking of the edges, epilogue. Separately each kernel is lowered for
``cuda`` with Triton parameters (no GPU needed) so a kernel that would not
compile for a GPU fails CI.

Tolerances: the int8 GEMM and the rounding kernels are bit-exact against
their references in interpret mode (integer accumulation is exact; the
epilogue and the rounding use the same float32 operations in the same
order). The fp8 GEMM differs from XLA only by float32 summation order and
is checked against the bound ``(2K + 2) 2**-24 (|x| @ |w|) s_x s_w``
(:func:`pallas_kernels.fp8_matmul.fp8_error_bound`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import _common
from qsync_jax.numerics import ops
from qsync_jax.numerics import quant
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _int8(rng, *shape):
  return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)


def _scales(rng, m, n, mode):
  if mode == "tensor":
    return jnp.float32(0.013), jnp.float32(0.021)
  return (
    jnp.asarray(rng.uniform(0.001, 0.05, m), jnp.float32),
    jnp.asarray(rng.uniform(0.001, 0.05, n), jnp.float32),
  )


# --------------------------------------------------------------------------
# int8_matmul
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "m,k,n,blocks",
  [
    (100, 70, 130, (32, 64, 32)),  # odd everything, K padded 70 -> 96
    (64, 64, 64, (64, 64, 64)),  # exact multiples, one tile
    (17, 5, 33, (16, 16, 16)),  # K smaller than a block
  ],
)
def test_int8_accumulation_is_bit_exact(m, k, n, blocks):
  rng = np.random.default_rng(m)
  x, w = _int8(rng, m, k), _int8(rng, k, n)
  bm, bn, bk = blocks
  y = pk.int8_matmul(x, w, 1.0, 1.0, block_m=bm, block_n=bn, block_k=bk)
  acc = jnp.dot(x, w, preferred_element_type=jnp.int32)
  # |acc| <= 127**2 * 130 < 2**24: the float32 output holds it exactly.
  np.testing.assert_array_equal(np.asarray(y).astype(np.int32), np.asarray(acc))


@pytest.mark.parametrize(
  "scale_mode,bias,out_dtype",
  [
    ("tensor", False, jnp.float32),
    ("rowcol", True, jnp.float32),
    ("rowcol", False, jnp.bfloat16),
    ("tensor", True, jnp.float16),
  ],
)
def test_int8_dequantize_epilogue_matches_reference(
  scale_mode, bias, out_dtype
):
  m, k, n = 100, 70, 130
  rng = np.random.default_rng(1)
  x, w = _int8(rng, m, k), _int8(rng, k, n)
  sx, sw = _scales(rng, m, n, scale_mode)
  b = jnp.asarray(rng.standard_normal(n), jnp.float32) if bias else None
  y = pk.int8_matmul(
    x, w, sx, sw, b, out_dtype=out_dtype, block_m=64, block_n=32, block_k=32
  )
  ref = pk.int8_matmul_reference(x, w, sx, sw, b, out_dtype=out_dtype)
  assert y.dtype == out_dtype and y.shape == (m, n)
  # Same float32 operations in the same order: equal after the final cast.
  np.testing.assert_array_equal(
    np.asarray(y, np.float32), np.asarray(ref, np.float32)
  )


def test_int8_scale_shapes_accept_vectors_and_keepdims_forms():
  rng = np.random.default_rng(2)
  x, w = _int8(rng, 20, 24), _int8(rng, 24, 18)
  sx, sw = _scales(rng, 20, 18, "rowcol")
  a = pk.int8_matmul(x, w, sx, sw, block_m=16, block_n=16, block_k=16)
  b = pk.int8_matmul(
    x, w, sx[:, None], sw[None, :], block_m=16, block_n=16, block_k=16
  )
  np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# fp8_matmul
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "m,k,n,xdt,wdt,out_dtype",
  [
    (100, 70, 130, E4M3, E4M3, jnp.float32),  # forward operands
    (33, 48, 20, E5M2, E5M2, jnp.float32),
    (64, 40, 50, E5M2, E4M3, jnp.float32),  # gradient x weight, mixed
    (100, 70, 130, E4M3, E4M3, jnp.bfloat16),
  ],
)
def test_fp8_matmul_within_summation_order_bound(m, k, n, xdt, wdt, out_dtype):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((m, k)) * 8, xdt)
  w = jnp.asarray(rng.standard_normal((k, n)) * 8, wdt)
  sx, sw = _scales(rng, m, n, "rowcol")
  bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
  y = pk.fp8_matmul(
    x, w, sx, sw, bias, out_dtype=out_dtype, block_m=32, block_n=64, block_k=32
  )
  ref = pk.fp8_matmul_reference(x, w, sx, sw, bias)
  bound = pk.fp8_error_bound(x, w, sx, sw)
  if out_dtype == jnp.bfloat16:  # plus the final rounding to bfloat16
    bound = bound + 2.0**-8 * jnp.abs(ref)
  assert y.dtype == out_dtype
  err = jnp.abs(y.astype(jnp.float32) - ref)
  assert bool(jnp.all(err <= bound)), float(jnp.max(err - bound))


# --------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "shape,per_row,blocks",
  [
    ((100, 130), False, (32, 64)),
    ((100, 130), True, (16, 128)),
    ((3, 5, 33), False, (8, 32)),
    ((7,), False, (1, 16)),
  ],
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "truncate"])
def test_quantize_equals_reference_and_qsync_quant(
  shape, per_row, blocks, rounding
):
  x = jax.random.normal(jax.random.key(4), shape) * 3
  axes = (1,) if per_row else None
  scale = quant.absmax_scale(x, 127, axes)
  br, bc = blocks
  q = pk.quantize(
    x, scale, rounding=rounding, salt=11, block_rows=br, block_cols=bc
  )
  assert q.dtype == jnp.int8 and q.shape == shape
  np.testing.assert_array_equal(
    q, pk.quantize_reference(x, scale, rounding=rounding, salt=11)
  )
  # The same numbers as the XLA path the layers use.
  np.testing.assert_array_equal(
    q, quant.quantize_int8(x, scale, rounding, salt=11)
  )


def test_nearest_rounding_ties_to_even_without_double_rounding():
  v = jnp.array(
    [
      0.5,
      1.5,
      2.5,
      -0.5,
      -1.5,
      -2.5,
      0.5 - 2.0**-25,
      126.5,
      127.49,
      -200.0,
      3.0,
      -0.0,
    ],
    jnp.float32,
  )
  q = pk.quantize(v, 1.0, block_rows=1, block_cols=16)
  np.testing.assert_array_equal(
    q, jnp.clip(jnp.round(v), -127, 127).astype(jnp.int8)
  )


def test_stochastic_rounding_is_unbiased():
  # Rows of one value each; over C elements the rounded mean estimates the
  # value with standard error sqrt(f (1 - f) / C), f its fractional part.
  # 5 standard errors: a false alarm has probability ~6e-7 per row for an
  # unbiased rounder, while a bias of 0.02 (e.g. a noise range off by 2%)
  # is > 5 SE at C = 4096 for every row here.
  values = jnp.array([0.1, 0.25, 0.5, 0.75, 0.9, -0.3, 2.6, -5.05], jnp.float32)
  rows, cols = values.size, 4096
  x = jnp.broadcast_to(values[:, None], (rows, cols))
  for salt in (0, 12345):
    q = pk.quantize(
      x, 1.0, rounding="stochastic", salt=salt, block_rows=8, block_cols=1024
    ).astype(jnp.float32)
    frac = values - jnp.floor(values)
    assert bool(jnp.all((q == jnp.floor(x)) | (q == jnp.floor(x) + 1)))
    se = jnp.sqrt(frac * (1 - frac) / cols)
    err = jnp.abs(q.mean(axis=1) - values)
    assert bool(jnp.all(err <= 5 * se)), (err, se)


def test_quantize_salt_may_be_traced_and_changes_the_noise():
  x = jax.random.normal(jax.random.key(5), (16, 64))
  f = jax.jit(
    lambda s: pk.quantize(
      x, 0.01, rounding="stochastic", salt=s, block_rows=16, block_cols=64
    )
  )
  a, b = f(jnp.uint32(1)), f(jnp.uint32(2))
  np.testing.assert_array_equal(
    a, pk.quantize_reference(x, 0.01, rounding="stochastic", salt=1)
  )
  assert bool(jnp.any(a != b))


# --------------------------------------------------------------------------
# gqsgd_encode
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "shape,num_workers,blocks",
  [
    ((4, 100), 4, (4, 64)),
    ((1000,), 1, (1, 256)),
    ((3, 257), 5, (2, 128)),
  ],
)
def test_gqsgd_encode_equals_reference(shape, num_workers, blocks):
  y = jax.random.normal(jax.random.key(6), shape)
  nb = shape[0] if len(shape) == 2 else 1
  m = jnp.max(jnp.abs(y.reshape(nb, -1)), axis=1) * 1.3  # another worker's
  s = 127 // num_workers
  br, bc = blocks
  q = pk.gqsgd_encode(y, m, s, seed=9, block_rows=br, block_cols=bc)
  assert q.dtype == jnp.int8 and q.shape == shape
  np.testing.assert_array_equal(q, pk.gqsgd_encode_reference(y, m, s, seed=9))
  assert int(jnp.max(jnp.abs(q))) <= s


@pytest.mark.parametrize("num_workers", [4, 127])
def test_gqsgd_codes_of_n_workers_never_wrap_int8(num_workers):
  # Worker 0 holds the bucket maxima exactly (its codes are +-s, the worst
  # case), the others random values below them.
  nb, width = 4, 96
  keys = jax.random.split(jax.random.key(7), num_workers)
  ys = [jax.random.normal(k, (nb, width)) for k in keys]
  m = jnp.max(jnp.stack([jnp.max(jnp.abs(y), 1) for y in ys]), axis=0)
  ys[0] = jnp.broadcast_to(m[:, None], (nb, width)) * jnp.where(
    jnp.arange(width) % 2 == 0, 1.0, -1.0
  )
  s = 127 // num_workers
  if num_workers > 5:  # keep the 127-worker case cheap: same kernel
    ys = ys[:1] * num_workers
  codes = [
    pk.gqsgd_encode(y, m, s, seed=i, block_rows=4, block_cols=32)
    for i, y in enumerate(ys)
  ]
  total32 = sum(c.astype(jnp.int32) for c in codes)
  assert int(jnp.max(jnp.abs(total32))) <= 127
  total8 = codes[0]
  for c in codes[1:]:
    total8 = total8 + c  # int8 sum, as the int8 all-reduce computes it
  np.testing.assert_array_equal(total8.astype(jnp.int32), total32)
  assert int(jnp.max(jnp.abs(codes[0]))) == s


def test_gqsgd_encode_is_unbiased_and_handles_zero_and_nonfinite_maxima():
  # Bucket 0: constant c with M = 1 and s = 31: codes average 31 c.
  width, s = 4096, 31
  c = 0.0123
  y = jnp.stack(
    [jnp.full((width,), c), jnp.zeros(width), jnp.full((width,), 0.5)]
  )
  m = jnp.array([1.0, 0.0, jnp.inf])
  q = pk.gqsgd_encode(y, m, s, seed=3, block_rows=4, block_cols=1024)
  v = c * s
  f = v - np.floor(v)
  se = np.sqrt(f * (1 - f) / width)
  assert abs(float(q[0].astype(jnp.float32).mean()) - v) <= 5 * se
  assert not bool(jnp.any(q[1])) and not bool(jnp.any(q[2]))
  decoded = pk.gqsgd_decode(q, m, s)
  assert abs(float(decoded[0].mean()) - c) <= 5 * se / s


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_clear_errors_for_bad_inputs():
  x8 = jnp.zeros((16, 16), jnp.int8)
  with pytest.raises(ValueError, match="dtype"):
    pk.int8_matmul(x8.astype(jnp.float32), x8, 1.0, 1.0)
  with pytest.raises(ValueError, match="contracting"):
    pk.int8_matmul(x8, jnp.zeros((8, 16), jnp.int8), 1.0, 1.0)
  with pytest.raises(ValueError, match="power of two"):
    pk.int8_matmul(x8, x8, 1.0, 1.0, block_m=48)
  with pytest.raises(ValueError, match="x_scale"):
    pk.int8_matmul(x8, x8, jnp.ones(3), 1.0)
  with pytest.raises(ValueError, match="out_dtype"):
    pk.int8_matmul(x8, x8, 1.0, 1.0, out_dtype=jnp.int32)
  with pytest.raises(ValueError, match="dtype"):
    pk.fp8_matmul(x8, x8, 1.0, 1.0)
  with pytest.raises(ValueError, match="rounding"):
    pk.quantize(jnp.ones(4), 1.0, rounding="up")
  with pytest.raises(ValueError, match="scale"):
    pk.quantize(jnp.ones((4, 4)), jnp.ones(3))
  with pytest.raises(ValueError, match="levels"):
    pk.gqsgd_encode(jnp.ones((2, 4)), jnp.ones(2), 128)
  with pytest.raises(ValueError, match="one value per bucket"):
    pk.gqsgd_encode(jnp.ones((2, 4)), jnp.ones(3), 3)


# --------------------------------------------------------------------------
# qsync_jax.numerics.ops dispatch
# --------------------------------------------------------------------------


def _has_pallas_call(fn, *args) -> bool:
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


_DENSE = ((4, 10, 30), (30, 20), (((2,), (0,)), ((), ())))
_TRANSPOSED = ((30, 12), (20, 30), (((0,), (1,)), ((), ())))
_BATCHED = ((2, 5, 7, 6), (2, 7, 6, 9), (((2, 3), (1, 2)), ((0,), (0,))))


@pytest.mark.parametrize(
  "compute,granularity,case",
  [
    ("int8", "tensor", _DENSE),
    ("int8", "channel", _DENSE),
    ("int8", "tensor", _TRANSPOSED),
    ("int8", "channel", _TRANSPOSED),
    ("int8", "tensor", _BATCHED),
    ("int8", "channel", _BATCHED),
    ("fp8", "tensor", _DENSE),
    ("fp8", "channel", _BATCHED),
  ],
)
def test_ops_with_pallas_forced_match_xla(compute, granularity, case):
  lhs_shape, rhs_shape, dn = case
  kx, kw = jax.random.split(jax.random.key(8))
  x, w = jax.random.normal(kx, lhs_shape), jax.random.normal(kw, rhs_shape)
  op = ops.DotGeneral(Precision(compute), QuantConfig(granularity=granularity))
  # A fresh function per setting: jax caches traces by function, and the
  # setting is read at trace time.
  make = lambda: lambda x, w: op(x, w, dn)
  with ops.kernel_backend("xla"):
    assert not _has_pallas_call(make(), x, w)
    want = jax.jit(make())(x, w)
  with ops.kernel_backend("pallas"):
    assert _has_pallas_call(make(), x, w)
    got = jax.jit(make())(x, w)
  if compute == "int8":
    np.testing.assert_array_equal(got, want)  # exact int32, same epilogue
  else:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_auto_uses_xla_on_cpu_and_convs_always_use_xla():
  x = jax.random.normal(jax.random.key(9), (32, 64))
  w = jax.random.normal(jax.random.key(10), (64, 32))
  dense = lambda x, w: ops.dot_general(
    x, w, (((1,), (0,)), ((), ())), compute="int8"
  )
  with ops.kernel_backend("auto"):
    assert not _has_pallas_call(dense, x, w)
  conv = lambda x, w: ops.conv_general_dilated(
    x,
    w,
    (1, 1),
    "SAME",
    compute="int8",
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  xc = jax.random.normal(jax.random.key(11), (2, 6, 6, 3))
  wc = jax.random.normal(jax.random.key(12), (3, 3, 3, 4))
  with ops.kernel_backend("pallas"):
    assert not _has_pallas_call(conv, xc, wc)
    got = conv(xc, wc)
  with ops.kernel_backend("xla"):
    np.testing.assert_array_equal(got, jax.jit(lambda a, b: conv(a, b))(xc, wc))


@pytest.mark.parametrize(
  "capability,compute,kernel",
  [
    ((8, 0), "int8", True),
    ((8, 6), "fp8", False),
    ((8, 9), "fp8", True),
    ((9, 0), "int8", False),
    ((9, 0), "fp8", False),
    ((10, 0), "int8", False),
  ],
)
def test_auto_runs_the_kernels_from_their_floor_up_to_hopper(
  monkeypatch, capability, compute, kernel
):
  # Only traced: on this CPU the chosen kernel would run in interpret mode.
  monkeypatch.setattr(ops, "_gpu_capability", lambda: capability)
  x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
  dense = lambda x, w: ops.dot_general(
    x, w, (((1,), (0,)), ((), ())), compute=compute
  )
  with ops.kernel_backend("auto"):
    assert _has_pallas_call(dense, x, w) == kernel


def test_kernel_backend_setting_env_and_errors(monkeypatch):
  monkeypatch.setenv("QSYNC_KERNELS", "xla")
  assert ops.get_kernel_backend() == "xla"
  with ops.kernel_backend("pallas"):
    assert ops.get_kernel_backend() == "pallas"
  assert ops.get_kernel_backend() == "xla"
  monkeypatch.setenv("QSYNC_KERNELS", "triton")
  with pytest.raises(ValueError, match="QSYNC_KERNELS"):
    ops.get_kernel_backend()
  monkeypatch.delenv("QSYNC_KERNELS")
  assert ops.get_kernel_backend() == "auto"
  with pytest.raises(ValueError, match="kernel backend"):
    ops.set_kernel_backend("gpu")


# --------------------------------------------------------------------------
# Lowering for CUDA through Triton, without a GPU.
# --------------------------------------------------------------------------

_LOWER_CASES = {
  "int8_matmul": (
    lambda x, w, sx, sw, b: pk.int8_matmul(
      x, w, sx, sw, b, out_dtype=jnp.bfloat16, interpret=False
    ),
    lambda: (
      jnp.zeros((100, 70), jnp.int8),
      jnp.zeros((70, 130), jnp.int8),
      jnp.ones(100),
      jnp.ones(130),
      jnp.zeros(130),
    ),
  ),
  "fp8_matmul_e4m3": (
    lambda x, w: pk.fp8_matmul(x, w, 0.5, 0.25, interpret=False),
    lambda: (jnp.zeros((64, 96), E4M3), jnp.zeros((96, 32), E4M3)),
  ),
  "fp8_matmul_e5m2_x_e4m3": (
    lambda x, w: pk.fp8_matmul(x, w, 0.5, 0.25, interpret=False),
    lambda: (jnp.zeros((64, 96), E5M2), jnp.zeros((96, 32), E4M3)),
  ),
  "quantize_stochastic_per_row": (
    lambda x, s, salt: pk.quantize(
      x, s, rounding="stochastic", salt=salt, interpret=False
    ),
    lambda: (jnp.ones((100, 130)), jnp.ones(100), jnp.uint32(7)),
  ),
  "quantize_nearest": (
    lambda x: pk.quantize(x, 0.1, interpret=False),
    lambda: (jnp.ones((3, 5, 33), jnp.bfloat16),),
  ),
  "int8_matmul_vmapped_batch": (  # how ops.py runs batched dot_generals
    jax.vmap(
      lambda x, w, sx, sw: pk.int8_matmul(x, w, sx, sw, interpret=False)
    ),
    lambda: (
      jnp.zeros((2, 8, 64), jnp.int8),
      jnp.zeros((2, 64, 48), jnp.int8),
      jnp.ones((2, 8)),
      jnp.ones((2, 48)),
    ),
  ),
  "gqsgd_encode": (
    lambda y, m, seed: pk.gqsgd_encode(y, m, 31, seed=seed, interpret=False),
    lambda: (jnp.ones((4, 1000)), jnp.ones(4), jnp.int32(3)),
  ),
}


@pytest.mark.parametrize("name", sorted(_LOWER_CASES))
def test_kernel_lowers_for_cuda_through_triton(name):
  fn, args = _LOWER_CASES[name]
  text = _common.lower_for_cuda(fn, *args())
  assert _common.is_triton_lowered(text), text[:2000]


def test_triton_lowering_rejects_non_power_of_two_tiles():
  # The check the lowering test relies on: a bad kernel does fail to lower.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  f = _common.pallas_call(
    kernel,
    interpret=False,
    num_warps=4,
    num_stages=2,
    out_shape=jax.ShapeDtypeStruct((24,), jnp.float32),
  )
  with pytest.raises(Exception, match="power of 2"):
    _common.lower_for_cuda(f, jnp.zeros(24))
