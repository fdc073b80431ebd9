"""Parameter averages on fake CPU devices that share few cores.

Four fake CPU devices on this machine's cores share XLA:CPU's pool of
threads. Workers of unequal speed under a local schedule let the devices'
queues drift apart; a parameter average then used to wait forever for the
devices behind (XLA aborts the process after 40 s), which the programs now
avoid by waiting for the devices' queued work first
(:func:`qsync_jax.train.programs.waits_for_local_work`).
"""

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import pytest

from examples import gpt
import qsync_jax as qs
from qsync_jax.parallel import schedules
from qsync_jax.train import programs
from qsync_jax.train.trainer import HybridTrainer
from qsync_jax.train.trainer import Worker

SEQ = 16
VOCAB = 64
STEPS = 60
# Two fast workers and two slow ones: the slow devices fall behind.
BATCH_SIZES = (1, 1, 128, 128)


def _trainer(schedule: schedules.Schedule, averager: str) -> HybridTrainer:
  """A one-block GPT's trainer over two fast and two slow workers."""
  model = gpt.make_gpt(
    rngs=nnx.Rngs(0),
    vocab_size=VOCAB,
    max_len=SEQ,
    num_layers=1,
    num_heads=2,
    emb_dim=16,
    mlp_dim=32,
  )
  workers = [
    Worker(d, "v100", qs.PrecisionPlan(), b)
    for d, b in zip(jax.devices(), BATCH_SIZES)
  ]
  return HybridTrainer(
    model,
    workers,
    optax.sgd(0.05),
    sample=(jnp.zeros((1, SEQ), jnp.int32),) * 2,
    sync=qs.SyncSettings(
      schedule=schedule, averager=qs.make_averager(averager)
    ),
  )


def _batches() -> list[dict[int, tuple[np.ndarray, np.ndarray]]]:
  """Two steps' batches of token ids (inputs and targets alike)."""
  rng = np.random.default_rng(0)
  return [
    {
      i: (rng.integers(0, VOCAB, (b, SEQ), dtype=np.int32),) * 2
      for i, b in enumerate(BATCH_SIZES)
    }
    for _ in range(2)
  ]


@pytest.mark.parametrize("averager", ["mean", "gqsgd"])
def test_qsr_on_a_gpt_on_unequal_fake_devices_finishes(averager):
  # alpha small for the learning rate: every round is h_base = 2 steps, a
  # local step and one that ends with the parameter average.
  schedule = schedules.QSR(0.05, total_steps=STEPS, alpha=0.01, h_base=2)
  trainer = _trainer(schedule, averager)
  batches = _batches()
  state = trainer.init()
  for step in range(STEPS):
    state, metrics = trainer.train_step(state, batches[step % 2])
  assert state.sync_rounds == STEPS // 2
  assert np.isfinite(np.asarray(state.params)).all()
  assert np.isfinite(float(metrics[0]["loss"]))


def test_waits_on_cpu_meshes_of_several_local_devices_only():
  devices = jax.devices()
  assert programs.waits_for_local_work(Mesh(np.array(devices), ("workers",)))
  assert not programs.waits_for_local_work(
    Mesh(np.array(devices[:1]), ("workers",))
  )
