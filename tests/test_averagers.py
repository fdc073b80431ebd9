"""Tests for the averaging strategies (qsync_jax.parallel.averagers and
qsync_jax.parallel.global_qsgd).

Up to 64 workers are simulated on one device with ``jax.vmap(...,
axis_name=AXIS)``, under which psum / pmax / ppermute / all_gather /
axis_index act over the mapped axis (int8 psum wraps there as it does in
shard_map); one test checks that the simulation agrees with ``shard_map``
over the 4 fake CPU devices the trainer uses.

Statistical tests use fixed keys, so they are deterministic. Unbiasedness is
checked per coordinate with z = (mean of R draws - exact) / (std / sqrt(R)):
|z| < 5 for every coordinate (a false alarm has probability ~6e-7 per
coordinate for a true mean), while a bias of 5 standard errors fails.
"""

import functools
import re

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from qsync_jax import numerics
from qsync_jax.numerics import gqsgd_encode as gqsgd_encode_lib
from qsync_jax.parallel import averagers
from qsync_jax.parallel import buckets
from qsync_jax.parallel import global_qsgd

AXIS = "workers"
Z_MAX = 5.0


@functools.partial(jax.jit, static_argnums=0)
def simulate(averager, x, w, key=None):
  """Runs ``averager`` for ``n = x.shape[0]`` vmapped workers."""
  return jax.vmap(lambda xi, wi: averager(xi, wi, AXIS, key), axis_name=AXIS)(
    x, w
  )


@functools.partial(jax.jit, static_argnums=(0, 3))
def draws(averager, x, w, num):
  """``num`` independent runs: shape (num, n, d)."""
  keys = jax.random.split(jax.random.key(42), num)
  return jax.vmap(lambda k: simulate(averager, x, w, k))(keys)


def dirichlet(n, seed):
  """Random worker weights summing to 1 (float32)."""
  return np.random.default_rng(seed).dirichlet(np.ones(n)).astype(np.float32)


def problem(n, d=32, seed=0):
  """Worker vectors (n, d), unequal weights and the exact weighted mean.

  Test data come from NumPy: eager jax.random calls would each compile.
  """
  x = (
    np.random.default_rng(seed).normal(size=(n, d)) * np.linspace(0.1, 2.0, d)
  ).astype(np.float32)
  w = dirichlet(n, seed + 1)
  return x, w, (x.astype(np.float64) * w[:, None]).sum(axis=0)


def assert_unbiased(samples, exact):
  """samples: (R, n, d), identical over workers; exact: (d,)."""
  s = np.asarray(samples[:, 0], np.float64)
  se = s.std(axis=0) / np.sqrt(len(s))
  z = np.abs(s.mean(axis=0) - np.asarray(exact)) / (se + 1e-12)
  assert z.max() < Z_MAX, f"max |z| = {z.max():.2f}"


def assert_replicas_identical(out):
  out = np.asarray(out)
  assert (out == out[..., :1, :]).all()


# ----------------------------------------------------------------------------
# shard_map agreement and wire formats.
# ----------------------------------------------------------------------------

ALL = [
  averagers.MeanAverager(),
  averagers.CastAverager("float16"),
  averagers.CastAverager("bfloat16"),
  averagers.GlobalQSGD(),
  averagers.GlobalQSGDExp(),
  averagers.QSGD(),
]


def shard_mapped(averager, key):
  """The trainer's layout: one (1, d) row per device, out_specs P(AXIS)."""
  mesh = Mesh(np.array(jax.devices()[:4]), (AXIS,))

  def fn(x, w):
    return averager(x[0], w[0], AXIS, key)[None]

  sharding = NamedSharding(mesh, P(AXIS))
  f = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
  )
  return f, sharding


