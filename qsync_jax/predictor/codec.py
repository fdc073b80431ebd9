"""An averager's own work, everything but the wire: measured and fitted.

This module owns :func:`profile_codec` and :class:`CodecCost`, the
encode/decode part of :func:`qsync_jax.predictor.communication.averaging_time`,
and :func:`local_program`, what it times: the averager's program as one
worker runs it, with its collectives replaced by local passes. It also holds
the ``shard_map`` body both modules trace an averager in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from qsync_jax.parallel import averagers
from qsync_jax.parallel.wire import Averager
from qsync_jax.predictor import timing

AXIS = "workers"
#: Collective primitives and the kind of collective each issues.
COLLECTIVE_PRIMITIVES = {
  "psum": "all_reduce",
  "psum_invariant": "all_reduce",
  "pmax": "all_reduce",
  "pmin": "all_reduce",
  "all_gather": "all_gather",
  "all_gather_invariant": "all_gather",
  "ppermute": "permute",
  "psum_scatter": "reduce_scatter",
  "reduce_scatter": "reduce_scatter",
  "all_to_all": "all_to_all",
}


def shard_body(averager: Averager, error_feedback: bool | None = None):
  """The ``shard_map`` body of one average: a ``(1, d)`` row per worker.

  Args:
    averager: the averaging strategy.
    error_feedback: None for the averager's own call, ``body(x, w)``
      returning the mean; True or False for the trainer's average
      (:func:`qsync_jax.parallel.averagers.average`), ``body(x, w,
      residual, state)`` returning the mean, the new residual and the new
      state: with the averager's state where it carries one (PowerSGD's
      warm start) and with or without the error-feedback residual (None
      without).
  """
  if error_feedback is None:

    def body(x, w):
      return averager(x[0], w[0], AXIS)[None]

    return body

  def trainer_body(x, w, residual, state):
    mean, residual, state = averagers.average(
      averager,
      x[0],
      w[0],
      AXIS,
      jax.random.key(0),
      None if residual is None else residual[0],
      jax.tree.map(lambda s: s[0], state),
    )
    return jax.tree.map(lambda v: v[None], (mean, residual, state))

  return trainer_body


def abstract_args(
  num_elements: int,
  num_workers: int,
  averager: Averager | None = None,
  error_feedback: bool | None = None,
):
  """The abstract arguments of :func:`shard_body` over the whole mesh:
  ``(x, w)``, and for the trainer's average also the residual (None without
  feedback) and the averager's state, stacked over the workers."""
  rows = jax.ShapeDtypeStruct((num_workers, num_elements), jnp.float32)
  args = (rows, jax.ShapeDtypeStruct((num_workers,), jnp.float32))
  if error_feedback is None:
    return args
  return (
    *args,
    rows if error_feedback else None,
    jax.tree.map(
      lambda s: jax.ShapeDtypeStruct((num_workers, *s.shape), s.dtype),
      _state_shape(averager, num_elements),
    ),
  )


def _state_shape(averager: Averager | None, num_elements: int) -> Any:
  """The averager's state's shapes and dtypes (None: it has none)."""
  return jax.eval_shape(lambda: averagers.init_state(averager, num_elements))


