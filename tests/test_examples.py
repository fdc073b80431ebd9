"""The examples/ scripts run and do what their docstrings say."""

from examples import byo_model


def test_byo_model_loop_learns_with_int8_qsr_and_gqsgd():
  # The user's own shard_map + optax loop: an INT8 convolution, QSR local
  # SGD (fewer syncs than steps) and Global-QSGD averages.
  accuracy, syncs = byo_model.main(steps=120, n=2)
  assert 0 < syncs < 120
  assert accuracy > 0.8
