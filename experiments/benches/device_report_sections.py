"""The measurements of the device report, one function per section.

Each section takes the report's :class:`Settings` and a :class:`Deadline`,
checks the deadline before each case (a case left undone is listed, not
lost) and returns a JSON-ready dict; :mod:`.device_report` runs them in
order, within the report's budget, and writes the files.

* :func:`gpu_tests`: ``pytest -m gpu`` in a subprocess, its counts and tail;
* :func:`numerics`: every low-precision contraction compiled and op by op
  (the self-check's cases, larger), the H200's reproduction, and what
  isolates a fault (an optimization barrier between quantize and dot, the
  int8 dot alone, the kernel, the safe paths; XLA's Triton GEMM off in a
  child process);
* :func:`throughput`: GEMMs and convolutions per precision at the sizes of
  real layers;
* :func:`predictor`: ``experiments.predictor_accuracy`` per model in a
  subprocess (measured profile, predicted and measured steps);
* :func:`main_job`: the allocator's plan for this device as the weak kind
  of a hybrid pair, its measured step against all-FP32 and all-BF16.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from experiments.benches import kernels as kernels_bench
from experiments.studies import predictor_accuracy
from pallas_kernels import _common as kernel_common
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.int8_matmul import int8_matmul
from qsync_jax import files
from qsync_jax import models as models_lib
from qsync_jax import sensitivity
from qsync_jax.allocation import pipeline
from qsync_jax.numerics import ops
from qsync_jax.numerics import quant
from qsync_jax.numerics import safe_paths
from qsync_jax.numerics import selfcheck
from qsync_jax.numerics.precision import Precision
from qsync_jax.numerics.quant import QuantConfig
from qsync_jax.plan import devices as devices_lib
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.predictor import timing
from qsync_jax.task import losses
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
#: Set in the child process the numerics section starts (no grandchild).
CHILD_ENV = "QSYNC_DEVICE_REPORT_CHILD"


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the sections measure: real sizes on a GPU, tiny ones on a CPU.

  Attributes:
    platform: ``"gpu"`` or ``"cpu"``.
    out_dir: where the sections' own files go.
    gemms: ``(M, K, N)`` of the GEMMs timed.
    convs: ``(N, H, W, C_in, C_out)`` of the 3x3 convolutions timed.
    case_size: the numerics cases' size (:func:`selfcheck.make_case`).
    repeats: timed rounds per throughput case (the median is reported).
    granularities: the quantization scales of the numerics cases.
    predictor_models: ``{model spec: (model kwargs, batch, dataset)}``.
    predictor_plans: the predictor check's plans
      (:func:`experiments.studies.predictor_accuracy.plans_for`'s names).
    predictor_precisions: the precisions its profile measures.
    predictor_rounds: its interleaved rounds.
    job_model_kwargs: the main job's timing CNN.
    job_batch: its batch per worker.
    job_indicator: the sensitivity method its plan is chosen by.
  """

  platform: str
  out_dir: str
  gemms: tuple[tuple[int, int, int], ...]
  convs: tuple[tuple[int, int, int, int, int], ...]
  case_size: int
  repeats: int
  granularities: tuple[str, ...]
  predictor_models: Mapping[str, tuple[dict, int, str | None]]
  predictor_plans: tuple[str, ...]
  predictor_precisions: tuple[str, ...]
  predictor_rounds: int
  job_model_kwargs: Mapping[str, Any]
  job_batch: int
  job_indicator: str