@dataclasses.dataclass(frozen=True)
class CodecCost:
  """An averager's local work (encode, decode, reduction arithmetic) per call:
  ``a_s + b_s * num_elements`` seconds (never below 0).

  Attributes:
    a_s: fixed seconds per call.
    b_s: seconds per element.
    sizes: the sizes it was fitted on.
    seconds: the times measured at them.
  """

  a_s: float
  b_s: float
  sizes: tuple[int, ...] = ()
  seconds: tuple[float, ...] = ()

  def __call__(self, num_elements: int) -> float:
    return max(self.a_s + self.b_s * num_elements, 0.0)

  @classmethod
  def fit(cls, sizes: Sequence[int], seconds: Sequence[float]) -> CodecCost:
    """Least-squares ``a + b n`` through (size, seconds) points.

    Raises:
      ValueError: fewer than two distinct sizes, or lengths differ.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
      raise ValueError(
        f"a codec fit needs >= 2 distinct sizes with one time "
        f"each, got sizes {list(sizes)}, times {list(seconds)}"
      )
    b, a = np.polyfit(
      np.asarray(sizes, np.float64), np.asarray(seconds, np.float64), 1
    )
    return cls(
      float(a),
      float(b),
      tuple(int(s) for s in sizes),
      tuple(float(t) for t in seconds),
    )

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# Collectives over the workers' axis, and what stands in for each when one
# worker's program runs alone: one pass over the operand, no wire. ``met``
# is None, or where the workers still meet (:func:`_meeting`), the one
# value the stand-in waits for.
_LOCAL_STAND_INS: dict[str, Callable[..., Any]] = {
  "psum": lambda x, n, out, met: _summed(x, n, met),
  "psum_invariant": lambda x, n, out, met: _summed(x, n, met),
  "pmax": lambda x, n, out, met: _after(x, met),
  "pmin": lambda x, n, out, met: _after(x, met),
  "ppermute": lambda x, n, out, met: _received(x, n, met),
  "pvary": lambda x, n, out, met: x,
  "pcast": lambda x, n, out, met: x,
  "all_gather": lambda x, n, out, met: _gathered(x, n, out, met),
  "all_gather_invariant": lambda x, n, out, met: _gathered(x, n, out, met),
  "axis_index": lambda n, out: jnp.zeros(out.shape, out.dtype),
}


#: Operand bytes per worker up to which, in the run's mesh program
#: (:func:`local_program` with a mesh), the workers meet before a
#: collective's stand-in in an all-reduce of its whole operands rather than
#: of one element. A collective this small costs its fixed costs (round
#: trips, and the wait for the slowest worker at each), which a one-element
#: meeting and a line through large operands do not price (PowerSGD's two
#: all-reduces are of that size). Its time is then the encode/decode's, and
#: it is not priced again (:func:`timed_in_codec`).
SMALL_COLLECTIVE_BYTES = 1 << 18


def timed_in_codec(operand_bytes: float) -> bool:
  """Whether a collective of ``operand_bytes`` per worker is timed in the
  mesh's encode/decode program (:data:`SMALL_COLLECTIVE_BYTES`), so that
  it must not be priced again."""
  return operand_bytes <= SMALL_COLLECTIVE_BYTES


def _operand_bytes(operands) -> int:
  return sum(x.size * x.dtype.itemsize for x in operands)


def _first_is_odd(x):
  """int32 ``[1]``: whether ``x``'s first element is a NaN (floats) or its
  type's least value (integers), which XLA cannot know, so it keeps the
  all-reduce that produces ``x``."""
  first = x.reshape(-1)[:1]
  if jnp.issubdtype(x.dtype, jnp.floating):
    return (first != first).astype(jnp.int32)
  return (first == jnp.iinfo(x.dtype).min).astype(jnp.int32)


def _meeting(operands, axis: str):
  """An all-reduce the workers wait at for each other, as at the collective
  it stands for: of the operands' first elements, or of the whole operands
  where they are small (:data:`SMALL_COLLECTIVE_BYTES`). It follows the work
  that produces the operands, except an elementwise pass that produces them
  (below).

  Returns int32 ``[1]``, never negative (which is what the stand-ins test,
  and XLA cannot fold away).
  """
  if timed_in_codec(_operand_bytes(operands)):
    flags = [
      _first_is_odd(
        jax.lax.psum(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axis)
      )
      for x in operands
    ]
    return sum(flags[1:], flags[0])
  # One element, not a reduction over all: a reduction is a read pass of its own
  # (it would double the float32 mean's encode/decode). But where the operand
  # comes from an elementwise pass, XLA fuses the slice into it and computes the
  # element first, so the workers meet before that pass, not after it. The flag
  # is one XLA cannot fold for any type: ``x != x`` of integer codes folded to a
  # constant, and the workers met before the encode that produced them.
  flags = [
    _first_is_odd(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x)
    for x in operands
  ]
  return jax.lax.psum(sum(flags[1:], flags[0]), axis)


def _after(x, met):
  """``x``, released once the workers met (a conditional on the meeting;
  only for the small operands of a max or min: the branch copies)."""
  if met is None:
    return x
  return jax.lax.cond(met[0] >= 0, lambda v: v, jnp.zeros_like, x)


# Equations that call a jaxpr (which may hold collectives); a reduce's or a
# scan's jaxpr is its computation, bound as is.
_CALLS = (
  "jit",
  "pjit",
  "closed_call",
  "core_call",
  "custom_jvp_call",
  "custom_vjp_call",
  "custom_vjp_call_jaxpr",
  "remat",
  "checkpoint",
)


def _summed(x, n: int, met=None):
  """``n x`` in a computation of its own (a branch of a conditional), so
  that, as around the real all-reduce, XLA fuses nothing across it: the
  operand is written out and the result read back in the sum's type.

  Scaled in line, the sum fused into the passes on both sides and the
  encode/decode came out one pass short wherever the real program has a pass
  on each side of its all-reduce, as the bfloat16 mean has (converted there,
  summed in float32 by XLA:CPU, converted back).
  """
  taken = (
    jax.lax.optimization_barrier(jnp.bool_(True))
    if met is None
    else met[0] >= 0
  )
  return jax.lax.cond(taken, lambda v: v * n, lambda v: v, x)


def _gathered(x, n: int, out, met=None):
  """n copies of ``x`` in the gather's output shape, made outside the
  program (a host callback), as a collective's receive buffer is.

  Inside the program XLA:CPU fuses the copies into the decode that reads them
  and runs it several times slower than the real program does, whatever barrier
  stands between them; a buffer from outside keeps the decode as the real
  program compiles it, for the cost of one copy of the gathered bytes, which the
  collective also writes. The callback returns a broadcast view, which jax
  copies into the result buffer: that one write. (Made contiguous in the
  callback first, the copies would be written twice.)
  """

  def copies(v, *_):
    return np.broadcast_to(np.asarray(v)[None], (n, *v.shape))

  gathered = jax.pure_callback(
    copies,
    jax.ShapeDtypeStruct((n, *x.shape), x.dtype),
    x,
    *([] if met is None else [met]),
  )
  return gathered.reshape(out.shape)


def _received(x, n: int, met=None):
  """A copy of ``x`` in a receive buffer, as a permute's partner's codes.

  Over the workers (``met`` given): a permute in which every worker sends
  to itself. XLA writes its receive buffer and fuses nothing across it, as
  across the real permute, and nothing crosses the link; what reads it
  waits for the meeting (a select, fused into that pass). One worker's
  program alone gets a host callback that hands back its argument, copied
  into the program's result buffer (one write, as a receive's).

  The operand itself would let XLA simplify the exponential merge of two
  equal values away. Over the workers the permute stands in rather than the
  host callback, which costs more than a receive and so would price the
  average long.
  """
  if met is None:
    return jax.pure_callback(
      lambda v: np.asarray(v), jax.ShapeDtypeStruct(x.shape, x.dtype), x
    )
  received = jax.lax.ppermute(x, AXIS, [(i, i) for i in range(n)])
  # A select that fuses into the pass reading it: no pass of its own.
  return jnp.where(met[0] >= 0, received, jnp.zeros_like(received))


def fit_sizes(num_elements: int) -> list[int]:
  """The sizes a cost at ``num_elements`` is fitted on: it and a quarter.

  Fitted at smaller sizes and extrapolated, the line misses what the host's
  caches stop holding.
  """
  lo = max(int(num_elements) // 4, 2)
  return [lo, max(int(num_elements), lo + 1)]


def sample_data(sample, num_elements: int) -> np.ndarray:
  """``num_elements`` float32 values of ``sample`` (repeated as needed), or
  standard normal ones where ``sample`` is None."""
  if sample is None:
    return np.random.default_rng(num_elements).standard_normal(
      num_elements, np.float32
    )
  flat = np.asarray(sample, np.float32).reshape(-1)
  if flat.size == 0:
    raise ValueError("sample data is empty")
  return np.resize(flat, num_elements)


def _called_jaxpr(eqn):
  """The jaxpr a call-like equation runs (jit, custom_jvp/vjp), or None."""
  if eqn.primitive.name not in _CALLS:
    return None
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if sub is not None and (hasattr(sub, "eqns") or hasattr(sub, "consts")):
      return sub
  return None


def _eval_local(jaxpr, consts, args, n: int, axis: str | None = None):
  """Evaluates a ``shard_map`` body with its collectives replaced by local
  stand-ins (:data:`_LOCAL_STAND_INS`), recursing into nested ``jit``s.

  With ``axis`` (the body runs in a ``shard_map`` over real workers), each
  stand-in first waits for the workers to meet (:func:`_meeting`)."""
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if hasattr(v, "val") else env[v]

  for var, val in zip(jaxpr.constvars, consts):
    env[var] = val
  for var, val in zip(jaxpr.invars, args):
    env[var] = val
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    invals = [read(v) for v in eqn.invars]
    if name == "axis_index" and axis is not None:
      # Over the mesh each worker draws its own noise, as in the real run.
      outs = [jax.lax.axis_index(eqn.params["axis_name"])]
    elif name == "axis_index":
      outs = [_LOCAL_STAND_INS[name](n, eqn.outvars[0].aval)]
    elif name in _LOCAL_STAND_INS:
      # Workers meet at a collective, not where a value is only retyped.
      met = (
        _meeting(invals, axis)
        if axis is not None and name in COLLECTIVE_PRIMITIVES
        else None
      )
      outs = [
        _LOCAL_STAND_INS[name](x, n, o.aval, met)
        for x, o in zip(invals, eqn.outvars)
      ]
    elif name in COLLECTIVE_PRIMITIVES:
      raise ValueError(f"profile_codec has no local stand-in for {name}")
    elif _called_jaxpr(eqn) is not None:
      # jit, closed calls and custom_jvp/vjp calls: their body, which may
      # hold collectives (forward only, so the custom rules do not matter).
      sub = _called_jaxpr(eqn)
      outs = _eval_local(
        getattr(sub, "jaxpr", sub), getattr(sub, "consts", ()), invals, n, axis
      )
    else:
      # As jax's own evaluator binds; before jax 0.10 call primitives also
      # returned sub-functions to bind with.
      params = eqn.primitive.get_bind_params(eqn.params)
      subfuns = []
      if isinstance(params, tuple):
        subfuns, params = params
      outs = eqn.primitive.bind(*subfuns, *invals, **params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    for var, val in zip(eqn.outvars, outs):
      env[var] = val
  return [read(v) for v in jaxpr.outvars]


def local_program(
  averager: Averager,
  num_elements: int,
  num_workers: int,
  mesh: Mesh | None = None,
  error_feedback: bool | None = None,
):
  """One worker's averager program with its collectives replaced.

  The averager is traced in a ``shard_map`` over an abstract mesh of
  ``num_workers`` (so what depends on the count, Global-QSGD's levels and
  the exponential merges' ``log2 n`` stages, is as in the real run), and its
  body is replayed with every collective swapped for one local pass over its
  operand (a sum becomes a scaling across which XLA fuses nothing, a max
  the operand itself, a gather a repeat made outside the program as a
  receive buffer is, and a permute a copy: outside the program as well, or
  over ``mesh`` a permute of each worker to itself). What is left is the
  averager's own work: encode, decode, scales, noise.

  Args:
    averager: the averaging strategy.
    num_elements: float32 elements per worker.
    num_workers: workers in the average it models.
    mesh: None for one worker's program alone, or the run's mesh (one axis,
      ``num_workers`` devices): the program then runs on every worker, and
      before each stand-in the workers meet in a one-element all-reduce, as
      they do at each collective of the real average (of the whole
      operands where they are at most :data:`SMALL_COLLECTIVE_BYTES` per
      worker, :func:`timed_in_codec`). A collective waits
      for the slowest worker, so where the workers share a host's cores the
      work between two collectives costs the slowest worker's time.
    error_feedback: None for the averager's own call; True or False for
      the trainer's average (:func:`shard_body`).

  Returns:
    A jitted ``fn(x, w)``: on one worker's ``(num_elements,)`` float32 ``x``
    and scalar ``w``; over ``mesh``, on the workers' ``(num_workers,
    num_elements)`` and ``(num_workers,)``, sharded over its axis. For the
    trainer's average ``fn(x, w, residual, state)``, which returns the
    mean, the new residual and the new state (flattened).

  Raises:
    ValueError: a mesh of other than ``num_workers`` devices on one axis.
  """
  if mesh is not None and mesh.devices.shape != (num_workers,):
    raise ValueError(
      f"local_program needs a mesh of {num_workers} devices "
      f"on one axis, got shape {mesh.devices.shape}"
    )
  # Traced over the mesh it replays on: its equations name their mesh.
  traced_on = (
    AbstractMesh((num_workers,), (AXIS,))
    if mesh is None
    else Mesh(mesh.devices, (AXIS,))
  )
  args = abstract_args(num_elements, num_workers, averager, error_feedback)
  specs = tuple(P(AXIS) for _ in args)
  fn = jax.shard_map(
    shard_body(averager, error_feedback),
    mesh=traced_on,
    in_specs=specs,
    out_specs=P(AXIS),
  )
  outer = jax.make_jaxpr(fn)(*args)
  (eqn,) = [e for e in outer.jaxpr.eqns if e.primitive.name == "shard_map"]
  body = eqn.params["jaxpr"]
  # Every output is returned, so XLA keeps the work of each (the trainer
  # keeps the residual and the state).
  if mesh is None:

    def run(*args):
      outs = _eval_local(
        body, (), [a[None] for a in jax.tree.leaves(args)], num_workers
      )
      return outs[0][0] if error_feedback is None else [o[0] for o in outs]

    return jax.jit(run)

  def met_run(*args):
    outs = _eval_local(body, (), jax.tree.leaves(args), num_workers, AXIS)
    return outs[0] if error_feedback is None else outs

  # The replayed body mixes values that vary over the workers with ones
  # that do not, as the stand-ins leave them: not what check_vma checks.
  return jax.jit(
    jax.shard_map(
      met_run,
      mesh=traced_on,
      in_specs=specs,
      out_specs=P(AXIS),
      check_vma=False,
    )
  )


def _on_each(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` called on each device's arguments at once: one tuple of them
  per device."""

  def call(*per_device):
    return [fn(*args) for args in per_device]

  return call


