"""Tests of the allocator on hand-made graphs and profiles (and one model)."""

import itertools
import json
import os

import binaries
from flax import nnx
import numpy as np
import pytest

import qsync_jax as qs
from qsync_jax import allocation
from qsync_jax import models
from qsync_jax import predictor
from qsync_jax.allocation import search
from qsync_jax.numerics.precision import Precision
from qsync_jax.predictor import casting
from qsync_jax.predictor import graph as graph_lib
from qsync_jax.predictor import memory
from qsync_jax.predictor import profiling
from qsync_jax.predictor import simulation

FP32, FP16, INT8 = Precision.FP32, Precision.FP16, Precision.INT8
NO_LINK = (0.0, 0.0)


def _chain(n: int, follows: bool = False) -> graph_lib.ModelGraph:
  """n Linear layers in a row; with ``follows`` each input keeps the dtype
  its producer emits (so a precision change between them costs a cast)."""
  nodes = [
    graph_lib.LayerNode(
      path=f"l{i}",
      kind="Linear",
      operands=(
        graph_lib.Operand((64, 16), (i - 1,), follows and i > 0, i > 0),
      ),
      weight_shape=(16, 16),
      out_shape=(64, 16),
      flops=1.0,
      floored=False,
    )
    for i in range(n)
  ]
  return graph_lib.ModelGraph(tuple(nodes), n * 256, (64, 16))


def _profile(g, costs, kind="t4", cast_s=0.0, base_bytes=1000.0):
  """costs: {precision name: [forward+backward seconds per layer]}."""
  layers = {
    n.path: {p: (c[i] / 3, c[i]) for p, c in costs.items()}
    for i, n in enumerate(g.nodes)
  }
  casts = casting.CastModel(
    {f"{s}->{d}": (0.0, cast_s) for s, d in casting.cast_pairs()}
  )
  mem = memory.MemoryModel(base_bytes, memory.analytic_deltas(g))
  return profiling.Profile(
    kind,
    "analytic",
    {},
    layers,
    {"float32": (0.0, 0.0), "float16": (0.0, 0.0)},
    0.0,
    casts,
    mem,
  )


def _scores(g, int8, fp16):
  return {
    n.path: {"int8": float(int8[i]), "fp16": float(fp16[i])}
    for i, n in enumerate(g.nodes)
  }


def _step(g, profs, precisions, cluster="v100:1,t4:1"):
  return predictor.predict(
    g,
    cluster,
    {k: qs.PrecisionPlan.from_precisions(p) for k, p in precisions.items()},
    profs,
    bucket_bytes=None,
    link=NO_LINK,
  ).step_time_s


@pytest.mark.parametrize("seed", range(6))
def test_plans_keep_the_memory_limit_and_the_step_time_target(seed):
  rng = np.random.default_rng(seed)
  n = 7
  g = _chain(n)
  v100 = _profile(
    g,
    {"fp32": rng.uniform(0.8, 1.2, n), "fp16": rng.uniform(0.4, 0.6, n)},
    kind="v100",
  )
  t4 = _profile(
    g,
    {
      "fp32": rng.uniform(1.5, 2.5, n),
      "fp16": rng.uniform(0.6, 1.0, n),
      "int8": rng.uniform(0.3, 0.6, n),
    },
  )
  profs = {"v100": v100, "t4": t4}
  scores = _scores(g, rng.uniform(1, 2, n), rng.uniform(0, 1, n))
  fp32_bytes = search.plan_memory(g, t4, [FP32] * n)
  low_bytes = search.plan_memory(g, t4, [INT8] * (n - 1) + [FP32])
  limit = low_bytes + rng.uniform(0.2, 0.8) * (fp32_bytes - low_bytes)
  a = qs.allocate(
    g,
    "v100:1,t4:1",
    scores,
    profs,
    bucket_bytes=None,
    link=NO_LINK,
    memory_limits={"t4": limit},
  )
  assert a.training_kinds == ("v100",)
  assert set(a) == {"v100", "t4"}
  assert all(p is FP32 for p in a.precisions["v100"].values())
  assert a.memory_bytes["t4"] <= limit
  ideal = sum(v100.layers[p]["fp32"][1] for p in g.paths)
  assert a.target_s == pytest.approx(ideal)
  assert a.training_pace_s == pytest.approx(ideal)
  assert not a.straggling
  assert a.prediction.step_time_s <= a.target_s * (1 + 1e-9)
  # The plans round-trip through the predictor's plan resolution.
  assert _step(g, profs, a.precisions) == pytest.approx(
    a.prediction.step_time_s
  )
  # Nothing more can be recovered: every single further step breaks a
  # constraint.
  for _i, path in enumerate(g.paths):
    cur = a.precisions["t4"][path]
    if cur is FP32:
      continue
    nxt = FP16 if cur is INT8 else FP32
    trial = dict(a.precisions["t4"], **{path: nxt})
    over_memory = search.plan_memory(g, t4, list(trial.values())) > limit
    over_time = _step(g, profs, {"t4": trial}) > a.target_s * (1 + 1e-9)
    assert over_memory or over_time, path