@pytest.mark.parametrize("averager", ALL, ids=lambda a: a.name)
def test_vmap_simulation_matches_shard_map(averager):
  x, w, _ = problem(4, d=40)
  key = jax.random.key(3)
  f, sharding = shard_mapped(averager, key)
  got = f(jax.device_put(x, sharding), jax.device_put(w, sharding))
  assert_replicas_identical(got)
  # A vmapped psum is a reduce over the mapped axis, which XLA may sum in
  # another order or precision than the all-reduce: allow the wire dtype's
  # rounding of each of the n - 1 partial sums.
  eps = {"fp16": 2.0**-11, "bf16": 2.0**-8}.get(averager.name, 1e-7)
  np.testing.assert_allclose(
    got, simulate(averager, x, w, key), rtol=3 * eps, atol=1e-7
  )


@pytest.mark.parametrize(
  "averager,wire,compiled",
  [
    (averagers.CastAverager("float16"), "f16", "f16"),
    # XLA:CPU promotes a bf16 all-reduce to f32 (one rounding of the exact
    # sum); NCCL on GPU sums bf16 natively.
    (averagers.CastAverager("bfloat16"), "bf16", "f32"),
    (averagers.GlobalQSGD(), "i8", "s8"),
    (averagers.GlobalQSGD(wire="int16"), "i16", "s16"),
  ],
)
def test_all_reduce_runs_in_the_wire_dtype(averager, wire, compiled):
  x, w, _ = problem(4, d=40)
  f, sharding = shard_mapped(averager, None)
  lowered = f.lower(jax.device_put(x, sharding), jax.device_put(w, sharding))
  # What JAX emits: the element type of every all_reduce's operand.
  emitted = [
    t.split("x")[-1]
    for t in re.findall(
      r'stablehlo\.all_reduce".*?\}\) : \(tensor<([^>]*)>',
      lowered.as_text(),
      re.DOTALL,
    )
  ]
  assert wire in emitted, emitted
  reduces = [
    l
    for l in lowered.compile().as_text().splitlines()
    if re.search(r"all-reduce(-start)?\(", l)
  ]
  assert any(re.search(rf"\b{compiled}\[\d", l) for l in reduces), reduces


def test_casts_are_close_to_the_float32_mean():
  x, w, exact = problem(8, d=256)
  np.testing.assert_allclose(
    simulate(averagers.MeanAverager(), x, w)[0], exact, rtol=1e-5, atol=1e-6
  )
  for averager, tol in [
    (averagers.CastAverager("float16"), 2e-3),
    (averagers.CastAverager("bfloat16"), 2e-2),
  ]:
    out = simulate(averager, x, w)
    assert_replicas_identical(out)
    err = np.abs(np.asarray(out[0]) - exact) / np.abs(exact).max()
    assert 0 < err.max() < tol, (averager.name, err.max())


# ----------------------------------------------------------------------------
# Global-QSGD, standard dithering.
# ----------------------------------------------------------------------------


def test_levels_fill_the_wire_without_overflow():
  assert [averagers.GlobalQSGD().levels(n) for n in (1, 2, 4, 8, 64, 127)] == [
    127,
    63,
    31,
    15,
    1,
    1,
  ]
  assert averagers.GlobalQSGD(wire="int16").levels(64) == 32767 // 64
  assert averagers.GlobalQSGD(wire="int32").levels(64) == 2**24  # float32-exact
  with pytest.raises(ValueError, match="int8 wire sums at most 127"):
    averagers.GlobalQSGD().levels(128)
  with pytest.raises(ValueError, match="wire must be one of"):
    averagers.GlobalQSGD(wire="int4")


@pytest.mark.parametrize(
  "wire,noise", [("int8", "hash"), ("int16", "hash"), ("int8", "threefry")]
)
def test_gqsgd_is_unbiased_with_unequal_weights(wire, noise):
  x, w, exact = problem(8)
  out = draws(averagers.GlobalQSGD(wire=wire, noise=noise), x, w, 2000)
  assert_replicas_identical(out)
  assert_unbiased(out, exact)
  # The per-element standard deviation respects sqrt(n) * scale / 2.
  levels = averagers.GlobalQSGD(wire=wire).levels(8)
  scale = np.abs(x * w[:, None]).max() / levels
  assert float(out[:, 0].std(axis=0).max()) <= np.sqrt(8) * scale / 2


