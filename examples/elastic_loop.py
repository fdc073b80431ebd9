r"""Your own training loop, elastic: it resumes onto whatever workers it has.

A loop written with library calls alone that runs under the elastic launcher
(or SLURM's requeue, or a JobSet's restarts) as the main job does: each
world trains on its slots' workers, a reclaim or a return makes every
process checkpoint the step they agree on and exit with status 75, and the
next world resumes from that checkpoint onto its own workers, keeping the
global batch. A tiny MLP learns the digits; ``--cluster`` names the pool,
one device kind per slot.

  python -m qsync_jax.distributed --num_processes=2 --elastic \
      --min_processes=1 --availability=avail.json -- \
      python examples/elastic_loop.py --out_dir=runs/loop --steps=40

Every step taken is one line of ``<out_dir>/steps.log`` (the world and the
step); the loss goes to ``metrics.jsonl`` and TensorBoard
(``tensorboard --logdir <out_dir>/tensorboard``); the end writes
``summary.json`` and the parameters (``params.npy``).
"""

import os
import signal

if __name__ == "__main__" and os.environ.get("QSYNC_ELASTIC_SLOTS"):
  # A reclaim notice (SIGTERM) may come while this process starts and would
  # kill it: held until the PreemptionWatch below takes it at a step.
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import argparse
import io
import sys
import time

from flax import nnx
import jax
from jax.flatten_util import ravel_pytree
import numpy as np
import optax

from qsync_jax import data
from qsync_jax import files
from qsync_jax import rundir
from qsync_jax.parallel import cluster
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.process import initialize
from qsync_jax.process import membership
from qsync_jax.process import preemption
from qsync_jax.process import run_start
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

#: The pool's plans: the T4s compute in FP16, the rest in FP32.
PLANS = {"t4": PrecisionPlan(default="fp16")}


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 32, rngs=rngs)
    self.out = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out_dir", required=True)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--cluster", default="v100:1,t4:1", help="the pool")
  parser.add_argument("--global_batch", type=int, default=32)
  parser.add_argument("--checkpoint_every", type=int, default=10)
  parser.add_argument(
    "--min_step_s",
    type=float,
    default=0.0,
    help="the least seconds a step takes, as a larger model's would",
  )
  args = parser.parse_args(argv)

  # Join the world's processes; in an elastic world, this world's slots.
  multi = initialize.initialize()
  world = membership.from_env()
  kinds = membership.world_kinds(
    cluster.parse_cluster(args.cluster).kinds, world
  )
  if not multi:  # one CPU device per worker (GPU backends ignore it)
    jax.config.update("jax_num_cpu_devices", len(kinds))
  devices = cluster.assign_devices(cluster.ClusterSpec(tuple(kinds)))
  writes = jax.process_index() == 0
  rundir.make_out_dir(args.out_dir)

  # The global batch a checkpoint records is kept, split over these workers.
  checkpointer = Checkpointer(os.path.join(args.out_dir, "checkpoints"))
  sizes = run_start.resume_batch_sizes(
    checkpointer.latest_meta(), kinds
  ) or cluster.split_batch(args.global_batch, kinds)
  plans = membership.world_plans(PLANS, kinds)
  workers = [
    Worker(d, k, plans.get(k, PrecisionPlan()), b)
    for d, k, b in zip(devices, kinds, sizes)
  ]
  digits = data.load_digits()
  batcher = data.WorkerBatcher(digits.x_train, digits.y_train, sizes, seed=0)
  trainer = HybridTrainer(
    MLP(nnx.Rngs(0)),
    workers,
    optax.sgd(0.1, momentum=0.9),
    sample=(digits.x_train[: sizes[0]], digits.y_train[: sizes[0]]),
  )
  state = trainer.init()
  # Onto other workers than the checkpoint's: every worker starts from the
  # saved workers' mean.
  restored = checkpointer.restore_latest(trainer, state)
  if restored is not None:
    state = restored.state
  restart = world.restart if world is not None else 0
  steps_log = os.path.join(args.out_dir, "steps.log")

  with (
    preemption.PreemptionWatch() as watch,
    rundir.MetricWriter(args.out_dir, start_step=state.step) as metrics,
  ):
    while state.step < args.steps:
      began = time.monotonic()
      batches = batcher.worker_batches(state.step, trainer.local_workers)
      state, out = trainer.train_step(state, batches)
      step, loss = state.step, float(np.mean([m["loss"] for m in out.values()]))
      if writes:
        files.append_line(steps_log, f"world {restart} step {step}")
      metrics.write(step, {"loss": loss, "num_workers": len(workers)})
      time.sleep(max(0.0, args.min_step_s - (time.monotonic() - began)))
      saved = args.checkpoint_every and step % args.checkpoint_every == 0
      if saved:
        checkpointer.save(trainer, state)
      # Every process reaches the step the processes agreed on together.
      if watch.reached(step):
        if not saved:
          checkpointer.save(trainer, state)
        checkpointer.close()
        print(f"notice: checkpointed step {step}; start again", flush=True)
        return membership.MEMBERSHIP_CHANGED_EXIT_CODE
  if checkpointer.latest_step() != state.step:
    checkpointer.save(trainer, state)
  checkpointer.close()
  final = trainer.evaluate(state, data.eval_set(digits))
  if writes:
    flat, _ = ravel_pytree(trainer.worker_params(state, 0))
    npy = io.BytesIO()
    np.save(npy, np.asarray(flat))
    files.write_bytes(os.path.join(args.out_dir, "params.npy"), npy.getvalue())
    summary = {"steps": state.step, "workers": kinds, **final}
    files.write_json(os.path.join(args.out_dir, "summary.json"), summary)
    print(f"done: step {state.step}, eval {final}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
