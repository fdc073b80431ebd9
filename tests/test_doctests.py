"""The docstrings' examples and the docs pages' runnable code blocks run.

Two kinds of examples are collected and run on CPU (with the fake devices
of ``conftest.py``):

* every ``>>>`` example in the docstrings of every ``qsync_jax`` module
  (found by ``doctest.DocTestFinder`` over the imported modules; one test
  per module that has examples, failing on any mismatch);
* every fenced ``python`` block of a page under ``docs/`` (``.md``) that the
  line right before it marks runnable with the comment ``<!-- test -->``:

      <!-- test -->
      ```python
      import qsync_jax as qs
      ...
      ```

  Each marked block runs on its own, in a fresh namespace, and must not
  raise; blocks without the marker (fragments, long runs) are not run.

Keep both kinds short: they run in every test run.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import qsync_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKED_BLOCK = re.compile(r"^<!-- test -->\n```python\n(.*?)^```", re.M | re.S)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
  names = [qsync_jax.__name__]
  for info in pkgutil.walk_packages(qsync_jax.__path__, "qsync_jax."):
    names.append(info.name)
  return sorted(names)


def _doctests(module_name: str) -> list[doctest.DocTest]:
  module = importlib.import_module(module_name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  tests = finder.find(module, module_name)
  # Only the examples written in this module: not those of objects it imports.
  return sorted((t for t in tests if t.examples), key=lambda t: t.name)


def _modules_with_doctests() -> list[str]:
  return [name for name in _modules() if _doctests(name)]


@pytest.mark.parametrize("module_name", _modules_with_doctests())
def test_docstring_examples(module_name):
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  failures = []
  for test in _doctests(module_name):
    result = runner.run(test, out=failures.append)
    del result
  assert runner.failures == 0, "".join(failures)


def test_docstring_examples_exist():
  # The examples the API reference promises; a module losing all of them
  # would silently drop out of the parametrization above.
  with_examples = set(_modules_with_doctests())
  for name in (
    "qsync_jax.plan.precision",
    "qsync_jax.plan.policy",
    "qsync_jax.parallel.cluster",
    "qsync_jax.parallel.schedules",
  ):
    assert name in with_examples, name


def _doc_blocks() -> list[tuple[str, int, str]]:
  blocks = []
  for page in sorted(DOCS.rglob("*.md")):
    if "_build" in page.parts:
      continue
    text = page.read_text()
    for i, match in enumerate(MARKED_BLOCK.finditer(text)):
      blocks.append((str(page.relative_to(ROOT)), i, match.group(1)))
  return blocks


@pytest.mark.parametrize(
  "page,index,code",
  _doc_blocks(),
  ids=[f"{page}:{i}" for page, i, _ in _doc_blocks()],
)
def test_docs_code_block(page, index, code):
  del page, index
  exec(compile(code, "<docs block>", "exec"), {"__name__": "__docs__"})


def test_docs_have_runnable_blocks():
  assert len(_doc_blocks()) >= 3
