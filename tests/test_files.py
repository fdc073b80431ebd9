"""Files written whole (qsync_jax.files): old or new, never part, no leftovers."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading

import pytest

from qsync_jax import files


def _full_disk_after(n: int):
  """An ``os.write`` that lands ``n`` bytes, then finds the disk full."""
  real_write = os.write

  def write(fd, data):
    real_write(fd, bytes(data[:n]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  return write


@pytest.mark.parametrize("fails", ["write", "fsync"])
def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch, fails):
  path = tmp_path / "summary.json"
  path.write_text('{"old": true}')
  if fails == "write":
    monkeypatch.setattr(os, "write", _full_disk_after(5))
  else:

    def fsync(fd):
      raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
  with pytest.raises(OSError) as raised:
    files.write_json(str(path), {"new": True})
  monkeypatch.undo()
  assert raised.value.errno == (errno.ENOSPC if fails == "write" else errno.EIO)
  assert raised.value.filename == str(path)  # not the temporary file
  assert path.read_text() == '{"old": true}'
  assert os.listdir(tmp_path) == ["summary.json"]  # no temporary file left


def test_a_failed_first_write_leaves_no_file(tmp_path, monkeypatch):
  monkeypatch.setattr(os, "write", _full_disk_after(3))
  with pytest.raises(OSError):
    files.write_bytes(tmp_path / "curves.png", b"\x89PNG" * 100)
  monkeypatch.undo()
  assert os.listdir(tmp_path) == []


def test_an_interrupted_write_removes_its_temporary_file(tmp_path, monkeypatch):
  def interrupted(fd, data):
    raise KeyboardInterrupt

  monkeypatch.setattr(os, "write", interrupted)
  with pytest.raises(KeyboardInterrupt):
    files.write_text(tmp_path / "a.txt", "text")
  monkeypatch.undo()
  assert os.listdir(tmp_path) == []


def test_a_value_json_cannot_hold_leaves_the_old_file(tmp_path):
  path = tmp_path / "a.json"
  path.write_text("[1]")
  with pytest.raises(TypeError):
    files.write_json(path, {"x": object()})
  assert path.read_text() == "[1]" and os.listdir(tmp_path) == ["a.json"]


def test_the_file_and_its_directory_are_flushed_before_and_after_the_rename(
  tmp_path, monkeypatch
):
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
    events.append(f"fsync {kind}")
    real_fsync(fd)

  def replace(src, dst):
    events.append("replace")
    real_replace(src, dst)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "replace", replace)
  files.write_json(tmp_path / "a.json", {"a": 1}, indent=2)
  assert events == ["fsync file", "replace", "fsync dir"]
  assert json.loads((tmp_path / "a.json").read_text()) == {"a": 1}


def test_writers_of_one_path_each_write_their_own_temporary_file(
  tmp_path, monkeypatch
):
  # Both writers have written their temporary files before either renames
  # it: with one shared name the second rename would find none, or move the
  # first writer's content.
  path = tmp_path / "profile.json"
  ready = threading.Barrier(2, timeout=30)
  real_replace = os.replace
  temporaries = []

  def replace(src, dst):
    temporaries.append(src)
    ready.wait()
    real_replace(src, dst)

  monkeypatch.setattr(os, "replace", replace)
  payloads = [b"a" * 1_000_000, b"b" * 1_000_000]
  errors = []

  def writer(data):
    try:
      files.write_bytes(path, data)
    except BaseException as e:  # reported by the assertion below
      errors.append(e)

  threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []
  assert len(set(temporaries)) == 2
  assert path.read_bytes() in payloads  # one writer's content, whole
  assert os.listdir(tmp_path) == ["profile.json"]


def test_a_new_file_gets_the_permissions_of_a_plain_open(tmp_path):
  old = os.umask(0o027)
  try:
    files.write_text(tmp_path / "a.txt", "x")
  finally:
    os.umask(old)
  assert stat.S_IMODE(os.stat(tmp_path / "a.txt").st_mode) == 0o640


def test_a_failed_append_is_cut_off_again(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n')
  monkeypatch.setattr(os, "write", _full_disk_after(5))
  with pytest.raises(OSError) as raised:
    files.append_line(str(path), json.dumps({"step": 2}))
  monkeypatch.undo()
  assert raised.value.filename == str(path)
  assert path.read_text() == '{"step": 1}\n'  # no half record left
  files.append_line(path, json.dumps({"step": 2}))
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
