"""The package layout's rules (docs/ARCHITECTURE.md), read from the source.

Every import statement counts, at module level or inside a function: a
function-level import that hides a cycle is still a cycle. Importing
``a.b.c`` also runs the ``__init__`` of ``a.b``, so an import from outside a
package counts as an edge to that package's ``__init__`` too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP_LEVEL = ("qsync_jax", "pallas_kernels", "experiments")

#: Which parts of the library may import which (docs/ARCHITECTURE.md). A part
#: is a subpackage of qsync_jax, or a top-level module of it.
ALLOWED = {
  "numerics": {"pallas_kernels"},
  "task": set(),
  "plan": {"numerics", "task"},
  "models": {"plan", "task"},
  "data": {"files"},
  "parallel": {"numerics", "plan"},
  "train": {"numerics", "plan", "parallel", "data", "task", "files"},
  "sensitivity": {"numerics", "plan", "task"},
  "predictor": {
    "numerics",
    "plan",
    "parallel",
    "train",
    "task",
    "launch",
    "process",
    "host_malloc",
    "host_memory",
    "files",
  },
  "allocation": {
    "numerics",
    "plan",
    "parallel",
    "train",
    "sensitivity",
    "predictor",
    "data",
    "task",
    "process",
    "files",
    "version",
  },
  "files": set(),
  "process": {"parallel", "train", "files", "rundir"},
  "rundir": {"files"},
  "launch": {"process", "cli", "files"},
  "cli": {"host_malloc", "numerics", "launch", "process", "files"},
  "host_malloc": set(),
  "host_memory": set(),
  "distributed": {"launch"},
  "version": set(),
  "__init__": {
    "numerics",
    "task",
    "plan",
    "models",
    "data",
    "parallel",
    "train",
    "sensitivity",
    "predictor",
    "allocation",
    "process",
    "launch",
    "rundir",
    "version",
  },
}

# Sizes in lines as the formatter lays them out (one argument a line where a
# call does not fit).
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 350
# A function's body, docstring aside.
MAX_FUNCTION_LINES = 120


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
  out = {}
  for top in TOP_LEVEL:
    for path in (ROOT / top).rglob("*.py"):
      out[_module_name(path)] = path
  return out


SOURCES = _sources()


def _is_package(name: str) -> bool:
  return SOURCES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
  """The modules ``name`` imports (resolved to modules of this repo)."""
  tree = ast.parse(SOURCES[name].read_text())
  package = name if _is_package(name) else name.rpartition(".")[0]
  targets = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for a in node.names:
        sub = f"{base}.{a.name}"
        targets.add(sub if sub in SOURCES else base)
  edges = set()
  for t in targets:
    while t and t not in SOURCES:  # `import a.b.Name` style: nearest module
      t = t.rpartition(".")[0]
    if not t or t == name:
      continue
    edges.add(t)
    # Running a.b.c runs the __init__ of every package above it that the
    # importer is not already inside.
    parts = t.split(".")
    for i in range(1, len(parts)):
      pkg = ".".join(parts[:i])
      if pkg in SOURCES and not (name + ".").startswith(pkg + "."):
        edges.add(pkg)
  return edges


GRAPH = {name: _imports(name) for name in SOURCES}


def _part(module: str) -> str | None:
  """The library part a qsync_jax module belongs to."""
  parts = module.split(".")
  if parts[0] != "qsync_jax":
    return None
  return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every cycle found by a depth-first search (one per back edge)."""
  found, state, stack = [], {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        found.append(stack[stack.index(nxt) :] + [nxt])
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
  return found


def test_the_graph_sees_imports_at_any_depth():
  # The rules below are only as good as the graph they read.
  assert "qsync_jax.train.step" in GRAPH["qsync_jax.train.trainer"]
  assert "pallas_kernels.int8_matmul" in GRAPH["qsync_jax.numerics.ops"]
  assert "qsync_jax.train" in GRAPH["qsync_jax.predictor.calls"]
  assert not _is_package("qsync_jax.train.step") and _is_package(
    "qsync_jax.train"
  )
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
  assert _cycles(GRAPH) == []


@pytest.mark.parametrize(
  "top,forbidden",
  [
    ("pallas_kernels", ("qsync_jax", "experiments")),
    ("qsync_jax", ("experiments",)),
  ],
)
def test_top_level_packages_import_downwards_only(top, forbidden):
  bad = sorted(
    (m, t)
    for m, ts in GRAPH.items()
    if m.split(".")[0] == top
    for t in ts
    if t.split(".")[0] in forbidden
  )
  assert bad == []


def test_parts_import_only_what_the_architecture_allows():
  unknown = sorted({_part(m) for m in SOURCES if _part(m)} - set(ALLOWED))
  assert unknown == [], f"parts missing from ALLOWED: {unknown}"
  bad = []
  for module, targets in GRAPH.items():
    part = _part(module)
    if part is None:
      continue
    for t in targets:
      other = "pallas_kernels" if t.startswith("pallas_kernels") else _part(t)
      if other not in (None, part, "__init__") and other not in ALLOWED[part]:
        bad.append((module, t))
      if other == "__init__" and part != "__init__":
        bad.append((module, t))  # the curated API imports the parts, not back
  assert sorted(bad) == []


def test_the_predictor_times_the_step_not_the_trainer():
  step_modules = {
    "qsync_jax.train",
    "qsync_jax.train.step",
    "qsync_jax.train.programs",
    "qsync_jax.train.layout",
    "qsync_jax.train.loss_scale",
    "qsync_jax.train.state",
  }
  bad = sorted(
    (m, t)
    for m, ts in GRAPH.items()
    if m.startswith("qsync_jax.predictor")
    for t in ts
    if t.startswith("qsync_jax.train") and t not in step_modules
  )
  assert bad == []
  # Nor through a chain: nothing the predictor reaches loads the trainer.
  reached, todo = (
    set(),
    [m for m in GRAPH if m.startswith("qsync_jax.predictor")],
  )
  while todo:
    m = todo.pop()
    if m not in reached:
      reached.add(m)
      todo.extend(GRAPH[m])
  assert "qsync_jax.train.trainer" not in reached


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """A function's body in lines, from its first statement after the
  docstring to its end."""
  body = node.body
  if (
    body
    and isinstance(body[0], ast.Expr)
    and isinstance(body[0].value, ast.Constant)
    and isinstance(body[0].value.value, str)
  ):
    body = body[1:]
  return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_files_classes_and_functions_stay_small():
  # The library, the kernels and the binaries alike: code moved into
  # experiments/ is held to the same sizes. get_config is exempt from the
  # function rule (one long list of fields).
  long_files, long_classes, long_functions = [], [], []
  for name, path in SOURCES.items():
    text = path.read_text()
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
      long_files.append((name, lines))
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.ClassDef):
        size = node.end_lineno - node.lineno + 1
        if size > MAX_CLASS_LINES:
          long_classes.append((name, node.name, size))
      elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        size = _body_lines(node)
        if size > MAX_FUNCTION_LINES and node.name != "get_config":
          long_functions.append((name, node.name, size))
  assert long_files == [] and long_classes == [] and long_functions == []


