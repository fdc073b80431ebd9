"""Sphinx configuration for the qsync_jax documentation.

Builds offline: no intersphinx, no remote assets beyond the theme's own
files. Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html``.
"""

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "ext"))

# Importing the package must not start an accelerator backend or print.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from qsync_jax.version import __version__  # noqa: E402

project = "qsync_jax"
author = "qsync_jax authors"
copyright = "qsync_jax authors"
version = release = __version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "coverage_check",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: heading anchors for links such as RESULTS.md#some-heading.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]

# Autodoc and autosummary: one page per public name.
autosummary_generate = True
autosummary_imported_members = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": False}
add_module_names = False

# Google-style docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
# Attributes sections as fields: no second description of a documented member.
napoleon_use_ivar = True

html_theme = "furo"
html_title = f"qsync_jax {release}"
html_static_path = []

# Figures and data live in the top-level results/ directory, outside the
# docs source. Pages refer to them relative to themselves, e.g.
# ![...](../results/NAME.png) in docs/RESULTS.md: Sphinx copies each image a
# page embeds into _images/, and MyST turns a link to an existing file such
# as [data](../results/x/study.json) into a download (copied to _downloads/).


def _constant_doc(app, what, name, obj, options, lines):
  """Documents a re-exported constant by its defining module's ``#:`` comment.

  Autodoc reads a constant's ``#:`` comment from the module it is documented
  under (a package's ``__init__``, which only imports it), and otherwise
  falls back to the docstring of the value's type (``dict``, ``tuple``).
  This finds the comment where the constant is defined, drops a type's
  docstring, and shows a short value.
  """
  if what != "data":
    return
  if lines and "\n".join(lines).strip() == (type(obj).__doc__ or "").strip():
    lines[:] = []
  attr = name.rpartition(".")[2]
  if not lines:
    from sphinx.pycode import ModuleAnalyzer

    for module_name, module in sorted(sys.modules.items()):
      if not module_name.startswith("qsync_jax"):
        continue
      if getattr(module, attr, None) is not obj:
        continue
      try:
        docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
      except Exception:  # no source: try the next module
        continue
      if ("", attr) in docs:
        lines[:] = [line for line in docs["", attr] if line]
        break
  value = repr(obj)
  if len(value) <= 100:
    lines += ["", f"Value: ``{value}``"]


def setup(app):
  app.connect("autodoc-process-docstring", _constant_doc)