def test_greedy_recovers_the_most_sensitive_layers_first():
  n = 6
  g = _chain(n)
  v100 = _profile(g, {"fp32": [1.0] * n}, kind="v100")
  # On the T4 FP32 costs 1.5 and FP16 0.5 per layer: with a 6 s target,
  # exactly three layers can be FP32 (3 * 1.5 + 3 * 0.5 = 6), and the head
  # (l5) always is.
  t4 = _profile(g, {"fp32": [1.5] * n, "fp16": [0.5] * n})
  fp16_scores = [0.1, 5.0, 0.3, 4.0, 0.2, 3.0]
  a = qs.allocate(
    g,
    "v100:1,t4:1",
    _scores(g, [9] * n, fp16_scores),
    {"v100": v100, "t4": t4},
    bucket_bytes=None,
    link=NO_LINK,
    candidates=("fp16", "fp32"),
  )
  recovered = [p for p, v in a.precisions["t4"].items() if v is FP32]
  assert recovered == ["l1", "l3", "l5"]
  assert a.quantized_layers == {"v100": 0, "t4": 3}
  assert a.indicator_sum["t4"] == pytest.approx(0.1 + 0.3 + 0.2)
  # A shuffled indicator recovers the layers its permutation favours.
  shuffled = allocation.shuffled_scores(_scores(g, [9] * n, fp16_scores), 3)
  assert sorted(v["fp16"] for v in shuffled.values()) == sorted(fp16_scores)


def test_the_intended_gain_steps_int8_layers_by_what_they_remove():
  g = _chain(3)
  v100 = _profile(g, {"fp32": [1.0] * 3}, kind="v100")
  # The head l2 stays FP32 (1 s), which leaves 2 s for l0 and l1: room for
  # one INT8 -> FP16 step only.
  t4 = _profile(
    g, {"fp32": [5.0, 5.0, 1.0], "fp16": [1.2] * 3, "int8": [0.5] * 3}
  )
  # l0 has the larger INT8 score but also a large FP16 one: moving it up
  # removes 10 - 9 = 1; moving l1 up removes 6 - 0 = 6.
  scores = _scores(g, [10.0, 6.0, 1.0], [9.0, 0.0, 1.0])
  a = qs.allocate(
    g,
    "v100:1,t4:1",
    scores,
    {"v100": v100, "t4": t4},
    bucket_bytes=None,
    link=NO_LINK,
  )
  assert a.precisions["t4"] == {"l0": INT8, "l1": FP16, "l2": FP32}


def test_infeasible_memory_limit_names_the_smallest_memory():
  g = _chain(4)
  v100 = _profile(g, {"fp32": [1.0] * 4}, kind="v100")
  t4 = _profile(g, {"fp32": [2.0] * 4, "fp16": [1.0] * 4, "int8": [0.5] * 4})
  smallest = search.plan_memory(g, t4, [INT8] * 3 + [FP32])
  for method in allocation.METHODS:
    with pytest.raises(allocation.AllocationError) as err:
      qs.allocate(
        g,
        "v100:1,t4:1",
        _scores(g, [1] * 4, [0.5] * 4),
        {"v100": v100, "t4": t4},
        method=method,
        memory_limits={"t4": smallest - 1.0},
      )
    assert f"{smallest:.0f} bytes" in str(err.value)
    assert "t4" in str(err.value)