def _worker_args(
  averager: Averager,
  row: np.ndarray,
  num_workers: int,
  error_feedback: bool | None,
  rng: np.random.Generator,
) -> list[Any]:
  """One worker's host arguments of :func:`local_program`'s program."""
  args = [row, np.float32(1.0 / num_workers)]
  if error_feedback is None:
    return args
  # A warm state (PowerSGD's previous Q), as every call after the first
  # has: a state of zeros takes the first call's path.
  state = jax.tree.map(
    lambda s: rng.standard_normal(s.shape).astype(s.dtype),
    _state_shape(averager, row.size),
  )
  return [*args, np.float32(0.01) * row if error_feedback else None, state]


def codec_programs(
  averager: Averager,
  sizes: Sequence[int],
  device: jax.Device | None = None,
  *,
  mesh: Mesh | None = None,
  host_devices: Sequence[jax.Device] | None = None,
  num_workers: int = 2,
  sample=None,
  error_feedback: bool | None = None,
) -> list[tuple[Callable[..., Any], tuple]]:
  """The programs :func:`profile_codec` times, compiled and run once.

  For callers that time them their own way (in rounds with other programs,
  as the compression bench does). Arguments as :func:`profile_codec`'s.

  Returns:
    One ``(fn, args)`` per size (:func:`local_program`): ``fn(*args)`` is
    one call (on every one of ``host_devices`` where given).

  Raises:
    ValueError: more than one of a device, a mesh and host devices, or an
      empty ``host_devices``.
  """
  if sum(a is not None for a in (device, mesh, host_devices)) > 1:
    raise ValueError(
      "profile_codec takes a device, a mesh or host devices, not several"
    )
  if host_devices is not None and not host_devices:
    raise ValueError("profile_codec's host_devices is empty")
  rng = np.random.default_rng(0)
  if mesh is not None:
    num_workers = mesh.devices.size
    sharding = NamedSharding(mesh, P(mesh.axis_names[0]))

    def stacked(v):
      v = np.asarray(v)
      return jax.make_array_from_callback(
        (num_workers, *v.shape), sharding, lambda _: v[None]
      )

    def args_of(row):
      return tuple(
        jax.tree.map(
          stacked, _worker_args(averager, row, num_workers, error_feedback, rng)
        )
      )
  else:
    # One device is the case of one host device.
    devices = list(host_devices or [device or jax.local_devices()[0]])

    def args_of(row):
      args = _worker_args(averager, row, num_workers, error_feedback, rng)
      return tuple(tuple(jax.device_put(args, d)) for d in devices)

  # Compile everything first, so processes that share the host stay in step.
  programs = []
  for d in sizes:
    args = args_of(sample_data(sample, int(d)))
    fn = local_program(averager, int(d), num_workers, mesh, error_feedback)
    fn = fn if mesh is not None else _on_each(fn)
    jax.block_until_ready(fn(*args))
    programs.append((fn, args))
  return programs