def test_gqsgd_hash_codes_are_the_pallas_encode():
  # With hash noise a worker's codes are pallas_kernels.gqsgd_encode of its
  # bucketed w_i x_i, seeded with the worker's salt.
  import pallas_kernels as pk

  n, d, bucket = 4, 96, 32
  x, w, _ = problem(n, d=d)
  key = jax.random.key(7)
  averager = averagers.GlobalQSGD(bucket_size=bucket)
  _, sent = jax.jit(
    jax.vmap(lambda xi, wi: averager.reduce(xi, wi, AXIS, key), axis_name=AXIS)
  )(x, w)
  yb = (x * w[:, None]).reshape(n, d // bucket, bucket)
  m = np.abs(yb).max(axis=(0, 2))
  s = averager.levels(n)
  for i in range(n):
    salt = jax.random.bits(jax.random.fold_in(key, i), (), jnp.uint32)
    codes = pk.gqsgd_encode_reference(yb[i], m, s, seed=salt)
    np.testing.assert_array_equal(
      np.asarray(sent[i]), pk.gqsgd_decode(codes, m, s).reshape(-1)
    )


def shard_mapped_on(averager, n, key):
  """(f, sharding) of ``averager`` over the first ``n`` fake devices."""
  mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))

  def fn(x, w):
    mean, sent = averager.reduce(x[0], w[0], AXIS, key)
    return mean[None], sent[None]

  sharding = NamedSharding(mesh, P(AXIS))
  return jax.jit(
    jax.shard_map(
      fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS))
    )
  ), sharding