def test_ilp_is_the_least_indicator_plan_under_the_budget():
  rng = np.random.default_rng(0)
  n = 6
  g = _chain(n)
  t4 = _profile(
    g, {"fp32": [2.0] * n, "fp16": [1.0] * n, "int8": [1.0] * n}, base_bytes=1e6
  )
  scores = _scores(g, rng.uniform(1, 3, n), rng.uniform(0, 1, n))

  def brute(ladder, limit):
    return list(
      min(
        (
          p
          for p in itertools.product(*ladder)
          if search.plan_memory(g, t4, p) <= limit
        ),
        key=lambda p: sum(
          search.indicator_of(scores, g.paths[i], v) for i, v in enumerate(p)
        ),
      )
    )

  ladder = [[INT8, FP16]] * n
  limit = search.compression_budget(g, t4, 0.6)
  got = search.min_indicator_plan(g, t4, ladder, scores, limit)
  assert got == brute(ladder, limit)
  assert INT8 in got and FP16 in got  # the budget forces a real mix
  # Through allocate, 8/16-bit candidates leave only the head in FP32.
  v100 = _profile(g, {"fp32": [1.0] * n}, kind="v100")
  limit = search.compression_budget(g, t4, 0.5)
  a = qs.allocate(
    g,
    "v100:1,t4:1",
    scores,
    {"v100": v100, "t4": t4},
    method="ilp",
    candidates=("int8", "fp16"),
    memory_limits={"t4": limit},
  )
  assert list(a.precisions["t4"].values()) == brute(
    [[INT8, FP16]] * (n - 1) + [[FP32]], limit
  )
  assert a.precisions["t4"]["l5"] is FP32
  assert a.memory_bytes["t4"] <= limit


def test_memory_variant_lowers_least_indicator_per_byte_first():
  g = _chain(4)
  t4 = _profile(g, {"fp32": [1.0] * 4, "fp16": [1.0] * 4})
  ladder = [[FP16, FP32]] * 4
  scores = _scores(g, [9] * 4, [0.4, 0.1, 0.3, 0.2])
  one_layer = search.plan_memory(g, t4, [FP32] * 4) - search.plan_memory(
    g, t4, [FP16] + [FP32] * 3
  )
  limit = search.plan_memory(g, t4, [FP32] * 4) - 1.5 * one_layer
  precs, steps = search.lower_to_fit(g, t4, ladder, scores, limit)
  assert steps == 2
  assert precs == [FP32, FP16, FP32, FP16]
  assert search.plan_memory(g, t4, precs) <= limit


def test_fastest_plan_accounts_for_casts_between_layers():
  g = _chain(3, follows=True)
  assert search.cast_groups(g) == [[0, 1, 2]]
  # FP16 is a little faster per layer, but a cast between FP16 and FP32
  # neighbours costs more than that: the fastest plan is uniform.
  t4 = _profile(
    g, {"fp32": [1.0, 1.0, 1.0], "fp16": [0.9, 0.9, 2.0]}, cast_s=0.3
  )
  ladder = [[FP16, FP32]] * 3
  got = search.fastest_plan(g, t4, ladder)

  def time_of(precs):
    c = simulation.worker_costs(g, t4, list(precs))
    return c.fwd.sum() + c.bwd.sum()

  best = min(itertools.product(*ladder), key=time_of)
  assert got == list(best)
  assert time_of(got) < time_of([FP16, FP16, FP32])


