"""Bring your own model: your NNX model and loop, qsync_jax's pieces.

A plain NNX CNN (BatchNorm, Dropout with its own RNG stream, no special
methods) trains on 4 devices in its own ``jax.shard_map`` + optax loop with an
INT8 convolution (a precision plan), QSR local SGD (a sync table indexed inside
the one jitted step) and Global-QSGD averaging of the parameter change.

  python examples/byo_model.py   # 4 fake CPU devices when no GPUs
"""

import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import qsync_jax as qs


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(16 * 64, 10, rngs=rngs)

  def __call__(self, x):
    x = self.drop(nnx.relu(self.bn(self.conv(x))))
    return self.head(x.reshape(x.shape[0], -1))


def main(
  steps: int = 300, n: int | None = None, batch: int = 32, lr: float = 0.05
):
  # XLA:CPU runs a lax.cond's collectives on its host thread pool: with more
  # fake devices than cores they can deadlock (seen: 4 on 2 cores).
  n = n or min(4, jax.device_count(), os.cpu_count() or 1)
  digits = load_digits()
  x = (digits.images / 16.0)[..., None].astype(np.float32)
  y = digits.target.astype(np.int32)
  model = CNN(nnx.Rngs(0))
  qs.apply_plan(model, qs.PrecisionPlan([("conv", "int8")]), x[:2])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  schedule = optax.cosine_decay_schedule(lr, steps)
  tx = optax.sgd(schedule, momentum=0.9)
  sync = jnp.asarray(
    qs.make_schedule(
      "qsr", lr_schedule=schedule, h_base=2, alpha=0.02, total_steps=steps
    ).sync_table(steps)
  )
  averager = qs.make_averager("gqsgd")  # int8 on the wire, global scale
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
  # Every worker holds its own copy (local SGD): stack a row per worker.
  stack = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)
  state = stack((params, rest, tx.init(params), params))

  @jax.jit
  @jax.shard_map(
    mesh=mesh,
    in_specs=(jax.P("data"), jax.P("data"), jax.P("data"), jax.P()),
    out_specs=(jax.P("data"), jax.P()),
  )
  def step(state, xb, yb, t):
    params, rest, opt, anchor = jax.tree.map(lambda a: a[0], state)

    model = nnx.merge(graphdef, params, rest)

    def loss_fn(m):
      logits = m(xb)
      return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    loss, g = nnx.value_and_grad(loss_fn)(model)  # updates BN stats, RNG
    rest = nnx.state(model, nnx.Not(nnx.Param))
    updates, opt = tx.update(g, opt, params)
    params = optax.apply_updates(params, updates)

    def average(p):  # a sync step: average the change since the last one
      delta = jax.tree.map(jnp.subtract, p, anchor)
      mean = qs.parallel.averagers.average_tree(
        averager, delta, jnp.float32(1 / n), "data"
      )
      p = jax.tree.map(jnp.add, anchor, mean)
      return p, p

    params, anchor = jax.lax.cond(
      sync[t], average, lambda p: (p, anchor), params
    )
    out = jax.tree.map(lambda a: a[None], (params, rest, opt, anchor))
    return out, jax.lax.pmean(loss, "data")

  rng = np.random.default_rng(0)
  for t in range(steps):
    idx = rng.integers(0, 1500, n * batch)
    state, loss = step(state, x[idx], y[idx], t)
  params, rest = jax.tree.map(lambda a: a[0], state[:2])
  test = nnx.merge(graphdef, params, rest)
  test.eval()
  accuracy = float((test(x[1500:]).argmax(-1) == y[1500:]).mean())
  print(
    f"loss {float(loss):.3f}, test accuracy {accuracy:.3f}, "
    f"{int(sync.sum())} syncs in {steps} steps"
  )
  return accuracy, int(sync.sum())


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 4)  # on CPU: four fake devices
  main()