@pytest.mark.parametrize(
  "n,wire,bucket",
  [(2, "int8", 24), (4, "int8", 24), (3, "int16", 40), (4, "int16", None)],
)
def test_gqsgd_kernel_encode_is_bit_identical_in_shard_map(n, wire, bucket):
  # QSYNC_KERNELS=pallas runs the Pallas encode (interpret mode on CPU):
  # mean and sent equal the jnp path's bit for bit, an inf bucket included,
  # and only the forced backend puts a pallas_call in the program.
  x, w, _ = problem(n, d=100)
  x[1, 30] = np.inf  # one non-finite bucket (or, unbucketed, all of them)
  key = jax.random.key(5)
  averager = averagers.GlobalQSGD(wire=wire, bucket_size=bucket)
  got, programs = {}, {}
  for backend in ("pallas", "xla", "auto"):
    with numerics.kernel_backend(backend):
      f, sharding = shard_mapped_on(averager, n, key)
      args = (jax.device_put(x, sharding), jax.device_put(w, sharding))
      programs[backend] = str(jax.make_jaxpr(f)(*args))
      got[backend] = [np.asarray(a) for a in f(*args)]
  assert "pallas_call" in programs["pallas"]
  assert "pallas_call" not in programs["xla"]
  assert "pallas_call" not in programs["auto"]  # auto on CPU: jnp
  for a, b in zip(got["pallas"], got["xla"]):
    np.testing.assert_array_equal(a, b)
  mean, sent = got["pallas"]
  np.testing.assert_array_equal(mean, np.broadcast_to(mean[:1], mean.shape))
  # NaN exactly over the bucket holding the inf (to_buckets' row width).
  width = buckets.bucket_width(100, bucket)
  nan = np.zeros(100, bool)
  nan[30 // width * width : (30 // width + 1) * width] = True
  np.testing.assert_array_equal(np.isnan(mean), np.broadcast_to(nan, (n, 100)))
  # Codes 0 where the bucket is not finite, so what was sent stays finite.
  assert np.isfinite(sent).all()


def test_forced_kernel_encode_refuses_threefry_noise():
  x, w, _ = problem(2, d=16)
  averager = averagers.GlobalQSGD(noise="threefry")
  with numerics.kernel_backend("pallas"):
    f, sharding = shard_mapped_on(averager, 2, None)
    with pytest.raises(
      ValueError,
      match="QSYNC_KERNELS=pallas: the "
      "Global-QSGD kernel draws only hash noise",
    ):
      f(jax.device_put(x, sharding), jax.device_put(w, sharding))
  with numerics.kernel_backend("auto"):  # auto falls back to jnp instead
    f, sharding = shard_mapped_on(averager, 2, None)
    assert "pallas_call" not in str(
      jax.make_jaxpr(f)(
        jax.device_put(x, sharding), jax.device_put(w, sharding)
      )
    )


def test_kernel_encode_tiles_keep_the_triton_grid_legal():
  # Wide unbucketed rows get wider column tiles, up to a limit.
  assert gqsgd_encode_lib.use_kernel("hash", (1, 1 << 24)) is False  # CPU
  with numerics.kernel_backend("pallas"):
    assert gqsgd_encode_lib.use_kernel("hash", (1, 1 << 29))
    with pytest.raises(ValueError, match="set a bucket_size"):
      gqsgd_encode_lib.use_kernel("hash", (1, 1 << 30))
  with numerics.kernel_backend("xla"):
    assert not gqsgd_encode_lib.use_kernel("threefry", (1, 1 << 31))


def test_hash_noise_differs_per_worker_and_per_key():
  x = np.broadcast_to(np.linspace(-1, 1, 256, dtype=np.float32), (4, 256))
  averager = averagers.GlobalQSGD()
  run = jax.jit(
    jax.vmap(
      lambda xi, k: averager.reduce(xi, 0.25, AXIS, k)[1],
      in_axes=(0, None),
      axis_name=AXIS,
    )
  )
  a = np.asarray(run(x, jax.random.key(0)))
  b = np.asarray(run(x, jax.random.key(1)))
  assert len({row.tobytes() for row in np.concatenate([a, b])}) == 8


def test_statistical_test_catches_a_biased_estimate():
  # Weights applied after the sum (the mean of x, not the weighted mean)
  # is what the design rules out: the test must reject it.
  x, _w, exact = problem(8)
  out = draws(averagers.GlobalQSGD(), x, np.full(8, 1 / 8, np.float32), 2000)
  with pytest.raises(AssertionError, match="max"):
    assert_unbiased(out, exact)


def naive_reference_dithering(x, axis_name):
  """Global-QSGD's official hook (sands-lab/global-qsgd,
  ``standard_dithering_hook``): q = x * 127 / (n M), int8 psum, x M / 127."""
  n = lax.axis_size(axis_name)
  m = lax.pmax(jnp.max(jnp.abs(x)), axis_name)
  u = jax.random.uniform(
    jax.random.fold_in(jax.random.key(0), lax.axis_index(axis_name)), x.shape
  )
  q = jnp.floor(x * 127 / (n * m) + u).astype(jnp.int8)
  return lax.psum(q, axis_name).astype(jnp.float32) * m / 127


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_gqsgd_never_overflows_with_every_worker_at_the_maximum(n):
  d = 256
  mag = np.exp(np.random.default_rng(n).uniform(-20, 20, d)).astype(np.float32)
  averager = averagers.GlobalQSGD(bucket_size=1)
  for sign in (1.0, -1.0):
    x = np.broadcast_to(sign * mag, (n, d))
    # bucket_size=1: every element is its bucket's maximum on every worker,
    # each with its own scale (so the rounding of M / s varies too).
    out = simulate(averager, x, np.full(n, 1 / n, np.float32))
    np.testing.assert_allclose(out[0], sign * mag, rtol=1e-5)
    # Unequal weights: the heaviest worker sends s, the others at most s.
    w = dirichlet(n, n)
    out = np.asarray(simulate(averager, x, w)[0])
    assert (np.sign(out) == sign).all()
    assert (np.abs(out) <= n * w.max() * mag * (1 + 1e-5)).all()
  # The same worst case wraps the official code's int8 sum.
  naive = jax.jit(
    jax.vmap(lambda xi: naive_reference_dithering(xi, AXIS), axis_name=AXIS)
  )(np.ones((n, d), np.float32))
  assert (np.asarray(naive[0]) < 0).any(), "expected a wrapped int8 sum"


def test_default_noise_is_independent_per_worker():
  # Identical inputs on every worker must still get independent rounding.
  x = np.broadcast_to(np.linspace(-1, 1, 64, dtype=np.float32), (8, 64))
  averager = averagers.GlobalQSGD()
  mean, sent = jax.jit(
    jax.vmap(lambda xi: averager.reduce(xi, 1 / 8, AXIS), axis_name=AXIS)
  )(x)
  assert len({np.asarray(s).tobytes() for s in sent}) == 8
  # A mean over many elements of one draw is close to the exact value.
  assert np.mean(mean[0] - x[0]) == pytest.approx(0, abs=1e-2)


def test_non_finite_inputs_stay_non_finite():
  x, w, _ = problem(4, d=40)
  x[2, 5] = np.inf
  for averager in ALL:
    out = simulate(averager, x, w, jax.random.key(0))
    assert not np.isfinite(np.asarray(out)).all(), averager.name


@pytest.mark.parametrize(
  "averager",
  [
    averagers.GlobalQSGD(),
    averagers.GlobalQSGDExp(),
    averagers.QSGD(norm="linf", bucket_size=1 << 16),
  ],
  ids=lambda a: a.name,
)
def test_non_finite_values_inside_large_buckets_are_caught(averager):
  # XLA:CPU reduces large rows with YNNPACK, whose max drops NaN: the bucket
  # maxima must still see a NaN (or inf) in the middle of a 2**16 bucket.
  bucket = 1 << 16
  x = np.random.default_rng(0).normal(size=(4, 3 * bucket)).astype(np.float32)
  x[1, bucket + 12345] = np.nan
  x[2, 2 * bucket + 777] = -np.inf
  out = np.asarray(
    simulate(averager, x, np.full(4, 0.25, np.float32), jax.random.key(0))[0]
  ).reshape(3, bucket)
  assert np.isfinite(out[0]).all()
  assert np.isnan(out[1]).all() and np.isnan(out[2]).all()


# ----------------------------------------------------------------------------
# Global-QSGD, exponential dithering.
# ----------------------------------------------------------------------------

# 2**12 evenly spaced noise values: the expectation over them is exact for
# probabilities that are multiples of 2**-12.
U_GRID = ((np.arange(4096, dtype=np.float32) + 0.5) / 4096)[:, None]


def test_exponential_compress_is_exactly_unbiased():
  a = np.array(
    [0.5, -0.3125, 0.1171875, 2.0**-20 * 1.5, 0.0, -0.25], np.float32
  )
  codes = jax.jit(global_qsgd._exp_compress)(a[None, :], U_GRID)
  assert codes.dtype == jnp.uint8
  decoded = np.asarray(jax.jit(global_qsgd._exp_decode)(codes), np.float64)
  np.testing.assert_array_equal(decoded.mean(axis=0), a)


def test_exponential_merge_is_exactly_unbiased_and_symmetric():
  # Operands of at most 1/4, as the 2n normalization guarantees at a merge.
  values = [0.0, 0.25, -0.25, 0.125, -0.0625, 2.0**-5, -(2.0**-9)]
  a, b = (v.ravel().astype(np.float32) for v in np.meshgrid(values, values))

  @jax.jit
  def merge(a, b, u):
    zero = jnp.zeros_like(a)  # u = 0 keeps powers of two exact
    ca = global_qsgd._exp_compress(a, zero)
    cb = global_qsgd._exp_compress(b, zero)
    return global_qsgd._exp_merge(ca, cb, u), global_qsgd._exp_merge(cb, ca, u)

  ab, ba = merge(a[None], b[None], U_GRID)
  np.testing.assert_array_equal(ab, ba)
  decoded = np.asarray(jax.jit(global_qsgd._exp_decode)(ab), np.float64)
  np.testing.assert_array_equal(decoded.mean(axis=0), a + b)
  # Zero has one code (no negative zero), so replicas cannot diverge.
  assert (np.asarray(ab)[:, a + b == 0] == 0).all()


@pytest.mark.parametrize(
  "n,noise", [(1, "hash"), (2, "hash"), (8, "hash"), (8, "threefry")]
)
def test_exponential_dithering_is_unbiased_and_bit_identical(n, noise):
  x, w, exact = problem(n)
  out = draws(averagers.GlobalQSGDExp(noise=noise), x, w, 3000)
  assert_replicas_identical(out)
  assert_unbiased(out, exact)


def test_exponential_dithering_default_key_keeps_replicas_identical():
  x, w, exact = problem(16, d=300)
  out = simulate(averagers.GlobalQSGDExp(bucket_size=64), x, w)
  assert_replicas_identical(out)
  assert np.abs(out[0] - exact).mean() < np.abs(exact).mean()


def test_exponential_dithering_needs_a_power_of_two():
  x, w, _ = problem(3)
  with pytest.raises(ValueError, match="power-of-two"):
    simulate(averagers.GlobalQSGDExp(), x, w)
  with pytest.raises(ValueError, match="power-of-two"):
    averagers.GlobalQSGDExp().wire_bytes(100, 6)


# ----------------------------------------------------------------------------
# QSGD baseline and error feedback.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  "norm,levels,noise",
  [("l2", 127, "hash"), ("linf", 15, "hash"), ("l2", 127, "threefry")],
)
def test_qsgd_is_unbiased(norm, levels, noise):
  x, w, exact = problem(8)
  out = draws(
    averagers.QSGD(levels=levels, norm=norm, bucket_size=16, noise=noise),
    x,
    w,
    2000,
  )
  assert_replicas_identical(out)
  assert_unbiased(out, exact)


