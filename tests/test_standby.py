"""Tests for qsync_jax.launch.standby: a program run by a hot standby sees
what a fresh interpreter gives it, less the imports it already has."""

import ast
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from qsync_jax.launch import standby

# What the program reports, as one JSON line. ``decimal`` is imported at its
# top: a standby has imported it before the program's first line runs.
_PROGRAM = """\
import json, os, signal, sys
preloaded = "decimal" in sys.modules
import decimal
print(json.dumps({
  "preloaded": preloaded,
  "name": __name__,
  "argv": sys.argv,
  "cwd": os.getcwd(),
  "path0": sys.path[0],
  "var": os.environ.get("QSYNC_TEST_VAR"),
  "getenv": os.getenv("QSYNC_TEST_VAR"),
  "stdin": sys.stdin.read(),
  "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
}), flush=True)
sys.exit(int(sys.argv[1]))
"""


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("QSYNC_")}
  return {**env, **extra}


@pytest.fixture
def program(tmp_path):
  path = tmp_path / "program.py"
  path.write_text(_PROGRAM)
  return path


def _fresh_run(command, env):
  """``command`` run by a fresh interpreter, as the launcher starts one."""
  return subprocess.run(
    command,
    env=env,
    stdin=subprocess.DEVNULL,
    capture_output=True,
    text=True,
    timeout=60,
  )


def _take_when_ready(standbys, slot, env, timeout_s=60):
  """Takes ``slot``'s standby once its imports are done."""
  deadline = time.monotonic() + timeout_s
  while (p := standbys.take(slot, env)) is None:
    assert time.monotonic() < deadline, "the standby never became ready"
    time.sleep(0.02)
  return p


def _standby_run(command, env, world_env):
  """``command`` run by a standby told ``world_env``: (status, report)."""
  standbys = standby.Standbys.of(command, env)
  assert standbys is not None
  try:
    assert standbys.fill([0]) == 1
    p = _take_when_ready(standbys, 0, world_env)
    out, _ = p.communicate(timeout=60)
  finally:
    standbys.close()
  return p.returncode, json.loads(out)