def test_straggling_weak_devices_keep_their_fastest_plan():
  g = _chain(3)
  v100 = _profile(g, {"fp32": [1.0] * 3}, kind="v100")
  t4 = _profile(g, {"fp32": [4.0] * 3, "fp16": [2.0] * 3})
  a = qs.allocate(
    g,
    "v100:1,t4:1",
    _scores(g, [1] * 3, [1] * 3),
    {"v100": v100, "t4": t4},
    bucket_bytes=None,
    link=NO_LINK,
  )
  assert a.straggling
  assert a.target_s == pytest.approx(2.0 + 2.0 + 4.0)  # head in FP32
  assert a.training_pace_s == pytest.approx(3.0)
  assert list(a.precisions["t4"].values()) == [FP16, FP16, FP32]


def test_bad_inputs_are_clear_errors():
  g = _chain(2)
  profs = {
    "v100": _profile(g, {"fp32": [1, 1]}, kind="v100"),
    "t4": _profile(g, {"fp32": [2, 2], "fp16": [1, 1]}),
  }
  scores = _scores(g, [1, 1], [1, 1])
  with pytest.raises(ValueError, match="unknown allocation method"):
    qs.allocate(g, "v100:1,t4:1", scores, profs, method="magic")
  with pytest.raises(allocation.AllocationError, match="no entry for layer"):
    qs.allocate(g, "v100:1,t4:1", {"l0": scores["l0"]}, profs)
  with pytest.raises(ValueError, match="no profile"):
    qs.allocate(g, "v100:1,a10:1", scores, profs)
  with pytest.raises(ValueError, match="memory limits for a100"):
    qs.allocate(g, "v100:1,t4:1", scores, profs, memory_limits={"a100": 1})
  with pytest.raises(allocation.AllocationError, match="needs a memory limit"):
    qs.allocate(g, "v100:1,t4:1", scores, profs, method="ilp")


def test_allocation_on_a_model_applies_and_beats_the_baselines():
  model = models.create_model(
    "resnet18", rngs=nnx.Rngs(0), width=8, image_size=32
  )
  g = predictor.trace_graph(model, model.input_spec(256))
  profs = {k: predictor.analytic_profile(g, k) for k in ("v100", "t4")}
  rng = np.random.default_rng(0)
  scores = {
    p: {"int8": float(rng.uniform(1, 2)), "fp16": float(rng.uniform(0, 1))}
    for p in g.paths
  }
  a = qs.allocate(g, "v100:2,t4:2", scores, profs)
  assert a.search_time_s < 10
  qs.apply_plan(model, a["t4"], device_kind="t4")  # a valid plan for a T4
  fp32 = predictor.predict(g, "v100:2,t4:2", {}, profs).step_time_s
  low = predictor.predict(
    g,
    "v100:2,t4:2",
    allocation.uniform_low_plans("v100:2,t4:2", a.training_kinds),
    profs,
  )
  assert a.prediction.step_time_s <= fp32
  # QSync quantizes no more layers than the uniform baseline.
  assert a.quantized_layers["t4"] <= len(g.paths) - 1
  assert a.indicator_sum["t4"] <= sum(
    search.indicator_of(scores, p, v)
    for p, v in predictor.resolve_plan(
      g, allocation.uniform_low_plans("v100:2,t4:2", ["v100"])["t4"]
    ).items()
  )
  assert low.step_time_s > 0
  sizes = allocation.dynamic_batch_split(g, "v100:2,t4:2", profs)
  assert sum(sizes) == 4 * 256 and sizes[0] > sizes[-1]


