"""Resuming a run directory that does not fit the command, or a failing disk.

A refused resume ends with one line ``error: <what is wrong>``, exit status 1
and no traceback, and leaves every file of the run directory as it was; a
full or read-only disk while the run writes is one such line too, and the
checkpoints before the failed save stay intact. One finished run is shared by
the module (copied per test). The binary runs where what it prints at exit
matters (orbax's threads); the other cases run the main job in-process inside
the binary's own error handling.
"""

import errno
import json
import os
import re
import shutil
import subprocess

import ml_collections
import numpy as np
import optax
import pytest
from test_bad_input import _error_line
from test_bad_input import _run
from test_trainer import _batch
from test_trainer import _cnn
from test_trainer import _split
from test_trainer import _workers

from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config
import qsync_jax as qs
from qsync_jax import cli
from qsync_jax import files
from qsync_jax import rundir
from qsync_jax.train.checkpoint import Checkpointer
from qsync_jax.train.trainer import HybridTrainer

# A tiny CNN on one worker: checkpoints at steps 2 and 4.
_MODEL_KWARGS = {"widths": [2, 2], "hidden": 4}
_RUN = (
  "--cluster=v100:1",
  f"--model_kwargs={json.dumps(_MODEL_KWARGS)}",
  "--config.batch_size=8",
  "--config.eval_every=2",
  "--config.checkpoint_every=2",
  "--config.log_every=1",
)


def _train(out, *args):
  return _run("experiments.train", f"--out_dir={out}", *_RUN, *args)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished 4-step run: the template every test copies."""
  out = tmp_path_factory.mktemp("finished") / "run"
  result = _train(out, "--config.steps=4")
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]
  return out


@pytest.fixture
def run_dir(finished, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(finished, out)
  return out


def _files(root):
  """{relative path: bytes} of every file under ``root``, and its dirs."""
  files, dirs = {}, set()
  for dirpath, dirnames, names in os.walk(root):
    dirs.update(
      os.path.relpath(os.path.join(dirpath, d), root) for d in dirnames
    )
    for name in names:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        files[os.path.relpath(path, root)] = f.read()
  return files, dirs


def _steps(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(line)["step"] for line in f]


def _config(**fields):
  """The config of ``finished``'s command, resuming, with ``fields``."""
  config = default_config.get_config()
  config.cluster = "v100:1"
  config.model_kwargs = ml_collections.ConfigDict(dict(_MODEL_KWARGS))
  config.batch_size = 8
  config.eval_every = 2
  config.checkpoint_every = 2
  config.log_every = 1
  config.steps = 4
  config.resume = True
  for name, value in fields.items():
    setattr(config, name, value)
  return config


# --------------------------------------------------------------------------
# The binary
# --------------------------------------------------------------------------


