"""Profiles: what each piece of a training step costs on one device kind.

This module owns :class:`Profile` (the table the simulation reads, saved and
loaded as JSON) and the measured way to get one: :func:`profile` measures, on
the device at hand, every layer's forward and forward+backward time at each
precision (its op jitted alone at the real operand shapes recorded by
:func:`~qsync_jax.predictor.graph.trace_graph`, warm, median of repeats,
dispatch overhead removed), the rest of the step (the same gradient function
the trainer compiles, with every layer's op replaced by a stand-in that only
emits an output of the right shape and dtype), the optimizer update, the cast
costs (fitted, :mod:`.casting`), the memory of the compiled step at each
uniform precision, the whole gradient pass at each uniform precision (alone,
and on hosts that carry several workers as k copies at once: how they share
the host), on a host that carries workers the trainer's step at each
uniform precision, and what a host all-reduce costs. Layers whose pieces are
the same computation (:func:`.pieces.piece_signature`: a ResNet's repeated
blocks) are timed once. Profiles are cached as JSON keyed by model graph,
batch shape, device kind and jax version.

What the pieces compute is :mod:`.pieces`; the calls that run them are
:mod:`.calls`. :func:`.analytic.analytic_profile` derives the same table for a
GPU kind that is not present.

The step times :mod:`.simulation` predicts are built from the isolated
pieces, scaled per precision to the model's whole gradient pass at that
uniform precision (:func:`.simulation.pass_factors`), as QSync's replayer
builds mixed plans on uniform-precision traces. No mixed plan is ever timed
whole. On a host that carries workers, the trainer's uniform steps are:
against the uniform passes they give the step's fixed part and the host
work a pass hides (:func:`fit_step_overhead`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import hashlib
import json
import os
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from qsync_jax import files
from qsync_jax import host_memory
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan.devices import supported_precisions
from qsync_jax.predictor import calls as calls_lib
from qsync_jax.predictor import casting
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory
from qsync_jax.predictor import pieces
from qsync_jax.predictor import timing
from qsync_jax.task import calling
from qsync_jax.task import sharding
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import LossFn
from qsync_jax.task.objective import Objective

DEFAULT_PRECISIONS = (
  Precision.FP32,
  Precision.BF16,
  Precision.FP16,
  Precision.INT8,
)
#: The dtype activation operands arrive in when layers are profiled: NNX
#: layers promote their input to their float32 parameters' dtype.
PROFILED_INPUT_DTYPE = "float32"
#: Version of what a profile holds; a cached profile of another is measured
#: again (2: whole uniform passes, host sharing no longer per piece; 3: the
#: step's fixed part from the trainer's uniform-FP32 step; 4: the fixed part
#: and the host work a pass hides, fitted to the uniform steps).
PROFILE_FORMAT = 5
#: The name of the compute-free pass among a profile's uniform steps
#: (:func:`.calls.compute_free_step_calls`).
FREE = "compute-free"


@dataclasses.dataclass
class Profile:
  """Costs of a model's step pieces on one device kind.

  Attributes:
    device_kind: the kind the costs hold for.
    source: ``"measured"`` or ``"analytic"``.
    key: what the profile is valid for (model graph fingerprint, batch shape,
      jax version, ...).
    layers: ``{path: {precision: (forward_s, forward_and_backward_s)}}``,
      with operands arriving in :data:`PROFILED_INPUT_DTYPE`.
    rest: ``{dtype: (forward_s, forward_and_backward_s)}``: everything that
      is not a layer, when every layer emits ``dtype``.
    optimizer_s: one optimizer update of all parameters.
    casts: the cast model.
    memory: see :class:`qsync_jax.predictor.memory.MemoryModel`.
    host: for measured profiles of a host that carries workers:
      ``{"uniform_steps_s": {precision or FREE: {k: the trainer's step over
      k workers at that uniform precision, or with compute-free passes}},
      "compute_free_pass_s": {k: those passes alone}, "fixed_step_s": {k:
      ...}, "hidden_host_s": {k: ...}}`` (a step over k workers whose pass
      takes ``t`` costs ``max(t, hidden_host_s) + fixed_step_s``,
      :func:`fit_step_overhead`), and with several workers
      ``"allreduce": [alpha_s, seconds_per_byte]``.
    passes: for measured profiles, ``{precision: {k: seconds}}``: k copies
      of the model's whole gradient pass at that uniform precision, run at
      once on k of the host's devices (k = 1: one pass alone). The
      simulation scales the pieces to these uniform passes
      (:func:`.simulation.pass_factors`).
  """

  device_kind: str
  source: str
  key: dict[str, Any]
  layers: dict[str, dict[str, tuple[float, float]]]
  rest: dict[str, tuple[float, float]]
  optimizer_s: float
  casts: casting.CastModel
  memory: memory.MemoryModel
  host: dict[str, Any] = dataclasses.field(default_factory=dict)
  passes: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)

  @property
  def precisions(self) -> list[Precision]:
    """Every precision some layer was costed at."""
    present = {p for per in self.layers.values() for p in per}
    return [p for p in Precision if p.value in present]

  def layer_cost(self, path: str, precision: Precision) -> tuple[float, float]:
    """(forward_s, backward_s) of a layer at ``precision``.

    Raises:
      KeyError: the layer or the precision was not profiled.
    """
    try:
      per = self.layers[path]
    except KeyError:
      raise KeyError(
        f"layer {path!r} is not in the {self.device_kind} profile"
      ) from None
    if precision.value not in per:
      raise KeyError(
        f"the {self.device_kind} profile has no {precision.value} cost for "
        f"{path} (profiled: {', '.join(per)})"
      )
    f, fb = per[precision.value]
    return f, max(fb - f, 0.0)

  def to_dict(self) -> dict[str, Any]:
    return {
      "device_kind": self.device_kind,
      "source": self.source,
      "key": self.key,
      "layers": self.layers,
      "rest": self.rest,
      "optimizer_s": self.optimizer_s,
      "casts": self.casts.to_dict(),
      "memory": self.memory.to_dict(),
      "host": _host_to_json(self.host),
      "passes": _host_to_json(self.passes),
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Profile:
    host = _host_from_json(d.get("host") or {})
    return cls(
      device_kind=d["device_kind"],
      source=d["source"],
      key=dict(d["key"]),
      layers={
        p: {k: tuple(v) for k, v in per.items()}
        for p, per in d["layers"].items()
      },
      rest={k: tuple(v) for k, v in d["rest"].items()},
      optimizer_s=float(d["optimizer_s"]),
      casts=casting.CastModel.from_dict(d["casts"]),
      memory=memory.MemoryModel.from_dict(d["memory"]),
      host=host,
      passes=_host_from_json(d.get("passes") or {}),
    )

  def save(self, path: str) -> None:
    """Writes the profile to ``path`` as JSON, whole.

    Processes sharing a profile cache may save the same profile at once;
    each writes its own temporary file (:mod:`qsync_jax.files`).

    Raises:
      OSError: the file could not be written (naming it).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    files.write_json(path, self.to_dict(), indent=1)

  @classmethod
  def load(cls, path: str) -> Profile:
    with open(path) as f:
      return cls.from_dict(json.load(f))


