"""A job's automatic plans from Python alone: settings, pipeline and cache.

The library pipeline (:mod:`qsync_jax.allocation.job_plans`) plans a tiny
model for a two-kind cluster with analytic profiles, without any
``ConfigDict``; the timing model's sample becomes a Probe once on the way
down.
"""

import dataclasses

from flax import nnx
import optax
import pytest

from experiments import config_lib
from experiments.configs import default as default_config
from qsync_jax import data
from qsync_jax import models
from qsync_jax.allocation import job_plans
from qsync_jax.allocation import pipeline
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.task import calling


def _settings(**changes):
  fields = dict(
    indicator="qsync_var",
    method="greedy",
    num_batches=1,
    compression=None,
    candidates=("int8", "fp16", "fp32"),
    timing_model_kwargs={},
    timing_batch_size=0,
    profiles="analytic",
    profile_repeats=1,
    profile_cache_dir="",
    planning_timeout_s=60,
  )
  return job_plans.AutoPlanSettings(**{**fields, **changes})


@pytest.fixture(name="digits", scope="module")
def _digits():
  return data.load_dataset("digits")


def _plan(digits, cluster="v100:1,t4:1", cache=None):
  model = models.create_model("cnn", rngs=nnx.Rngs(0), widths=(2, 2), hidden=4)
  return job_plans.plan_job(
    model,
    model,
    None,
    cluster,
    _settings(),
    dataset=digits,
    batch_size=8,
    loss_fn=None,
    tx=optax.adam(1e-3),
    optimizer_name="adam",
    optimizer_state_copies=2,
    seed=0,
    cache=cache,
  )


def test_a_job_is_planned_from_python_with_one_probe(digits, monkeypatch):
  converted = []
  real = calling.as_probe

  def as_probe(model, sample=None):
    if not isinstance(sample, calling.Probe):
      converted.append(sample)
    return real(model, sample)

  monkeypatch.setattr(calling, "as_probe", as_probe)
  planned = _plan(digits)
  assert len(converted) == 1  # the timing model's input_spec, once
  assert set(planned.plans) == {"v100", "t4"}
  assert all(isinstance(p, PrecisionPlan) for p in planned.plans.values())
  assert planned.result.allocation.plans == planned.plans
  assert planned.result.graph.batch_size == 8
  assert planned.sources == {"v100": "analytic", "t4": "analytic"}
  # One kind: nothing to allocate.
  assert _plan(digits, "t4:2") == job_plans.JobPlans({}, None, {})


def test_planning_again_in_a_run_directory_reuses_the_scores(
  digits, tmp_path, monkeypatch
):
  computed = []
  real = pipeline.compute_scores

  def compute_scores(*args, **kwargs):
    computed.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(pipeline, "compute_scores", compute_scores)
  cache = job_plans.PlanCache(str(tmp_path))
  first = _plan(digits, cache=cache)
  cache.save(first.result)  # as process 0 does once past its checks
  again = _plan(digits, cache=job_plans.PlanCache(str(tmp_path)))
  assert len(computed) == 1
  assert again.plans == first.plans


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("method", "fastest", "method must be one of greedy, memory, ilp"),
    ("indicator", "nope", "indicator must be one of qsync, qsync_var"),
    ("num_batches", 0, "num_batches must be an integer >= 1, got 0"),
    ("compression", 1.5, "compression must be None or a number in [0, 1]"),
    ("candidates", ("int4",), "candidates must be a non-empty list of"),
    ("profiles", "guess", "profiles must be one of auto, measured, analytic"),
    ("planning_timeout_s", 0, "planning_timeout_s must be a finite number"),
  ],
)
def test_settings_name_the_field_out_of_range(field, value, message):
  with pytest.raises(ValueError) as info:
    _settings(**{field: value})
  assert str(info.value).startswith(f"AutoPlanSettings.{message}")
  # The binary names the config field instead.
  config = default_config.get_config()
  job = config_lib.parse(config)
  if field == "planning_timeout_s":
    config.distributed.planning_timeout_s = value
    where = "config.distributed."
    section = dataclasses.replace(job.distributed, **{field: value})
    job = job.replace(distributed=section)
  else:
    config.allocator[field] = value
    where = "config.allocator."
    job = job.replace(
      allocator=dataclasses.replace(job.allocator, **{field: value})
    )
  with pytest.raises(ValueError) as info:
    config_lib.auto_settings(job)
  assert str(info.value).startswith(f"{where}{message}")
  # Parsing the config refuses it first; a field's own check, where it has
  # one, says so in its words.
  with pytest.raises(ValueError) as info:
    config_lib.parse(config)
  assert str(info.value).startswith(f"{where}{_PARSED.get(field, message)}"), (
    str(info.value)
  )


# The config field's own check, where it refuses the value before the
# allocator's settings are made.
_PARSED = {
  "compression": "compression must be a finite number in [0, 1], got 1.5",
  "planning_timeout_s": "planning_timeout_s must be an integer >= 1, got 0",
}


def test_settings_keep_precision_names():
  assert _settings(candidates=["INT8", "fp16"]).candidates == ("int8", "fp16")