def profile_codec(
  averager: Averager,
  num_elements: int | Sequence[int],
  device: jax.Device | None = None,
  *,
  num_workers: int = 2,
  repeats: int = 5,
  calls: int = 3,
  sync: Callable[[], Any] | None = None,
  sample=None,
  mesh: Mesh | None = None,
  host_devices: Sequence[jax.Device] | None = None,
  error_feedback: bool | None = None,
) -> CodecCost:
  """Measures an averager's local work on ``device``, fitted as ``a + b n``.

  Times :func:`local_program`: the averager as one worker runs it, with
  every collective replaced by a local pass over its operand, so the time is
  everything but the wire. (A ``jax.vmap`` over the workers' axis would be
  the obvious alternative, but it batches the per-worker PRNG keys, and
  batched-key noise is several times slower than one worker's, which would
  overstate the dithering's cost.)

  The statistic is the one a run pays: the median over ``repeats`` blocks
  of ``calls`` back-to-back calls (:func:`qsync_jax.predictor.timing.
  seconds_per_call`), dispatch included, not the fastest call. Where several
  processes share the host's cores, have them all profile at once, with
  ``sync`` a barrier: each block then shares the cores as the averagers'
  calls do.

  Args:
    averager: the averaging strategy.
    num_elements: the size (float32 elements per worker) to fit at: it and
      a quarter of it (:func:`fit_sizes`), or an explicit list of sizes.
    device: where to time (default: the first local device).
    num_workers: workers in the average it models.
    repeats: timed blocks per size.
    calls: calls per block.
    sync: called before each block (a barrier across processes).
    sample: representative float32 data, such as one worker's raveled
      gradient, repeated to each size (default: standard normal). The data
      matters on a CPU: the float16 mean's casts are far slower on
      gradient-like data, whose small layers hold float16 subnormals, than
      on normal data.
    mesh: instead of ``device``, the run's mesh (one axis, one device per
      worker, every process calling this alike): the program runs on every
      worker and the workers meet where the average's collectives are
      (:func:`local_program`), so waiting for the slowest worker is timed.
      ``num_workers`` is then the mesh's size.
    host_devices: instead of ``device``, devices of one host whose workers
      encode at once, as workers sharing a host's cores do (processes
      launched on one machine, or fake CPU devices): one worker's program
      runs on each of them at the same time, and a call is the time until
      all have finished (timed alone on one device, the encode/decode of
      workers sharing cores comes out short). Processes
      each run their own XLA thread pool, which fake devices of one process
      share: for processes, :func:`~qsync_jax.predictor.codec_processes.
      profile_codecs_in_processes` profiles over their mesh.
    error_feedback: None to time the averager's own call (what the
      compression bench times); True or False to time the trainer's average
      (:func:`qsync_jax.parallel.averagers.average`): with the averager's
      state where it carries one and with or without the error-feedback
      residual, which can cost far more than the averager's own call.

  Returns:
    The fitted :class:`CodecCost`.

  Raises:
    ValueError: a size below 2, fewer than one worker, repeat or call, or
      more than one of a device, a mesh and host devices.
  """
  if isinstance(num_elements, (int, np.integer)):
    sizes = (
      fit_sizes(num_elements) if num_elements >= 2 else [int(num_elements)]
    )
  else:
    sizes = [int(s) for s in num_elements]
  if min(sizes) < 2 or min(num_workers, repeats, calls) < 1:
    raise ValueError(
      f"profile_codec needs sizes >= 2 and at least one "
      f"worker, repeat and call; got sizes {sizes}, "
      f"{num_workers} workers, {repeats} repeats, {calls} "
      "calls"
    )
  programs = codec_programs(
    averager,
    sizes,
    device,
    mesh=mesh,
    host_devices=host_devices,
    num_workers=num_workers,
    sample=sample,
    error_feedback=error_feedback,
  )
  times = [
    timing.median_block_seconds(fn, args, repeats, calls, sync)
    for fn, args in programs
  ]
  del programs
  return CodecCost.fit(sizes, times)