def settings_for(platform: str, out_dir: str) -> Settings:
  """Real layer sizes on a GPU (a GPT-2-small block over 8192 tokens, the
  4096-cube of the kernel bench, ResNet-18's 3x3 stages at 224 pixels,
  batch 32); a few tiny ones on a CPU (a dry run)."""
  if platform == "gpu":
    return Settings(
      platform,
      out_dir,
      gemms=((8192, 768, 2304), (8192, 768, 3072), (8192, 3072, 768))
      + ((4096, 4096, 4096),),
      convs=(
        (32, 56, 56, 64, 64),
        (32, 28, 28, 128, 128),
        (32, 14, 14, 256, 256),
        (32, 7, 7, 512, 512),
      ),
      case_size=4,
      repeats=3,
      granularities=("tensor", "channel"),
      predictor_models={
        "examples.gpt:make_gpt": ({}, 32, "text"),
        "resnet18": ({"width": 64, "image_size": 32}, 64, None),
      },
      predictor_plans=("fp32", "bf16", "int8", "first half int8"),
      predictor_precisions=("fp32", "bf16", "int8"),
      predictor_rounds=5,
      job_model_kwargs=dict(
        image_size=32, in_channels=3, widths=(128, 256), hidden=1024
      ),
      job_batch=128,
      job_indicator=sensitivity.DEFAULT_METHOD,
    )
  return Settings(
    platform,
    out_dir,
    gemms=((64, 64, 64),),
    convs=((2, 8, 8, 8, 8),),
    case_size=1,
    repeats=1,
    granularities=("tensor",),
    predictor_models={
      "cnn": ({"widths": [4, 8], "image_size": 8, "hidden": 8}, 4, None)
    },
    predictor_plans=("fp32", "int8"),
    predictor_precisions=("fp32", "int8"),
    predictor_rounds=1,
    job_model_kwargs=dict(image_size=8, in_channels=1, widths=(4, 8), hidden=8),
    job_batch=4,
    job_indicator="random",  # the dry run: the plumbing, not the scores
  )


class Deadline:
  """A section's time: ``left()`` seconds until it ends."""

  def __init__(self, seconds: float):
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()

  def expired(self) -> bool:
    return self.left() <= 0


def _subprocess(args, timeout: float, env=None) -> dict[str, Any]:
  """Runs ``args`` in the repository root; its status and output's tail
  (``timed_out`` where it ran past ``timeout``)."""
  env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
  try:
    p = subprocess.run(
      args,
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=max(timeout, 1.0),
    )
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else ""
    return {"returncode": None, "timed_out": True, "tail": out[-3000:]}
  return {
    "returncode": p.returncode,
    "timed_out": False,
    "tail": (p.stdout + p.stderr)[-3000:],
  }


def gpu_tests(s: Settings, deadline: Deadline) -> dict[str, Any]:
  """The ``gpu`` tests (``pytest -m gpu``) of ``tests/test_gpu.py`` and
  ``tests/test_selfcheck.py``: the counts of their summary line and each
  test's outcome."""
  env = {"JAX_PLATFORMS": "cpu"} if s.platform == "cpu" else {}
  args = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA"]
  result = _subprocess(
    args
    + ["-p", "no:cacheprovider", "tests/test_gpu.py"]
    + ["tests/test_selfcheck.py"],
    deadline.left(),
    env,
  )
  counts = {
    k: int(n)
    for n, k in re.findall(
      r"(\d+) (passed|failed|skipped|xfailed|xpassed|error)", result["tail"]
    )
  }
  outcomes = re.findall(
    r"^(PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR) (\S+)", result["tail"], re.M
  )
  return {**result, "counts": counts, "outcomes": outcomes}


def _paths_here(precision: Precision) -> tuple[str, ...]:
  """Both paths where the kernel can run on this device, else XLA's."""
  if precision not in (Precision.INT8, Precision.FP8):
    return ("xla",)
  cc = ops._gpu_capability()
  if jax.default_backend() == "gpu" and (
    cc is None or cc < ops._MIN_CAPABILITY[precision]
  ):
    return ("xla",)
  return ("pallas", "xla")


