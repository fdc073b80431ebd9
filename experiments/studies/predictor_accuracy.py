"""Checks the predictor against real steps on the device at hand.

This module owns :func:`evaluate`, the library side of
``experiments/predictor_accuracy.py``: for each model and plan it profiles
the model's pieces (:func:`.profiling.profile_job`), predicts the step time of
:class:`qsync_jax.HybridTrainer` with one worker and with several workers on
fake devices of this host (:func:`.simulation.simulate`), and measures those
steps. Each phase (a worker count and a few plans) times its profile pieces
and its real steps in the same interleaved rounds
(:func:`.timing.interleaved`) so that both see the same machine load;
nothing of a real step's time enters a prediction. Memory is checked against
``memory_analysis`` of the compiled step (:func:`.memory.compiled_step_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import time
from typing import Any, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import progress
from qsync_jax import data as data_lib
from qsync_jax import models as models_lib
from qsync_jax import task
from qsync_jax.numerics.precision import Precision
from qsync_jax.plan import policy
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import analytic
from qsync_jax.predictor import casting
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory
from qsync_jax.predictor import profiling as profile_lib
from qsync_jax.predictor import simulation
from qsync_jax.predictor import timing
from qsync_jax.task import losses
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

#: Built-in models of the check, sized so a step takes tens of milliseconds
#: on a 2-core CPU.
DEFAULT_MODEL_KWARGS: dict[str, dict[str, Any]] = {
  "cnn": {
    "widths": (32, 64),
    "image_size": 16,
    "in_channels": 3,
    "hidden": 128,
  },
  "bert": {"num_layers": 2, "max_len": 64, "vocab_size": 512},
  "resnet18": {"width": 16, "image_size": 16},
}
DEFAULT_BATCH = {"cnn": 32, "bert": 16, "resnet18": 16}


#: The precisions of :func:`plans_for`'s uniform plans (named by value).
#: Their whole passes and, with the host's workers, their steps are part of
#: the profile (:func:`.simulation.pass_factors`,
#: :func:`.profiling.fit_step_overhead`), so the result also reports the
#: error over the mixed plans alone, which nothing of theirs was fitted on.
UNIFORM_PRECISIONS = (
  Precision.FP32,
  Precision.BF16,
  Precision.FP16,
  Precision.INT8,
)
UNIFORM_PLANS = tuple(p.value for p in UNIFORM_PRECISIONS)
#: The names of :func:`plans_for`'s mixed plans.
MIXED_PLANS = (
  "int8/fp16 alternating",
  "first half int8",
  "second half fp16",
  "random",
)


def plans_for(g: graph_lib.ModelGraph) -> dict[str, PrecisionPlan]:
  """The evaluated plans: four uniform ones and four mixed ones."""
  paths = [n.path for n in g.nodes if not n.floored]
  low = {
    p: Precision.INT8 if i % 2 == 0 else Precision.FP16
    for i, p in enumerate(paths)
  }
  half = len(paths) // 2
  rng = np.random.default_rng(0)
  choices = UNIFORM_PRECISIONS
  mixed = (
    PrecisionPlan.from_precisions(low),
    PrecisionPlan.from_precisions(
      {
        p: Precision.INT8 if i < half else Precision.FP32
        for i, p in enumerate(paths)
      }
    ),
    PrecisionPlan.from_precisions(
      {
        p: Precision.FP16 if i >= half else Precision.FP32
        for i, p in enumerate(paths)
      }
    ),
    PrecisionPlan.from_precisions(
      {p: choices[int(rng.integers(len(choices)))] for p in paths}
    ),
  )
  return {
    **{p.value: PrecisionPlan.uniform(p) for p in UNIFORM_PRECISIONS},
    **dict(zip(MIXED_PLANS, mixed, strict=True)),
  }


def sample_batch(model: nnx.Module, batch_size: int, seed: int = 0):
  """A random ``(x, y)`` batch the model accepts (shapes are what count)."""
  spec = model.input_spec(batch_size)
  rng = np.random.default_rng(seed)
  config = getattr(model, "config", None)
  if jnp.issubdtype(spec.dtype, jnp.floating):
    x = rng.standard_normal(spec.shape).astype(spec.dtype)
  else:
    vocab = getattr(config, "vocab_size", 2)
    x = rng.integers(0, vocab, spec.shape).astype(spec.dtype)
  if getattr(model, "task", "classification") == "lm":
    y = rng.integers(0, getattr(config, "vocab_size", 2), spec.shape).astype(
      np.int32
    )
  else:
    y = rng.integers(
      0, getattr(config, "num_classes", 2), (batch_size,)
    ).astype(np.int32)
  return x, y


def model_and_batch(
  spec: str,
  model_kwargs: Mapping[str, Any],
  batch_size: int,
  dataset: str | None = None,
  dataset_kwargs: Mapping[str, Any] | None = None,
  loss_fn: str | None = None,
) -> tuple[nnx.Module, tuple[Any, Any], Any, Any]:
  """A model of the check, a batch it trains on, its loss and trace input.

  Without ``dataset`` the model is built from ``model_kwargs`` alone and
  must have ``input_spec(batch_size)`` (the built-in models); the batch is
  random (:func:`sample_batch`). With ``dataset`` (a built-in name or
  ``package.module:factory``, as the main job takes it) the model is sized
  for the data as the main job sizes it, the batch is the first
  ``batch_size`` training examples, and the model is traced through the
  loss on that batch: a model written the usual way needs no special
  method.

  Args:
    spec: a built-in model name or ``package.module:factory``.
    model_kwargs: the model's keyword arguments (config overrides).
    batch_size: examples per worker.
    dataset: the data the model trains on (None: ``input_spec``).
    dataset_kwargs: the dataset's keyword arguments.
    loss_fn: ``package.module:fn``, the loss in any form
      :func:`qsync_jax.task.as_objective` takes (None: cross-entropy).

  Returns:
    ``(model, (x, y), loss, sample)``: ``sample`` is what the graph is
    traced on (the model's ``input_spec`` or the loss's probe).

  Raises:
    ValueError: without a dataset, a model that its kwargs alone do not
      build or that has no ``input_spec``; a bad spec; or a dataset with
      fewer training examples than ``batch_size``.
  """
  loss: Any = losses.cross_entropy
  if loss_fn:
    loss = task.as_objective(
      task.load_callable(loss_fn, "loss_fn", "expected 'package.module:fn'")
    )
  if dataset is None:
    factory = models_lib.load_model_factory(spec)
    try:
      model = factory(rngs=nnx.Rngs(0), **model_kwargs)
    except TypeError as err:  # it takes the data's facts (in_channels...)
      raise ValueError(
        f"model {spec!r} cannot be built from its model_kwargs alone "
        f"({err}): name the data it trains on (--datasets)"
      ) from None
    if not callable(getattr(model, "input_spec", None)):
      raise ValueError(
        f"model {spec!r} has no input_spec(batch_size): name the data it "
        "trains on (--datasets)"
      )
    batch = sample_batch(model, batch_size)
    return model, batch, loss, model.input_spec(batch_size)
  data = data_lib.examples_in_memory(
    data_lib.open_dataset(
      dataset, integer_labels=not loss_fn, **(dataset_kwargs or {})
    ),
    batch_size,
  )
  if len(data.x_train) < batch_size:
    raise ValueError(
      f"dataset {dataset!r} has {len(data.x_train)} training examples, "
      f"fewer than a batch of {batch_size}"
    )
  model = models_lib.build_model(
    spec,
    rngs=nnx.Rngs(0),
    data_kwargs=data.model_kwargs(),
    sample_input=data.x_train[:2],
    **model_kwargs,
  )
  batch = (data.x_train[:batch_size], data.y_train[:batch_size])
  sample = task.as_objective(loss).probe(task.abstract(batch))
  return model, batch, loss, sample


def _step_call(
  model, plan: PrecisionPlan, devices, batch, tx, loss, sample
) -> Callable[[], Any]:
  workers = [Worker(d, "cpu", plan, batch[0].shape[0]) for d in devices]
  if not isinstance(sample, task.Probe):  # the model's inputs alone
    sample = task.input_probe(sample)
  trainer = HybridTrainer(model, workers, tx, objective=loss, sample=sample)
  batches = {
    i: (jax.device_put(batch[0], w.device), jax.device_put(batch[1], w.device))
    for i, w in enumerate(workers)
  }
  state = [trainer.init()]

  def step():
    state[0], _ = trainer.train_step(state[0], batches)
    return state[0].params

  return step


def evaluate(
  models: Sequence[str],
  *,
  model_kwargs: Mapping[str, Mapping] | None = None,
  batch_sizes: Mapping[str, int] | None = None,
  datasets: Mapping[str, str] | None = None,
  dataset_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
  loss_fns: Mapping[str, str] | None = None,
  workers: Sequence[int] = (1, 4),
  rounds: int = 15,
  burst: int = 5,
  precisions: Sequence[str] = ("fp32", "bf16", "fp16", "int8"),
  plan_names: Sequence[str] | None = None,
  plans_per_phase: int = 4,
  log: Callable[[str], None] = print,
) -> dict[str, Any]:
  """Predicted against measured step time and memory.

  Each model is checked in phases: one per worker count and group of at
  most ``plans_per_phase`` plans. A phase profiles the model's pieces (with
  host sharing up to that worker count) and times them in the same
  interleaved rounds as its real steps, then frees them all. Phases bound
  how many executables are alive at once: a trainer step compiles one
  program per worker, and XLA:CPU maps thousands of memory regions per
  ResNet-18 step over four workers, against a per-process limit
  (``vm.max_map_count``, often 65530).

  Args:
    models: built-in model names or ``package.module:factory`` specs.
    model_kwargs: config overrides per model spec (default
      :data:`DEFAULT_MODEL_KWARGS` for built-in names).
    batch_sizes: batch per worker per model spec (default 32, or
      :data:`DEFAULT_BATCH`).
    datasets: the data per model spec (a built-in name or
      ``package.module:factory``): the model is sized for it and traced on
      its examples (:func:`model_and_batch`); a model not named here needs
      ``input_spec``.
    dataset_kwargs: the dataset's keyword arguments per model spec.
    loss_fns: ``package.module:fn`` per model spec, the loss its profile,
      memory and real steps use (default cross-entropy).
    workers: worker counts to check (fake devices of this host).
    rounds: interleaved timing rounds.
    burst: calls per burst (the fastest counts).
    precisions: precisions to profile.
    plan_names: a subset of :func:`plans_for`'s plans (default: all).
    plans_per_phase: real steps timed alongside one profile.
    log: progress messages.

  Returns:
    ``{"cases": [{"model", "plan", "workers", "predicted_s", "measured_s",
    "rel_error", "predicted_memory_bytes", "measured_memory_bytes",
    "memory_rel_error", "uniform", "fitted", "steal_fraction"}],
    "mean_abs_rel_error", "max_abs_rel_error", "unfitted_mean_abs_rel_error",
    "unfitted_max_abs_rel_error" (without the uniform plans of profiled
    precisions, whose steps the profile times for the step's fixed part and
    the host work a pass hides: the mixed plans alone),
    "max_abs_memory_rel_error", "simulate_ms",
    "steal_fraction", "profiles": {model: {workers: the profile of that
    worker count's first phase}}, "device", "jax"}``; ``steal_fraction`` is
    the share of the CPUs' time the hypervisor stole while timing (bursts
    that lost more than 5 % were run again, :func:`.timing.interleaved`).

  Raises:
    ValueError: no model or no worker count, more workers than local
      devices, a bad model spec, a model without ``input_spec`` and no
      dataset, an entry of ``datasets``, ``dataset_kwargs`` or ``loss_fns``
      for a model not checked, an unknown plan name or
      ``plans_per_phase < 1``.
  """
  devices = jax.local_devices()
  _check_arguments(
    models,
    workers,
    len(devices),
    plans_per_phase,
    datasets,
    dataset_kwargs,
    loss_fns,
  )
  datasets, dataset_kwargs = dict(datasets or {}), dict(dataset_kwargs or {})
  loss_fns = dict(loss_fns or {})
  kwargs_of = dict(DEFAULT_MODEL_KWARGS)
  kwargs_of.update(model_kwargs or {})
  batch_of = dict(DEFAULT_BATCH)
  batch_of.update(batch_sizes or {})
  parsed = [Precision.parse(p) for p in precisions]
  num_plans = len(
    dict.fromkeys(
      plan_names if plan_names is not None else UNIFORM_PLANS + MIXED_PLANS
    )
  )
  phases = progress.Progress(
    len(models) * len(workers) * -(-num_plans // plans_per_phase), log
  )
  tally = _Tally()
  casts = casting.fit_cast_model(devices[0])  # the device's, not a model's
  timing_args = _Timing(rounds, burst, casts, phases, log)
  for spec in models:
    checked = _prepare_model(
      spec,
      model_and_batch(
        spec,
        kwargs_of.get(spec, {}),
        batch_of.get(spec, 32),
        datasets.get(spec),
        dataset_kwargs.get(spec),
        loss_fns.get(spec),
      ),
      parsed,
      plan_names,
    )
    log(
      f"{spec}: {len(checked.graph.nodes)} layers, "
      f"{checked.graph.num_params} parameters"
    )
    model_cases: list[dict[str, Any]] = []
    for n in workers:
      for first in range(0, len(checked.names), plans_per_phase):
        group = checked.names[first : first + plans_per_phase]
        model_cases += _phase(checked, devices[:n], group, timing_args, tally)
        phases.done(
          f"predictor {spec} x{n} plans {first + 1}-"
          f"{first + len(group)} of {len(checked.names)}"
        )
    names = checked.names
    tally.cases += sorted(
      model_cases, key=lambda c: (names.index(c["plan"]), c["workers"])
    )
  return _totals(tally, rounds, burst, devices[0])


def _check_arguments(
  models: Sequence[str],
  workers: Sequence[int],
  num_devices: int,
  plans_per_phase: int,
  datasets: Mapping[str, Any] | None,
  dataset_kwargs: Mapping[str, Any] | None,
  loss_fns: Mapping[str, Any] | None,
) -> None:
  """Raises the ValueError of :func:`evaluate` for its arguments."""
  if not models or not workers:
    raise ValueError(
      f"give at least one model and one worker count, got "
      f"models {list(models)} and workers {list(workers)}"
    )
  if max(workers) > num_devices:
    raise ValueError(
      f"{max(workers)} workers need as many devices, this host has "
      f"{num_devices} (set jax_num_cpu_devices)"
    )
  if plans_per_phase < 1:
    raise ValueError(
      f"plans_per_phase must be at least 1, got {plans_per_phase}"
    )
  for what, given in (
    ("datasets", datasets or {}),
    ("dataset_kwargs", dataset_kwargs or {}),
    ("loss_fns", loss_fns or {}),
  ):
    unknown = sorted(set(given) - set(models))
    if unknown:
      raise ValueError(
        f"{what} names model(s) {unknown} that are not checked; models: "
        f"{list(models)}"
      )


class _Checked(NamedTuple):
  """One model as :func:`evaluate` checks it: its pieces, plans and their
  measured memory."""

  spec: str
  model: Any
  batch: Any
  loss: Any
  sample: Any
  graph: Any
  key: str
  plans: dict[str, PrecisionPlan]
  names: list[str]
  effective: dict[str, Any]
  measured_mem: dict[str, float]
  memory_model: Any
  precisions: list[Precision]


def _prepare_model(
  spec: str,
  built: tuple[Any, Any, Any, Any],
  precisions: list[Precision],
  plan_names: Sequence[str] | None,
) -> _Checked:
  """The model's graph, plans, effective precisions and compiled memory."""
  model, batch, loss, sample = built
  tx = optax.adam(1e-3)
  g = graph_lib.trace_graph(model, sample)
  key = profile_lib.profile_key(g, spec, "cpu", precisions, "adam")
  plans = plans_for(g)
  if plan_names is not None:
    unknown = [p for p in plan_names if p not in plans]
    if unknown:
      raise ValueError(f"unknown plan(s) {unknown}; plans: {list(plans)}")
    plans = {p: plans[p] for p in plan_names}
  floored = {n.path for n in g.nodes if n.floored}
  effective = {
    name: policy.resolve_with_forced(g.paths, floored, plan)
    for name, plan in plans.items()
  }
  measured_mem = {
    name: memory.compiled_step_bytes(model, eff, batch, loss, tx)
    for name, eff in effective.items()
  }
  memory_model = memory.measure_memory_model(
    model, g, batch, loss, tx, precisions
  )
  return _Checked(
    spec,
    model,
    batch,
    loss,
    sample,
    g,
    key,
    plans,
    list(plans),
    effective,
    measured_mem,
    memory_model,
    precisions,
  )


class _Timing(NamedTuple):
  """How a phase times its calls, and where it reports."""

  rounds: int
  burst: int
  casts: Any
  phases: Any
  log: Callable[[str], None]


@dataclasses.dataclass
class _Tally:
  """What the phases have found so far."""

  cases: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  profiles: dict[str, Any] = dataclasses.field(default_factory=dict)
  sim_ms: list[float] = dataclasses.field(default_factory=list)
  steal: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _phase(
  m: _Checked,
  devices: Sequence[jax.Device],
  group: Sequence[str],
  t: _Timing,
  tally: _Tally,
) -> list[dict[str, Any]]:
  """One phase: a profile over ``devices`` timed with the real steps of the
  plans in ``group``, in the same interleaved rounds; their cases."""
  n = len(devices)
  tx = optax.adam(1e-3)
  jax.clear_caches()  # free the previous phase's executables
  job = profile_lib.profile_job(
    m.model,
    m.batch,
    m.graph,
    m.key,
    device=devices[0],
    device_kind="cpu",
    precisions=m.precisions,
    loss_fn=m.loss,
    tx=tx,
    host_devices=devices,
    casts=t.casts,
    memory_model=m.memory_model,
  )
  steps = {
    ("step", name): _step_call(
      m.model, m.plans[name], devices, m.batch, tx, m.loss, m.sample
    )
    for name in group
  }
  start = time.perf_counter()
  meter = timing.StealMeter()
  raw = timing.interleaved(
    {**job.calls, **steps},
    t.rounds,
    subtract_overhead=False,
    burst=t.burst,
    meter=meter,
  )
  steal = meter.overall_fraction
  tally.steal.append((meter.total_stolen, meter.total_ticks))
  prof = job.finish(raw)
  tally.profiles.setdefault(m.spec, {}).setdefault(str(n), prof.to_dict())
  t.log(
    f"{m.spec} x{n}: timed {len(job.calls)} profile pieces and "
    f"{len(steps)} steps in {t.rounds} rounds, "
    f"{time.perf_counter() - start:.0f} s, {steal:.1%} of the CPU "
    "stolen by the hypervisor"
  )
  del job, steps
  return [
    _case(m, name, n, prof, raw[("step", name)], steal, tally, t.log)
    for name in group
  ]


def _case(
  m: _Checked,
  name: str,
  n: int,
  prof: Any,
  measured: float,
  steal: float,
  tally: _Tally,
  log: Callable[[str], None],
) -> dict[str, Any]:
  """Plan ``name`` on ``n`` workers: predicted against measured."""
  sim_workers = [
    simulation.SimWorker(f"cpu[{i}]", prof, m.effective[name]) for i in range(n)
  ]
  t0 = time.perf_counter()
  pred = simulation.simulate(
    m.graph, sim_workers, bucket_bytes=None, shared_host=True
  )
  tally.sim_ms.append((time.perf_counter() - t0) * 1e3)
  pm = pred.worker_memory_bytes[0]
  mm = m.measured_mem[name]
  case = {
    "model": m.spec,
    "plan": name,
    "workers": n,
    "predicted_s": pred.step_time_s,
    "measured_s": measured,
    "rel_error": (pred.step_time_s - measured) / measured,
    "predicted_memory_bytes": pm,
    "measured_memory_bytes": mm,
    "memory_rel_error": (pm - mm) / mm,
    "uniform": name in UNIFORM_PLANS,
    # The profile times this step whole (its fixed part).
    "fitted": name in {p.value for p in m.precisions},
    "steal_fraction": steal,
  }
  log(
    f"  {name:<22} x{n}: predicted "
    f"{pred.step_time_s * 1e3:8.2f} ms  measured "
    f"{measured * 1e3:8.2f} ms  error {case['rel_error']:+.3f}  "
    f"memory error {case['memory_rel_error']:+.3f}"
  )
  return case


def _totals(
  tally: _Tally, rounds: int, burst: int, device: jax.Device
) -> dict[str, Any]:
  """:func:`evaluate`'s result from the cases found."""
  cases = tally.cases
  errors = np.abs([c["rel_error"] for c in cases])
  unfitted = np.abs([c["rel_error"] for c in cases if not c["fitted"]])
  return {
    "cases": cases,
    "mean_abs_rel_error": float(errors.mean()),
    "max_abs_rel_error": float(errors.max()),
    "unfitted_mean_abs_rel_error": (
      float(unfitted.mean()) if unfitted.size else None
    ),
    "unfitted_max_abs_rel_error": (
      float(unfitted.max()) if unfitted.size else None
    ),
    "max_abs_memory_rel_error": float(
      np.max(np.abs([c["memory_rel_error"] for c in cases]))
    ),
    "simulate_ms": float(np.median(tally.sim_ms)),
    "steal_fraction": (
      sum(a for a, _ in tally.steal) / max(sum(b for _, b in tally.steal), 1)
    ),
    "rounds": rounds,
    "burst": burst,
    "profiles": tally.profiles,
    "device": str(device.device_kind),
    "jax": jax.__version__,
  }


def plot(result: Mapping[str, Any], path: str) -> None:
  """Writes the predicted-vs-measured scatter to ``path`` (PNG)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5.5, 5))
  markers = {1: "o", 2: "s", 4: "^", 8: "D"}
  for model in sorted({c["model"] for c in result["cases"]}):
    for n in sorted({c["workers"] for c in result["cases"]}):
      sel = [
        c for c in result["cases"] if c["model"] == model and c["workers"] == n
      ]
      if sel:
        ax.scatter(
          [c["measured_s"] * 1e3 for c in sel],
          [c["predicted_s"] * 1e3 for c in sel],
          marker=markers.get(n, "x"),
          label=f"{model} x{n}",
        )
  lim = [
    0,
    max(max(c["measured_s"], c["predicted_s"]) for c in result["cases"])
    * 1.1e3,
  ]
  ax.plot(lim, lim, "k-", lw=0.8)
  ax.plot(lim, [v * 1.1 for v in lim], "k:", lw=0.6)
  ax.plot(lim, [v * 0.9 for v in lim], "k:", lw=0.6)
  ax.set_xlabel("measured step (ms)")
  ax.set_ylabel("predicted step (ms)")
  ax.set_title(
    f"mean |error| {result['mean_abs_rel_error']:.3f}, "
    f"max {result['max_abs_rel_error']:.3f}"
  )
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


#: ImageNet-size configs for the simulation-speed check.
PAPER_SIZE_KWARGS = models_lib.PAPER_SIZE_KWARGS


def simulation_speed(
  model_name: str = "resnet50",
  batch_size: int = 32,
  cluster: str = "v100:8,t4:8",
  calls: int = 200,
) -> dict[str, Any]:
  """Milliseconds to simulate one plan of a paper-size model.

  Traces the model once, derives analytic profiles for the cluster's kinds
  and times :func:`.simulation.simulate` on fresh mixed plans (the allocator's
  inner loop): the median over ``calls``.
  """
  model = models_lib.create_model(
    model_name, rngs=nnx.Rngs(0), **PAPER_SIZE_KWARGS.get(model_name, {})
  )
  g = graph_lib.trace_graph(model, model.input_spec(batch_size))
  spec = simulation.parse_cluster(cluster)
  profiles = {k: analytic.analytic_profile(g, k) for k in spec.groups()}
  rng = np.random.default_rng(0)
  times = []
  for _ in range(calls):
    workers = []
    for kind, count in spec.groups().items():
      allowed = [
        p
        for p in profiles[kind].precisions
        if p in (Precision.FP32, Precision.FP16, Precision.INT8)
      ]
      eff = {
        n.path: (
          allowed[int(rng.integers(len(allowed)))]
          if not n.floored
          else Precision.FP16
        )
        for n in g.nodes
      }
      workers += [
        simulation.SimWorker(f"{kind}[{i}]", profiles[kind], eff)
        for i in range(count)
      ]
    start = time.perf_counter()
    simulation.simulate(g, workers)
    times.append(time.perf_counter() - start)
  return {
    "model": model_name,
    "layers": len(g.nodes),
    "parameters": g.num_params,
    "cluster": cluster,
    "simulate_ms": float(np.median(times) * 1e3),
  }