def test_plan_cluster_costs_the_optimizer_it_is_given():
  model = models.create_model(
    "resnet18", rngs=nnx.Rngs(0), width=8, image_size=32
  )
  g = predictor.trace_graph(model, model.input_spec(64))
  scores = {p: {"int8": 2.0, "fp16": 1.0} for p in g.paths}
  runs = {
    c: allocation.plan_cluster(
      model,
      "v100:1,t4:1",
      scores,
      64,
      baselines=False,
      optimizer_state_copies=c,
    )
    for c in (0, 1, 2)
  }
  update = {c: r.summary()["optimizer_update_s"] for c, r in runs.items()}
  for kind in ("v100", "t4"):
    # Bytes moved per parameter: params, grads and the new params, plus a
    # read and a write per state copy (the launch term is the same).
    assert (update[2][kind] - update[1][kind]) == pytest.approx(
      update[1][kind] - update[0][kind]
    )
    assert update[2][kind] > update[1][kind] > update[0][kind]
  # Each state copy is a float32 copy of the parameters in memory too.
  mem = {c: r.allocation.memory_bytes["v100"] for c, r in runs.items()}
  assert mem[2] - mem[1] == pytest.approx(4.0 * g.num_params)
  with pytest.raises(ValueError, match="optimizer_state_copies"):
    allocation.plan_cluster(
      model, "v100:1,t4:1", scores, 64, optimizer_state_copies=-1
    )


# --------------------------------------------------------------------------
# The binaries.
# --------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWIN = (
  '{"image_size": 32, "in_channels": 3, "widths": [128, 256], "hidden": 1024}'
)


def _run(*args, timeout=600):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return binaries.run(*args, env=env, timeout=timeout)


def test_allocate_binary_writes_plans_summary_and_table(tmp_path):
  out = tmp_path / "plans"
  result = _run(
    "experiments.allocate",
    "--model=cnn",
    f"--model_kwargs={TWIN}",
    "--score_model_kwargs={}",
    "--dataset=digits",
    "--cluster=v100:2,t4:2",
    "--batch_size=128",
    "--num_batches=2",
    f"--out={out}",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["predicted_step_time_s"]) == {
    "qsync",
    "fp32",
    "uniform_low",
    "dynamic_batch",
    "training_only",
    "qsync_shuffled",
  }
  assert set(summary["predicted_memory_bytes"]["qsync"]) == {"v100", "t4"}
  assert summary["quantized_layers"]["v100"] == 0
  assert summary["quantized_layers"]["t4"] >= 1
  assert summary["search_time_s"] > 0
  # QSync is faster than all-FP32 and no slower than its own target.
  steps = summary["predicted_step_time_s"]
  assert steps["qsync"] < steps["fp32"]
  assert steps["qsync"] <= summary["target_s"] * (1 + 1e-9)
  t4 = qs.PrecisionPlan.from_json((out / "t4.json").read_text())
  assert t4.precision_of("head") is FP32
  for layer in ("conv1", "conv2", "fc", "head"):
    assert layer in result.stdout
  # Scores written by one run load into the next.
  again = _run(
    "experiments.allocate",
    "--model=cnn",
    f"--model_kwargs={TWIN}",
    f"--scores={out / 'scores.json'}",
    "--cluster=v100:2,t4:2",
    "--batch_size=128",
    f"--out={tmp_path / 'again'}",
  )
  assert again.returncode == 0, again.stderr[-3000:]
  assert (tmp_path / "again" / "t4.json").read_text() == (
    out / "t4.json"
  ).read_text()


def test_allocate_binary_impossible_memory_is_one_clear_error(tmp_path):
  result = _run(
    "experiments.allocate",
    "--model=cnn",
    "--num_batches=1",
    "--cluster=v100:1,t4:1",
    "--memory_limit=t4=0.00001",
    f"--out={tmp_path}",
  )
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: memory limit") and "smallest memory" in last
  assert "Traceback" not in result.stderr


def test_qsync_study_binary_writes_runs_and_plot(tmp_path):
  result = _run(
    "experiments.qsync_study",
    f"--out={tmp_path}",
    "--tasks=cnn",
    "--configs=qsync",
    "--seeds=1",
    "--steps=2",
    "--nopredict",
  )
  assert result.returncode == 0, result.stderr[-3000:]
  study = json.loads((tmp_path / "study.json").read_text())
  runs = study["tasks"]["cnn"]["runs"]
  # One run (the allocator's plan) keeps the test short; the other
  # configurations' configs are checked in-process below.
  assert [r["config"] for r in runs] == ["qsync"]
  assert "fp16" in set(runs[0]["t4_precisions"].values())
  assert set(study["tasks"]["cnn"]["accuracy"]) == {"qsync"}
  assert (tmp_path / "study.png").stat().st_size > 1000