def _numerics_cases(s: Settings, deadline: Deadline, device) -> list[dict]:
  rows = []
  for p in safe_paths.CHECKED_PRECISIONS:
    for op in safe_paths.OPS:
      for path in _paths_here(p) if op == "dot_general" else ("xla",):
        sig = safe_paths.Signature(p.value, op, path)
        case = selfcheck.make_case(sig, s.case_size)
        for granularity in s.granularities:
          row = {"signature": str(sig), "granularity": granularity}
          if deadline.expired():
            rows.append({**row, "status": "out of time"})
            continue
          config = QuantConfig(granularity)
          try:
            jit = selfcheck.measure(case, device, quant=config)
            eager = selfcheck.measure(
              case, device, compiled=False, quant=config
            )
          except Exception as e:  # pylint: disable=broad-except
            rows.append({**row, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
          rows.append({**row, "compiled": jit, "op_by_op": eager})
  return rows


def _h200_reproduction(device) -> dict[str, Any]:
  """tests/test_gpu.py's case: an INT8 ``DotGeneral`` of float operands
  against the float32 product, compiled and op by op, and what isolates a
  fault: the int8 dot alone, a barrier between quantize and dot, the
  kernel, the safe paths."""
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(8, 8, 8)).astype(np.float32), device)
  w = jax.device_put(rng.normal(size=(8, 8)).astype(np.float32), device)
  dn = (((2,), (0,)), ((), ()))
  ref = np.einsum("bmk,kn->bmn", np.asarray(x, np.float64), np.asarray(w))
  op = ops.DotGeneral(Precision.INT8)

  def err(y) -> float:
    y = np.asarray(jax.device_get(y), np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))

  def barrier(a, b):
    (qa, sa), (qb, sb) = quant.quantize(a), quant.quantize(b)
    qa, qb = lax.optimization_barrier((qa, qb))
    acc = lax.dot_general(qa, qb, dn, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * (sa * sb)

  qx, sx = quant.quantize(x)
  qw, sw = quant.quantize(w)
  int_dot = jax.jit(
    lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=jnp.int32)
  )
  exact = np.einsum("bmk,kn->bmn", np.asarray(qx, np.int64), np.asarray(qw))
  out = {
    "op_by_op": err(op(x, w, dn)),
    "compiled": err(jax.jit(lambda a, b: op(a, b, dn))(x, w)),
    "int8_dot_alone_exact": bool(
      np.array_equal(np.asarray(int_dot(qx, qw), np.int64), exact)
    ),
    "barrier_compiled": err(jax.jit(barrier)(x, w)),
    "quantized_outside_jit": err(
      int_dot(qx, qw).astype(jnp.float32) * (sx * sw)
    ),
  }
  sig = safe_paths.Signature("int8", "dot_general", "xla")
  for to in sig.safe_paths():
    with safe_paths.switches({sig: to}):
      out[f"safe_{to}_compiled"] = err(jax.jit(lambda a, b: op(a, b, dn))(x, w))
  if "pallas" in _paths_here(Precision.INT8):
    with ops.kernel_backend("pallas"):
      out["pallas_compiled"] = err(jax.jit(lambda a, b: op(a, b, dn))(x, w))
  return out


def numerics(s: Settings, deadline: Deadline) -> dict[str, Any]:
  """Every signature compiled and op by op, the H200's reproduction and its
  isolation; on a GPU, the same again with XLA's Triton GEMM off."""
  device = jax.devices()[0]
  out: dict[str, Any] = {"cases": _numerics_cases(s, deadline, device)}
  if deadline.expired():
    return {**out, "h200_reproduction": {"status": "out of time"}}
  try:
    out["h200_reproduction"] = _h200_reproduction(device)
  except Exception as e:  # pylint: disable=broad-except
    out["h200_reproduction"] = {"error": f"{type(e).__name__}: {e}"[:300]}
  if s.platform == "gpu" and not os.environ.get(CHILD_ENV):
    flags = os.environ.get("XLA_FLAGS", "")
    child_dir = os.path.join(s.out_dir, "triton_gemm_off")
    args = [sys.executable, "-m", "experiments.device_report"]
    args += [f"--out={child_dir}", "--sections=numerics", "--platform=gpu"]
    run = _subprocess(
      args + [f"--budget_s={max(deadline.left(), 1):.0f}"],
      deadline.left() + 30,
      {
        "XLA_FLAGS": f"{flags} --xla_gpu_enable_triton_gemm=false",
        CHILD_ENV: "1",
      },
    )
    path = os.path.join(child_dir, "report.json")
    if os.path.exists(path):
      with open(path) as f:
        run["report"] = json.load(f)["sections"].get("numerics")
    out["triton_gemm_off"] = run
  return out


