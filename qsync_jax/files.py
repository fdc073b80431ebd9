"""Files written whole: what a reader sees is the old file or the new one.

This module owns how the library and its binaries write a file other than a
checkpoint:

- :func:`write_bytes`, :func:`write_text` and :func:`write_json` write the
  new content to a temporary file of a unique name beside the target, flush
  it to disk (``fsync``), rename it over the target and flush the directory.
  A process killed at any point leaves the old file or the new one, never
  part of one; processes writing the same file at once each write their own
  temporary file, and the last rename wins. The file gets the permissions a
  plain ``open(path, "w")`` would give it.
- :func:`append_line` appends one record to a log (``metrics.jsonl``), and
  :func:`append_bytes` one binary record (a TensorBoard event); a write the
  file system refuses is undone, so no part of a record stays.
- :func:`write_errno` finds the file-system refusal (:data:`WRITE_ERRNOS`:
  a full disk, a read-only file system, no permission) behind a failed
  write, checkpoints' included.

A failed write raises ``OSError`` naming the file being written (not its
temporary file), leaves the old file unchanged and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from typing import Any


def _naming(error: OSError, path: str) -> OSError:
  """``error`` naming ``path``, the file being written.

  ``os.write`` names no file, and a temporary file is not the one the user
  knows.
  """
  if error.errno is None:
    return error
  return OSError(error.errno, error.strerror, path)


def _umask() -> int:
  """This process's umask, without changing it where the OS allows.

  ``os.umask`` only reads the mask by setting another one, which a thread
  creating a file at that moment would see; Linux shows it in
  ``/proc/self/status``.
  """
  with contextlib.suppress(OSError, ValueError):
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def _write_all(fd: int, data: bytes) -> None:
  """Writes all of ``data`` to ``fd`` (``os.write`` may write a part)."""
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view) :]


def _fsync_directory(directory: str) -> None:
  """Flushes ``directory``'s entries (the rename) to disk, where it can.

  Best effort: some file systems and platforms cannot open or flush a
  directory, and the file itself is already whole on disk.
  """
  try:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
  """Writes ``data`` to ``path`` whole.

  Args:
    path: the file to write; its directory must exist.
    data: the file's new content.

  Raises:
    OSError: the file system refused the write, naming ``path``; the old
      file, if any, is unchanged and no temporary file stays behind.
  """
  path = os.fspath(path)
  directory = os.path.dirname(path) or "."
  try:
    # A unique name: writers of the same path never share a temporary file.
    fd, tmp = tempfile.mkstemp(
      dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
    )
  except OSError as e:
    raise _naming(e, path) from None
  try:
    try:
      # mkstemp creates the file private (0600); a reader of another user
      # sees it as a plain open() would have made it, where the FS allows.
      with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666 & ~_umask())
      _write_all(fd, data)
      os.fsync(fd)  # the data is on disk before the name points at it
    finally:
      os.close(fd)
    os.replace(tmp, path)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    if isinstance(e, OSError):
      raise _naming(e, path) from None
    raise
  _fsync_directory(directory)


def write_text(path: str | os.PathLike[str], text: str) -> None:
  """Writes ``text`` (UTF-8) to ``path`` whole; see :func:`write_bytes`.

  Raises:
    OSError: as :func:`write_bytes`.
  """
  write_bytes(path, text.encode())


def write_json(
  path: str | os.PathLike[str], obj: Any, **json_kwargs: Any
) -> None:
  """Writes ``obj`` as JSON to ``path`` whole; see :func:`write_bytes`.

  Args:
    path: the file to write.
    obj: what to write; encoded before the file is touched, so a value JSON
      cannot hold leaves the old file as it was.
    **json_kwargs: passed to :func:`json.dumps` (``indent``, ``sort_keys``).

  Raises:
    OSError: as :func:`write_bytes`.
    TypeError: ``obj`` holds a value JSON cannot encode.
  """
  write_text(path, json.dumps(obj, **json_kwargs))


def append_line(path: str | os.PathLike[str], line: str) -> None:
  """Appends ``line`` and a newline to ``path`` (created if missing).

  Args:
    path: the log to append to.
    line: one record, without its newline.

  Raises:
    OSError: the file system refused the write, naming ``path``; what was
      written of the line is cut off again.
  """
  append_bytes(path, (line + "\n").encode())


def append_bytes(path: str | os.PathLike[str], data: bytes) -> None:
  """Appends one whole record ``data`` to ``path`` (created if missing).

  Args:
    path: the log to append to.
    data: the record, framed as the log's format wants it.

  Raises:
    OSError: the file system refused the write, naming ``path``; what was
      written of the record is cut off again.
  """
  path = os.fspath(path)
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
  try:
    size = os.fstat(fd).st_size
    try:
      _write_all(fd, data)
    except OSError as e:
      with contextlib.suppress(OSError):
        os.ftruncate(fd, size)
      raise _naming(e, path) from None
  finally:
    os.close(fd)


#: File-system errors of a write: the disk is full, or not writable.
WRITE_ERRNOS = (
  errno.ENOSPC,
  errno.EDQUOT,
  errno.EROFS,
  errno.EACCES,
  errno.EPERM,
)


def write_errno(error: BaseException) -> int | None:
  """The file-system errno behind a failed write, or None.

  Python raises ``OSError``; orbax too for what it does itself, and
  tensorstore a ``ValueError`` whose text carries the OS error code (e.g.
  ``RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']``);
  both are looked for along the exception's causes.

  Returns:
    One of :data:`WRITE_ERRNOS`, or None for any other error.
  """
  seen: set[int] = set()
  todo: list[BaseException | None] = [error]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
      return e.errno
    for code in re.findall(r"os_error_code='?(\d+)", str(e)):
      if int(code) in WRITE_ERRNOS:
        return int(code)
    todo += [e.__cause__, e.__context__]
  return None
