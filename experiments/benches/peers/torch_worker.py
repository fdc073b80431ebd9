r"""One process of a torch run: DDP, a torchft replica, or the compute floor.

Usage (one per process, under ``python -m qsync_jax.distributed``, which
sets ``QSYNC_COORDINATOR_ADDRESS``, ``QSYNC_NUM_PROCESSES`` and
``QSYNC_PROCESS_ID``):
  python -m experiments.benches.peers.torch_worker --out_dir=R \
      --system=ddp_fp32|ddp_fp16|ddp_powersgd|torchft_localsgd|
               torchft_diloco|torchft_streaming|torch_floor \
      [--seed=0] [--steps=N] [--model_kwargs=JSON] [--lighthouse_port=P] \
      [--recovery_log=FILE --min_replicas=K]

This module owns the torch trainer the peer benchmark runs. Everything that
decides what is learned comes from the main job's own code, so a torch
process and the JAX worker of the same index see the same task: the config
is the network study's (:func:`experiments.studies.network.run_config`),
the learning rate at each step is the job's optax schedule, the batches
are :func:`qsync_jax.data.training_batcher`'s for this worker at each step
(the same seed), the evaluation is on the same held-out split, and the
model is :class:`.torch_model.TorchCNN` with flax's initialization, the
same on every process. torch uses as many threads as the JAX process has
cores.

The clock starts once every process has run its first step and stops for
evaluations once every process has reached them (as ``train_time_s`` of
the main job: the slowest process's steps count). An evaluation of
replicas out of sync (torchft between syncs) is of their exact mean, one
float32 all-reduce over a side gloo group, as the main job evaluates its
workers' mean. Process 0 writes ``metrics.jsonl`` rows (``step``,
``train_time_s``, ``eval_accuracy``, ``eval_loss``) and ``summary.json``
(``final_eval_accuracy``, ``final_eval_loss``, ``steps``,
``train_time_s``, ``wall_time_s``, ...).

With ``--recovery_log`` (torchft only) nothing is evaluated, no side
group is made (replicas come and go) and the lighthouse is the caller's; each step appends ``{"t", "step",
"committed", "replica", "pid"}`` to the file, which
:mod:`.recovery` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from typing import Any

import numpy as np

from experiments import config_lib
from experiments.studies import network
from qsync_jax import data as data_lib
from qsync_jax import files

DDP = {"ddp_fp32": "fp32", "ddp_fp16": "fp16", "ddp_powersgd": "powersgd"}
TORCHFT = {
  "torchft_localsgd": "localsgd",
  "torchft_diloco": "diloco",
  "torchft_streaming": "streaming",
}
FLOOR = "torch_floor"
SYSTEMS = (*DDP, *TORCHFT, FLOOR)
#: PowerSGD's rank, as the network study's ``dp_powersgd``.
POWERSGD_RANK = 16
EVAL_BATCH = 256


def parse_args(argv: list[str]) -> argparse.Namespace:
  """The command line (see the module docstring)."""
  p = argparse.ArgumentParser(prog="torch_worker")
  p.add_argument("--out_dir", required=True)
  p.add_argument("--system", required=True, choices=SYSTEMS)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--model_kwargs", default=None)
  p.add_argument("--lighthouse_port", type=int, default=None)
  p.add_argument("--recovery_log", default=None)
  p.add_argument("--min_replicas", type=int, default=None)
  return p.parse_args(argv)


class Task:
  """What every process shares: the config, schedule, data and eval set."""

  def __init__(self, args: argparse.Namespace):
    """Builds the task of the network study's ``dp`` run at these flags."""
    kwargs = (
      None if args.model_kwargs is None else json.loads(args.model_kwargs)
    )
    config = network.run_config(
      "dp", args.seed, steps=args.steps, model_kwargs=kwargs
    )
    self.model_kwargs = config.model_kwargs.to_dict()
    job = config_lib.parse(config)
    self.job = job
    self.rank = int(os.environ["QSYNC_PROCESS_ID"])
    self.world = int(os.environ["QSYNC_NUM_PROCESSES"])
    self.coordinator = os.environ["QSYNC_COORDINATOR_ADDRESS"]
    schedule = config_lib.learning_rate(job).optax()
    self.lrs = [float(schedule(s)) for s in range(job.steps)]
    dataset = data_lib.load_dataset(job.dataset, **job.dataset_kwargs)
    self.batcher = data_lib.training_batcher(
      dataset, [job.batch_size] * self.world, seed=job.seed
    )
    self.eval_x, self.eval_y = data_lib.eval_set(dataset)

  def batch(self, step: int) -> tuple[Any, Any]:
    """This worker's examples at ``step`` as torch tensors."""
    import torch  # pylint: disable=g-import-not-at-top

    x, y = self.batcher.worker_batches(step, [self.rank])[self.rank]
    return torch.from_numpy(np.array(x, np.float32)), torch.from_numpy(
      np.array(y, np.int64)
    )


