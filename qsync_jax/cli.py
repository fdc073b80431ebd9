"""Shared behaviour of the experiment binaries.

Bad input (a malformed plan, an unknown layer or model, a missing file) ends a
binary with one line naming the problem and exit status 1, not a traceback.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

#: Exceptions that mean "the input is wrong", as raised by the library.
BAD_INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError)


@contextlib.contextmanager
def bad_input_exits() -> Iterator[None]:
  """Turns bad-input exceptions into ``error: <message>`` and exit status 1."""
  try:
    yield
  except BAD_INPUT_ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(1) from None
