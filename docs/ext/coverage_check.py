"""Fails the build when a public name of qsync_jax is not documented.

The public names are ``qsync_jax.__all__`` and the ``__all__`` of every
module listed in :data:`PUBLIC_MODULES`. A name counts as documented when
the Python domain holds it under its module (``qsync_jax.plan.PrecisionPlan``)
or when the very same object is documented under another public name: each
re-export is documented once, at its flat name (``qsync_jax.PrecisionPlan``),
and the subpackage pages link to it. A module without ``__all__`` (such as
``qsync_jax.train``) must have its own page.
"""

from __future__ import annotations

import importlib
import types

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

PUBLIC_MODULES = (
  "qsync_jax",
  "qsync_jax.allocation",
  "qsync_jax.data",
  "qsync_jax.models",
  "qsync_jax.numerics",
  "qsync_jax.launch",
  "qsync_jax.parallel",
  "qsync_jax.plan",
  "qsync_jax.plan.linen",
  "qsync_jax.predictor",
  "qsync_jax.process",
  "qsync_jax.rundir",
  "qsync_jax.sensitivity",
  "qsync_jax.task",
  "qsync_jax.train",
)


def public_names(module_name: str) -> list[str]:
  """The names ``module_name`` exports (its ``__all__``; none without)."""
  return list(getattr(importlib.import_module(module_name), "__all__", []))


def undocumented(documented: set[str]) -> list[str]:
  """The public names, as ``module.name``, that no page documents."""
  by_object: dict[int, str] = {}
  for full in documented:
    module_name, _, attr = full.rpartition(".")
    try:
      obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
      continue
    by_object.setdefault(id(obj), full)
  missing = []
  for module_name in PUBLIC_MODULES:
    if module_name not in documented:
      missing.append(module_name)
    module = importlib.import_module(module_name)
    for name in public_names(module_name):
      full = f"{module_name}.{name}"
      obj = getattr(module, name)
      if isinstance(obj, types.ModuleType):
        if obj.__name__ not in documented:
          missing.append(full)
      elif full not in documented and id(obj) not in by_object:
        missing.append(full)
  return missing


def _check(app: Sphinx, env) -> None:
  documented = set(env.domaindata["py"]["objects"])
  documented |= set(env.domaindata["py"]["modules"])
  missing = undocumented(documented)
  if missing:
    logger.warning(
      "public names not documented in docs/api/ (%d): %s",
      len(missing),
      ", ".join(missing),
      type="coverage_check",
    )


def setup(app: Sphinx) -> dict:
  app.connect("env-check-consistency", _check)
  return {"version": "1.0", "parallel_read_safe": True}
