"""A run directory itself: made, held by one run, and left clean on a refusal.

This module owns the directory a training run writes into, apart from what
it writes there:

- :func:`make_out_dir` creates it (and its parents), refusing a path that is
  a file or cannot be written, as one ``ValueError`` naming the path;
- :class:`OutDirLock` holds it for one run at a time (``fcntl.flock`` on
  :data:`LOCK_FILE`), naming the holder to a second run;
- :func:`refusal_leaves_no_dir` removes the directory again when the run
  that created it is refused before writing anything;
- :func:`check_layout` refuses a directory where something stands in the
  way of the files and directories a run writes;
- :class:`DirectoryIdentity` tells the directory a run started in from
  nothing (removed while the run trains) or another one made at its path
  (a save that made it again), so that the run stops instead of going on
  half-empty (:class:`RunDirectoryRemoved`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import errno
import fcntl
import json
import os
import socket

#: The lock file in a run directory: the run that holds it (process 0 of a
#: multi-process run) owns the directory; its text records the holder.
LOCK_FILE = ".lock"

#: The directories a training run keeps in its run directory: orbax's
#: checkpoints, the precision plans, the allocator's files and the
#: TensorBoard event files (:mod:`qsync_jax.rundir.metrics`).
DIRECTORIES = ("checkpoints", "plans", "allocation", "tensorboard")
#: The files a training run writes there.
FILES = ("metrics.jsonl", "summary.json", "curves.png")


class RunDirectoryRemoved(FileNotFoundError):
  """The run directory was removed, or made again, while the run trained."""


class DirectoryIdentity:
  """The directory a path named when a run started, held open.

  The directory stays open (a file descriptor) so that its inode cannot be
  given to another directory made at the path after it was removed: the
  path names the run's directory exactly while ``stat`` of both agree and
  the open one is not removed.

  Args:
    path: the directory (it must exist).
  """

  def __init__(self, path: str):
    self.path = path
    self._fd: int | None = os.open(path, os.O_RDONLY | os.O_DIRECTORY)

  def check(self) -> None:
    """Checks that the path still names the same directory.

    Raises:
      RunDirectoryRemoved: it is gone, or another directory stands there
        (removed and made again, e.g. by a save into it); the message names
        the path and what to do.
    """
    if self._fd is None:
      return
    held = os.fstat(self._fd)
    try:
      st = os.stat(self.path)
    except (FileNotFoundError, NotADirectoryError):
      what = "is gone"
    else:
      if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino) and (
        held.st_nlink > 0
      ):
        return
      what = "was made again without this run's earlier files"
    raise RunDirectoryRemoved(
      f"the run directory {self.path} was removed while the run was "
      f"training (it {what}); the run stops here: put back a copy of it "
      "and resume, or start again with a new --out_dir"
    )

  def close(self) -> None:
    """Lets the directory go (later checks pass)."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


def make_out_dir(path: str, what: str = "output directory") -> None:
  """Creates the output directory ``path`` (and its parents) if missing.

  Args:
    path: the directory.
    what: what it is, for the message (e.g. ``"--out"``).

  Raises:
    ValueError: ``path`` or one of its parents is an existing file, or
      ``path`` cannot be created or written (a read-only file system, no
      permission).
  """
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is an existing file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise ValueError(
      f"{what} {path!r} cannot be created: a parent of it is an existing file"
    ) from None
  except OSError as e:
    raise ValueError(
      f"{what} {path!r} cannot be created: {e.strerror}"
    ) from None
  if not os.access(path, os.W_OK | os.X_OK):
    # Root may write anywhere but on a read-only mount: say which it is.
    read_only = os.statvfs(path).f_flag & os.ST_RDONLY
    raise ValueError(
      f"{what} {path!r} is not writable: "
      + ("a read-only file system" if read_only else "permission denied")
    )