def test_a_script_sees_what_a_fresh_interpreter_gives_it(
  program, tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  command = [sys.executable, str(program), "3"]
  env = _env()
  world = _env(QSYNC_TEST_VAR="world 2")
  fresh = _fresh_run(command, world)
  code, report = _standby_run(command, env, world)
  assert code == fresh.returncode == 3
  expected = json.loads(fresh.stdout)
  assert not expected.pop("preloaded")
  assert report.pop("preloaded")  # the one difference
  assert report == expected
  assert report["var"] == report["getenv"] == "world 2"
  assert report["blocked"] == [] and report["stdin"] == ""


def test_a_module_runs_as_python_m_runs_it(program, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  command = [sys.executable, "-m", "program", "0"]
  world = _env(QSYNC_TEST_VAR="x")
  fresh = _fresh_run(command, world)
  code, report = _standby_run(command, _env(), world)
  assert code == fresh.returncode == 0
  expected = json.loads(fresh.stdout)
  assert report.pop("preloaded") and not expected.pop("preloaded")
  assert report == expected
  assert report["name"] == "__main__" and report["path0"] == str(tmp_path)


def test_a_world_that_changes_more_than_its_own_variables_is_refused(
  program, tmp_path
):
  standbys = standby.Standbys.of(
    [sys.executable, str(program), "0"], _env(JAX_PLATFORMS="cpu")
  )
  assert standbys is not None
  standbys.fill([0])
  p = _take_when_ready(
    standbys, 0, _env(JAX_PLATFORMS="cuda", QSYNC_TEST_VAR="1")
  )
  out, err = p.communicate(timeout=60)
  assert p.returncode == standby.REFUSED_EXIT_CODE and out == b""
  assert err.decode().strip() == (
    "error: standby: the world's environment differs from the one it "
    "started with in JAX_PLATFORMS"
  )


def test_a_standby_never_taken_runs_nothing_and_is_ended(program, tmp_path):
  marker = tmp_path / "ran"
  program.write_text(f"open({str(marker)!r}, 'w').close()\n")
  standbys = standby.Standbys.of([sys.executable, str(program)], _env())
  assert standbys is not None
  standbys.fill([0, 1])
  waiting = [p for queue in standbys.waiting.values() for p, _ in queue]
  assert standbys.fill([0, 1]) == 0  # one per slot
  standbys.close()
  assert [p.returncode for p in waiting] == [-signal.SIGKILL] * 2
  assert not marker.exists()
  # Its stdin closed, a standby ends with 0 without running the program.
  p = subprocess.Popen(
    standby.command([sys.executable, str(program)]),
    stdin=subprocess.PIPE,
    env=_env(),
  )
  p.communicate(b"", timeout=60)
  assert p.returncode == 0 and not marker.exists()


def test_several_standbys_per_slot_are_taken_oldest_first(program):
  standbys = standby.Standbys.of(
    [sys.executable, str(program), "0"], _env(), per_slot=2
  )
  assert standbys is not None
  try:
    assert standbys.fill([0, 1]) == 4
    (first, first_ready), (second, second_ready) = standbys.waiting[0]
    deadline = time.monotonic() + 60
    while len(select.select([first_ready, second_ready], [], [], 1)[0]) < 2:
      assert time.monotonic() < deadline, "the standbys never became ready"
    taken = [standbys.take(0, _env()) for _ in range(2)]
    assert taken == [first, second]
    assert standbys.take(0, _env()) is None and 0 not in standbys.waiting
    for p in taken:
      p.communicate(timeout=60)
      assert p.returncode == 0
    # A fill tops each slot up to two, starting only what is missing.
    assert standbys.fill([0, 1]) == 2
    assert [len(q) for q in standbys.waiting.values()] == [2, 2]
  finally:
    standbys.close()
  with pytest.raises(ValueError, match="standbys per slot must be >= 1"):
    standby.Standbys([sys.executable], {}, {}, per_slot=0)


def test_a_dead_standby_is_not_taken(program):
  standbys = standby.Standbys.of([sys.executable, str(program), "0"], _env())
  assert standbys is not None
  standbys.fill([0])
  p = standbys.waiting[0][0][0]
  os.killpg(p.pid, signal.SIGKILL)
  p.wait()
  assert standbys.take(0, _env()) is None and standbys.take(1, _env()) is None
  assert standbys.waiting == {}


def test_a_standby_still_importing_is_kept_for_a_later_world(
  tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(1.5)\n")
  (tmp_path / "prog.py").write_text("import slow_module\nprint('ran')\n")
  standbys = standby.Standbys.of([sys.executable, "prog.py"], _env())
  assert standbys is not None
  try:
    standbys.fill([0])
    # Its imports take 1.5 s: not taken, not ended.
    assert standbys.take(0, _env()) is None and 0 in standbys.waiting
    p = _take_when_ready(standbys, 0, _env())
    out, _ = p.communicate(timeout=60)
  finally:
    standbys.close()
  assert p.returncode == 0 and out == b"ran\n"


@pytest.mark.parametrize(
  "command, gets_one",
  [
    (["-m", "experiments.train", "--out_dir=x"], True),
    (["train.py", "--flag"], True),
    (["-u", "-m", "experiments.train"], False),  # interpreter options
    (["-c", "print(1)"], False),
    ([], False),
  ],
)
def test_only_a_module_or_a_script_of_this_interpreter_gets_one(
  command, gets_one
):
  got = standby.command([sys.executable, *command])
  assert (got is not None) == gets_one
  if gets_one:
    assert got == [sys.executable, standby.__file__, *command]
  assert standby.command(["/bin/sh", "-m", "x"]) is None


def test_the_preload_stops_where_the_program_changes_the_environment(
  tmp_path,
):
  path = tmp_path / "p.py"
  path.write_text(
    textwrap.dedent(
      """\
      '''Docstring.'''
      import os
      from a.b import c, d
      if os.environ.get("X"):
        import not_top_level
      value = os.environ.get("Y")
      import e
      os.environ["JAX_PLATFORMS"] = "cpu"
      import jax
      """
    )
  )
  assert standby.top_level_imports(str(path)) == [
    "os",
    "a.b",
    "a.b.c",
    "a.b.d",
    "e",
  ]
  assert standby.top_level_imports(str(tmp_path / "missing.py")) == []


@pytest.mark.parametrize(
  "statement, changes",
  [
    ("os.environ['X'] = '1'", True),
    ("os.environ.update(X='1')", True),
    ("os.environ.setdefault('X', '1')", True),
    ("del os.environ['X']", True),
    ("os.putenv('X', '1')", True),
    ("os.chdir('/')", True),
    ("sys.path.insert(0, 'src')", True),
    ("sys.path = ['src']", True),
    ("x = os.environ.get('X')", False),
    ("if os.environ.get('X'):\n  signal.pthread_sigmask(1, set())", False),
    ("print(sys.path[0])", False),
  ],
)
def test_what_counts_as_changing_the_environment(statement, changes):
  node = ast.parse(statement).body[0]
  assert standby.changes_environment(node) == changes


def test_the_train_binary_preloads_its_library_stack():
  # Its SIGTERM mask and progress file read the environment, not change it.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  names = standby.top_level_imports(
    os.path.join(root, "experiments", "train.py")
  )
  assert "experiments.train_lib" in names and "qsync_jax" in names
