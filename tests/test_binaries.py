"""tests/binaries.py runs a module as ``python -m`` would, forked from a
zygote: the same exit status, output, environment, paths and limits."""

import json
import os
import subprocess
import sys

import binaries
import pytest

ROOT = binaries.ROOT

_PROBE = """
import json, os, sys, threading, time, atexit
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
if mode == "report":
  print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("PROBE_VAR"),
    "getenv": os.popen("echo $PROBE_VAR").read().strip(),
    "path0": sys.path[0], "has_helper": "probe_helper" in sys.modules,
    "stdin": sys.stdin.read(), "pid": os.getpid(),
  }))
elif mode == "raise":
  raise KeyError("bad")
elif mode == "exit":
  sys.exit(int(sys.argv[2]))
elif mode == "message":
  sys.exit("a message")
elif mode == "thread":
  threading.Thread(target=lambda: (time.sleep(0.3), print("joined"))).start()
elif mode == "kill":
  os.kill(os.getpid(), 9)
elif mode == "sleep":
  time.sleep(60)
"""


@pytest.fixture(name="probe_env")
def _probe_env(tmp_path):
  (tmp_path / "probe_module.py").write_text(_PROBE)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), ROOT])
  env["PROBE_VAR"] = "value"
  return env


def _both(env, *args, cwd=ROOT):
  forked = binaries.run("probe_module", *args, env=env, cwd=cwd, timeout=60)
  fresh = subprocess.run(
    [sys.executable, "-m", "probe_module", *args],
    env=env,
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=60,
    stdin=subprocess.DEVNULL,
  )
  return forked, fresh


def test_what_the_module_sees_is_what_python_m_gives_it(probe_env, tmp_path):
  forked, fresh = _both(probe_env, "report", "x y", cwd=str(tmp_path))
  assert forked.returncode == fresh.returncode == 0, forked.stderr
  got = [json.loads(r.stdout.splitlines()[0]) for r in (forked, fresh)]
  assert got[0]["pid"] != os.getpid()
  for report in got:
    report.pop("pid")
  assert got[0] == got[1]
  assert got[0]["var"] == got[0]["getenv"] == "value"
  assert got[0]["argv"][1:] == ["report", "x y"]
  assert forked.stdout.splitlines()[1] == "atexit ran"


@pytest.mark.parametrize(
  "args",
  [("raise",), ("exit", "3"), ("exit", "0"), ("message",), ("thread",)],
)
def test_exit_status_and_output_match_a_fresh_interpreter(probe_env, args):
  forked, fresh = _both(probe_env, *args)
  assert forked.returncode == fresh.returncode
  assert forked.stdout == fresh.stdout
  # A traceback names the file of the runpy frame it came through; the
  # lines after it are the module's own.
  assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


def test_a_signal_and_a_timeout_are_reported_as_subprocess_does(probe_env):
  assert binaries.run("probe_module", "kill", env=probe_env).returncode == -9
  with pytest.raises(subprocess.TimeoutExpired):
    binaries.run("probe_module", "sleep", env=probe_env, timeout=1)
  # The zygote serves the next run after a timeout.
  again = binaries.run("probe_module", "exit", "4", env=probe_env, timeout=60)
  assert again.returncode == 4


def test_an_import_time_setting_gets_a_zygote_of_its_own(probe_env):
  code = "import jax; print(jax.config.jax_enable_x64)"
  path = probe_env["PYTHONPATH"].split(os.pathsep)[0]
  with open(os.path.join(path, "x64_probe.py"), "w") as f:
    f.write(code)
  off = binaries.run("x64_probe", env=dict(probe_env, JAX_ENABLE_X64="0"))
  on = binaries.run("x64_probe", env=dict(probe_env, JAX_ENABLE_X64="1"))
  assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True")


def test_a_refusal_of_the_train_binary_matches_a_fresh_interpreter(tmp_path):
  args = ("experiments.train", f"--out_dir={tmp_path}/o", "--model=nosuch")
  forked = binaries.run(*args, timeout=300)
  fresh = subprocess.run(
    [sys.executable, "-m", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert forked.returncode == fresh.returncode == 1
  error = [l for l in fresh.stderr.splitlines() if l.startswith("error:")]
  assert error and error == [
    l for l in forked.stderr.splitlines() if l.startswith("error:")
  ]
  assert not (tmp_path / "o").exists()
