"""TensorBoard event records, checked byte for byte against the generated
messages (tensorboardX's copy of TensorBoard's event.proto and summary.proto).
"""

import importlib.util
import os
import random
import subprocess
import sys

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2
from tensorboardX.record_writer import masked_crc32c as reference_masked_crc

from qsync_jax.rundir import tfevents


def _framed(event):
  return tfevents.frame(event.SerializeToString())


def test_the_masked_crc_matches_the_tfrecord_readers():
  rng = random.Random(0)
  for size in [0, 1, 7, 8, 31, 200, 1000]:
    data = bytes(rng.randrange(256) for _ in range(size))
    assert tfevents.masked_crc32c(data) == reference_masked_crc(data)


@pytest.mark.parametrize("wall_time", [0.0, 1.5, 1_764_000_000.123456])
def test_the_file_version_record_is_the_generated_messages(wall_time):
  expected = event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2")
  assert tfevents.file_version_record(wall_time) == _framed(expected)


@pytest.mark.parametrize("step", [0, 1, 127, 128, 300_000, 2**40, -1])
def test_the_purge_record_is_the_generated_messages(step):
  expected = event_pb2.Event(
    wall_time=12.25,
    step=step,
    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
  )
  assert tfevents.purge_record(12.25, step) == _framed(expected)


def test_scalars_records_are_the_generated_messages():
  scalars = {
    "loss": 0.25,
    "zero": 0.0,
    "negative": -3.5,
    "big": 1e40,
    "small": -1e40,
    "nan": float("nan"),
    "inf": float("inf"),
    "integer": 7,
    "": 1.0,
    "tag/with-ünïcode": 2.0,
    "x" * 200: 3.0,
  }
  expected = event_pb2.Event(
    wall_time=99.5,
    step=1234,
    summary=summary_pb2.Summary(
      value=[
        summary_pb2.Summary.Value(tag=tag, simple_value=value)
        for tag, value in scalars.items()
      ]
    ),
  )
  assert tfevents.scalars_record(99.5, 1234, scalars) == _framed(expected)


@pytest.mark.skipif(
  importlib.util.find_spec("torch") is None,
  reason="PyTorch is not installed, so nothing could import it",
)
def test_importing_the_library_and_the_train_binary_leaves_out_pytorch():
  # PyTorch in the environment (as for the peer bench) costs seconds at
  # every process start when anything imports it.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = (
    "import sys, qsync_jax, experiments.train; "
    "print(sorted({'torch', 'tensorboardX', 'tensorflow'} & set(sys.modules)))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=root,
    capture_output=True,
    text=True,
    check=True,
  )
  assert out.stdout.strip() == "[]", out.stdout