def _map_counts(tree: Any, key: Callable[[Any], Any]) -> Any:
  """Maps the worker-count keys (the innermost dict keys) of a host tree."""
  if isinstance(tree, Mapping):
    inner = all(not isinstance(v, Mapping) for v in tree.values())
    return {
      (key(k) if inner else k): (float(v) if inner else _map_counts(v, key))
      for k, v in tree.items()
    }
  return tree


def _host_to_json(host: Mapping[str, Any]) -> dict[str, Any]:
  """JSON needs string keys: worker counts become strings."""
  return {
    k: _map_counts(v, str) if isinstance(v, Mapping) else v
    for k, v in host.items()
  }


def _host_from_json(host: Mapping[str, Any]) -> dict[str, Any]:
  return {
    k: _map_counts(v, int) if isinstance(v, Mapping) else v
    for k, v in host.items()
  }


def profile_key(
  g: graph_lib.ModelGraph,
  model_name: str,
  device_kind: str,
  precisions: Sequence[Precision],
  optimizer: str,
) -> dict:
  """What a cached profile must match."""
  return {
    "model": model_name,
    "graph": g.fingerprint(),
    "batch_shape": list(g.input_shape),
    "device_kind": device_kind,
    "precisions": [p.value for p in precisions],
    "optimizer": optimizer,
    "jax": jax.__version__,
    "format": PROFILE_FORMAT,
  }