def _gemm_cases(m: int, k: int, n: int, seed: int = 0) -> dict[str, tuple]:
  """name -> (fn, args) of one (M, K) x (K, N) contraction per precision."""
  rng = np.random.default_rng(seed)
  xf = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  wf = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  x8 = jnp.asarray(rng.integers(-127, 128, (m, k)), jnp.int8)
  w8 = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
  e4x, e4w = xf.astype(jnp.float8_e4m3fn), wf.astype(jnp.float8_e4m3fn)
  one = jnp.float32(1.0)
  bm, bn, bk = (kernel_common.pick_block(d) for d in (m, n, k))
  blocks = dict(block_m=bm, block_n=bn, block_k=bk)
  hi, lo = lax.Precision.HIGHEST, lax.Precision.DEFAULT

  def scaled_fp8(a, b, sa, sb):  # XLA rewrites this to a scaled FP8 GEMM
    return jnp.dot(
      a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16),
      b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16),
      preferred_element_type=jnp.float32,
    )

  def planned(precision: str, backend: str):
    dot = ops.DotGeneral(Precision.parse(precision))

    def fn(a, b):
      with ops.kernel_backend(backend):
        return dot(a, b, (((1,), (0,)), ((), ())))

    return fn

  return {
    "fp32_highest": (lambda a, b: jnp.dot(a, b, precision=hi), (xf, wf)),
    "fp32_default": (lambda a, b: jnp.dot(a, b, precision=lo), (xf, wf)),
    "bf16": (jnp.dot, (xf.astype(jnp.bfloat16), wf.astype(jnp.bfloat16))),
    "fp16": (jnp.dot, (xf.astype(jnp.float16), wf.astype(jnp.float16))),
    "int8_xla": (
      lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.int32),
      (x8, w8),
    ),
    "fp8_xla": (
      lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32),
      (e4x, e4w),
    ),
    "fp8_xla_scaled": (scaled_fp8, (e4x, e4w, one, one)),
    "int8_pallas": (
      lambda *a: int8_matmul(*a, **blocks),
      (x8, w8, one, one),
    ),
    "fp8_pallas": (lambda *a: fp8_matmul(*a, **blocks), (e4x, e4w, one, one)),
    "int8_layer_xla": (planned("int8", "xla"), (xf, wf)),
    "int8_layer_pallas": (planned("int8", "pallas"), (xf, wf)),
    "fp8_layer_xla": (planned("fp8", "xla"), (xf, wf)),
    "fp8_layer_pallas": (planned("fp8", "pallas"), (xf, wf)),
  }


def _conv_cases(n, h, w, cin, cout, seed: int = 0) -> dict[str, tuple]:
  rng = np.random.default_rng(seed)
  xf = jnp.asarray(rng.standard_normal((n, h, w, cin)), jnp.float32)
  wf = jnp.asarray(rng.standard_normal((3, 3, cin, cout)), jnp.float32)
  dims = ("NHWC", "HWIO", "NHWC")

  def plain(precision=None):
    return lambda a, b: lax.conv_general_dilated(
      a, b, (1, 1), "SAME", dimension_numbers=dims, precision=precision
    )

  def planned(precision: str):
    conv = ops.ConvGeneralDilated(Precision.parse(precision))
    return lambda a, b: conv(a, b, (1, 1), "SAME", dimension_numbers=dims)

  return {
    "fp32_highest": (plain(lax.Precision.HIGHEST), (xf, wf)),
    "fp32_default": (plain(lax.Precision.DEFAULT), (xf, wf)),
    "bf16": (plain(), (xf.astype(jnp.bfloat16), wf.astype(jnp.bfloat16))),
    "fp16": (plain(), (xf.astype(jnp.float16), wf.astype(jnp.float16))),
    "int8_layer": (planned("int8"), (xf, wf)),
    "fp8_layer": (planned("fp8"), (xf, wf)),
    "bf16_layer": (planned("bf16"), (xf, wf)),
  }