def test_error_feedback_telescopes():
  # Over T calls, sum of means = T * exact mean - sum_i final residual_i:
  # the compression error does not accumulate.
  n, steps = 8, 30
  x, w, exact = problem(n)
  averager = averagers.GlobalQSGD(wire="int8")

  def step(residual, key):
    mean, residual = jax.vmap(
      lambda xi, ri, wi: averagers.compress_with_feedback(
        averager, xi, ri, wi, AXIS, key
      ),
      axis_name=AXIS,
    )(x, residual, w)
    return residual, mean[0]

  @jax.jit
  def run(key):
    residual, means = lax.scan(
      step, jnp.zeros_like(x), jax.random.split(key, steps)
    )
    # Exact averaging leaves no residual.
    _, exact_residual = jax.vmap(
      lambda xi, ri, wi: averagers.compress_with_feedback(
        averagers.MeanAverager(), xi, ri, wi, AXIS
      ),
      axis_name=AXIS,
    )(x, residual, w)
    return residual, means.sum(axis=0), exact_residual

  residual, total, exact_residual = map(np.asarray, run(jax.random.key(1)))
  np.testing.assert_allclose(
    total + residual.sum(axis=0), steps * exact, atol=1e-4
  )
  # The residual is bounded by one quantization step per worker.
  scale = np.abs(x * w[:, None] + residual).max() / 15
  assert np.abs(residual).max() <= 2 * scale
  np.testing.assert_array_equal(exact_residual, 0)