@contextlib.contextmanager
def refusal_leaves_no_dir(out_dir: str) -> Iterator[None]:
  """Removes ``out_dir`` again if the run that created it fails empty.

  A refused run writes nothing, but by then it has made the directory and
  the lock file in it; they go, unless the directory holds anything else.
  A directory that existed before is left as it is.

  Args:
    out_dir: the run directory, not yet created or already there.
  """
  made = not os.path.lexists(out_dir)
  try:
    yield
  except BaseException:
    lock = os.path.join(out_dir, LOCK_FILE)
    with contextlib.suppress(OSError):
      if made and os.listdir(out_dir) == [LOCK_FILE]:
        if os.path.getsize(lock) == 0:
          os.remove(lock)
      if made:
        os.rmdir(out_dir)
    raise


class OutDirLock:
  """An exclusive lock on a run directory, held for the run's lifetime.

  ``fcntl.flock`` on ``<out_dir>/.lock``, without waiting: the kernel
  releases it when the holder exits, even when killed, so a lock file left
  by a killed run blocks nobody. The holder's pid and host go into the file
  (:meth:`record`) once the run is past every check that can refuse it, and
  are cleared at :meth:`release`.

  Args:
    out_dir: the run directory (it must exist).
  """

  def __init__(self, out_dir: str):
    self.out_dir = out_dir
    self.path = os.path.join(out_dir, LOCK_FILE)
    self._fd: int | None = None
    self._recorded = False

  def acquire(self) -> None:
    """Takes the lock; opening it leaves an existing lock file unchanged.

    Raises:
      ValueError: another run holds it (naming its pid and host).
    """
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        os.close(fd)
        raise
      holder = _lock_holder(fd)
      os.close(fd)
      raise ValueError(
        f"--out_dir {self.out_dir} is in use by another run ({holder})"
      ) from None
    self._fd = fd

  def record(self) -> None:
    """Writes the holder's pid and host into the lock file."""
    if self._fd is None or self._recorded:
      return
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, (text + "\n").encode(), 0)
    self._recorded = True

  def release(self) -> None:
    """Clears what :meth:`record` wrote and releases the lock."""
    if self._fd is None:
      return
    try:
      if self._recorded:
        os.ftruncate(self._fd, 0)
      fcntl.flock(self._fd, fcntl.LOCK_UN)
    finally:
      os.close(self._fd)
      self._fd = None
      self._recorded = False

  def __enter__(self) -> OutDirLock:
    self.acquire()
    return self

  def __exit__(self, *exc: object) -> None:
    self.release()


def _lock_holder(fd: int) -> str:
  """Who holds the lock ``fd`` is a lock file of, in words."""
  try:
    holder = json.loads(os.pread(fd, 4096, 0).decode())
    pid, host = int(holder["pid"]), str(holder["host"])
  except (OSError, ValueError, TypeError, KeyError):
    return "starting: its pid is not recorded yet"
  if host == socket.gethostname() and not _pid_alive(pid):
    # A killed run's record; the holder has not written its own yet.
    return "starting: its pid is not recorded yet"
  return f"pid {pid} on {host}"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # another user's process
    return True
  return True


def check_layout(
  out_dir: str,
  directories: Sequence[str] = DIRECTORIES,
  files: Sequence[str] = FILES,
) -> None:
  """Checks that nothing in ``out_dir`` stands where the run writes.

  Args:
    out_dir: the run directory.
    directories: the directories the run keeps there.
    files: the files it writes there.

  Raises:
    ValueError: a file where the run keeps a directory, or a directory
      where it writes a file.
  """
  for name in directories:
    path = os.path.join(out_dir, name)
    if os.path.lexists(path) and not os.path.isdir(path):
      raise ValueError(
        f"{path} is a file, where the run keeps its {name} directory; "
        "move it away or use a new --out_dir"
      )
  for name in files:
    path = os.path.join(out_dir, name)
    if os.path.isdir(path):
      raise ValueError(
        f"{path} is a directory, where the run writes its {name}; move it "
        "away or use a new --out_dir"
      )
