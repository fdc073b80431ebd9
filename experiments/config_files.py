"""Config files given on the command line, and the flags that carry them.

``parse_flags`` is absl's flag parsing for a binary whose ``--config`` is a
``get_config()`` file: a file that cannot be loaded (it is missing, not
Python, has no ``get_config``, or its ``get_config`` raises or returns None)
is one ``error:`` line naming the file, and exit 1, with the file's own
frames of a traceback above it.
"""

import os
import sys
import traceback

from absl import flags
import ml_collections

#: The main job's config file, when no ``--config`` is given.
DEFAULT_CONFIG = os.path.join(
  os.path.dirname(__file__), "configs", "default.py"
)


def _config_path(argv: list[str]) -> str:
  """The ``--config`` value of ``argv`` (the default where none is)."""
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return DEFAULT_CONFIG


def _config_file_error(path: str, error: BaseException) -> str:
  """What went wrong loading the config file, in one line.

  The user's own frames of the traceback (those in the config file) are
  printed above it, as a user's factory's are.
  """
  file = os.path.abspath(path.split(":", 1)[0])
  frames = traceback.extract_tb(error.__traceback__)
  first = next(
    (i for i, f in enumerate(frames) if os.path.abspath(f.filename) == file),
    None,
  )
  if first is not None:
    sys.stderr.write("Traceback (most recent call last):\n")
    sys.stderr.writelines(traceback.format_list(frames[first:]))
    sys.stderr.writelines(traceback.format_exception_only(error))
  if not os.path.isfile(file):
    what = "no such file" if not os.path.exists(file) else "not a file"
  elif isinstance(error, SyntaxError):
    what = f"it is not valid Python: {error.msg} at line {error.lineno}"
  elif isinstance(error, AttributeError) and "get_config" in str(error):
    what = (
      "it defines no get_config(); a config file defines get_config() "
      "returning an ml_collections.ConfigDict"
    )
  else:
    message = " ".join(str(error).split()) or "(no message)"
    what = f"get_config() raised {type(error).__name__}: {message}"
  return f"error: --config={path}: {what}"


def parse_flags(
  argv: list[str], flag_values: flags.FlagValues = flags.FLAGS
) -> list[str]:
  """absl's flag parsing, where a config file that cannot be loaded (it is
  missing, not Python, has no ``get_config``, or its ``get_config`` raises
  or returns None) is one ``error:`` line naming the file, and exit 1.

  Args:
    argv: the command line.
    flag_values: the flags to parse into (the binary's).

  Returns:
    The arguments left after the flags.

  Raises:
    SystemExit: status 1 after the ``error:`` line (or absl's own message
      for another flag).
  """
  path = _config_path(argv)
  try:
    args = flag_values(argv)
  except flags.Error as e:
    cause = e.__cause__ or e.__context__
    if cause is not None and cause.__context__ is not None:
      # config_flags re-raises a TypeError or ValueError of get_config() as
      # its traceback's text; the user's own error is its context.
      cause = cause.__context__
    if cause is not None and str(e).startswith("flag --config="):
      print(_config_file_error(path, cause), file=sys.stderr)
      raise SystemExit(1) from None
    # absl's own message (app.parse_flags_with_usage's).
    message = str(e).replace("\n", "\n  ")
    print(f"FATAL Flags parsing error: {message}", file=sys.stderr)
    print(
      "Pass --helpshort or --helpfull to see help on flags.", file=sys.stderr
    )
    raise SystemExit(1) from None
  except Exception as e:  # the config file's own code, or its import
    print(_config_file_error(path, e), file=sys.stderr)
    raise SystemExit(1) from None
  config = flag_values.config
  error = getattr(config, "_error", None)  # config_flags defers a read error
  if error is not None and not isinstance(config, ml_collections.ConfigDict):
    print(_config_file_error(path, error), file=sys.stderr)
    raise SystemExit(1)
  if config is None:
    print(
      f"error: --config={path}: get_config() returned None; it must "
      "return an ml_collections.ConfigDict (a missing return statement?)",
      file=sys.stderr,
    )
    raise SystemExit(1)
  return args
