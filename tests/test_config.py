"""The main job's config, parsed once into typed, frozen structures.

``experiments.config_lib.parse`` fills what a config leaves out from the
default config, refuses a field the default config does not have (naming
the closest one) and a value of the wrong type (naming the field), reads
each plan file once, and gives a frozen :class:`JobConfig` that every part
of the main job reads attributes of.
"""

import dataclasses
import inspect
import json
import pathlib
import re

import pytest

from experiments import config_fields
from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import initialize

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_partial_config_is_filled_from_the_defaults():
  default = config_lib.parse(default_config.get_config())
  job = config_lib.parse({"steps": 7, "allocator": {"method": "ilp"}})
  assert job.steps == 7
  assert job.allocator.method == "ilp"
  # The rest of the section, and every other field, are the defaults.
  assert job.allocator.indicator == default.allocator.indicator
  assert job == default.replace(
    steps=7, allocator=dataclasses.replace(default.allocator, method="ilp")
  )
  assert config_lib.parse({}) == default


@pytest.mark.parametrize(
  "path, value, message",
  [
    (
      ("stpes",),
      5,
      "config.stpes is not a field of the main job's config (did you mean "
      "config.steps?)",
    ),
    (
      ("allocator", "methd"),
      "ilp",
      "config.allocator.methd is not a field of the main job's config (did "
      "you mean config.allocator.method?)",
    ),
  ],
)
def test_an_unknown_field_names_the_closest_one(path, value, message):
  config = default_config.get_config()
  node = config
  for parent in path[:-1]:
    node = node[parent]
  node[path[-1]] = value  # the default config is not locked
  with pytest.raises(ValueError) as info:
    config_lib.parse(config)
  assert str(info.value) == message
  # A plain mapping, as a library caller may pass, is read the same way.
  plain = {path[-1]: value}
  for parent in reversed(path[:-1]):
    plain = {parent: plain}
  with pytest.raises(ValueError) as info:
    config_lib.parse(plain)
  assert str(info.value) == message


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("steps", "ten", "config.steps must be an integer >= 1, got 'ten'"),
    (
      "learning_rate",
      "0.1",
      "config.learning_rate must be a finite number > 0, got '0.1'",
    ),
    ("resume", "yes", "config.resume must be true or false, got 'yes'"),
    ("cluster", 4, "config.cluster must be a string, got 4"),
    (
      "model_kwargs",
      "widths=2",
      "config.model_kwargs must be a mapping, got 'widths=2'",
    ),
  ],
)
def test_a_value_of_the_wrong_type_names_the_field(field, value, message):
  with pytest.raises(ValueError) as info:
    config_lib.parse({field: value})
  assert str(info.value) == message


def test_an_integral_float_is_an_integer():
  # As a config file or the command line may write it.
  job = config_lib.parse({"steps": 1e3})
  assert job.steps == 1000 and isinstance(job.steps, int)
  with pytest.raises(ValueError) as info:
    config_lib.parse({"steps": 2.5})
  assert str(info.value) == "config.steps must be an integer >= 1, got 2.5"


def test_each_plan_file_is_read_once(tmp_path, monkeypatch):
  paths = {}
  for kind, precision in (("v100", "fp16"), ("t4", "int8")):
    paths[kind] = tmp_path / f"{kind}.json"
    paths[kind].write_text(json.dumps({"rules": [], "default": precision}))
  reads = []
  read_file = config_fields.read_file

  def counted(path, what):
    reads.append(path)
    return read_file(path, what)

  monkeypatch.setattr(config_fields, "read_file", counted)
  config = default_config.get_config()
  config.cluster, config.plan_mode = "v100:1,t4:1", "manual"
  config.plans = {kind: str(path) for kind, path in paths.items()}
  job = config_lib.parse(config)
  assert sorted(reads) == sorted(str(p) for p in paths.values())
  assert job.plans["t4"] == PrecisionPlan.from_dict({"default": "int8"})
  # The workers are given the plans parsed, not the files again.
  workers = train_lib.make_workers(job)
  assert [(w.kind, w.plan.default.value) for w in workers] == [
    ("v100", "fp16"),
    ("t4", "int8"),
  ]
  assert len(reads) == 2


def test_the_job_config_is_frozen():
  job = config_lib.parse(
    {"model_kwargs": {"hidden": 4}, "plans": {"t4": {"rules": []}}}
  )
  with pytest.raises(dataclasses.FrozenInstanceError):
    job.steps = 5
  with pytest.raises(dataclasses.FrozenInstanceError):
    job.allocator.method = "ilp"
  with pytest.raises(TypeError):
    job.model_kwargs["hidden"] = 8
  with pytest.raises(TypeError):
    job.plans["v100"] = PrecisionPlan()
  assert isinstance(job.lr_decay_steps, tuple)
  assert isinstance(job.allocator.candidates, tuple)
  assert isinstance(job.plans["t4"], PrecisionPlan)
  # A copy with changes leaves the original alone.
  assert job.replace(steps=5).steps == 5 and job.steps != 5


def test_the_plain_config_is_json():
  job = config_lib.parse(
    {"plans": {"t4": {"rules": [["conv1", "int8"]], "default": "bf16"}}}
  )
  plain = job.to_plain()
  assert json.loads(json.dumps(plain)) == plain
  assert plain["plans"]["t4"] == job.plans["t4"].to_dict()
  assert plain["allocator"]["method"] == job.allocator.method


def test_unused_settings_name_what_the_run_will_not_read():
  config = default_config.get_config()
  assert config_lib.unused_settings(config_lib.parse(config)) == []
  config.optimizer, config.momentum = "adam", 0.9
  assert config_lib.unused_settings(config_lib.parse(config)) == [
    "config.momentum=0.9 is not used with optimizer='adam' (only with 'sgd')"
  ]
  config.optimizer = "sgd"
  assert config_lib.unused_settings(config_lib.parse(config)) == []


def test_the_experiments_read_no_config_with_get():
  # Every field is an attribute of the parsed config: a ``get`` with a
  # fallback would hide a default that differs from the default config's.
  pattern = re.compile(r"config[\w.]*\.get\(")
  found = [
    f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
    for path in sorted((ROOT / "experiments").rglob("*.py"))
    for number, line in enumerate(path.read_text().splitlines(), 1)
    if pattern.search(line)
  ]
  assert found == []


def test_initialize_defaults_are_the_default_configs():
  # One default: a library caller joins a run as the binary does.
  dist = config_lib.parse(default_config.get_config()).distributed
  defaults = {
    name: p.default
    for name, p in inspect.signature(initialize.initialize).parameters.items()
  }
  assert {
    "timeout_s": dist.initialization_timeout_s,
    "heartbeat_timeout_s": dist.heartbeat_timeout_s,
    "shutdown_timeout_s": dist.shutdown_timeout_s,
    "local_devices": dist.local_devices,
    "coordinator_address": dist.coordinator_address,
    "num_processes": dist.num_processes,
    "process_id": dist.process_id,
  } == {
    name: defaults[name]
    for name in (
      "timeout_s",
      "heartbeat_timeout_s",
      "shutdown_timeout_s",
      "local_devices",
      "coordinator_address",
      "num_processes",
      "process_id",
    )
  }
