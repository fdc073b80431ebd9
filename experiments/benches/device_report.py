"""The device report: what a GPU's few minutes answer, run as one command.

:func:`run` runs the sections of :mod:`.device_report_sections` in order
(the ``gpu`` tests, every low-precision contraction compiled against op by
op, GEMM and convolution throughput per precision, the predictor's
step-time error, the main job's planned step against all-FP32 and
all-BF16), each within its share of the budget (what an earlier section
leaves is shared by the later ones), and writes ``report.json`` and
``report.md`` (the tables for the results page) after every section, so
that a run cut short keeps what it measured. A section that runs out of
time is recorded as such; one that raises is recorded with its error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import datetime
import json
import os
import time
import traceback
from typing import Any

import jax

from experiments.benches import device_report_sections as sections_lib
from qsync_jax import files

#: The sections, in the order they run.
SECTIONS = tuple(sections_lib.SECTIONS)


def run(
  out_dir: str,
  *,
  platform: str,
  budget_s: float = 480.0,
  sections: Sequence[str] | None = None,
  log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
  """Runs the report's sections and writes ``out_dir/report.{json,md}``.

  Args:
    out_dir: the report's directory (created).
    platform: ``"gpu"`` (real layer sizes) or ``"cpu"`` (a dry run at tiny
      sizes, the Pallas kernels in interpret mode).
    budget_s: the whole report's seconds; each section gets its share of
      what is left when it starts.
    sections: a subset of :data:`SECTIONS` (default: all), run in that
      order.
    log: one line per section (``None``: silent).

  Returns:
    The report: ``{"device", "device_kind", "platform", "jax_version",
    "date", "budget_s", "seconds", "sections": {name: {"status" ("done",
    "out of time", "error"), "seconds", "budget_s", "result" | "error"}}}``.

  Raises:
    ValueError: an unknown platform or section, or a budget under 1 s.
  """
  names = list(SECTIONS if sections is None else sections)
  unknown = sorted(set(names) - set(SECTIONS))
  if unknown or platform not in ("gpu", "cpu") or budget_s < 1:
    raise ValueError(
      f"device report: sections must be among {', '.join(SECTIONS)} (got "
      f"{unknown}), platform gpu or cpu (got {platform!r}), budget_s >= 1 "
      f"(got {budget_s})"
    )
  os.makedirs(out_dir, exist_ok=True)
  settings = sections_lib.settings_for(platform, out_dir)
  device = jax.devices()[0]
  report: dict[str, Any] = {
    "device": str(device),
    "device_kind": device.device_kind,
    "platform": platform,
    "jax_version": jax.__version__,
    "date": datetime.datetime.now(datetime.UTC).isoformat(),
    "budget_s": budget_s,
    "sections": {},
  }
  start = time.monotonic()
  for i, name in enumerate(names):
    left = budget_s - (time.monotonic() - start)
    shares = [sections_lib.SECTIONS[n][1] for n in names[i:]]
    budget = max(left * shares[0] / sum(shares), 0.0)
    report["sections"][name] = _run_section(name, settings, budget)
    report["seconds"] = time.monotonic() - start
    write(report, out_dir)
    if log is not None:
      entry = report["sections"][name]
      log(
        f"{name}: {entry['status']} in {entry['seconds']:.1f} s "
        f"(budget {budget:.0f} s)"
      )
  return report


def _run_section(name: str, settings, budget: float) -> dict[str, Any]:
  fn = sections_lib.SECTIONS[name][0]
  deadline = sections_lib.Deadline(budget)
  begin = time.monotonic()
  entry: dict[str, Any] = {"budget_s": budget}
  try:
    entry["result"] = fn(settings, deadline)
    entry["status"] = "out of time" if _cut_short(entry["result"]) else "done"
  except Exception as e:  # pylint: disable=broad-except
    entry["status"] = "error"
    entry["error"] = "".join(traceback.format_exception_only(e)).strip()[-2000:]
  entry["seconds"] = time.monotonic() - begin
  return entry


def _cut_short(result: Any) -> bool:
  """Whether a section left a case undone (a status or a timed-out run)."""
  if isinstance(result, dict):
    if result.get("status") == "out of time" or result.get("timed_out"):
      return True
    return any(_cut_short(v) for v in result.values())
  if isinstance(result, list):
    return any(_cut_short(v) for v in result)
  return False


def write(report: dict[str, Any], out_dir: str) -> None:
  """Writes ``report.json`` and ``report.md`` whole (each replaced)."""
  files.write_text(
    os.path.join(out_dir, "report.json"), json.dumps(report, indent=1)
  )
  files.write_text(os.path.join(out_dir, "report.md"), markdown(report))


def _fmt(v: Any, spec: str = ".3g") -> str:
  if v is None:
    return "–"
  if isinstance(v, float):
    return format(v, spec)
  return str(v)


def _numerics_md(r: dict[str, Any]) -> list[str]:
  lines = [
    "| contraction | scales | compiled: rel. error | bound ratio | "
    "op by op: rel. error | ok |",
    "|---|---|---|---|---|---|",
  ]
  for c in r.get("cases", []):
    jit, eager = c.get("compiled", {}), c.get("op_by_op", {})
    ok = (
      c.get("status")
      or c.get("error")
      or ("yes" if jit.get("ok") and eager.get("ok") else "**no**")
    )
    lines.append(
      f"| {c['signature']} | {c['granularity']} | "
      f"{_fmt(jit.get('rel_error'))} | {_fmt(jit.get('bound_ratio'))} | "
      f"{_fmt(eager.get('rel_error'))} | {ok} |"
    )
  repro = r.get("h200_reproduction", {})
  if repro:
    lines += ["", "| the H200's case (8×8×8 by 8×8, INT8) | rel. error |"]
    lines += ["|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in repro.items()]
  off = r.get("triton_gemm_off")
  if off:
    sub = off.get("report") or {}
    bad = [
      c["signature"]
      for c in (sub.get("result") or {}).get("cases", [])
      if not c.get("compiled", {}).get("ok", True)
    ]
    lines += [
      "",
      f"XLA's Triton GEMM off (child run, status {sub.get('status')}): "
      f"wrong compiled: {', '.join(bad) or 'none'}",
    ]
  return lines


def _throughput_md(r: dict[str, Any]) -> list[str]:
  lines = []
  for what in ("gemms", "convs"):
    rows = r.get(what, [])
    if not rows:
      continue
    names = list(rows[0]["cases"])
    label = "GEMM M×K×N" if what == "gemms" else "3×3 conv N,H,W,Cin,Cout"
    lines += ["", f"| {label} | " + " | ".join(names) + " |"]
    lines += ["|---|" + "---|" * len(names)]
    for row in rows:
      cells = []
      for n in names:
        c = row["cases"].get(n, {})
        cells.append(
          _fmt(c.get("tflops"))
          if "tflops" in c
          else ("error" if "error" in c else c.get("status", "–"))
        )
      shape = "×".join(str(d) for d in row["shape"])
      lines.append(f"| {shape} | " + " | ".join(cells) + " |")
  if r.get("interpret_mode"):
    lines.append("\nTFLOP/s; the Pallas kernels ran in interpret mode.")
  return lines


def _predictor_md(r: dict[str, Any]) -> list[str]:
  lines = ["| model | mean abs. error | max abs. error | cases | status |"]
  lines += ["|---|---|---|---|---|"]
  for spec, m in r.items():
    status = m.get("status") or (
      "timed out"
      if m.get("timed_out")
      else ("done" if m.get("returncode") == 0 else f"rc {m.get('returncode')}")
    )
    lines.append(
      f"| {spec} | {_fmt(m.get('mean_abs_rel_error'))} | "
      f"{_fmt(m.get('max_abs_rel_error'))} | {len(m.get('cases', []))} | "
      f"{status} |"
    )
  return lines


def _main_job_md(r: dict[str, Any]) -> list[str]:
  fp32 = " (all FP32: the allocator lowered no layer)"
  lines = [
    f"Plan for {r.get('kind')} as the weak kind of {r.get('cluster')}"
    f"{fp32 if r.get('planned_is_fp32') else ''}: "
    f"`{json.dumps(r.get('plan'))}`",
    "",
    "| plan | step (ms) | planned speed-up |",
    "|---|---|---|",
  ]
  for name, step in r.get("steps", {}).items():
    ms = step.get("step_s")
    speed = {
      "fp32": r.get("planned_speedup_over_fp32"),
      "bf16": r.get("planned_speedup_over_bf16"),
    }.get(name)
    lines.append(
      f"| {name} | {_fmt(ms * 1e3 if ms else None)} | {_fmt(speed)} |"
    )
  return lines


_SECTION_MD = {
  "numerics": _numerics_md,
  "throughput": _throughput_md,
  "predictor": _predictor_md,
  "main_job": _main_job_md,
}


def markdown(report: dict[str, Any]) -> str:
  """The report as Markdown tables, one section each."""
  lines = [
    f"# Device report: {report['device_kind']} ({report['platform']})",
    "",
    f"jax {report['jax_version']}, {report['date']}, budget "
    f"{report['budget_s']:.0f} s, took {report.get('seconds', 0):.0f} s.",
  ]
  for name, entry in report["sections"].items():
    lines += ["", f"## {name}", ""]
    lines.append(f"{entry['status']} in {entry['seconds']:.1f} s.")
    if entry["status"] == "error":
      lines += ["", "```", entry["error"], "```"]
      continue
    result = entry["result"]
    if name == "gpu_tests":
      lines.append(
        f"\nCounts: {json.dumps(result.get('counts'))}; "
        + ", ".join(f"{o} {t}" for o, t in result.get("outcomes", []))
      )
    else:
      lines += [""] + _SECTION_MD[name](result)
  return "\n".join(lines) + "\n"
