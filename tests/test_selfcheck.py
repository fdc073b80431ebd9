"""The numerics self-check: cases within their bounds, an injected fault
caught, switched to a safe path and recorded, and the main job unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
from qsync_jax.numerics import ops
from qsync_jax.numerics import safe_paths
from qsync_jax.numerics import selfcheck
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.safe_paths import Signature

INT8_DOT = Signature("int8", "dot_general", "xla")
INT8_CONV = Signature("int8", "conv_general_dilated", "xla")


@pytest.fixture(autouse=True)
def _no_switches_left():
  safe_paths.reset()
  yield
  safe_paths.reset()


def _inject_h200_fault(monkeypatch):
  """XLA's INT8 contraction wrong under jax.jit, right op by op, as an H200
  with jax 0.11.2 computes it: the accumulator's last axis reversed (an
  uncorrelated permutation of the right values) whenever it is traced."""
  real = ops._native_contract

  def faulty(spec, compute, ql, qr):
    acc = real(spec, compute, ql, qr)
    if compute is Precision.INT8 and isinstance(ql, jax.core.Tracer):
      return jnp.flip(acc, axis=-1)
    return acc

  monkeypatch.setattr(ops, "_native_contract", faulty)


@pytest.fixture
def h200_fault(monkeypatch):
  _inject_h200_fault(monkeypatch)


def test_every_signature_is_within_its_bound_on_the_cpu():
  sigs = selfcheck.signatures_for(["int8", "fp8", "fp16", "bf16", "fp32"])
  assert len(sigs) == 8  # a dot and a conv per low precision, fp32 none
  record = selfcheck.run({"cpu": jax.devices()[0]}, {"cpu": sigs})
  assert record["switches"] == [] and record["mode"] == "warn"
  by_sig = {c["signature"]: c for c in record["checks"]}
  assert all(c["ok"] for c in record["checks"]), record["checks"]
  # An int8 x int8 -> int32 contraction is exact.
  assert by_sig[str(INT8_DOT)]["bound_ratio"] == 0.0
  assert by_sig[str(INT8_CONV)]["rel_error"] == 0.0
  assert 0 < by_sig["bf16 dot_general via xla"]["bound_ratio"] <= 1


def test_an_injected_int8_fault_is_caught_switched_and_recorded(h200_fault):
  case = selfcheck.make_case(INT8_DOT)
  device = jax.devices()[0]
  assert selfcheck.measure(case, device, compiled=False)["rel_error"] == 0.0
  wrong = selfcheck.measure(case, device)
  assert not wrong["ok"] and wrong["rel_error"] > 0.5
  lines = []
  record = selfcheck.run(
    {"t4": device, "v100": jax.devices()[1]},
    {"t4": [INT8_DOT, INT8_CONV], "v100": [INT8_DOT]},
    warn=lines.append,
  )
  # One line per wrong signature and device kind, naming both and the
  # error; the v100 workers are on the same hardware: checked once.
  assert len(lines) == 2
  assert lines[0].startswith("numerics check: int8 dot_general via xla on cpu")
  assert "(t4) is wrong under jax.jit: relative error" in lines[0]
  assert lines[0].endswith("switched to f16")
  assert [(s["signature"], s["to"]) for s in record["switches"]] == [
    (str(INT8_DOT), "f16"),
    (str(INT8_CONV), "f16"),
  ]
  assert [c["ok"] for c in record["checks"]] == [False, False, False]
  assert safe_paths.safe_path(INT8_DOT) == "f16"
  # Every trace from now on takes the safe path: compiled and exact again.
  assert selfcheck.measure(case, device)["rel_error"] == 0.0


def test_error_mode_stops_on_the_first_wrong_contraction(h200_fault):
  with pytest.raises(selfcheck.NumericsCheckError, match="int8 dot_general"):
    selfcheck.run({"t4": jax.devices()[0]}, {"t4": [INT8_DOT]}, mode="error")
  assert safe_paths.switched() == {}
  off = selfcheck.run({"t4": jax.devices()[0]}, {"t4": [INT8_DOT]}, mode="off")
  assert off["checks"] == [] and off["seconds"] == 0.0


def test_a_contraction_that_does_not_compile_is_switched(monkeypatch):
  def refused(spec, compute, ql, qr):
    raise NotImplementedError("no int8 convolution on this device")

  monkeypatch.setattr(ops, "_native_contract", refused)
  lines = []
  record = selfcheck.run(
    {"t4": jax.devices()[0]}, {"t4": [INT8_CONV]}, warn=lines.append
  )
  assert lines == [
    "numerics check: int8 conv_general_dilated via xla on cpu (t4) does not "
    "run under jax.jit: NotImplementedError: no int8 convolution on this "
    "device; switched to f16"
  ]
  assert record["checks"][0]["error"].startswith("NotImplementedError")


def test_a_bad_mode_is_a_config_error():
  config = default_config.get_config()
  config.numerics_check = "sometimes"
  with pytest.raises(ValueError, match="numerics_check"):
    config_lib.parse(config)


def _tiny_job():
  config = default_config.get_config()
  config.cluster = "t4:1"
  config.plan_mode = "manual"
  config.plans = {"t4": {"rules": [[r"conv\d|fc", "int8"]], "default": "fp32"}}
  config.steps = 12
  config.log_every = 12
  config.batch_size = 16
  config.eval_every = 0
  config.checkpoint_every = 0
  return config_lib.parse(config)


def test_the_main_job_trains_the_same_with_the_fault_switched(
  tmp_path, monkeypatch
):
  job = _tiny_job()
  clean = train_lib.train_and_evaluate(job, str(tmp_path / "clean"))
  assert clean["numerics_check"]["switches"] == []
  assert len(clean["numerics_check"]["checks"]) == 4  # int8 and fp16 floors
  _inject_h200_fault(monkeypatch)
  faulted = train_lib.train_and_evaluate(job, str(tmp_path / "faulted"))
  switches = faulted["numerics_check"]["switches"]
  assert {(s["kind"], s["signature"], s["to"]) for s in switches} == {
    ("t4", str(INT8_DOT), "f16"),
    ("t4", str(INT8_CONV), "f16"),
  }
  assert faulted["precisions"] == clean["precisions"]
  assert faulted["final_eval_accuracy"] == clean["final_eval_accuracy"]
  # Integer codes contracted in float16 with float32 sums: bit-identical.
  assert faulted["params_sha256"] == clean["params_sha256"]
  print(
    "accuracy",
    clean["final_eval_accuracy"],
    faulted["final_eval_accuracy"],
    "check seconds",
    clean["numerics_check"]["seconds"],
    faulted["numerics_check"]["seconds"],
  )
  assert np.isfinite(faulted["numerics_check"]["seconds"])


@pytest.mark.gpu
def test_after_the_self_check_every_contraction_is_right_under_jit_on_the_gpu():
  from qsync_jax.plan import devices as devices_lib

  gpu = jax.devices("gpu")[0]
  kind = devices_lib.device_kind_of(gpu)
  sigs = selfcheck.signatures_for(devices_lib.supported_precisions(kind))
  record = selfcheck.run({kind: gpu}, {kind: sigs})
  print("switches on", kind, record["switches"])
  # Whatever the device computes wrong now runs on a safe path.
  for sig in sigs:
    assert selfcheck.measure(selfcheck.make_case(sig, 4), gpu)["ok"], sig
  # tests/test_gpu.py's case: an INT8 layer of float operands under jit.
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(8, 8, 8)).astype(np.float32), gpu)
  w = jax.device_put(rng.normal(size=(8, 8)).astype(np.float32), gpu)
  dn = (((2,), (0,)), ((), ()))
  op = ops.DotGeneral(Precision.INT8)
  y = np.asarray(jax.jit(lambda a, b: op(a, b, dn))(x, w), np.float64)
  ref = np.einsum("bmk,kn->bmn", np.asarray(x, np.float64), np.asarray(w))
  assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.05
