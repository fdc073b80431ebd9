"""The main job's files in its run directory: whole or absent, read with care.

This module owns how :mod:`experiments.train_lib` writes and reads back the
files of a run directory other than its checkpoints:

- :func:`write_text`, :func:`write_bytes` and :func:`write_json` write a
  whole file (``summary.json``, ``plans/<kind>.json``, ``curves.png``,
  ``PREEMPTED``) to a temporary file beside it and rename it into place, so
  a run killed mid-write leaves the old file or the new one, never half of
  one;
- :func:`append_line` appends one record to ``metrics.jsonl``; a write the
  file system refuses is undone, so no half record stays behind;
- :func:`metrics_to_keep` reads ``metrics.jsonl`` back when a run resumes:
  a torn last record (a run killed while appending) is dropped with one
  warning line, any other damaged line is an error naming the file and line;
- :func:`disk_errors_exit` turns a file-system refusal (a full disk, a
  read-only file system, no permission) into one ``error:`` line.

A failed write raises ``OSError`` naming the file it was writing.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import json
import os
import sys
from typing import Any

from qsync_jax.train import checkpoint


def _naming(error: OSError, path: str) -> OSError:
  """``error`` naming ``path``, the file being written.

  ``os.write`` names no file, and a failed temporary file is not the one
  the user knows.
  """
  if error.errno is None:
    return error
  return OSError(error.errno, error.strerror, path)


def write_bytes(path: str, data: bytes) -> None:
  """Writes ``data`` to ``path`` whole: a temporary file, then a rename.

  Raises:
    OSError: the file system refused the write, naming ``path``; the old
      file, if any, is unchanged and no temporary file stays behind.
  """
  tmp = os.path.join(
    os.path.dirname(path) or ".",
    f".{os.path.basename(path)}.{os.getpid()}.tmp",
  )
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view) :]
      os.fsync(fd)  # the data is on disk before the name points at it
    finally:
      os.close(fd)
    os.replace(tmp, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise _naming(e, path) from None


def write_text(path: str, text: str) -> None:
  """Writes ``text`` (UTF-8) to ``path`` whole; see :func:`write_bytes`."""
  write_bytes(path, text.encode())


def write_json(path: str, value: Any) -> None:
  """Writes ``value`` as indented JSON to ``path`` whole."""
  write_text(path, json.dumps(value, indent=2))


def append_line(path: str, line: str) -> None:
  """Appends ``line`` and a newline to ``path`` (created if missing).

  Raises:
    OSError: the file system refused the write, naming ``path``; what was
      written of the line is cut off again.
  """
  data = (line + "\n").encode()
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
  try:
    size = os.fstat(fd).st_size
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view) :]
    except OSError as e:
      with contextlib.suppress(OSError):
        os.ftruncate(fd, size)
      raise _naming(e, path) from None
  finally:
    os.close(fd)


def _row_problem(line: bytes) -> str | None:
  """Why ``line`` is not a metrics record, or None."""
  try:
    row = json.loads(line.decode())
  except UnicodeDecodeError:
    return "not UTF-8 text"
  except json.JSONDecodeError as e:
    return f"not JSON: {e.msg} (column {e.colno})"
  if not isinstance(row, dict):
    return "not a JSON object"
  step = row.get("step")
  if isinstance(step, bool) or not isinstance(step, int):
    return f"its step is {step!r}, not an integer"
  return None


def _step(line: bytes) -> int:
  return int(json.loads(line.decode())["step"])


def metrics_to_keep(path: str, last_step: int) -> bytes | None:
  """What a run resumed at ``last_step`` keeps of its ``metrics.jsonl``.

  The records up to ``last_step`` (those after it were logged past the
  checkpoint), as they are in the file. A last record that is not whole
  (a run killed while appending it) is dropped with one warning line on
  stderr; blank lines are dropped.

  Args:
    path: the ``metrics.jsonl`` to read.
    last_step: the step the run resumes from.

  Returns:
    The bytes to write back, or None where ``path`` does not exist.

  Raises:
    ValueError: a line other than the last is not a metrics record (a JSON
      object with an integer ``step``), naming the file and line.
  """
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None
  numbered = [
    (n, line)
    for n, line in enumerate(data.split(b"\n"), start=1)
    if line.strip()
  ]
  kept = []
  for k, (n, line) in enumerate(numbered):
    problem = _row_problem(line)
    if problem is None:
      if _step(line) <= last_step:
        kept.append(line + b"\n")
    elif k == len(numbered) - 1:
      print(
        f"warning: {path}: line {n}, the last, is cut off ({problem}), as "
        "a run killed while writing it leaves it; the resumed run drops it",
        file=sys.stderr,
      )
    else:
      raise ValueError(
        f"{path}: line {n} is not a metrics record ({problem}); repair or "
        "delete that line to resume, or use a new --out_dir"
      )
  return b"".join(kept)


#: The directories and files a run writes in its run directory.
DIRECTORIES = ("checkpoints", "plans", "allocation")
FILES = ("metrics.jsonl", "summary.json", "curves.png")


def check_layout(out_dir: str) -> None:
  """Checks that nothing in ``out_dir`` stands where the run writes.

  Raises:
    ValueError: a file where the run keeps a directory (``checkpoints``,
      ``plans``, ``allocation``), or a directory where it writes a file.
  """
  for name in DIRECTORIES:
    path = os.path.join(out_dir, name)
    if os.path.lexists(path) and not os.path.isdir(path):
      raise ValueError(
        f"{path} is a file, where the run keeps its {name} directory; "
        "move it away or use a new --out_dir"
      )
  for name in FILES:
    path = os.path.join(out_dir, name)
    if os.path.isdir(path):
      raise ValueError(
        f"{path} is a directory, where the run writes its {name}; move it "
        "away or use a new --out_dir"
      )


def check_resume(
  out_dir: str, step: int | None, steps: int
) -> tuple[bytes | None, dict[str, Any] | None]:
  """What a resumed run keeps of ``out_dir``'s files; checked before writing.

  Args:
    out_dir: the run directory.
    step: the step of the checkpoint the run resumes from; None: there was
      none, and the run starts from step 0.
    steps: the steps the run trains to (``config.steps``).

  Returns:
    ``(metrics, finished)``: the bytes to write back to ``metrics.jsonl``
    (None: there is none), and where the run already ended at ``steps``
    with its ``summary.json`` written, that summary (the resumed run has
    nothing to do), else None.

  Raises:
    ValueError: ``out_dir`` holds a finished run's ``summary.json`` but no
      checkpoint, or a damaged line of ``metrics.jsonl`` other than its last.
  """
  metrics_path = os.path.join(out_dir, "metrics.jsonl")
  summary_path = os.path.join(out_dir, "summary.json")
  if step is None:
    if os.path.exists(summary_path):
      raise ValueError(
        f"--resume: {out_dir} holds a finished run (summary.json) but no "
        "checkpoint to resume from (it saved none, or they were deleted); "
        "use a new --out_dir, or leave out --resume to train it anew"
      )
    return (b"" if os.path.exists(metrics_path) else None), None
  metrics = metrics_to_keep(metrics_path, step)
  if step != steps or not os.path.exists(summary_path):
    return metrics, None
  try:
    with open(summary_path) as f:
      summary = json.load(f)
  except (ValueError, OSError) as e:
    print(
      f"warning: {summary_path} is unreadable ({e}); the resumed run "
      f"evaluates step {step} again and writes it anew",
      file=sys.stderr,
    )
    return metrics, None
  if isinstance(summary, dict) and summary.get("steps") == step:
    return metrics, summary
  return metrics, None


@contextlib.contextmanager
def disk_errors_exit(out_dir: str) -> Iterator[None]:
  """Ends the program with one ``error:`` line on a file-system refusal.

  An ``OSError`` of :data:`qsync_jax.train.checkpoint.WRITE_ERRNOS` (no
  space, read-only, no permission) becomes ``error: PATH: REASON`` and exit
  status 1; ``out_dir`` stands for the path where the error names none.
  """
  try:
    yield
  except OSError as e:
    if e.errno not in checkpoint.WRITE_ERRNOS:
      raise
    print(f"error: {e.filename or out_dir}: {e.strerror}", file=sys.stderr)
    raise SystemExit(1) from None
