"""Recovery side by side: a replica SIGKILLed mid-run and started again.

This module owns the bench's recovery section. The same job (the bench's
task, ``num_processes`` processes behind the bench's links) loses its last
process to SIGKILL a third of the way through and gets it back:

* torchft (:func:`torchft_repeat`): the replicas keep training; the
  process is started again at once in the same network namespace, joins
  the next quorum and heals from a peer. Each replica appends a row per
  step (:mod:`.torch_worker` ``--recovery_log``). ``stall_s``: the longest
  gap between a survivor's steps after the kill, less its usual step;
  ``newcomer_s``: from the restart to the newcomer's first step with a
  committed step count (it has joined a quorum and healed);
  ``seconds_lost`` their sum; ``steps_lost``: the killed replica's steps
  its successor did not inherit (it inherits the step it heals to).
* qsync_jax (:func:`qsync_repeat`): the main job under the elastic
  launcher (``python -m qsync_jax.distributed --elastic``, the
  :mod:`experiments.studies.elastic` machinery), checkpointing every
  :data:`CHECKPOINT_EVERY` steps; the launcher restarts the world without
  the dead slot and again when it returns (``--rejoin_after``; a return
  that reaches a world that has not stepped ends it at once, and the two
  events are one change). Its seconds and steps lost are the run's
  membership entries (``summary.json["membership"]``), summed over its
  changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from experiments.studies import elastic
from qsync_jax import files
from qsync_jax.launch import links
from qsync_jax.launch import local

#: The qsync_jax job's checkpoint period under the elastic launcher.
CHECKPOINT_EVERY = 5
#: Seconds after its death that the killed slot returns.
REJOIN_AFTER_S = 1.0
POLL_S = 0.1


def kill_step(steps: int) -> int:
  """The step after which the last process is killed: a third of the run."""
  return max(1, steps // 3)


def _rows(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def torchft_measures(
  rows: Sequence[Mapping[str, Any]],
  killed_pid: int,
  new_pid: int,
  t_kill: float,
  t_restart: float,
) -> dict[str, Any]:
  """The seconds and steps the kill cost, from the replicas' step rows."""
  stalls = []
  for replica in sorted({r["replica"] for r in rows if r["pid"] != killed_pid}):
    mine = [r for r in rows if r["replica"] == replica and r["pid"] != new_pid]
    if not mine or mine[0]["pid"] == killed_pid:
      continue
    t = np.array([r["t"] for r in mine])
    gaps = np.diff(t)
    before = gaps[t[1:] <= t_kill]
    after = gaps[t[1:] > t_kill]
    usual = float(np.median(before)) if len(before) else 0.0
    if len(after):
      stalls.append(max(0.0, float(after.max()) - usual))
  new = [r for r in rows if r["pid"] == new_pid]
  committed = [r for r in new if r["committed"]]
  killed = [r["step"] for r in rows if r["pid"] == killed_pid]
  newcomer_s = committed[0]["t"] - t_restart if committed else None
  stall_s = max(stalls) if stalls else None
  return {
    "stall_s": stall_s,
    "newcomer_s": newcomer_s,
    "seconds_lost": (
      None if stall_s is None or newcomer_s is None else stall_s + newcomer_s
    ),
    # The newcomer's steps before it healed are its own, from nothing; the
    # step it healed to is what it inherited.
    "steps_lost": (
      max(0, max(killed) - (committed[0]["step"] - 1))
      if killed and committed
      else None
    ),
    "newcomer_finished": bool(new)
    and new[-1]["step"] == max(r["step"] for r in rows),
  }