def test_qsync_study_uniform_low_puts_the_t4s_in_int8_where_allowed():
  from experiments.configs import default as default_config
  from experiments.studies import qsync as study

  task = study.TASKS["cnn"]
  config = study.task_config(
    default_config.get_config(), task, "uniform_low", 0
  )
  assert config.plan_mode == "manual"
  plan = qs.PrecisionPlan.from_dict(config.plans.t4.to_dict())
  model = nnx.eval_shape(
    lambda: models.build_model(
      task["model"], rngs=nnx.Rngs(0), **task["model_kwargs"]
    )
  )
  g = graph_lib.trace_graph(model, model.input_spec(2))
  got = predictor.resolve_plan(g, plan, "t4")
  assert set(got.values()) == {Precision.INT8, Precision.FP32}
  assert got["head"] == Precision.FP32  # the policy keeps the head FP32
  # The FP32 baseline: manual, with no plan, so every layer stays FP32.
  fp32 = study.task_config(default_config.get_config(), task, "fp32", 0)
  assert fp32.plan_mode == "manual" and not fp32.plans.to_dict()


def test_qsync_study_greedy_configs_name_their_own_indicator():
  from experiments.configs import default as default_config
  from experiments.studies import qsync as study

  base = default_config.get_config()
  base.allocator.indicator = "wvar"  # a default no greedy configuration uses
  assert study.GREEDY_INDICATORS == {
    "qsync": "qsync",
    "qsync_var": "qsync_var",
    "greedy_random": "random",
  }
  for name, indicator in study.GREEDY_INDICATORS.items():
    assert name in study.CONFIGS
    config = study.task_config(base, study.TASKS["cnn"], name, 0)
    assert config.plan_mode == "auto"
    assert config.allocator.method == "greedy"
    assert config.allocator.indicator == indicator
  assert base.allocator.indicator == "wvar"  # the base is left alone


@pytest.mark.parametrize("name", ["qsync", "qsync_var", "greedy_random"])
def test_qsync_study_greedy_plan_comes_from_its_own_indicators_scores(
  name, tmp_path, monkeypatch
):
  from experiments import config_lib
  from experiments import plans_lib
  from experiments.configs import default as default_config
  from experiments.studies import qsync as study
  from qsync_jax import data
  from qsync_jax.allocation import pipeline

  asked, given = [], []
  real = pipeline.compute_scores

  def compute_scores(model, dataset, method, **kwargs):
    asked.append(method)
    # Random scores stand in for the indicator's (they cost no gradients).
    given.append(real(model, dataset, "random", **kwargs))
    return given[-1]

  monkeypatch.setattr(pipeline, "compute_scores", compute_scores)
  config = study.task_config(
    default_config.get_config(), study.TASKS["cnn"], name, 0
  )
  dataset = data.load_dataset(config.dataset)
  job = config_lib.parse(config)
  model = config_lib.build_model(job, dataset)
  plans, result, _ = plans_lib.job_plans(job, model, dataset)
  indicator = study.GREEDY_INDICATORS[name]
  assert asked == [indicator]
  assert result.indicator == indicator
  assert result.scores == dict(search.score_table(given[0].values))
  assert result.allocation.method == "greedy"
  # The study reads the plan's prediction on the deployment twin back.
  pipeline.write(result, str(tmp_path / "allocation"))
  assert study.twin_allocation(str(tmp_path)) == {
    "indicator": indicator,
    "twin_step_time_s": result.allocation.prediction.step_time_s,
    "twin_target_s": result.allocation.target_s,
  }
  assert study.twin_allocation(str(tmp_path / "manual")) == {}
  t4 = {p: v.value for p, v in result.allocation.precisions["t4"].items()}
  counts = study.layer_counts(t4)
  assert sum(counts.values()) == len(t4)
  assert counts == {
    p: sum(v == p for v in t4.values()) for p in sorted(set(t4.values()))
  }
  assert plans["t4"] == result.allocation.plans["t4"]