def test_torn_last_metrics_line_is_dropped_and_edited_plans_rewritten(
  run_dir,
):
  metrics = run_dir / "metrics.jsonl"
  data = metrics.read_bytes()
  # A run killed while appending step 4's row: half of it, no newline.
  last = data.rstrip(b"\n").rfind(b"\n") + 1
  metrics.write_bytes(data[: last + (len(data) - last) // 2])
  plan = run_dir / "plans" / "v100.json"
  saved_plan = plan.read_text()
  plan.write_text('{"rules": [], "default": "int8"}')
  result = _train(run_dir, "--config.steps=6", "--resume")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  warnings = [
    l for l in result.stderr.splitlines() if l.startswith("warning: ")
  ]
  assert len(warnings) == 1, result.stderr[-3000:]
  assert warnings[0].startswith(
    f"warning: {metrics}: line 4, the last, is cut off (not JSON: "
  ), warnings
  assert warnings[0].endswith("the resumed run drops it"), warnings
  assert _steps(run_dir) == [1, 2, 3, 5, 6]
  # plans/ is what the run trains with, whatever was edited there.
  assert plan.read_text() == saved_plan


def test_resume_with_another_model_names_the_first_differing_parameter(
  run_dir,
):
  before = _files(run_dir)
  last = _error_line(
    _train(
      run_dir,
      "--config.steps=6",
      "--resume",
      # The last --model_kwargs counts: the same CNN, a wider hidden layer.
      f"--model_kwargs={json.dumps({**_MODEL_KWARGS, 'hidden': 8})}",
    )
  )
  assert last == (
    f"error: checkpoint step 4 in {run_dir}/checkpoints is of another "
    "model: parameter fc.bias is (4,) float32 in the checkpoint and (8,) "
    "float32 in this run; resume with the model it was saved with, or "
    "start a new run directory"
  ), last
  assert _files(run_dir) == before  # nothing renamed, deleted or written


@pytest.fixture
def tmpfs(tmp_path):
  """Mounts a tmpfs of the requested size; unmounted at teardown."""
  if os.geteuid() != 0:
    pytest.skip("mounting a tmpfs needs root")
  mounted = []

  def mount(size, path=None):
    path = path or tmp_path / "mnt"
    path.mkdir(exist_ok=True)
    done = subprocess.run(
      ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
      capture_output=True,
      text=True,
    )
    if done.returncode != 0:
      pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    mounted.append(path)
    return path

  try:
    yield mount
  finally:
    for path in reversed(mounted):
      subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory, leave):
  """Fills the file system of ``directory`` but ``leave`` bytes."""
  st = os.statvfs(directory)
  free = st.f_bavail * st.f_frsize
  with open(os.path.join(directory, "filler"), "wb") as f:
    f.write(b"\0" * max(0, free - leave))


def _remount_read_only(path):
  subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def test_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoints(
  finished, tmpfs
):
  disk = tmpfs("4m")
  out = disk / "run"
  shutil.copytree(finished, out)
  checkpoints = _files(out / "checkpoints")
  # Room for the metrics rows, not for step 6's checkpoint.
  _fill(disk, leave=48 * 1024)
  last = _error_line(_train(out, "--config.steps=6", "--resume"))
  assert last == (
    f"error: {out}/checkpoints/6: No space left on device; checkpoint step "
    "6 was not saved (step 4 before it is intact)"
  ), last
  assert _files(out / "checkpoints") == checkpoints  # no partial step left


# --------------------------------------------------------------------------
# The main job in-process
# --------------------------------------------------------------------------


def _refused(config, out, capsys):
  """Runs the main job in-process as the binary does; its one error line."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as exited:
    with cli.bad_input_exits(), cli.disk_errors_exit(str(out)):
      train_lib.train_and_evaluate(config_lib.parse(config), str(out))
  assert exited.value.code == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  return err[0]


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(
  run_dir, capsys
):
  before = _files(run_dir)
  last = _refused(_config(steps=2), run_dir, capsys)
  assert last == (
    f"error: --resume: the checkpoint in {run_dir}/checkpoints is at step "
    "4, past config.steps=2; pass --config.steps=4 or more to continue that "
    "run, or use a new --out_dir"
  ), last
  assert _files(run_dir) == before


def test_read_only_plans_directory_is_one_line(
  run_dir, tmp_path, tmpfs, capsys
):
  saved = shutil.copytree(run_dir / "plans", tmp_path / "plans")
  plans = tmpfs("64k", run_dir / "plans")
  shutil.copytree(saved, plans, dirs_exist_ok=True)
  _remount_read_only(plans)
  last = _refused(_config(steps=6), run_dir, capsys)
  assert last == f"error: {run_dir}/plans/v100.json: Read-only file system"


def _rewrite_line(path, number, text):
  lines = path.read_text().splitlines(keepends=True)
  lines[number - 1] = text + "\n"
  path.write_text("".join(lines))


@pytest.mark.parametrize(
  "fields, damage, message",
  [
    (
      {"optimizer": "sgd"},
      None,
      r"checkpoint step 4 in .*/checkpoints is of another optimizer: "
      r"opt_state\.0\.count is \(1,\) int32 in the checkpoint and absent "
      r"in this run; resume with the optimizer it was saved with",
    ),
    (
      {"compress": "powersgd"},
      None,
      r"is of another averager: averager_state is absent in the checkpoint",
    ),
    (
      {"compress": "gqsgd", "error_feedback": True},
      None,
      r"is of another error-feedback setting: residual is absent",
    ),
    (
      {
        "plan_mode": "manual",
        "plans": {"v100": {"rules": [["fc", "fp16"]], "default": "fp32"}},
      },
      None,
      r"written by a run with other workers or plans \(worker 0, v100: "
      r"plan \{'rules': \[\], .*\} vs \{'rules': \[\['fc', 'fp16'\]\]",
    ),
    (
      {"steps": 6},
      lambda d: _rewrite_line(d / "metrics.jsonl", 2, '{"step": 2, "lo'),
      r"metrics\.jsonl: line 2 is not a metrics record \(not JSON: "
      r"Unterminated string starting at \(column 13\)\)",
    ),
    (
      {"steps": 6},
      lambda d: _rewrite_line(d / "metrics.jsonl", 3, '{"loss": 1.0}'),
      r"metrics\.jsonl: line 3 is not a metrics record \(its step is None",
    ),
    (
      {"steps": 6},
      lambda d: shutil.rmtree(d / "checkpoints"),
      r"holds a finished run \(summary\.json\) but no checkpoint to resume",
    ),
    (
      {"steps": 6},
      lambda d: (shutil.rmtree(d / "plans"), (d / "plans").write_text("x")),
      r"/plans is a file, where the run keeps its plans directory",
    ),
  ],
  ids=[
    "optimizer",
    "averager",
    "error_feedback",
    "plans",
    "damaged_metrics_line",
    "metrics_line_without_step",
    "no_checkpoint",
    "plans_is_a_file",
  ],
)
def test_resume_refusals_name_the_difference_and_change_nothing(
  run_dir, capsys, fields, damage, message
):
  if damage is not None:
    damage(run_dir)
  before = _files(run_dir)
  last = _refused(_config(**fields), run_dir, capsys)
  assert re.search(message, last), last
  assert _files(run_dir) == before


def test_resume_of_a_finished_run_changes_nothing(run_dir):
  before = _files(run_dir)
  summary = train_lib.train_and_evaluate(
    config_lib.parse(_config()), str(run_dir)
  )
  assert summary == json.loads((run_dir / "summary.json").read_text())
  assert _files(run_dir) == before


def test_unreadable_summary_is_written_anew_on_resume(run_dir, capsys):
  (run_dir / "summary.json").write_text('{"final_eval_accuracy": 0.9')
  summary = train_lib.train_and_evaluate(
    config_lib.parse(_config()), str(run_dir)
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
    f"warning: {run_dir}/summary.json is unreadable ("
  ), err
  assert json.loads((run_dir / "summary.json").read_text()) == summary
  assert summary["steps"] == 4 and summary["steps_this_run"] == 0
  assert _steps(run_dir) == [1, 2, 3, 4]


def test_mid_round_checkpoint_refuses_a_gradient_averaging_schedule(
  tmp_path,
):
  sizes = [4, 4]

  def make(schedule):
    return HybridTrainer(
      _cnn(),
      _workers(sizes),
      optax.adam(1e-2),
      sync=qs.SyncSettings(schedule=schedule),
    )

  local = make(qs.make_schedule("local", total_steps=8, h_base=4))
  state = local.init()
  for s in range(2):
    state, _ = local.train_step(state, _split(*_batch(8, seed=s), sizes))
  assert not state.in_sync
  directory = tmp_path / "ckpt"
  ckpt = Checkpointer(str(directory))
  ckpt.save(local, state)
  ckpt.close()
  names = sorted(os.listdir(directory))
  with pytest.raises(
    ValueError,
    match=r"saved mid-round of sync 'local', its workers' parameters apart, "
    r"and this run's sync 'dp' averages gradients at step 3",
  ):
    dp = make(qs.make_schedule("dp", total_steps=8))
    Checkpointer(str(directory)).restore_latest(dp, dp.init())
  assert sorted(os.listdir(directory)) == names  # not set aside as corrupt
  resumed = make(qs.make_schedule("local", total_steps=8, h_base=4))
  restored = Checkpointer(str(directory)).restore_latest(
    resumed, resumed.init()
  )
  assert restored.meta["step"] == 2 and restored.state.step == 2


# --------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------


def test_metrics_to_keep_drops_a_torn_last_line_and_names_a_damaged_one(
  tmp_path, capsys
):
  path = tmp_path / "metrics.jsonl"
  rows = [json.dumps({"step": s, "loss": 1.0}).encode() for s in (1, 2, 3)]
  path.write_bytes(b"\n".join(rows) + b"\n" + rows[2][:7])
  assert (
    rundir.metrics.metrics_to_keep(str(path), 2)
    == rows[0] + b"\n" + rows[1] + b"\n"
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
    f"warning: {path}: line 4, the last, is cut off (not JSON: "
  ), err
  path.write_bytes(rows[0] + b"\n\xff\xfe\n" + rows[1] + b"\n")
  with pytest.raises(
    ValueError,
    match=r"metrics\.jsonl: line 2 is not a metrics record "
    r"\(not UTF-8 text\)",
  ):
    rundir.metrics.metrics_to_keep(str(path), 5)
  assert rundir.metrics.metrics_to_keep(str(tmp_path / "missing"), 5) is None


def test_write_errno_finds_the_file_system_error_behind_a_failed_save():
  store = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "params/0.0" in OCDBT database: '
    "Failed to write 80573 bytes to file 15: No space left on device "
    "[os_error_code='28']"
  )
  assert files.write_errno(store) == errno.ENOSPC
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = PermissionError(errno.EACCES, "Permission denied")
  assert files.write_errno(wrapped) == errno.EACCES
  assert files.write_errno(OSError(errno.EROFS, "ro")) == errno.EROFS
  assert files.write_errno(ValueError("Requested shape (1, 2)")) is None
  assert files.write_errno(FileNotFoundError(errno.ENOENT, "x")) is None


def test_checkpointer_save_on_a_full_or_read_only_disk(tmpfs):
  sizes = [4]
  trainer = HybridTrainer(_cnn(), _workers(sizes), optax.adam(1e-2))
  disk = tmpfs("2m")
  ckpt = Checkpointer(str(disk / "ckpt"))
  state = trainer.init()
  ckpt.save(trainer, state)
  saved = _files(disk / "ckpt")
  params = np.asarray(state.params)
  state, _ = trainer.train_step(state, _split(*_batch(4), sizes))
  _fill(disk, leave=16 * 1024)
  with pytest.raises(OSError) as raised:
    ckpt.save(trainer, state)
  assert raised.value.errno == errno.ENOSPC
  assert raised.value.filename == str(disk / "ckpt" / "1")
  assert "step 0 before it is intact" in raised.value.strerror
  assert _files(disk / "ckpt") == saved  # the partial step 1 is gone
  os.remove(disk / "filler")
  _remount_read_only(disk)
  with pytest.raises(OSError) as raised:
    ckpt.save(trainer, state)
  assert raised.value.errno == errno.EROFS
  ckpt.close()
  fresh = HybridTrainer(_cnn(), _workers(sizes), optax.adam(1e-2))
  restored = Checkpointer(str(disk / "ckpt")).restore_latest(
    fresh, fresh.init()
  )
  assert restored.meta["step"] == 0
  np.testing.assert_array_equal(np.asarray(restored.state.params), params)
