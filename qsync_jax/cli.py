"""How a command-line program of this project starts and treats bad input.

Bad input (a malformed plan, an unknown layer or model, a missing file) ends a
binary with one line naming the problem and exit status 1, not a traceback
(:func:`bad_input_exits`), and so does a full or read-only disk
(:func:`disk_errors_exit`). Every binary calls :func:`start_binary` first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
import contextlib
import sys
import traceback

from qsync_jax import files
from qsync_jax import host_malloc
from qsync_jax.launch import links
from qsync_jax.numerics import ops
from qsync_jax.process import membership

#: Exceptions that mean "the input is wrong", as raised by the library.
BAD_INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


@contextlib.contextmanager
def bad_input_exits() -> Iterator[None]:
  """Turns bad-input exceptions into ``error: <message>`` and exit status 1.

  An error whose ``show_cause`` is true (a user's factory raised, e.g.
  :class:`qsync_jax.data.FactoryError`) has the traceback of its cause, the
  user's exception, printed above the line.
  """
  try:
    yield
  except BAD_INPUT_ERRORS as e:
    if getattr(e, "show_cause", False) and e.__cause__ is not None:
      traceback.print_exception(e.__cause__, file=sys.stderr)
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from None


@contextlib.contextmanager
def disk_errors_exit(out_dir: str) -> Iterator[None]:
  """Ends the program with one ``error:`` line on a file-system refusal.

  An ``OSError`` of :data:`qsync_jax.files.WRITE_ERRNOS` (no space,
  read-only, no permission) becomes ``error: PATH: REASON`` and exit status
  1; ``out_dir`` stands for the path where the error names none.

  Args:
    out_dir: the directory the program writes into.
  """
  try:
    yield
  except OSError as e:
    if e.errno not in files.WRITE_ERRNOS:
      raise
    print(f"error: {e.filename or out_dir}: {e.strerror}", file=sys.stderr)
    raise SystemExit(1) from None


def start_binary() -> None:
  """What every binary of this project does first: applies the host
  allocator mode ``$QSYNC_HOST_MALLOC`` names (:mod:`qsync_jax.host_malloc`;
  ``reuse`` when unset) and checks the other variables the library reads
  (``QSYNC_KERNELS``, the launcher's ``QSYNC_LINK_*`` and the elastic
  launcher's ``QSYNC_ELASTIC_*``), ending the program with one line naming
  the first that is malformed.
  """
  with bad_input_exits():
    host_malloc.configure_from_env()
    # Read only where a layer runs INT8 or FP8, or where a run writes its
    # summary: a typo would surface late, or never.
    ops.kernel_backend_from_env()
    links.link_info_from_env()
    membership.from_env()


def check_names(what: str, names: Sequence[str], valid: Iterable[str]) -> None:
  """Raises ``ValueError`` naming every entry of ``names`` not in ``valid``.

  Args:
    what: what the names are, for the message (e.g. ``"task"``).
    names: the names asked for.
    valid: the names that exist.
  """
  valid = list(valid)
  unknown = [n for n in names if n not in valid]
  if unknown:
    raise ValueError(f"unknown {what}(s) {unknown}; valid: {', '.join(valid)}")


def check_flags_need(
  given: Sequence[str],
  what: str,
  *,
  verbs: tuple[str, str] = ("applies", "apply"),
  fix: str | None = None,
) -> None:
  """Raises ``ValueError`` for flags given where they would be ignored.

  Args:
    given: the flags given (``["--latency"]``); none: nothing to say.
    what: what they need, after the verb (``"to an elastic pool"``).
    verbs: the verb for one flag and for several.
    fix: how to give what they need (``"add --elastic"``); the message then
      also offers to leave them out.

  Example:
    >>> check_flags_need([], "to --study=trace")
    >>> check_flags_need(["--a", "--b"], "to X", fix="add --x")
    Traceback (most recent call last):
    ...
    ValueError: --a, --b only apply to X: add --x, or leave them out
  """
  if not given:
    return
  one = len(given) == 1
  line = f"{', '.join(given)} only {verbs[0] if one else verbs[1]} {what}"
  if fix:
    line += f": {fix}, or leave {'it' if one else 'them'} out"
  raise ValueError(line)


def exit_on_bad_override(error: Exception, argv: Sequence[str]) -> None:
  """Reports a ``--config.a.b=...`` override of a field the config lacks.

  ``ml_collections`` applies the overrides while the config flag is defined
  and refuses a missing field with a bare ``AttributeError`` or
  ``KeyError``; a binary catches it there and calls this, which prints one
  ``error:`` line naming the override and exits with status 1.
  """
  key = str(error).strip("'\"")
  named = [
    a.split("=", 1)[0]
    for a in argv[1:]
    if a.startswith("--config.")
    and a.split("=", 1)[0].rsplit(".", 1)[-1] == key
  ]
  where = named[0] if named else "a --config override"
  print(
    f"error: {where}: the config has no field {key!r} (give model and "
    "dataset arguments as JSON: --model_kwargs='{...}', "
    "--dataset_kwargs='{...}')",
    file=sys.stderr,
  )
  raise SystemExit(1)
