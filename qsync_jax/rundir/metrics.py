"""A run's metrics: one writer for ``metrics.jsonl`` and TensorBoard, and
what a resumed run keeps of them.

This module owns the metrics a training run leaves in its run directory:

- :class:`MetricWriter` writes each logged step twice, as one JSON row
  appended to ``metrics.jsonl`` and as TensorBoard scalars in
  ``tensorboard/``, one event file per run (no TensorFlow: the records
  are encoded by :mod:`qsync_jax.rundir.tfevents`). A run that starts at a step keeps
  the rows and shows the events up to it, and no later ones.
- :func:`metrics_to_keep` and :func:`check_resume` read ``metrics.jsonl``
  back when a run resumes: a torn last record (a run killed while
  appending) is dropped with one warning line, any other damaged line is an
  error naming the file and line; :func:`last_logged_step` is the largest
  step a file holds.

Every write is a whole record appended with :mod:`qsync_jax.files`, at once:
a run killed at any point leaves every row and event it logged before.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import math
import os
import socket
import sys
import time
from typing import Any

import jax

from qsync_jax import files
from qsync_jax.rundir import directory
from qsync_jax.rundir import tfevents

#: The metrics log in a run directory: one JSON object a line, with ``step``.
METRICS_FILE = "metrics.jsonl"
#: The directory of the TensorBoard event files in a run directory.
TENSORBOARD_DIR = "tensorboard"
#: The summary a finished run writes in its run directory.
SUMMARY_FILE = "summary.json"


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


def last_logged_step(path: str) -> int | None:
  """The largest step of the whole records of a ``metrics.jsonl``.

  Damaged lines are passed over (a torn last record is what a killed run
  leaves); a file that cannot be read has none.

  Args:
    path: the ``metrics.jsonl`` to read.

  Returns:
    The step, or None where no record has one.
  """
  last = None
  try:
    with open(path, "rb") as f:
      for line in f:
        try:
          step = json.loads(line).get("step")
        except (ValueError, AttributeError):
          continue  # a torn last record: the resume drops it
        if isinstance(step, int) and not isinstance(step, bool):
          last = step if last is None else max(last, step)
  except OSError:
    pass
  return last


def check_resume(
  out_dir: str, step: int | None, steps: int
) -> tuple[bytes | None, dict[str, Any] | None]:
  """What a resumed run keeps of ``out_dir``'s files; checked before writing.

  Args:
    out_dir: the run directory.
    step: the step of the checkpoint the run resumes from; None: there was
      none, and the run starts from step 0.
    steps: the steps the run trains to.

  Returns:
    ``(metrics, finished)``: the bytes to write back to ``metrics.jsonl``
    (None: there is none), and where the run already ended at ``steps``
    with its ``summary.json`` written, that summary (the resumed run has
    nothing to do), else None.

  Raises:
    ValueError: ``out_dir`` holds a finished run's ``summary.json`` but no
      checkpoint, or a damaged line of ``metrics.jsonl`` other than its last.
  """
  metrics_path = os.path.join(out_dir, METRICS_FILE)
  summary_path = os.path.join(out_dir, SUMMARY_FILE)
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


def _scalar(value: Any) -> float | None:
  """``value`` as a TensorBoard scalar, or None where it is not a number."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value)


