"""Tests that need GPUs: the Pallas kernels on the device, catalog kinds, NCCL.

Each carries the ``gpu`` marker (``gpu(count=2)`` for two GPUs); where jax
sees fewer, tests/conftest.py skips it with the reason. On a GPU host:
``python -m pytest -m gpu tests``.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.plan import devices as devices_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.gpu
def test_int8_kernel_compiles_and_is_bit_exact_on_the_gpu():
  gpu = jax.devices("gpu")[0]
  rng = np.random.default_rng(0)
  x = jax.device_put(
    jnp.asarray(rng.integers(-127, 128, (256, 192)), jnp.int8), gpu
  )
  w = jax.device_put(
    jnp.asarray(rng.integers(-127, 128, (192, 128)), jnp.int8), gpu
  )
  # interpret=False: the Triton kernel itself, not Pallas's interpreter.
  y = pk.int8_matmul(x, w, 1.0, 1.0, interpret=False)
  assert y.devices() == {gpu}
  acc = jnp.dot(x, w, preferred_element_type=jnp.int32)
  np.testing.assert_array_equal(np.asarray(y).astype(np.int32), np.asarray(acc))


@pytest.mark.gpu
@pytest.mark.xfail(
  strict=True,
  reason="measured on an H200 with jax 0.11.2: the XLA INT8 dot of a "
  "quantized pair is right op by op (relative error 0.011) and wrong under "
  "jax.jit (1.003); the int8 dot alone is exact both ways",
)
def test_an_int8_dot_under_jit_matches_op_by_op_on_the_gpu():
  from jax import lax

  from qsync_jax.numerics import ops
  from qsync_jax.numerics.precision import Precision

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 8, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  dn = (((2,), (0,)), ((), ()))
  reference = lax.dot_general(x, w, dn, precision="highest")
  op = ops.DotGeneral(Precision.INT8)

  def error(y):
    return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))

  assert error(op(x, w, dn)) < 0.05
  assert error(jax.jit(lambda a, b: op(a, b, dn))(x, w)) < 0.05


@pytest.mark.gpu
def test_the_gpu_is_a_catalog_kind_and_auto_cluster_names_it():
  kind = devices_lib.device_kind_of(jax.devices("gpu")[0])
  assert kind in devices_lib.DEVICES
  spec = cluster_lib.resolve_cluster(cluster_lib.AUTO)
  assert set(spec.kinds) == {kind}


@pytest.mark.gpu(count=2)
def test_two_processes_over_nccl_match_one_process(tmp_path):
  args = [
    "--cluster=auto",
    "--config.steps=8",
    "--config.eval_every=0",
    "--config.checkpoint_every=0",
    "--config.log_every=4",
  ]
  env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "0,1"}
  single = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={tmp_path / 'single'}",
      *args,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert single.returncode == 0, single.stderr[-3000:]
  multi = subprocess.run(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=2",
      "--timeout_s=500",
      "--",
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={tmp_path / 'multi'}",
      *args,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]
  s, m = (
    json.loads((tmp_path / d / "summary.json").read_text())
    for d in ("single", "multi")
  )
  assert m["num_processes"] == 2 and m["cluster"] == s["cluster"]
  # The same kind, plans and batches; NCCL's mean may differ from the one
  # process's in the last bits, so compare the losses, not the digest.
  assert m["final_train_loss"] == pytest.approx(s["final_train_loss"], rel=1e-4)


@pytest.mark.gpu
def test_the_gpu_kind_is_profiled_on_the_gpu():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from qsync_jax import models
  from qsync_jax import predictor
  from qsync_jax.allocation import sharing

  gpu = jax.devices("gpu")[0]
  kind = devices_lib.device_kind_of(gpu)
  spec = cluster_lib.parse_cluster(
    f"{kind}:1,t4:1" if kind != "t4" else "t4:1,v100:1"
  )
  sites = sharing.profile_sites(spec, [gpu, gpu])
  assert sites[kind] is gpu and list(sites.values())[1] is None
  model = models.build_model("cnn", rngs=nnx.Rngs(0))
  batch = (np.zeros((32, 8, 8, 1), np.float32), np.zeros((32,), np.int32))
  g = predictor.trace_graph(model, model.input_spec(32))

  def measure(k, device, local):
    return predictor.profile(
      model,
      batch,
      device=device,
      device_kind=k,
      precisions=["fp32", "bf16"],
      repeats=3,
      graph=g,
    )

  profiles = sharing.gather_profiles(g, spec, [gpu, gpu], sites, measure)
  assert profiles[kind].source == "measured"
  assert profiles[kind].device_kind == kind
  assert [p.source for p in profiles.values()][1] == "analytic"
  assert all(
    fb > 0 for per in profiles[kind].layers.values() for _, fb in per.values()
  )


@pytest.mark.gpu(count=2)
def test_two_processes_profile_their_own_gpu_and_share_the_plans(tmp_path):
  kind = devices_lib.device_kind_of(jax.devices("gpu")[0])
  other = "t4" if kind != "t4" else "v100"
  env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "0,1"}
  multi = subprocess.run(
    [
      sys.executable,
      "-m",
      "qsync_jax.distributed",
      "--num_processes=2",
      "--timeout_s=500",
      "--",
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={tmp_path}",
      f"--cluster={kind}:1,{other}:1",
      "--plan=auto",
      "--config.allocator.profiles=measured",
      "--config.steps=4",
      "--config.eval_every=0",
      "--config.checkpoint_every=0",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["profiles"][kind].startswith("measured on process 0")
  assert summary["profiles"][other].startswith("measured on process 1")