def evaluate(model: Any, task: Task) -> dict[str, float]:
  """Mean cross-entropy and accuracy over the held-out split."""
  import torch  # pylint: disable=g-import-not-at-top

  loss, correct, n = 0.0, 0, len(task.eval_x)
  model.eval()
  with torch.no_grad():
    for start in range(0, n, EVAL_BATCH):
      x = torch.from_numpy(np.array(task.eval_x[start : start + EVAL_BATCH]))
      y = torch.from_numpy(np.array(task.eval_y[start : start + EVAL_BATCH]))
      logits = model(x.float())
      loss += float(
        torch.nn.functional.cross_entropy(logits, y.long(), reduction="sum")
      )
      correct += int((logits.argmax(-1) == y).sum())
  model.train()
  return {"accuracy": correct / n, "loss": loss / n}


def mean_evaluate(model: Any, task: Task, in_sync: bool) -> dict[str, float]:
  """:func:`evaluate` of the processes' mean parameters (an all-reduce on
  the side group, unless they are ``in_sync``); the model is left as it
  was."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top

  if in_sync:
    return evaluate(model, task)
  params = list(model.parameters())
  saved = [p.detach().clone() for p in params]
  with torch.no_grad():
    flat = torch.cat([p.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= task.world
    offset = 0
    for p in params:
      p.copy_(flat[offset : offset + p.numel()].view_as(p))
      offset += p.numel()
  out = evaluate(model, task)
  with torch.no_grad():
    for p, s in zip(params, saved):
      p.copy_(s)
  return out


class Clock:
  """Training seconds: from the first step done everywhere, evals left out."""

  def __init__(self) -> None:
    """A clock not yet started."""
    self.start: float | None = None
    self.excluded = 0.0
    self.wall_start = time.perf_counter()

  def train_time(self) -> float:
    """Training seconds so far."""
    if self.start is None:
      return 0.0
    return time.perf_counter() - self.start - self.excluded


def _side_group(task: Task) -> None:
  """Joins the gloo group of all processes (DDP's, the barriers, the
  evaluations' means) through a store at the coordinator's address."""
  import datetime  # pylint: disable=g-import-not-at-top

  import torch.distributed as dist  # pylint: disable=g-import-not-at-top

  host, port = task.coordinator.rsplit(":", 1)
  store = dist.TCPStore(
    host,
    int(port),
    task.world,
    is_master=task.rank == 0,
    timeout=datetime.timedelta(seconds=300),
  )
  dist.init_process_group(
    "gloo", store=store, rank=task.rank, world_size=task.world
  )


def _ddp(model: Any, variant: str, steps: int) -> Any:
  """``model`` wrapped in DDP with ``variant``'s communication hook."""
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # pylint: disable=g-import-not-at-top
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # pylint: disable=g-import-not-at-top
  from torch.nn.parallel import DistributedDataParallel  # pylint: disable=g-import-not-at-top

  # PowerSGD's hook issues its collectives from the previous ones'
  # callbacks; with several buckets in flight at once, gloo ran them in
  # different orders on different processes (a size mismatch), so it gets
  # the whole model as one bucket.
  one_bucket = sum(p.numel() * 4 for p in model.parameters()) / 2**20 + 1
  ddp = DistributedDataParallel(
    model, bucket_cap_mb=one_bucket if variant == "powersgd" else None
  )
  if variant == "fp16":
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
  elif variant == "powersgd":
    state = powerSGD_hook.PowerSGDState(
      process_group=None,
      matrix_approximation_rank=POWERSGD_RANK,
      # torch's docs: about 10% of the steps with the plain all-reduce
      # first (at least 2, which error feedback and warm start need).
      start_powerSGD_iter=max(2, steps // 10),
      use_error_feedback=True,
      warm_start=True,
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
  return ddp


def _write_row(task: Task, out_dir: str, row: dict[str, Any]) -> None:
  if task.rank == 0:
    files.append_line(os.path.join(out_dir, "metrics.jsonl"), json.dumps(row))


def train(args: argparse.Namespace) -> dict[str, Any]:
  """Runs the steps; returns process 0's summary (every process's)."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top

  from experiments.benches.peers import torch_model  # pylint: disable=g-import-not-at-top

  threads = len(os.sched_getaffinity(0))
  torch.set_num_threads(threads)
  task = Task(args)
  job = task.job
  recovery = args.recovery_log is not None
  model = torch_model.build(task.model_kwargs, job.seed)
  if not recovery:
    _side_group(task)
  if args.system in DDP:
    net = _ddp(model, DDP[args.system], job.steps)
  else:
    net = model
  optimizer = torch.optim.SGD(
    model.parameters(), lr=task.lrs[0], momentum=job.momentum
  )
  state = {"step": 0}
  stack = contextlib.ExitStack()
  manager = None
  if args.system in TORCHFT:
    manager = _torchft(stack, args, task, model, optimizer, state)
  clock = Clock()
  last: dict[str, float] = {}
  with stack:
    while state["step"] < job.steps:
      step = state["step"]
      for group in optimizer.param_groups:
        group["lr"] = task.lrs[step]
      x, y = task.batch(step)
      optimizer.zero_grad()
      loss = torch.nn.functional.cross_entropy(net(x), y)
      loss.backward()
      optimizer.step()
      # Counted on the state, not from `step`: a torchft newcomer heals
      # inside optimizer.step() (the sync hook), which loads the peers' step.
      state["step"] += 1
      done = state["step"]
      if recovery:
        _log_step(args.recovery_log, task, done, manager)
        continue
      if clock.start is None:
        dist.barrier()
        clock.start = time.perf_counter()
      if done % job.eval_every == 0 or done == job.steps:
        # Every process's steps so far are training time, the slowest's
        # included (as the main job's evaluation clock).
        dist.barrier()
        eval_start = time.perf_counter()
        row = {
          "step": done,
          "train_time_s": clock.train_time(),
          "loss": float(loss.detach()),
        }
        in_sync = args.system not in TORCHFT or (
          manager is not None and _torchft_in_sync(args.system, done)
        )
        last = mean_evaluate(model, task, in_sync)
        row |= {f"eval_{k}": v for k, v in last.items()}
        _write_row(task, args.out_dir, row)
        clock.excluded += time.perf_counter() - eval_start
  summary = {
    "framework": "torch",
    "system": args.system,
    "final_eval_accuracy": last.get("accuracy"),
    "final_eval_loss": last.get("loss"),
    "steps": state["step"],
    "train_time_s": clock.train_time(),
    "wall_time_s": time.perf_counter() - clock.wall_start,
    "num_processes": task.world,
    "torch_threads": threads,
    "torch_version": torch.__version__,
    "seed": job.seed,
  }
  if not recovery:
    dist.barrier()
    dist.destroy_process_group()
  return summary


def _torchft_in_sync(system: str, step: int) -> bool:
  from experiments.benches.peers import torchft_side  # pylint: disable=g-import-not-at-top

  return torchft_side.in_sync_after(TORCHFT[system], step)


def _torchft(stack, args, task, model, optimizer, state) -> Any:
  """Starts the lighthouse (process 0), the manager and the algorithm on
  ``stack``; returns the manager."""
  import torch  # pylint: disable=g-import-not-at-top

  from experiments.benches.peers import torchft_side  # pylint: disable=g-import-not-at-top

  host = task.coordinator.rsplit(":", 1)[0]
  min_replicas = args.min_replicas or task.world
  if task.rank == 0 and args.recovery_log is None:
    lighthouse = torchft_side.start_lighthouse(
      f"{host}:{args.lighthouse_port}", min_replicas
    )
    stack.callback(lighthouse.shutdown)

  def state_dict() -> dict[str, Any]:
    return {
      "model": model.state_dict(),
      "optim": optimizer.state_dict(),
      "step": torch.tensor(state["step"]),
    }

  def load_state_dict(sd: dict[str, Any]) -> None:
    model.load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optim"])
    state["step"] = int(sd["step"])

  manager, store = torchft_side.make_manager(
    task.rank,
    socket.gethostbyname(socket.gethostname()),
    f"http://{host}:{args.lighthouse_port}",
    min_replicas,
    load_state_dict,
    state_dict,
  )
  stack.callback(lambda: manager.shutdown(wait=False))
  stack.callback(lambda: store)  # held until the manager is down
  stack.enter_context(
    torchft_side.algorithm(TORCHFT[args.system], manager, model, optimizer)
  )
  return manager


def _log_step(path: str, task: Task, step: int, manager: Any) -> None:
  row = {
    "t": time.time(),
    "step": step,
    "committed": None if manager is None else int(manager.current_step()),
    "replica": task.rank,
    "pid": os.getpid(),
  }
  files.append_line(path, json.dumps(row))


def main(argv: list[str]) -> None:
  """Trains; process 0 writes ``summary.json`` into ``--out_dir``."""
  args = parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  summary = train(args)
  if int(os.environ["QSYNC_PROCESS_ID"]) == 0 and args.recovery_log is None:
    files.write_json(
      os.path.join(args.out_dir, "summary.json"), summary, indent=2
    )


if __name__ == "__main__":
  main(sys.argv[1:])
