"""Sizes past what the host can hold: one error line, before any allocation.

The binaries' cases run ``experiments.train`` and ``experiments.allocate``
(forked from a process that has imported their libraries: tests/binaries.py) and check the one ``error:`` line, exit status 1, no
traceback, nothing written into the output directory, and that the process
stayed small and quick: a size is refused before anything it sizes is made.
The checks themselves are tested
in-process: the host's memory limit (cgroup v1 and v2), the config's sizes,
a model's memory from its shapes and a measured profile's estimate.
"""

import os

from flax import nnx
import jax
import pytest
from test_bad_input import _error_line
from test_bad_input import _run

from experiments import config_lib
from experiments import limits_lib
from experiments.configs import default as default_config
from qsync_jax import data as data_lib
from qsync_jax import host_memory
from qsync_jax import models
from qsync_jax import predictor
from qsync_jax.models import sizes as model_sizes
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.predictor import host_limits
from qsync_jax.predictor import profiling

# A refused run starts the interpreter and JAX and stops: far below this.
_MAX_RSS_KIB = 2 * 2**20
_TIMEOUT_S = 180


def _refused(module, out, *args):
  """The error line of a run that must be refused small, quick and before
  writing anything."""
  result = _run(module, *args, timeout=_TIMEOUT_S)
  # The binary's own peak (wait4), the imports it inherited included.
  assert result.max_rss_kib <= _MAX_RSS_KIB, (
    f"peak RSS {result.max_rss_kib} KiB"
  )
  last = _error_line(result)
  assert not out.exists() or not os.listdir(out), os.listdir(out)
  return last


# --------------------------------------------------------------------------
# The binaries
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "module, args, message",
  [
    (
      "experiments.train",
      ["--cluster=v100:2,cpu:2", "--plan=auto"],
      "error: --plan=auto cannot plan device kind cpu: it is not a GPU, so "
      "the GPU catalog has no figures for it, and "
      "config.allocator.profiles=auto measures none but GPUs; give it a "
      "plan: --plan=cpu=FILE.json, or a uniform one such as "
      '--plan=cpu=\'{"default": "fp32"}\'',
    ),
    (
      "experiments.train",
      ["--cluster=v100:100000"],
      "error: config.cluster='v100:100000' with config.batch_size=32 needs "
      "a global batch of 3200000 examples (100000 workers x 32), more than "
      "the 1437 training examples of dataset 'digits'",
    ),
    (
      "experiments.train",
      [
        "--cluster=v100:2,cpu:2",
        "--plan=auto",
        "--config.allocator.profiles=measured",
        # Past any host's memory, whatever this one has.
        "--config.allocator.timing_model_kwargs.hidden=65536",
      ],
      "error: a measured v100 profile on cpu:0 of the model at batch 128 "
      "(4295986954 parameters, 4 layers, 5 repeats) needs about",
    ),
    (
      "experiments.train",
      ['--model_kwargs={"widths": [100000, 100000]}'],
      "error: config.model='cnn' at config.batch_size=32 with model_kwargs "
      "{'widths': [100000, 100000]} on 4 CPU worker(s) "
      "(config.cluster='v100:2,t4:2') needs about",
    ),
    (
      "experiments.allocate",
      [
        "--model=cnn",
        "--cluster=v100:1,t4:1",
        '--score_model_kwargs={"widths": [100000, 100000]}',
      ],
      "error: --model=cnn with --score_model_kwargs {'widths': [100000, "
      "100000]} at --score_batch_size=32 needs about",
    ),
  ],
)
def test_binary_refuses_a_size_past_the_host_before_allocating(
  tmp_path, module, args, message
):
  out = tmp_path / "out"
  flag = "--out_dir" if module == "experiments.train" else "--out"
  last = _refused(module, out, f"{flag}={out}", *args)
  assert last.startswith(message), last
  if "needs about" in message:
    assert "more than this host's memory" in last, last


