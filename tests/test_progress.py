"""Tests for experiments.progress: the estimate, the line's format, and
the studies and bench that print it."""

import pytest

from experiments import progress
from experiments.benches import compression
from experiments.studies import qsr
from experiments.studies import qsync


class FakeClock:
  """A clock the test moves by hand."""

  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def test_durations_read_as_seconds_minutes_or_hours():
  assert progress.format_duration(0) == "0 s"
  assert progress.format_duration(41.4) == "41 s"
  assert progress.format_duration(99.4) == "99 s"
  assert progress.format_duration(99.6) == "2 min"
  assert progress.format_duration(360) == "6 min"
  assert progress.format_duration(99 * 60) == "99 min"
  assert progress.format_duration(100 * 60) == "1.7 h"
  assert progress.format_duration(9000) == "2.5 h"
  for bad in (-1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="finite and >= 0"):
      progress.format_duration(bad)


def test_estimate_is_mean_time_per_unit_times_units_left():
  clock, lines = FakeClock(), []
  p = progress.Progress(12, log=lines.append, clock=clock)
  with pytest.raises(ValueError, match="no unit of work has finished"):
    p.seconds_left()
  # Units of 20 s, 30 s and 41 s: mean 30.33 s, 9 left -> 273 s = 5 min.
  for took, what in (
    (20, "qsr cnn seed 0"),
    (30, "qsr cnn seed 1"),
    (41, "qsr cnn seed 2"),
  ):
    clock.now += took
    line = p.done(what)
  assert p.seconds_left() == pytest.approx(91 / 3 * 9)
  assert line == "[3/12] qsr cnn seed 2 done in 41 s; about 5 min left"
  assert lines[0] == "[1/12] qsr cnn seed 0 done in 20 s; about 4 min left"
  assert lines[1] == "[2/12] qsr cnn seed 1 done in 30 s; about 4 min left"
  assert lines[-1] == line and len(lines) == 3


def test_last_unit_reports_the_total_and_no_more_are_taken():
  clock, lines = FakeClock(), []
  p = progress.Progress(2, log=lines.append, clock=clock)
  clock.now += 50
  p.done("size 1M")
  clock.now += 70
  assert p.done("size 4M") == "[2/2] size 4M done in 70 s; all done in 2 min"
  assert p.seconds_left() == 0
  with pytest.raises(ValueError, match="one too many"):
    p.done("size 16M")
  assert len(lines) == 2


@pytest.mark.parametrize("total", [0, -3, 2.5, True])
def test_total_must_be_a_positive_count(total):
  with pytest.raises(ValueError, match="at least 1 unit of work"):
    progress.Progress(total)


def test_default_log_prints_the_line(capsys):
  progress.Progress(1).done("phase")
  assert capsys.readouterr().out.startswith(
    "[1/1] phase done in 0 s; all done in 0 s"
  )


def test_compression_bench_prints_a_progress_line_per_size(capsys):
  compression.run_fake_devices([64, 128], 1, 2, ["none"])
  out = capsys.readouterr().out
  assert "[1/2] compression fake_devices 64 elements done in " in out
  assert "; about " in out
  assert "[2/2] compression fake_devices 128 elements done in " in out
  assert "; all done in " in out


@pytest.mark.parametrize("module", [qsr, qsync], ids=["qsr", "qsync"])
def test_studies_refuse_zero_runs_before_writing(module, tmp_path):
  with pytest.raises(ValueError, match="0 seeds"):
    module.run(str(tmp_path / "out"), None, seeds=0)
  with pytest.raises(ValueError, match="0 configurations"):
    module.run(str(tmp_path / "out"), None, configs=[])
  assert not (tmp_path / "out").exists()