# ----------------------------------------------------------------------------
# Bytes on the wire and construction.
# ----------------------------------------------------------------------------


def test_wire_bytes():
  d, n = 10**7, 8
  fp32 = averagers.MeanAverager().wire_bytes(d, n)
  assert fp32 == pytest.approx(2 * 7 / 8 * 4 * d)
  ratio = lambda a: a.wire_bytes(d, n) / fp32
  assert ratio(averagers.CastAverager("bfloat16")) == pytest.approx(0.5)
  assert ratio(averagers.GlobalQSGD()) == pytest.approx(0.25, rel=1e-3)
  assert ratio(averagers.GlobalQSGD(wire="int16")) == pytest.approx(
    0.5, rel=1e-3
  )
  assert ratio(averagers.GlobalQSGD(wire="int32")) == pytest.approx(
    1.0, rel=1e-3
  )
  # Scale exchange: one float32 per bucket through a ring all-reduce.
  buckets = -(-d // (1 << 16))
  assert averagers.GlobalQSGD().wire_bytes(d, n) == pytest.approx(
    averagers.ring_allreduce_bytes(d + 4 * buckets, n)
  )
  # Butterfly: log2(n) uint8 vectors.
  assert averagers.GlobalQSGDExp().wire_bytes(d, n) == pytest.approx(
    3 * d + averagers.ring_allreduce_bytes(4 * buckets, n)
  )
  # All-gather: n - 1 payloads of int8 codes and float32 norms.
  assert averagers.QSGD().wire_bytes(d, n) == pytest.approx(
    7 * (d + 4 * -(-d // 512))
  )
  assert averagers.QSGD(levels=1000).wire_bytes(d, n) == pytest.approx(
    7 * (2 * d + 4 * -(-d // 512))
  )
  assert averagers.GlobalQSGD().wire_bytes(d, 1) == 0.0


def test_make_averager():
  assert isinstance(averagers.make_averager("none"), averagers.MeanAverager)
  assert isinstance(averagers.make_averager("fp32"), averagers.MeanAverager)
  assert averagers.make_averager("fp16").dtype == "float16"
  assert averagers.make_averager("bf16").name == "bf16"
  assert averagers.make_averager("gqsgd", wire="int16").wire == "int16"
  assert averagers.make_averager("gqsgd_exp", seed=3).seed == 3
  assert averagers.make_averager("qsgd", levels=7).levels == 7
  with pytest.raises(ValueError, match="valid: none, fp32, mean, fp16"):
    averagers.make_averager("int8")
  with pytest.raises(ValueError, match="dtype must be one of"):
    averagers.CastAverager("float8")
  with pytest.raises(ValueError, match="norm must be"):
    averagers.QSGD(norm="l1")
  for strategy in (
    averagers.GlobalQSGD,
    averagers.GlobalQSGDExp,
    averagers.QSGD,
  ):
    with pytest.raises(ValueError, match="noise must be one of"):
      strategy(noise="philox")


@pytest.mark.parametrize(
  "n,bucket", [(100, 32), (96, 32), (10, 32), (100, None)]
)
@pytest.mark.parametrize("bad", [None, np.inf, np.nan])
def test_bucket_rows_are_bucket_wide_and_absmax_reads_them(n, bucket, bad):
  x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
  if bad is not None:
    x[n - 3] = bad  # In the last, padded bucket.
  yb = buckets.to_buckets(jnp.asarray(x), bucket)
  assert yb.shape == (
    buckets.num_buckets(n, bucket),
    n if bucket is None or n <= bucket else bucket,
  )
  np.testing.assert_array_equal(buckets.from_buckets(yb, x), x)
  m = buckets.absmax(jnp.asarray(x), bucket, 0.5)
  np.testing.assert_array_equal(m, buckets.bucket_absmax(yb, 0.5))
  assert np.isinf(m[-1]) == (bad is not None)


@pytest.mark.parametrize(
  "n,bucket", [(100, 32), (96, 32), (10, 32), (100, None)]
)
@pytest.mark.parametrize("noise", ["hash", "threefry"])
def test_row_blocks_give_what_the_padded_rows_give(n, bucket, noise):
  # map_rows hands fn the full rows and the padded last row apart; with
  # the noise of each block taken at its rows, the result is fn over the
  # padded rows, bit for bit.
  x = jnp.asarray(np.random.default_rng(n).standard_normal(n), jnp.float32)
  rows = buckets.num_buckets(n, bucket)
  key = jax.random.key(3)
  starts = []

  def fn(xb, start):
    starts.append(start)
    u = buckets.uniform(key, xb.shape, noise, xb, start=start, num_rows=rows)
    return jnp.floor(xb * 7 + u).astype(jnp.int8)

  got = buckets.map_rows(fn, x, bucket)
  whole = fn(buckets.to_buckets(x, bucket), 0)
  np.testing.assert_array_equal(got, whole)
  full = n // buckets.bucket_width(n, bucket)
  blocks = [0] if full in (0, rows) else [0, full]
  assert starts[: len(blocks)] == blocks