def _time_cases(cases, flops, s: Settings, deadline: Deadline) -> dict:
  out = {}
  for name, (fn, args) in cases.items():
    if deadline.expired():
      out[name] = {"status": "out of time"}
      continue
    try:
      t = kernels_bench._time(fn, args, s.repeats, 3)
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
      continue
    out[name] = {"seconds": t, "tflops": flops / t / 1e12}
  return out


def throughput(s: Settings, deadline: Deadline) -> dict[str, Any]:
  """TFLOP/s per precision of each GEMM and convolution of
  :class:`Settings` (kernels off a GPU: Pallas interpret mode)."""
  gemms, convs = [], []
  for m, k, n in s.gemms:
    cases = _gemm_cases(m, k, n)
    gemms.append(
      {
        "shape": [m, k, n],
        "cases": _time_cases(cases, 2.0 * m * k * n, s, deadline),
      }
    )
  for shape in s.convs:
    n, h, w, cin, cout = shape
    flops = 2.0 * n * h * w * cout * 9 * cin
    cases = _conv_cases(*shape)
    convs.append(
      {"shape": list(shape), "cases": _time_cases(cases, flops, s, deadline)}
    )
  return {
    "interpret_mode": not kernel_common.on_gpu(),
    "gemms": gemms,
    "convs": convs,
  }


def predictor_child(arguments: str) -> None:
  """The predictor check of one model, in the child process
  :func:`predictor` starts: ``arguments`` is its JSON."""
  a = json.loads(arguments)
  spec = a["spec"]
  result = predictor_accuracy.evaluate(
    [spec],
    model_kwargs={spec: a["kwargs"]},
    batch_sizes={spec: a["batch"]},
    datasets={spec: a["dataset"]} if a["dataset"] else None,
    workers=(1,),
    rounds=a["rounds"],
    burst=3,
    precisions=a["precisions"],
    plan_names=a["plans"],
    plans_per_phase=len(a["plans"]),
  )
  files.write_text(a["out"], json.dumps(result, default=str))


def predictor(s: Settings, deadline: Deadline) -> dict[str, Any]:
  """The predictor's accuracy check
  (:func:`experiments.studies.predictor_accuracy.evaluate`: a measured
  profile, predicted against measured steps) with one worker on this
  device, a child process per model, killed at the deadline."""
  out = {}
  env = {"JAX_PLATFORMS": "cpu"} if s.platform == "cpu" else {}
  for spec, (kwargs, batch, dataset) in s.predictor_models.items():
    if deadline.expired():
      out[spec] = {"status": "out of time"}
      continue
    path = os.path.join(s.out_dir, f"predictor_{spec.split(':')[-1]}.json")
    arguments = dict(spec=spec, kwargs=kwargs, batch=batch, dataset=dataset)
    arguments.update(plans=list(s.predictor_plans), out=path)
    arguments.update(
      precisions=list(s.predictor_precisions), rounds=s.predictor_rounds
    )
    code = (
      "import sys; from experiments.benches import device_report_sections "
      "as s; s.predictor_child(sys.argv[1])"
    )
    run = _subprocess(
      [sys.executable, "-c", code, json.dumps(arguments)], deadline.left(), env
    )
    if run["returncode"] not in (0, None):
      run["status"] = "failed"
    elif run["returncode"] == 0:
      with open(path) as f:
        result = json.load(f)
      keep = ("plan", "predicted_s", "measured_s", "rel_error")
      run.update(
        {k: result.get(k) for k in ("mean_abs_rel_error", "max_abs_rel_error")},
        cases=[{k: c.get(k) for k in keep} for c in result.get("cases", [])],
      )
    out[spec] = run
  return out


