"""A user's own config file (``--config=my_config.py``) and the README's
shortcuts, as a new user writes them.

A config file that cannot be loaded is one ``error:`` line naming the file
and what went wrong (experiments.config_files.parse_flags, the main job's
flag parsing, called in-process on flags of its own; one case runs the
binary); numbers written as ``1e3`` and an ``--out_dir`` with spaces and
non-ASCII characters simply work; ``--sync=qsr`` either runs QSR with a growth coefficient from the
learning rate or names the flag to pass.
"""

import json
import os
import sys

from absl import flags
import binaries
import ml_collections
from ml_collections import config_flags
import pytest

from experiments import config_files
from experiments import config_lib
from experiments import train_lib
from experiments.configs import default as default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HEADER = "from experiments.configs import default\n\n\ndef get_config():\n"


def _parse(tmp_path, body, capsys):
  """Parses ``--config=<tmp_path>/my_config.py`` holding ``body``.

  Returns:
    ``(config, None)``, or ``(None, stderr)`` where parsing exited 1.
  """
  path = tmp_path / "my_config.py"
  path.write_text(body)
  values = flags.FlagValues()
  flags.DEFINE_string("out_dir", None, "", flag_values=values)
  config_flags.DEFINE_config_file(
    "config",
    config_files.DEFAULT_CONFIG,
    "",
    flag_values=values,
    lock_config=True,
  )
  # config_flags loads every file as module "config_config", into the one
  # the default's load left (a file without get_config would find its).
  sys.modules.pop("config_config", None)
  argv = ["train", f"--config={path}", f"--out_dir={tmp_path}/o"]
  try:
    config_files.parse_flags(argv, values)
  except SystemExit as e:
    assert e.code == 1
    return None, capsys.readouterr().err
  return values.config, None


@pytest.mark.parametrize(
  "body, message",
  [
    (
      _HEADER + '  raise KeyError("data_dir")\n',
      "get_config() raised KeyError: 'data_dir'",
    ),
    (
      # config_flags re-raises a ValueError as text: the user's is named.
      _HEADER + '  raise ValueError("bad\\n  sweep")\n',
      "get_config() raised ValueError: bad sweep",
    ),
    ("x = 1\n", "it defines no get_config(); a config file defines "),
    ("def get_config(:\n", "it is not valid Python: "),
    (
      "def get_config():\n  pass\n",
      "get_config() returned None; it must return an "
      "ml_collections.ConfigDict (a missing return statement?)",
    ),
  ],
  ids=["raises", "raises_value_error", "no_get_config", "syntax", "none"],
)
def test_a_config_file_that_cannot_load_is_one_error_line(
  tmp_path, capsys, body, message
):
  config, err = _parse(tmp_path, body, capsys)
  assert config is None
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"error: --config={tmp_path}/my_config.py: "), last
  assert message in last, last
  assert "FATAL" not in err


def test_a_missing_config_file_is_named(tmp_path, capsys):
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  with pytest.raises(SystemExit):
    config_files.parse_flags(["train", f"--config={tmp_path}/nope.py"], values)
  assert capsys.readouterr().err.strip() == (
    f"error: --config={tmp_path}/nope.py: no such file"
  )


def test_numbers_written_as_1e3_in_a_config_file_work(tmp_path, capsys):
  config, err = _parse(
    tmp_path,
    _HEADER + "  c = default.get_config()\n  c.steps = 1e3\n"
    "  c.batch_size = 8e0\n  c.allocator.num_batches = 2e0\n  return c\n",
    capsys,
  )
  assert err is None
  job = config_lib.parse(config)
  assert (job.steps, job.batch_size, job.allocator.num_batches) == (1000, 8, 2)


def test_misspelled_and_mistyped_fields_name_the_field(tmp_path, capsys):
  config, _ = _parse(
    tmp_path,
    _HEADER + "  c = default.get_config()\n  c.stpes = 10\n  return c\n",
    capsys,
  )
  with pytest.raises(
    ValueError, match=r"config.stpes is not a field .*did you mean config.steps"
  ):
    config_lib.parse(config)
  config, _ = _parse(
    tmp_path,
    _HEADER + '  c = default.get_config()\n  c.steps = "ten"\n  return c\n',
    capsys,
  )
  with pytest.raises(ValueError, match="config.steps must be an integer >= 1"):
    config_lib.parse(config)


def test_the_binary_says_which_config_file_raised(tmp_path):
  path = tmp_path / "my config.py"
  path.write_text(_HEADER + '  raise KeyError("data_dir")\n')
  env = dict(os.environ, PYTHONPATH=ROOT)
  result = binaries.run(
    "experiments.train",
    f"--out_dir={tmp_path}/o",
    f"--config={path}",
    env=env,
    timeout=300,
  )
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert lines[-1] == (
    f"error: --config={path}: get_config() raised KeyError: 'data_dir'"
  ), result.stderr[-2000:]
  # The user's own frame, not absl's, above the line.
  assert f'File "{path}", line 5, in get_config' in result.stderr
  assert "absl" not in result.stderr
  assert not (tmp_path / "o").exists()


def test_an_out_dir_with_spaces_and_non_ascii_characters_works(tmp_path):
  out = tmp_path / "my runs" / "été 日本"
  config = default_config.get_config()
  config.cluster = "cpu:1"
  config.plan_mode = "manual"
  # A linear model on 8 features (tests/failing_training.py's clean data).
  config.model = "user_models:bare_linear"
  config.dataset = "failing_training:arrays"
  config.model_kwargs = ml_collections.ConfigDict({"num_classes": 3})
  config.batch_size = 4
  config.steps = 2
  config.eval_every = 0
  config.checkpoint_every = 2
  train_lib.train_and_evaluate(config_lib.parse(config), str(out))
  assert json.loads((out / "summary.json").read_text())["steps"] == 2
  assert os.listdir(out / "checkpoints") == ["2"]


def test_sync_qsr_with_a_constant_learning_rate_names_the_flag_to_pass():
  config = default_config.get_config()
  config.sync = "qsr"
  with pytest.raises(ValueError) as e:
    config_lib.parse(config)
  assert str(e.value) == (
    "config.sync='qsr' needs a decaying learning rate, but "
    "config.lr_schedule='constant' keeps QSR's period at h_base=4 (that is "
    "--sync=local); pass --config.lr_schedule=cosine (QSR's schedule; or "
    "linear, step, cosine_step), or --alpha for a fixed longer period"
  )


def test_sync_qsr_with_cosine_takes_alpha_from_the_learning_rate():
  config = default_config.get_config()
  config.sync = "qsr"
  config.lr_schedule = "cosine"
  job = config_lib.parse(config)
  schedule = config_lib.make_schedule(job)
  # learning_rate 3e-3 * sqrt(h_base = 4): H = 4 at the peak, then growing.
  assert schedule.alpha == pytest.approx(6e-3)
  syncs = schedule.sync_steps(job.steps)
  assert syncs[:3] == [4, 8, 12] and syncs[-1] == job.steps
  assert 20 < len(syncs) < job.steps // job.h_base
  assert schedule.round_length(1) == 4 < schedule.round_length(300)
  assert config_lib.unused_settings(job) == []