def _start(cmd: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
  return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def torchft_repeat(
  worker_cmd: Sequence[str],
  run_dir: str,
  *,
  num_processes: int,
  steps: int,
  lighthouse_port: int,
  link: links.LinkSpec | None,
  timeout_s: float,
) -> dict[str, Any]:
  """One torchft recovery: ``worker_cmd`` (a torch worker command with
  ``--recovery_log`` and ``--lighthouse_port``) on every process, beside a
  lighthouse of their own at that port; the last one killed and
  restarted."""
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, "steps.jsonl")
  if os.path.exists(path):
    os.remove(path)
  port = local.free_port()
  with contextlib.ExitStack() as stack:
    emulator = None
    host = "127.0.0.1"
    if link is not None:
      emulator = stack.enter_context(links.LinkEmulator(num_processes, link))
      host = emulator.address(0)
    base = local.launch_env(os.environ, f"{host}:{port}", num_processes)
    log = stack.enter_context(open(os.path.join(run_dir, "log.txt"), "w"))

    def start(i: int) -> subprocess.Popen:
      cmd = list(worker_cmd)
      if emulator is not None:
        cmd = emulator.wrap(i, cmd)
      return _start(cmd, {**base, "QSYNC_PROCESS_ID": str(i)}, log)

    # The lighthouse outlives every replica: a newcomer that comes late
    # still finds it.
    beacon = [
      sys.executable,
      "-m",
      "experiments.benches.peers.torchft_side",
      f"{host}:{lighthouse_port}",
      str(max(1, num_processes - 1)),
    ]
    if emulator is not None:
      beacon = emulator.wrap(0, beacon)
    lighthouse = _start(beacon, base, log)
    procs = [start(i) for i in range(num_processes)]
    last = num_processes - 1
    deadline = time.monotonic() + timeout_s
    try:
      while not any(
        r["replica"] == last and r["step"] >= kill_step(steps)
        for r in _rows(path)
      ):
        if time.monotonic() > deadline or procs[last].poll() is not None:
          raise RuntimeError(f"torchft recovery in {run_dir} never got going")
        time.sleep(POLL_S)
      killed_pid = procs[last].pid
      t_kill = time.time()
      procs[last].send_signal(signal.SIGKILL)
      procs[last].wait()
      t_restart = time.time()
      procs[last] = start(last)
      for p in procs[:last]:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
      with contextlib.suppress(subprocess.TimeoutExpired):
        procs[last].wait(timeout=30)
    finally:
      for p in [*procs, lighthouse]:
        if p.poll() is None:
          p.kill()
          p.wait()
  out = torchft_measures(
    _rows(path), killed_pid, procs[last].pid, t_kill, t_restart
  )
  files.write_json(os.path.join(run_dir, "recovery.json"), out, indent=2)
  return out


def _descendants(root: int) -> list[int]:
  """Every process below ``root`` (from /proc)."""
  parents: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        continue
      parents.setdefault(ppid, []).append(int(name))
  out, todo = [], [root]
  while todo:
    for child in parents.get(todo.pop(), []):
      out.append(child)
      todo.append(child)
  return out


def _trainer_pid(root: int, process_id: int) -> int | None:
  """The main job's process ``process_id`` below ``root``."""
  for pid in _descendants(root):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
      with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    except OSError:
      continue
    if (
      b"experiments.train" in cmdline
      and f"QSYNC_PROCESS_ID={process_id}".encode() in environ
      and b"python" in cmdline.split(b"\0")[0]
    ):
      return pid
  return None


def qsync_repeat(
  job_cmd: Sequence[str],
  run_dir: str,
  *,
  num_processes: int,
  steps: int,
  link: str | None,
  timeout_s: float,
) -> dict[str, Any]:
  """One elastic recovery of the main job ``job_cmd`` (its command after
  ``--``): its last process SIGKILLed a third of the way through."""
  cmd = elastic.launcher_command(
    num_processes, max(1, num_processes - 1), link=link, timeout_s=timeout_s
  )
  cmd = [*cmd[:-1], f"--rejoin_after={REJOIN_AFTER_S:g}", "--", *job_cmd]
  cmd += [f"--config.checkpoint_every={CHECKPOINT_EVERY}"]
  killed: dict[str, Any] = {}
  me = os.getpid()

  def killer() -> None:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
      if any(r.get("step", 0) >= kill_step(steps) for r in _rows(metrics)):
        pid = _trainer_pid(me, num_processes - 1)
        if pid is not None:
          os.kill(pid, signal.SIGKILL)
          killed.update(pid=pid, t=time.time())
          return
      time.sleep(POLL_S)

  if os.path.exists(run_dir):
    import shutil  # pylint: disable=g-import-not-at-top

    shutil.rmtree(run_dir)
  os.makedirs(os.path.dirname(run_dir), exist_ok=True)
  thread = threading.Thread(target=killer, daemon=True)
  thread.start()
  launched = elastic.launch(cmd, run_dir, timeout_s=timeout_s)
  thread.join(timeout=1)
  summary_path = os.path.join(run_dir, "summary.json")
  summary: dict[str, Any] = {}
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  changes = summary.get("membership", [])
  lost_s = [c["seconds_lost"] for c in changes]
  out = {
    "killed": bool(killed),
    "exit": launched.code,
    "steps": summary.get("steps"),
    "changes": [
      {k: c.get(k) for k in ("cause", "steps_lost", "seconds_lost")}
      for c in changes
    ],
    "seconds_lost": (
      float(sum(lost_s)) if lost_s and None not in lost_s else None
    ),
    "steps_lost": int(sum(c["steps_lost"] for c in changes)),
  }
  files.write_json(os.path.join(run_dir + ".recovery.json"), out, indent=2)
  return out


def summarize(repeats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Means over the repeats of seconds and steps lost (None if none)."""

  def mean(key: str) -> float | None:
    values = [r[key] for r in repeats if r.get(key) is not None]
    return float(np.mean(values)) if values else None

  return {
    "repeats": list(repeats),
    "seconds_lost_mean": mean("seconds_lost"),
    "steps_lost_mean": mean("steps_lost"),
  }