def _step_seconds(model, plan, device, batch, s: Settings) -> float:
  import optax  # pylint: disable=g-import-not-at-top

  trainer = HybridTrainer(
    model,
    [Worker(device, "cpu", plan, batch[0].shape[0])],
    optax.sgd(0.01),
    objective=losses.cross_entropy,
    sample=batch,
  )
  batches = {0: tuple(jax.device_put(b, device) for b in batch)}
  state = [trainer.init()]

  def block(k):
    for _ in range(k):
      state[0], _ = trainer.train_step(state[0], batches)
    jax.block_until_ready(state[0].params)

  block(2)  # compiled, warmed
  return min(timing.seconds_per_call(block, 5) for _ in range(s.repeats))


def main_job(s: Settings, deadline: Deadline) -> dict[str, Any]:
  """The allocator's plan for this device's kind as the weak kind of a pair
  with the fastest catalog GPU (analytic profiles, the main job's timing
  CNN), its measured step against all-FP32 and all-BF16 here."""
  device = jax.devices()[0]
  kind = devices_lib.device_kind_of(device) if s.platform == "gpu" else "t4"
  partner = "h100" if kind == "h200" else "h200"
  model = models_lib.create_model("cnn", rngs=nnx.Rngs(0), **s.job_model_kwargs)
  batch = predictor_accuracy.sample_batch(model, s.job_batch)
  cluster = f"{partner}:1,{kind}:1"
  out: dict[str, Any] = {"kind": kind, "cluster": cluster, "steps": {}}
  scores = sensitivity.compute(
    model, losses.cross_entropy, [batch], s.job_indicator
  )
  if deadline.expired():
    return {**out, "status": "out of time"}
  result = pipeline.plan_cluster(
    model, cluster, scores, s.job_batch, baselines=False
  )
  planned = result.allocation.get(kind, PrecisionPlan())
  plans = {
    "fp32": PrecisionPlan(),
    "planned": planned,
    "bf16": PrecisionPlan.uniform(Precision.BF16),
  }
  if Precision.INT8 in devices_lib.supported_precisions(kind):
    plans["int8"] = PrecisionPlan.uniform(Precision.INT8)
  out["plan"] = planned.to_dict()
  # The allocator lowered no layer (this kind the faster): timed once.
  out["planned_is_fp32"] = planned.precisions() <= {Precision.FP32}
  for name, plan in plans.items():
    if deadline.expired():
      out["steps"][name] = {"status": "out of time"}
      continue
    if name == "planned" and out["planned_is_fp32"]:
      out["steps"][name] = dict(out["steps"]["fp32"])
      continue
    fresh = models_lib.create_model(
      "cnn", rngs=nnx.Rngs(0), **s.job_model_kwargs
    )
    out["steps"][name] = {
      "step_s": _step_seconds(fresh, plan, device, batch, s)
    }
  steps = {k: v.get("step_s") for k, v in out["steps"].items()}
  if all(steps.values()):
    out["planned_speedup_over_fp32"] = steps["fp32"] / steps["planned"]
    out["planned_speedup_over_bf16"] = steps["bf16"] / steps["planned"]
  return out


#: The sections in the order they run, and their shares of the budget.
SECTIONS: dict[str, tuple[Callable[[Settings, Deadline], dict], float]] = {
  "gpu_tests": (gpu_tests, 0.15),
  "numerics": (numerics, 0.15),
  "throughput": (throughput, 0.25),
  "predictor": (predictor, 0.30),
  "main_job": (main_job, 0.15),
}