# --------------------------------------------------------------------------
# The host's memory
# --------------------------------------------------------------------------


def _fake_cgroups(tmp_path, v2_limit, v1_limit):
  """A mount table and cgroup membership with a v2 and a v1 memory limit
  set on an ancestor of the process's cgroup."""
  v2, v1 = tmp_path / "unified", tmp_path / "memory"
  (v2 / "job" / "task").mkdir(parents=True)
  (v2 / "job" / "memory.max").write_text(f"{v2_limit}\n")
  (v2 / "job" / "task" / "memory.max").write_text("max\n")
  (v1 / "a" / "b").mkdir(parents=True)
  (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
  (v1 / "a" / "memory.limit_in_bytes").write_text(f"{v1_limit}\n")
  mountinfo = tmp_path / "mountinfo"
  mountinfo.write_text(
    f"30 23 0:26 / {v2} rw,nosuid - cgroup2 cgroup2 rw\n"
    f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory\n"
    f"36 31 0:33 / {tmp_path} rw,relatime - cgroup cgroup rw,cpu\n"
  )
  cgroup = tmp_path / "cgroup"
  cgroup.write_text("4:memory:/a/b\n2:cpu:/a\n0::/job/task\n")
  return str(cgroup), str(mountinfo)


def test_host_limit_is_the_least_cgroup_limit_else_physical(tmp_path):
  cgroup, mountinfo = _fake_cgroups(tmp_path, 3 * 2**30, 2 * 2**30)
  assert host_memory.cgroup_limit_bytes(cgroup, mountinfo) == 2 * 2**30
  limit = host_memory.limit(cgroup, mountinfo)
  assert limit == host_memory.Limit(2 * 2**30, "the cgroup memory limit")
  assert str(limit) == "2 GiB (the cgroup memory limit)"
  # No limit set ("max", the v1 sentinel), or none readable: physical.
  cgroup, mountinfo = _fake_cgroups(tmp_path / "none", "max", 2**63 - 4096)
  assert host_memory.cgroup_limit_bytes(cgroup, mountinfo) is None
  assert host_memory.limit(cgroup, mountinfo).source == "physical memory"
  missing = str(tmp_path / "missing")
  assert host_memory.limit(missing, missing).bytes == (
    host_memory.physical_bytes()
  )


def test_sizes_are_checked_against_the_cgroup_limit(tmp_path, monkeypatch):
  cgroup, mountinfo = _fake_cgroups(tmp_path, 2**30, 2**31)
  monkeypatch.setattr(host_memory, "_PROC_CGROUP", cgroup)
  monkeypatch.setattr(host_memory, "_PROC_MOUNTINFO", mountinfo)
  job = config_lib.parse(default_config.get_config())
  limits_lib.check_sizes(job)  # the default job fits 1 GiB
  with pytest.raises(ValueError) as info:
    limits_lib.check_sizes(job.replace(steps=20_000_000))
  assert str(info.value) == (
    "config.steps=20000000 needs about 1.86 GiB (the sync schedule's table "
    "of steps, 100 bytes a step), more than this host's memory, 1 GiB (the "
    "cgroup memory limit)"
  )


# --------------------------------------------------------------------------
# The main job's config
# --------------------------------------------------------------------------


def _config(**fields):
  config = default_config.get_config()
  for name, value in fields.items():
    config[name] = value
  return config


def _job(**fields):
  return config_lib.parse(_config(**fields))


@pytest.mark.parametrize(
  "fields, message",
  [
    (
      {"model_kwargs": {"widths": [0, 4]}},
      "config.model_kwargs.widths must be integers >= 1, got [0, 4]",
    ),
    (
      {"model_kwargs": {"hidden": 2.5}},
      "config.model_kwargs.hidden must be an integer >= 1, got 2.5",
    ),
    (
      {"model": "lm", "model_kwargs": {"num_layers": -1}},
      "config.model_kwargs.num_layers must be an integer >= 1, got -1",
    ),
    (
      {"model": "resnet18", "model_kwargs": {"stage_sizes": [2, 0]}},
      "config.model_kwargs.stage_sizes must be integers >= 1, got [2, 0]",
    ),
    (
      {"dataset": "synthetic", "dataset_kwargs": {"num_train": 2.5}},
      "config.dataset_kwargs.num_train must be an integer >= 1, got 2.5",
    ),
    (
      {"dataset": "text", "dataset_kwargs": {"stride": 0}},
      "config.dataset_kwargs.stride must be an integer >= 1, got 0",
    ),
    (
      {"dataset": "synthetic", "dataset_kwargs": {"input_shape": [8, -8]}},
      "config.dataset_kwargs.input_shape must be an integer >= 1, got -8",
    ),
    (
      {"steps": 10**12},
      "config.steps=1000000000000 needs about 93132 GiB (the sync "
      "schedule's table of steps, 100 bytes a step), more than this host's "
      "memory",
    ),
    (
      {"dataset": "synthetic", "dataset_kwargs": {"num_train": 10**10}},
      "config.dataset='synthetic' with {'num_train': 10000000000} needs "
      "about 16689 GiB (its arrays while the loader makes them)",
    ),
    (
      {"dataset": "text", "dataset_kwargs": {"seq_len": 4096, "stride": 1}},
      "config.dataset='text' with {'seq_len': 4096, 'stride': 1} needs about",
    ),
    (
      {"batch_size": 2000},
      "config.cluster='v100:2,t4:2' with config.batch_size=2000 needs a "
      "global batch of 8000 examples (4 workers x 2000), more than the "
      "1437 training examples of dataset 'digits'",
    ),
  ],
)
def test_config_sizes_are_checked_before_anything_runs(fields, message):
  job = _job(**fields)
  with pytest.raises(ValueError) as info:
    limits_lib.check_sizes(job)
  assert str(info.value).startswith(message), str(info.value)


def test_worker_and_fake_device_counts_are_bounded():
  with pytest.raises(ValueError, match="names 2000000 workers, more than the"):
    cluster_lib.parse_cluster("v100:1000000,t4:1000000")
  assert cluster_lib.parse_cluster("v100:3").num_workers == 3
  # A count the data would allow, but not its fake CPU devices.
  job = _job(cluster=f"v100:{cluster_lib.MAX_WORKERS}")
  with pytest.raises(ValueError) as info:
    limits_lib.check_fake_devices(job)
  assert f"{cluster_lib.MAX_WORKERS} fake CPU devices, one a worker" in str(
    info.value
  )
  limits_lib.check_fake_devices(_job(cluster="v100:64"))


def test_auto_plans_refuse_a_kind_outside_the_catalog():
  config = _config(cluster="v100:2,cpu:2")
  with pytest.raises(ValueError, match="cannot plan device kind cpu"):
    config_lib.parse(config)
  # One kind allocates nothing; a measured profile (bounded) or a plan of
  # its own is the way to plan cpu alongside others.
  config_lib.parse(_config(cluster="cpu:4"))
  measured = _config(cluster="v100:2,cpu:2")
  measured.allocator.profiles = "measured"
  config_lib.parse(measured)
  manual = _config(cluster="v100:2,cpu:2", plan_mode="manual")
  manual.plans = {"cpu": '{"default": "fp32"}'}
  config_lib.parse(manual)


# --------------------------------------------------------------------------
# A model's memory, from its shapes
# --------------------------------------------------------------------------


@pytest.fixture(name="digits", scope="module")
def _digits():
  return data_lib.load_dataset("digits")


def _worker_memory(job, dataset, batch):
  """One worker's step of the job's model, built abstractly."""
  return host_limits.step_memory(
    models.without_weights(lambda: config_lib.build_model(job, dataset)),
    (dataset.x_train[:1], dataset.y_train[:1]),
    batch,
    config_lib.make_loss_fn(job),
    host_limits.optimizer_state_copies(job.optimizer, job.momentum),
  )


def test_model_memory_is_estimated_without_allocating(digits):
  job = _job()
  limits_lib.check_model_memory(job, digits)  # the default job fits
  small = _worker_memory(job, digits, 32)
  # Parameters, gradients and Adam's two moments; activations per example.
  params = sum(
    x.size
    for x in jax.tree.leaves(
      nnx.state(config_lib.build_model(job, digits), nnx.Param)
    )
  )
  assert small.fixed_bytes == 4 * params * 4
  assert small.example_bytes > 0
  # The widths of a model no host holds, priced in a blink.
  job = _job(model_kwargs={"widths": [100000, 100000]})
  big = _worker_memory(job, digits, 32)
  assert big.fixed_bytes > 1000 * 2**30
  with pytest.raises(ValueError) as info:
    limits_lib.check_model_memory(job, digits)
  assert "on 4 CPU worker(s) (config.cluster='v100:2,t4:2') needs about" in (
    str(info.value)
  )


def test_a_deep_model_is_priced_from_shallow_copies():
  text = data_lib.load_dataset("text", max_bytes=20000)
  config = _config(
    model="lm",
    dataset="text",
    model_kwargs={"num_layers": 1_000_000, "hidden": 16, "mlp_dim": 16},
  )
  shallow = _config(
    model="lm", dataset="text", model_kwargs={"hidden": 16, "mlp_dim": 16}
  )
  counts = {}
  for layers in (1, 2, 40):
    shallow.model_kwargs.num_layers = layers
    counts[layers] = sum(
      x.size
      for x in jax.tree.leaves(
        nnx.state(
          config_lib.build_model(config_lib.parse(shallow), text), nnx.Param
        )
      )
    )

  def deep_params(c):
    return model_sizes.deep_model_params(
      c.model,
      c.model_kwargs.to_dict(),
      lambda kwargs: config_lib.build_model(
        _job(model="lm", dataset="text", model_kwargs=kwargs), text
      ),
    )

  assert deep_params(shallow) == counts[40]
  per_layer = counts[2] - counts[1]
  assert deep_params(config) == (counts[1] + 999_999 * per_layer)
  with pytest.raises(ValueError, match="'num_layers': 1000000.* on 4 CPU"):
    limits_lib.check_model_memory(config_lib.parse(config), text)


# --------------------------------------------------------------------------
# Measured profiles
# --------------------------------------------------------------------------


def test_a_measured_profile_on_cpu_is_bounded():
  deployed = models.without_weights(
    lambda: models.create_model(
      "cnn",
      rngs=nnx.Rngs(0),
      widths=(128, 256),
      hidden=1024,
      image_size=32,
      in_channels=3,
    )
  )
  g = predictor.trace_graph(deployed, deployed.input_spec(128))
  cpu = jax.devices()[0]
  big = profiling.estimated_bytes(g, ["int8", "fp16"], host_devices=2)
  # Every precision's passes and steps on both host devices: many times
  # the 270 MB of parameters.
  assert big > 60 * 4 * g.num_params
  if big > host_memory.limit().bytes:
    with pytest.raises(ValueError, match="a measured cpu profile on"):
      profiling.check_fits(g, cpu, "cpu", ["int8", "fp16"], 2)
  tiny = models.create_model("cnn", rngs=nnx.Rngs(0), widths=(2, 2), hidden=4)
  small = predictor.trace_graph(tiny, tiny.input_spec(8))
  profiling.check_fits(small, cpu, "cpu", ["int8"], 2, repeats=5)
  with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
    profiling.check_fits(small, cpu, "cpu", ["int8"], repeats=0)
  with pytest.raises(ValueError, match=r"1000000000000 repeats\) needs"):
    profiling.check_fits(small, cpu, "cpu", ["int8"], repeats=10**12)
