"""The host allocator policy (qsync_jax.host_malloc) and the binaries' use."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from qsync_jax import host_malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_mode_defaults_to_reuse_and_names_a_bad_value():
  assert host_malloc.mode_from_env({}) == "reuse"
  assert host_malloc.mode_from_env({host_malloc.ENV_VAR: ""}) == "reuse"
  assert host_malloc.mode_from_env({host_malloc.ENV_VAR: "system"}) == "system"
  with pytest.raises(ValueError, match="QSYNC_HOST_MALLOC='tcmalloc'"):
    host_malloc.mode_from_env({host_malloc.ENV_VAR: "tcmalloc"})
  with pytest.raises(ValueError, match="unknown host allocator mode"):
    host_malloc.configure("fast")
  assert host_malloc.configure("system") is False


_FAULTS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from qsync_jax import host_malloc
    applied = host_malloc.configure_from_env()
    def faults():
      return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(16 << 20, np.float32)  # 64 MiB: above any mmap threshold
    del a
    before = faults()
    for _ in range(5):
      a = np.ones(16 << 20, np.float32)
      del a
    print(applied, faults() - before)
""")


def _faults(mode: str) -> tuple[str, int]:
  env = {**os.environ, host_malloc.ENV_VAR: mode}
  out = subprocess.run(
    [sys.executable, "-c", _FAULTS],
    env=env,
    check=True,
    capture_output=True,
    text=True,
  ).stdout.split()
  return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="the reuse mode acts on glibc only")
def test_reuse_keeps_freed_large_buffers_mapped():
  # glibc's default maps and unmaps a 64 MiB block on each allocation, and
  # the kernel faults its pages in again each time; reuse hands the freed
  # block back, so refilling it faults (almost) nothing.
  applied, reuse = _faults("reuse")
  assert applied == "True"
  applied, system = _faults("system")
  assert applied == "False"
  # Five fresh 64 MiB blocks take at least 5 x 32 faults, even in the
  # 2 MiB pages numpy asks for.
  assert system >= 5 * 32, system
  assert reuse < system / 10, (reuse, system)


def test_a_binary_names_a_bad_mode_and_exits_1(tmp_path):
  env = {**os.environ, host_malloc.ENV_VAR: "bogus"}
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      f"--out_dir={tmp_path / 'run'}",
    ],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
    "error: QSYNC_HOST_MALLOC='bogus' is not a host allocator mode; "
    "valid: reuse, system"
  )
  assert not (tmp_path / "run").exists()