class MetricWriter:
  """Writes a run's metrics to ``metrics.jsonl`` and TensorBoard.

  Each :meth:`write` appends one JSON row ``{"step": step, **scalars}`` to
  ``<out_dir>/metrics.jsonl`` and one event with the row's numbers as
  scalars (tagged by their names, at ``step``) to this run's event file in
  ``<out_dir>/tensorboard/``, which ``tensorboard --logdir`` reads. Both
  are whole records appended at once (:func:`qsync_jax.files.append_bytes`):
  a run killed at any point loses nothing it logged, unlike an event writer
  that writes from a thread (``tensorboardX.SummaryWriter``), and a full
  disk is an ``OSError`` of the call that wrote.

  A run that starts at ``start_step`` (a resume; 0 for a new run) keeps
  what the runs before it logged up to that step and no more: the rows of
  ``metrics.jsonl`` after it go, and its event file begins with a
  TensorBoard purge at ``start_step + 1`` (``SessionLog.START``, as
  ``SummaryWriter(purge_step=...)`` writes it), which hides every earlier
  event file's events from that step on.

  Only the process that writes the run's files writes (process 0 of a
  multi-process run); elsewhere the writer does nothing.

  Args:
    out_dir: the run directory (it must exist).
    start_step: the step the run starts from: the checkpoint's step on a
      resume, 0 for a new run.
    kept_rows: the rows of ``metrics.jsonl`` to keep, as
      :func:`check_resume` returned them (None: none, or read here with
      :func:`metrics_to_keep`).
    active: whether this process writes; None: process 0 does.

  Raises:
    ValueError: a damaged line of ``metrics.jsonl`` other than its last
      (where ``kept_rows`` is not given and the run resumes).
    OSError: the file system refused a write, naming the file.
  """

  def __init__(
    self,
    out_dir: str,
    *,
    start_step: int = 0,
    kept_rows: bytes | None = None,
    active: bool | None = None,
  ):
    self.out_dir = out_dir
    self.active = jax.process_index() == 0 if active is None else active
    self.metrics_path = os.path.join(out_dir, METRICS_FILE)
    self.events_path: str | None = None
    self._closed = False
    self._identity: directory.DirectoryIdentity | None = None
    if not self.active:
      return
    self._identity = directory.DirectoryIdentity(out_dir)
    if start_step > 0 and kept_rows is None:
      kept_rows = metrics_to_keep(self.metrics_path, start_step)
    if start_step > 0 and kept_rows is not None:
      files.write_bytes(self.metrics_path, kept_rows)
    elif start_step <= 0 and os.path.exists(self.metrics_path):
      os.remove(self.metrics_path)
    self.events_path = _new_event_file(os.path.join(out_dir, TENSORBOARD_DIR))
    now = time.time()
    files.append_bytes(
      self.events_path,
      tfevents.file_version_record(now)
      + tfevents.purge_record(now, start_step + 1),
    )

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Logs ``scalars`` at ``step``.

    Args:
      step: the step they are of (steps done).
      scalars: ``{name: value}``; every value goes into the JSON row, the
        numbers (not booleans) into TensorBoard too.

    Raises:
      OSError: the file system refused a write, naming the file; no part
        of a record stays.
      ValueError: the writer is closed.
      RunDirectoryRemoved: the run directory was removed (or made again)
        since the writer was opened; nothing is written.
    """
    if self._closed:
      raise ValueError(f"the metric writer of {self.out_dir} is closed")
    if not self.active or self.events_path is None:
      return
    if self._identity is not None:
      self._identity.check()
    row = {"step": step, **scalars}
    files.append_line(self.metrics_path, json.dumps(row))
    numbers = {
      name: number
      for name, number in ((k, _scalar(v)) for k, v in scalars.items())
      if number is not None
    }
    if numbers:
      files.append_bytes(
        self.events_path,
        tfevents.scalars_record(time.time(), step, numbers),
      )

  def close(self) -> None:
    """Flushes what was written to disk (``fsync``); later writes fail.

    Raises:
      RunDirectoryRemoved: the run directory was removed (or made again)
        since the writer was opened: a run must not end as a success then.
    """
    if self._closed:
      return
    self._closed = True
    if self._identity is not None:
      identity, self._identity = self._identity, None
      try:
        identity.check()
      finally:
        identity.close()
    for path in (self.metrics_path, self.events_path):
      if self.active and path is not None and os.path.exists(path):
        fd = os.open(path, os.O_RDONLY)
        try:
          os.fsync(fd)
        finally:
          os.close(fd)

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def _new_event_file(directory: str) -> str:
  """Creates a new, empty event file in ``directory`` (made if missing).

  TensorBoard reads every file whose name holds ``tfevents``, in name
  order; the names begin as ``tensorboardX``'s do (``events.out.tfevents.``
  with the time in seconds and the host), and end with the process id and
  a number that makes each one new.
  """
  os.makedirs(directory, exist_ok=True)
  stem = (
    f"events.out.tfevents.{math.floor(time.time()):010d}."
    f"{socket.gethostname()}.{os.getpid()}"
  )
  for n in range(1000):
    path = os.path.join(directory, f"{stem}.{n}")
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
      continue
    os.close(fd)
    return path
  raise FileExistsError(f"{directory} holds 1000 event files named {stem}.*")
