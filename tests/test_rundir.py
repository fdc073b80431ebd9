"""A run directory's metrics: metrics.jsonl and TensorBoard, written together.

The event files are read back as TensorBoard reads them: TFRecords (an
8-byte little-endian length, its masked CRC-32C, the payload, the payload's
masked CRC-32C) of ``tensorboardX.proto.event_pb2.Event``, loaded in name
order, a ``SessionLog.START`` at step ``s`` hiding every event loaded before
it from step ``s`` on. The main job runs in-process on conftest's fake CPU
devices.
"""

import json
import os
import shutil
import struct

import ml_collections
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
from qsync_jax import rundir
from qsync_jax.rundir import metrics


def _events(directory):
  """Every event of every event file in ``directory``, in name order."""
  events = []
  for name in sorted(os.listdir(directory)):
    assert ".tfevents." in name, name
    data = (directory / name).read_bytes()
    pos = 0
    while pos < len(data):
      header = data[pos : pos + 8]
      (length,) = struct.unpack("<Q", header)
      (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
      assert header_crc == masked_crc32c(header)
      payload = data[pos + 12 : pos + 12 + length]
      (crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
      assert crc == masked_crc32c(payload)
      events.append(event_pb2.Event.FromString(payload))
      pos += 16 + length
  return events


def _shown(directory):
  """``[(tag, step, value)]`` as TensorBoard shows them, purges applied."""
  shown = []
  for event in _events(directory):
    if (
      event.HasField("session_log")
      and event.session_log.status == event_pb2.SessionLog.START
    ):
      shown = [s for s in shown if s[1] < event.step]
    shown += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return shown


def _rows(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def _as_scalars(rows):
  """The rows' numbers as ``[(tag, step, value)]``."""
  return [
    (name, row["step"], value)
    for row in rows
    for name, value in row.items()
    if name != "step"
    and isinstance(value, (int, float))
    and not isinstance(value, bool)
  ]


def _same(shown, rows):
  """TensorBoard shows each number of ``rows`` once, at float32."""
  expected = _as_scalars(rows)
  assert sorted(s[:2] for s in shown) == sorted(s[:2] for s in expected)
  values = {s[:2]: s[2] for s in shown}
  for tag, step, value in expected:
    assert values[tag, step] == pytest.approx(value, rel=1e-6), (tag, step)


def test_a_writer_logs_rows_and_scalars_and_a_resume_keeps_its_step(tmp_path):
  with rundir.MetricWriter(str(tmp_path), active=True) as writer:
    for step in (1, 2, 3):
      writer.write(step, {"loss": 1.0 / step, "note": "x", "ok": True})
  rows = _rows(tmp_path)
  assert rows[0] == {"step": 1, "loss": 1.0, "note": "x", "ok": True}
  # Only numbers are scalars: not strings, not booleans.
  assert _shown(tmp_path / "tensorboard") == [
    ("loss", s, pytest.approx(1.0 / s)) for s in (1, 2, 3)
  ]
  with pytest.raises(ValueError, match="closed"):
    writer.write(4, {"loss": 0.25})
  # Resumed at step 1: the rows and the events after it go.
  resumed = rundir.MetricWriter(str(tmp_path), start_step=1, active=True)
  resumed.write(2, {"loss": 0.4})
  resumed.close()
  assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
  _same(_shown(tmp_path / "tensorboard"), _rows(tmp_path))
  [first, second] = sorted(os.listdir(tmp_path / "tensorboard"))
  assert first != second
  # A new run (step 0) starts both anew.
  rundir.MetricWriter(str(tmp_path), active=True).close()
  assert not (tmp_path / "metrics.jsonl").exists()
  assert _shown(tmp_path / "tensorboard") == []


def test_a_process_that_does_not_write_writes_nothing(tmp_path):
  writer = rundir.MetricWriter(str(tmp_path), active=False)
  writer.write(1, {"loss": 1.0})
  writer.close()
  assert os.listdir(tmp_path) == []


def test_a_damaged_row_before_the_last_is_refused_on_resume(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
    '{"step": 1}\nnot json\n{"step": 2}\n'
  )
  with pytest.raises(ValueError, match="line 2 is not a metrics record"):
    rundir.MetricWriter(str(tmp_path), start_step=2, active=True)
  assert not (tmp_path / "tensorboard").exists()
  assert metrics.last_logged_step(str(tmp_path / "metrics.jsonl")) == 2


def _job(**fields):
  """A tiny CNN on one worker: logs at 2 and 4, evaluates at 4."""
  config = default_config.get_config()
  config.cluster = "v100:1"
  config.model_kwargs = ml_collections.ConfigDict(
    {"widths": [2, 2], "hidden": 4}
  )
  config.batch_size = 8
  config.steps = 4
  config.log_every = 2
  config.eval_every = 4
  config.checkpoint_every = 2
  for name, value in fields.items():
    setattr(config, name, value)
  return config_lib.parse(config)


def test_the_main_job_writes_tensorboard_and_a_resume_purges_later_steps(
  tmp_path,
):
  out = tmp_path / "run"
  train_lib.train_and_evaluate(_job(), str(out))
  rows = _rows(out)
  assert [r["step"] for r in rows] == [2, 4]
  shown = _shown(out / "tensorboard")
  _same(shown, rows)
  assert {"loss", "examples_per_s", "num_workers", "eval_loss"} <= {
    tag for tag, _, _ in shown
  }
  # Killed after step 4 was logged, before its checkpoint was complete:
  # the resume restores step 2 and trains steps 3 and 4 again.
  shutil.rmtree(out / "checkpoints" / "4")
  os.remove(out / "summary.json")
  summary = train_lib.train_and_evaluate(_job(resume=True), str(out))
  assert summary["steps_this_run"] == 2
  rows = _rows(out)
  assert [r["step"] for r in rows] == [2, 4]
  # Both runs logged step 4; TensorBoard shows the resumed run's alone,
  # as metrics.jsonl keeps it.
  assert (
    sum(
      e.step == 4 and bool(e.summary.value)
      for e in _events(out / "tensorboard")
    )
    == 2
  )
  _same(_shown(out / "tensorboard"), rows)
