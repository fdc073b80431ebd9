"""Global-QSGD's encode through the Pallas kernel or jnp, by kernel backend.

This module owns the choice of how
:class:`qsync_jax.parallel.global_qsgd.GlobalQSGD` turns a worker's bucketed
``w_i x_i`` into integer codes when its noise is the counter hash: the
Pallas kernel ``pallas_kernels.gqsgd_encode`` (one read of the buckets, one
write of codes) or the jnp path, which XLA fuses. It lives in ``numerics``
because only this package may import ``pallas_kernels``
(docs/ARCHITECTURE.md). The choice follows the contractions' setting,
:func:`qsync_jax.numerics.ops.get_kernel_backend` (``QSYNC_KERNELS``), with
no second switch:

* ``"xla"``: the jnp path.
* ``"auto"``: the kernel on a CUDA GPU of compute capability sm_80+ (the
  Triton floor) when the kernel can run the call (below); the jnp path
  everywhere else, so the same configuration runs on any machine.
* ``"pallas"``: the kernel (interpret mode off GPU, slow: for checking
  numerics); raises ``ValueError`` where it cannot run the call.

The kernel cannot run the call, so ``auto`` uses jnp and ``pallas`` raises,
when: the noise is not ``"hash"`` (the kernel draws only the counter hash);
the GPU is below sm_80 or has no CUDA capability (ROCm); or one bucket is so
wide that its column tiles would exceed Triton's grid (more than
``65535 * 16384`` elements, i.e. ``bucket_size=None`` on a gradient of over
a billion elements). Any other bucket shape runs: the tiles are powers of
two chosen here and the kernel pads the buckets to them.

Off GPU (interpret mode) the kernel's codes equal the jnp path's bit for
bit. On a GPU, Triton's float32 division is ``div.full.f32`` (2 ulp), so a
code can differ by one step where ``y / scale`` lies that close to a grid
point; every worker runs the same path, so the codes stay unbiased and the
integer all-reduce cannot wrap (``|q| <= levels`` holds either way). The
backend is read when the averager is traced: functions already jitted keep
their choice.
"""

from __future__ import annotations

import jax

from pallas_kernels import _common as kernel_common
from pallas_kernels.gqsgd_encode import gqsgd_encode
from qsync_jax.numerics import ops

# Triton's floor for the kernel's integer and float ops (as for int8 GEMMs).
_MIN_CAPABILITY = (8, 0)
# Triton launches program_id(1), the column tiles, on the CUDA grid's y
# axis, which holds at most 65535 blocks.
_MAX_COL_TILES = 65535
_MAX_BLOCK_ROWS = 8
_MIN_BLOCK_COLS, _BLOCK_COLS, _MAX_BLOCK_COLS = 16, 512, 16384


def _block_cols(cols: int) -> int | None:
  """A power-of-two column tile keeping the grid legal, or None."""
  block = kernel_common.pick_block(cols, _MIN_BLOCK_COLS, _BLOCK_COLS)
  while -(-cols // block) > _MAX_COL_TILES:
    block *= 2
  return block if block <= _MAX_BLOCK_COLS else None


def _why_not(noise: str, shape: tuple[int, ...]) -> str | None:
  """Why the kernel cannot encode buckets of ``shape``; None if it can."""
  if noise != "hash":
    return (
      f"the Global-QSGD kernel draws only hash noise, the averager "
      f"has noise={noise!r}"
    )
  if _block_cols(shape[1]) is None:
    return (
      f"a bucket of {shape[1]} elements needs more than "
      f"{_MAX_COL_TILES} tiles of {_MAX_BLOCK_COLS}; set a "
      "bucket_size"
    )
  if jax.default_backend() == "gpu":
    cc = ops._gpu_capability()  # pylint: disable=protected-access
    if cc is None or cc < _MIN_CAPABILITY:
      return (
        f"the Triton kernel needs a CUDA GPU of capability "
        f"sm_{_MIN_CAPABILITY[0]}{_MIN_CAPABILITY[1]}+, this device "
        f"has {cc}"
      )
  return None


def use_kernel(noise: str, shape: tuple[int, ...]) -> bool:
  """Whether the encode of buckets of ``shape`` runs as the Pallas kernel.

  Args:
    noise: the averager's rounding noise (``"hash"`` or ``"threefry"``).
    shape: ``(num_buckets, bucket_width)`` of the bucketed array.

  Returns:
    True for the kernel, False for the jnp path (module docstring).

  Raises:
    ValueError: the backend is ``"pallas"`` and the kernel cannot run this
      call (the message says why).
  """
  backend = ops.get_kernel_backend()
  if backend == "xla":
    return False
  why = _why_not(noise, shape)
  if backend == "pallas":
    if why is not None:
      raise ValueError(f"QSYNC_KERNELS=pallas: {why}; use 'auto' or 'xla'")
    return True
  return why is None and jax.default_backend() == "gpu"


def encode(
  yb: jax.Array, global_max: jax.Array, levels: int, salt: jax.Array, wire: str
) -> jax.Array:
  """This worker's codes of ``yb`` from ``pallas_kernels.gqsgd_encode``.

  Args:
    yb: ``(num_buckets, bucket_width)`` float32 weighted values.
    global_max: ``(num_buckets,)`` ``pmax`` over workers of the buckets'
      ``max |y|`` (inf for a bucket holding a non-finite value).
    levels: levels per worker.
    salt: uint32 scalar of the counter hash, distinct per worker and step.
    wire: ``"int8"``, ``"int16"`` or ``"int32"``: the codes' dtype.

  Returns:
    Codes of ``yb``'s shape in ``wire``; 0 in non-finite buckets.

  Raises:
    ValueError: a shape :func:`use_kernel` would have refused.
  """
  rows, cols = yb.shape
  block_cols = _block_cols(cols)
  if block_cols is None:
    raise ValueError(_why_not("hash", yb.shape))

  def kernel(yb, global_max, salt):
    return gqsgd_encode(
      yb,
      global_max,
      levels,
      seed=salt,
      out_dtype=wire,
      block_rows=kernel_common.pick_block(rows, 1, _MAX_BLOCK_ROWS),
      block_cols=block_cols,
    )

  # Under shard_map's check_vma the kernel runs unchecked, its codes typed
  # back as varying over the workers' axis, so the psum that follows sums them.
  return ops.outside_vma_check(kernel, yb, global_max, salt)