def _cache_path(cache_dir: str, key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[
    :16
  ]
  return os.path.join(
    cache_dir, f"{key['model']}-{key['device_kind']}-{digest}.json"
  )


#: How much host memory a measured profile holds, in units of what its
#: buffers add up to (:func:`estimated_bytes`): XLA's temporaries while a
#: call runs, its compiled programs, and the blocks the host allocator keeps
#: for reuse (:mod:`qsync_jax.host_malloc`). Measured on XLA:CPU with two
#: host devices and three precisions: 2.7 for a CNN of 4M parameters, and
#: more than 2 for CNNs of 17M and 67M (the 67M one grew past 22 GB).
PROFILE_OVERHEAD = 3.0
# A timed burst's entry: a float in a list.
_TIMING_BYTES = 32


def estimated_bytes(
  g: graph_lib.ModelGraph,
  precisions: Sequence[Precision | str],
  host_devices: int = 0,
  repeats: int = 9,
  optimizer_state_copies: int = 2,
) -> float:
  """The host memory :func:`profile` takes on a CPU, from shapes alone.

  A profile builds every call it times before it times the first, each with
  its own buffers: every layer's operands, weight and cotangent per
  precision; the model's parameters and batch for the stand-in step at each
  output dtype, for the whole pass at each precision on each host device,
  and with the optimizer state for the update and (with host devices) the
  trainer's step at each precision and without compute; the pass's
  activations while it runs; and a timing per call and round. Their sum
  times :data:`PROFILE_OVERHEAD`.

  Args:
    g: the model's graph at the profiled batch.
    precisions: the precisions profiled (FP32 is added).
    host_devices: the host devices of co-located workers (0: none).
    repeats: the timed rounds.
    optimizer_state_copies: float32 copies of the parameters the optimizer
      keeps (2: Adam).

  Returns:
    Bytes.
  """
  parsed = {Precision.parse(p) for p in precisions} | {Precision.FP32}
  n = len(parsed)
  params = 4.0 * g.num_params
  batch = float(g.batch_bytes)
  state = params * (2 + optimizer_state_copies)
  unique = {pieces.piece_signature(node): node for node in g.nodes}.values()
  layers = n * sum(
    4.0 * (sum(op.numel for op in node.operands) + node.weight_numel)
    + 4.0 * node.out_numel
    for node in unique
  )
  activations = memory.analytic_memory_model(
    g, 0.0, optimizer_state_copies
  ).base_bytes - (state + batch)
  k = max(host_devices, 1)
  dtypes = len({graph_lib.output_dtype(p) for p in parsed})
  total = (
    params  # the model itself
    + layers
    + dtypes * (params + batch)  # the stand-in steps
    + n * k * (params + batch)  # the whole passes
    + state  # the optimizer update
    + (n + 1) * host_devices * (state + batch)  # the trainer's steps
    + k * max(activations, 0.0)  # k passes running at once
  )
  calls = 2 * len(unique) * n + 2 * dtypes + 1 + n * k * (n + 1)
  return PROFILE_OVERHEAD * total + repeats * calls * _TIMING_BYTES


def check_fits(
  g: graph_lib.ModelGraph,
  device: Any,
  device_kind: str,
  precisions: Sequence[Precision | str],
  host_devices: int = 0,
  repeats: int = 9,
  optimizer_state_copies: int = 2,
) -> None:
  """Refuses a profile on a CPU device that this host's memory cannot
  hold (:func:`estimated_bytes`); a GPU's own memory bounds a profile
  there.

  Raises:
    ValueError: naming the profile, its estimate and the host's memory.
  """
  if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
    raise ValueError(
      f"profile repeats must be an integer >= 1, got {repeats!r}"
    )
  if getattr(device, "platform", "cpu") != "cpu":
    return
  host_memory.check(
    f"a measured {device_kind} profile on {device} of the model at batch "
    f"{g.batch_size} ({g.num_params} "
    f"parameters, {len(g.nodes)} layers, {repeats} repeats)",
    estimated_bytes(
      g, precisions, host_devices, repeats, optimizer_state_copies
    ),
    f"every timed call's buffers at {len(precisions)} precision(s)"
    + (f" on {host_devices} host devices" if host_devices else ""),
  )


@sharding.without_mesh
def profile(
  model: nnx.Module,
  sample_batch: Any,
  *,
  device: jax.Device | None = None,
  device_kind: str = "cpu",
  precisions: Sequence[Precision | str] = DEFAULT_PRECISIONS,
  loss_fn: LossFn = None,
  call: calling.CallFn | None = None,
  tx: optax.GradientTransformation | None = None,
  optimizer_name: str = "adam",
  model_name: str | None = None,
  cache_dir: str | None = None,
  host_devices: Sequence[jax.Device] | None = None,
  quant: QuantConfig | None = None,
  repeats: int = 9,
  graph: graph_lib.ModelGraph | None = None,
) -> Profile:
  """Measures a model's profile on the device at hand.

  It runs on ``device`` alone, with no mesh of the caller's in context.

  Args:
    model: the NNX model (FP32 parameters; left unchanged, its mode
      included).
    sample_batch: one batch at the worker's batch size (any pytree the
      objective takes; ``(inputs, labels)`` for classification).
    device: the device to measure on (default: the first).
    device_kind: the kind this device stands for.
    precisions: precisions to profile each layer at (FP32 is always added).
    loss_fn: the training loss, in any form
      :func:`qsync_jax.task.as_objective` takes (default: classification).
    call: the call hook ``call(model, inputs, *, train, rngs)`` of the
      classification objectives.
    tx: the optimizer (default ``optax.adam(1e-3)``).
    optimizer_name: its name in the cache key.
    model_name: the model's name in the cache key (default: class name).
    cache_dir: if given, load the profile from / save it to this directory.
    host_devices: devices sharing this host for co-located workers: when
      given, the trainer's step at each uniform precision and with
      compute-free passes (:func:`.calls.uniform_step_calls`,
      :func:`.calls.compute_free_step_calls`: the step's fixed part and the
      host work a pass hides) is measured for each worker count
      (:func:`.calls.host_counts`); with more than one, host sharing and the
      host all-reduce too.
    quant: operand quantization of INT8 / FP8 layers.
    repeats: timed calls per measurement (at least).
    graph: the model's graph if already traced at this batch (default:
      traced through the objective's training step on ``sample_batch``).

  Returns:
    The :class:`Profile`.

  Raises:
    ValueError: the device kind lacks one of ``precisions``.
  """
  device = device or jax.devices()[0]
  parsed = [Precision.parse(p) for p in precisions]
  if Precision.FP32 not in parsed:
    parsed.insert(0, Precision.FP32)
  lacking = [
    p.value for p in parsed if p not in supported_precisions(device_kind)
  ]
  if lacking:
    raise ValueError(
      f"device kind {device_kind!r} does not support {', '.join(lacking)}"
    )
  tx = tx or optax.adam(1e-3)
  objective = as_objective(loss_fn, call=call)
  g = graph or graph_lib.trace_graph(
    model,
    objective.probe(calling.abstract(jax.tree.map(jnp.asarray, sample_batch))),
  )
  key = profile_key(
    g,
    model_name or type(model).__name__,
    device_kind,
    parsed,
    optimizer_name,
  )
  host_devices = list(host_devices or [])
  key["host_devices"] = len(host_devices)
  path = _cache_path(cache_dir, key) if cache_dir else None
  if path and os.path.exists(path):
    cached = Profile.load(path)
    if cached.key == key:
      return cached
  check_fits(g, device, device_kind, parsed, len(host_devices), repeats)

  job = profile_job(
    model,
    sample_batch,
    g,
    key,
    device=device,
    device_kind=device_kind,
    precisions=parsed,
    loss_fn=objective,
    tx=tx,
    host_devices=host_devices,
    quant=quant,
  )
  result = job.finish(
    timing.interleaved(job.calls, repeats, subtract_overhead=False)
  )
  if path:
    result.save(path)
  return result


@dataclasses.dataclass
class ProfileJob:
  """The timed calls of a profile, and how to turn their times into it.

  Run ``calls`` with :func:`qsync_jax.predictor.timing.interleaved`
  (``subtract_overhead=False``), possibly together with other calls (the
  predictor's accuracy check times its real steps in the same rounds, so
  both see the same machine load), then ``finish(times)``.
  """

  calls: dict[tuple, Callable[[], Any]]
  finish: Callable[[Mapping[tuple, float]], Profile]


def _timed_as(g: graph_lib.ModelGraph) -> dict[str, str]:
  """``{layer path: the path its pieces are timed under}``.

  Layers with equal pieces are timed once, under the first one's path:
  fewer timings, and fewer live executables (a process can map only so
  many; each piece is compiled once per host device).
  """
  first_of: dict[str, str] = {}
  return {
    node.path: first_of.setdefault(pieces.piece_signature(node), node.path)
    for node in g.nodes
  }


def _piece_calls(
  model: nnx.Module,
  sample_batch: Any,
  g: graph_lib.ModelGraph,
  loss_fn: Objective,
  timed_as: Mapping[str, str],
  dtypes: Sequence[str],
  device: jax.Device,
  precisions: Sequence[Precision],
  quant: QuantConfig | None,
) -> dict[tuple, Callable[[], Any]]:
  """The layers' calls at each precision and the rest's at each dtype."""
  calls: dict[tuple, Callable[[], Any]] = {}
  for node in g.nodes:
    if timed_as[node.path] != node.path:
      continue
    for p in precisions:
      if node.floored and p.bits < 16:
        continue
      f, fb = calls_lib.layer_calls(node, p, device, quant)
      calls[("layer", node.path, p.value, "f")] = f
      calls[("layer", node.path, p.value, "fb")] = fb
  for dt in dtypes:
    f, fb = calls_lib.rest_calls(model, g, sample_batch, loss_fn, dt, device)
    calls[("rest", dt, "f")] = f
    calls[("rest", dt, "fb")] = fb
  return calls


def _host_calls(
  model: nnx.Module,
  sample_batch: Any,
  g: graph_lib.ModelGraph,
  loss_fn: Objective,
  tx: optax.GradientTransformation,
  precisions: Sequence[Precision],
  quant: QuantConfig | None,
  host_devices: Sequence[jax.Device],
) -> dict[tuple, Callable[[], Any]]:
  """The host's calls: all-reduces, and the trainer's steps per count."""
  calls: dict[tuple, Callable[[], Any]] = {}
  if len(host_devices) > 1:
    for kn, c in calls_lib.allreduce_calls(host_devices).items():
      calls[("allreduce", *kn)] = c
  if not host_devices:
    return calls
  for p in precisions:
    for k, c in calls_lib.uniform_step_calls(
      model, tx, host_devices, sample_batch, g.sample, loss_fn, p, quant
    ).items():
      calls[("step", p.value, k)] = c
  free_steps, free_passes = calls_lib.compute_free_step_calls(
    model, tx, host_devices, sample_batch, g.sample, loss_fn
  )
  for k, c in free_steps.items():
    calls[("step", FREE, k)] = c
  for k, c in free_passes.items():
    calls[("pass", FREE, k)] = c
  return calls


def _piece_entry(t: Mapping[tuple, float], *key: str) -> tuple[float, float]:
  """A piece's entry in ``Profile.layers`` or ``Profile.rest``: its
  forward and its forward-and-backward time, the latter no less."""
  f = t[(*key, "f")]
  return f, max(t[(*key, "fb")], f)


def _host_times(
  raw: Mapping[tuple, float],
  t: Mapping[tuple, float],
  host_devices: Sequence[jax.Device],
  precisions: Sequence[Precision],
) -> dict[str, Any]:
  """A profile's ``host``: the steps' fitted fixed and hidden parts, and
  the host all-reduce (:func:`fit_step_overhead`, :func:`fit_allreduce`)."""
  host: dict[str, Any] = {}
  if host_devices:
    ks = calls_lib.host_counts(len(host_devices))
    names = [p.value for p in precisions]
    steps = {q: {k: raw[("step", q, k)] for k in ks} for q in [*names, FREE]}
    alone = {q: {k: t[("pass", q, k)] for k in ks} for q in [*names, FREE]}
    fits = {
      k: fit_step_overhead(
        [alone[q][k] for q in names],
        [steps[q][k] for q in names],
        max_hidden=steps[FREE][k],
      )
      for k in ks
    }
    host = {
      "uniform_steps_s": steps,
      "compute_free_pass_s": alone[FREE],
      "fixed_step_s": {k: f for k, (f, _) in fits.items()},
      "hidden_host_s": {k: h for k, (_, h) in fits.items()},
    }
  if len(host_devices) > 1:
    host["allreduce"] = list(
      fit_allreduce({k[1:]: v for k, v in t.items() if k[0] == "allreduce"})
    )
  return host


def profile_job(
  model: nnx.Module,
  sample_batch,
  g: graph_lib.ModelGraph,
  key: dict[str, Any],
  *,
  device: jax.Device,
  device_kind: str,
  precisions: Sequence[Precision],
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  host_devices: Sequence[jax.Device] = (),
  quant: QuantConfig | None = None,
  casts: casting.CastModel | None = None,
  memory_model: memory.MemoryModel | None = None,
) -> ProfileJob:
  """Builds the calls of :func:`profile` (see there); keys are tuples.

  ``loss_fn`` is any form :func:`qsync_jax.task.as_objective` takes and
  ``sample_batch`` any pytree it takes. ``casts`` and ``memory_model``, when
  given, are reused instead of fitted and compiled again (for several jobs
  on one model).
  """
  objective = as_objective(loss_fn)
  host_devices = list(host_devices)
  timed_as = _timed_as(g)
  dtypes = sorted({graph_lib.output_dtype(p) for p in precisions})
  calls = _piece_calls(
    model,
    sample_batch,
    g,
    objective,
    timed_as,
    dtypes,
    device,
    precisions,
    quant,
  )
  calls[("optimizer",)] = calls_lib.optimizer_call(model, tx, device)
  # The whole pass at each uniform precision, alone and (several workers on this
  # host) as k copies at once. Copies of one isolated piece overstate the
  # slowdown of sharing: in real steps the workers are at different pieces, and
  # one's serial stretch fills the cores another leaves idle.
  pass_devices = host_devices if len(host_devices) > 1 else [device]
  for p in precisions:
    for k, c in calls_lib.pass_concurrency_calls(
      model, g, sample_batch, objective, p, quant, pass_devices
    ).items():
      calls[("pass", p.value, k)] = c
  calls.update(
    _host_calls(
      model, sample_batch, g, objective, tx, precisions, quant, host_devices
    )
  )

  def finish(raw: Mapping[tuple, float]) -> Profile:
    over = timing.call_overhead(device)
    t = {
      k: max(raw[k] - over, 0.0)
      for k in calls
      if k[0] in ("layer", "rest", "optimizer", "allreduce", "pass")
    }
    layers = {
      node.path: {
        p.value: _piece_entry(t, "layer", timed_as[node.path], p.value)
        for p in precisions
        if not (node.floored and p.bits < 16)
      }
      for node in g.nodes
    }
    return Profile(
      device_kind,
      "measured",
      key,
      layers,
      {dt: _piece_entry(t, "rest", dt) for dt in dtypes},
      t[("optimizer",)],
      casts or casting.fit_cast_model(device),
      memory_model
      or memory.measure_memory_model(
        model, g, sample_batch, objective, tx, precisions, quant
      ),
      _host_times(raw, t, host_devices, precisions),
      {
        p.value: {
          k: t[("pass", p.value, k)]
          for k in calls_lib.host_counts(len(pass_devices))
        }
        for p in precisions
      },
    )

  return ProfileJob(calls, finish)


def fit_step_overhead(
  passes: Sequence[float],
  steps: Sequence[float],
  max_hidden: float | None = None,
) -> tuple[float, float]:
  """Fits ``step = fixed + max(pass, hidden)`` to uniform steps and passes.

  The trainer dispatches a worker's gradient pass and goes on with the host's
  work (stacking the gradients, preparing the update program's dispatch) while
  it runs; the update then waits for the pass. A pass shorter than that work
  (``hidden``) costs the step nothing more, and one longer adds its excess.
  ``fixed`` is what the step pays besides (dispatches, transfers, the update
  program). Least squares over the steps, both parts non-negative; where the
  data cannot tell a smaller ``hidden`` from a larger one (every pass longer
  than it), the smallest is kept, which is the model without hiding: one step
  and its pass give ``hidden = 0`` and ``fixed = step - pass``.

  Uniform passes alike in length cannot tell hidden host work from noise (the
  fit can price every plan alike), so ``max_hidden`` bounds it: the profile
  passes the trainer's step whose passes compute nothing
  (:func:`.calls.compute_free_step_calls`), since the host work a pass hides
  cannot outlast a whole step without compute. That step is a bound, not a point
  of the fit: the host work slows while a pass shares the cores with it, so the
  compute-free step can be shorter than ``hidden + fixed`` (fitted as a point,
  it would pull ``hidden`` too low and price the slower passes' steps slow).

  Args:
    passes: the whole gradient pass at each uniform precision (seconds).
    steps: the trainer's step at the same precisions (seconds).
    max_hidden: the most host work a pass can hide (seconds; default: no
      bound).

  Returns:
    ``(fixed_s, hidden_s)``.

  Raises:
    ValueError: no points, lengths that differ, or a negative
      ``max_hidden``.
  """
  p = np.asarray(passes, np.float64)
  s = np.asarray(steps, np.float64)
  if p.size == 0 or p.shape != s.shape:
    raise ValueError(
      f"fit_step_overhead needs as many steps as passes, at "
      f"least one; got {p.size} passes and {s.size} steps"
    )
  if max_hidden is not None and not max_hidden >= 0:
    raise ValueError(f"max_hidden must be non-negative, got {max_hidden}")
  # Beyond the longest pass every ``hidden`` fits alike (all steps are
  # ``fixed + hidden``), so the grid stops there or at the bound.
  top = (
    float(p.max())
    if max_hidden is None
    else min(float(p.max()), float(max_hidden))
  )
  # The error is piecewise quadratic in ``hidden`` with knees at the passes;
  # a fine grid with the knees on it finds its minimum within 0.1 % of the
  # longest pass. Errors equal to rounding tie, and np.argmin keeps the
  # smallest ``hidden`` of them.
  grid = np.unique(
    np.concatenate([[0.0], p[p <= top], np.linspace(0.0, top, 1001)])
  )
  above = np.maximum(p[None, :], grid[:, None])
  fixed = np.maximum((s[None, :] - above).mean(axis=1), 0.0)
  sse = ((s[None, :] - fixed[:, None] - above) ** 2).sum(axis=1)
  best = int(np.argmin(np.round(sse / max(float((s**2).sum()), 1e-30), 12)))
  return float(fixed[best]), float(grid[best])


def fit_allreduce(
  times: Mapping[tuple[int, int], float],
) -> tuple[float, float]:
  """Fits ``2 (k-1) alpha + 2 (k-1)/k bytes beta`` (non-negative) to
  ``{(k, float32 elements): seconds}``."""
  if not times:
    return 0.0, 0.0
  from scipy import optimize  # local: 0.4 s to import, needed only here

  keys = list(times)
  rows = [(2.0 * (k - 1), 2.0 * (k - 1) / k * 4 * n) for k, n in keys]
  (alpha, beta), _ = optimize.nnls(
    np.array(rows), np.array([times[k] for k in keys])
  )
  return float(alpha), float(beta)