def test_the_size_rules_see_every_part():
  # The rules above read these trees; a directory dropped from TOP_LEVEL
  # would escape them.
  tops = {name.split(".")[0] for name in SOURCES}
  assert {"qsync_jax", "pallas_kernels", "experiments"} <= tops
  source = 'def f():\n  """doc"""\n  a = 1\n  return a\n'
  assert _body_lines(ast.parse(source).body[0]) == 2


def test_every_module_says_what_it_owns():
  missing = sorted(
    name
    for name, path in SOURCES.items()
    if name.split(".")[0] in ("qsync_jax", "pallas_kernels")
    and ast.get_docstring(ast.parse(path.read_text())) is None
  )
  assert missing == []


def test_files_are_replaced_in_two_places_only():
  # Every whole-file write goes through qsync_jax.files (fsync, a unique
  # temporary name); the checkpointer's set-aside of a damaged step renames
  # a directory, which no file writer does.
  callers = set()
  for top in ("qsync_jax", "pallas_kernels", "experiments", "examples"):
    for path in sorted((ROOT / top).rglob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        if (
          isinstance(node, ast.Attribute)
          and node.attr in ("replace", "rename")
          and isinstance(node.value, ast.Name)
          and node.value.id == "os"
        ):
          callers.add(str(path.relative_to(ROOT)))
  assert callers == {"qsync_jax/files.py", "qsync_jax/train/checkpoint.py"}
