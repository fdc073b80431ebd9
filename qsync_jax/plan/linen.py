"""Precision plans for Flax Linen models, through method interception.

Linen modules are frozen dataclasses created anew inside every ``init`` /
``apply``, so a plan cannot be written into them ahead of time. Instead
:func:`apply_plan` returns a :class:`PlannedModule` whose ``init`` and
``apply`` run the original module under ``nn.intercept_methods``: when an
addressable layer is called, the interceptor hands it the plan's op for the
duration of that call. Linen layers with such a hook are ``nn.Dense``,
``nn.DenseGeneral`` (``dot_general``), ``nn.Conv`` (``conv_general_dilated``)
and ``nn.Embed`` (``dtype``); every other contraction (``nn.Einsum``,
``nn.ConvTranspose``, attention matmuls, a module's own ``jnp.einsum`` or
``@``) is intercepted and runs its site's op
(:mod:`qsync_jax.plan.intercept`). Paths are the Linen module paths joined by
``/`` (``"Conv_0"``, ``"encoder/layer_1/Dense_0"``, ``"block/einsum_0"``). The ops and forced precisions are those of
the NNX API (:mod:`qsync_jax.plan.rules`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from qsync_jax.numerics.precision import Precision
from qsync_jax.plan import intercept
from qsync_jax.plan.precision import PrecisionPlan
from qsync_jax.plan.rules import embed_dtype
from qsync_jax.plan.rules import OP_FOR_ATTRIBUTE
from qsync_jax.plan.rules import resolve_with_forced

# The attribute each layer type computes through (its op: OP_FOR_ATTRIBUTE).
_OP_ATTR = (
  (nn.Dense, "dot_general"),
  (nn.DenseGeneral, "dot_general"),
  (nn.Conv, "conv_general_dilated"),
)
ADDRESSABLE_TYPES = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Embed)
# The Linen layers interception leaves alone (an embedding's attend is a site).
_INTERCEPT_PASSES = (nn.Dense, nn.DenseGeneral, nn.Conv)
intercept.pass_through(_INTERCEPT_PASSES)


def _layer_path(context) -> str | None:
  module = context.module
  if context.method_name != "__call__" or not isinstance(
    module, ADDRESSABLE_TYPES
  ):
    return None
  return "/".join(module.path)


@contextlib.contextmanager
def temporarily(module: nn.Module, **attrs):
  """Sets attributes of a bound Linen module for the ``with`` block.

  Linen modules are frozen dataclasses; an interceptor swaps attributes of
  the bound instance for the duration of one call and restores them (also
  used by :mod:`qsync_jax.plan.bridge`).
  """
  saved = {k: getattr(module, k) for k in attrs}
  for k, v in attrs.items():
    object.__setattr__(module, k, v)
  try:
    yield
  finally:
    for k, v in saved.items():
      object.__setattr__(module, k, v)


class _SiteHome:
  """Where the intercepted contractions of a Linen call find their sites."""

  def __init__(self, proxies: dict[str, Any]):
    self.proxies = proxies


@dataclasses.dataclass
class _Layout:
  """The layers of one Linen call: paths in forward order, the embeddings,
  and the sites of the intercepted contractions by Linen key."""

  paths: list[str]
  embeds: set[str]
  sites: dict[str, Any]
  site_paths: dict[str, str]


def _layout(module: nn.Module, method: str, args: tuple, kwargs: dict):
  order: list[Any] = []
  embeds: set[str] = set()

  def record(next_fun, call_args, call_kwargs, context):
    path = _layer_path(context)
    if path is not None and path not in order:
      order.append(path)
      if isinstance(context.module, nn.Embed):
        embeds.add(path)
    return next_fun(*call_args, **call_kwargs)

  home = _SiteHome({})
  discovery = intercept.Discovery(order.append)
  discovery.paths[id(home)] = ()
  # The first argument (rngs for init, variables for apply) is not data:
  # the inputs are the array leaves of the rest.
  leaves, treedef = jax.tree.flatten((args[1:], kwargs))
  traced_at = [
    i
    for i, leaf in enumerate(leaves)
    if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
  ]

  def run(first, traced):
    full = list(leaves)
    for i, value in zip(traced_at, traced):
      full[i] = value
    rest, kw = treedef.unflatten(full)
    with (
      nn.intercept_methods(record),
      intercept.linen_scope(home),
      intercept.discovering(discovery),
    ):
      return getattr(module, method)(first, *rest, **kw)

  closed = jax.make_jaxpr(run)(args[0], [leaves[i] for i in traced_at])
  discovery.mark_dependence(
    closed.jaxpr, closed.jaxpr.invars[len(jax.tree.leaves(args[0])) :]
  )
  sites, site_paths = {}, {}
  for f, site in zip(discovery.found, intercept.make_sites(discovery.found)):
    key = "/".join((*f.owner_path, f.name))
    sites[key] = site
    site_paths[key] = intercept.site_path(
      f.owner_path, f.name, site, type(module).__name__
    )
  paths: list[str] = []
  for item in order:
    if isinstance(item, intercept.Found):
      item = site_paths["/".join((*item.owner_path, item.name))]
    if item not in paths:
      paths.append(item)
  if not paths:
    raise ValueError(
      f"{type(module).__name__} has no layer a precision plan can address: "
      "no flax contracting layer and no contraction (jnp.einsum, @, "
      "lax.dot_general, lax.conv_general_dilated...) in its modules"
    )
  return _Layout(paths, embeds, sites, site_paths)


def layer_paths(
  module: nn.Module, *args, method: str = "init", **kwargs
) -> list[str]:
  """Returns the paths of ``module``'s addressable layers in forward order.

  The contractions its modules compute with jax ops are layers too
  (:mod:`qsync_jax.plan.intercept`), named ``owner/einsum_0``.

  Args:
    module: a Linen module.
    *args: the arguments of ``module.init`` (``method="init"``: an rng and
      sample inputs) or ``module.apply`` (``method="apply"``).
    method: which entry point to trace (abstractly, no FLOPs).
    **kwargs: keyword arguments of that entry point.
  """
  return _layout(module, method, args, kwargs).paths


class PlannedModule:
  """A Linen module whose ``init`` / ``apply`` compute with a plan.

  The variables are exactly those of the wrapped module (FP32 params), so the
  same variables work with and without the plan.

  Attributes:
    module: the wrapped Linen module.
    plan: the precision plan.
    device_kind: if set, the plan is validated against it.
  """

  def __init__(
    self, module: nn.Module, plan: PrecisionPlan, device_kind: str | None = None
  ):
    if isinstance(module, PlannedModule):
      module = module.module  # a new plan replaces the old one
    self.module: nn.Module = module
    self.plan = plan
    self.device_kind = device_kind
    self._precisions: dict[str, Precision] | None = None
    self._home = _SiteHome({})

  def precisions(
    self, *args, method: str = "init", **kwargs
  ) -> dict[str, Precision]:
    """Returns {layer path: precision}, resolving it from a traced call."""
    if self._precisions is None:
      layout = _layout(self.module, method, args, kwargs)
      hard = set(layout.embeds)
      soft = set()
      for key, site in layout.sites.items():
        if site.in_embedding:
          hard.add(layout.site_paths[key])
        elif site.floored:
          soft.add(layout.site_paths[key])
      effective = resolve_with_forced(
        layout.paths, hard, self.plan, soft_floored=soft
      )
      if self.device_kind is not None:
        PrecisionPlan.from_precisions(effective).validate_for(
          self.device_kind, layout.paths
        )
      for key, site in layout.sites.items():
        op = OP_FOR_ATTRIBUTE[site.hook]
        setattr(
          site,
          site.hook,
          op(effective[layout.site_paths[key]], self.plan.quant),
        )
      self._home = _SiteHome(layout.sites)
      self._precisions = effective
    return self._precisions

  def _interceptor(self, precisions: dict[str, Precision]):
    def intercept(next_fun, call_args, call_kwargs, context):
      path = _layer_path(context)
      if path is None or path not in precisions:
        return next_fun(*call_args, **call_kwargs)
      prec, module = precisions[path], context.module
      if isinstance(module, nn.Embed):
        attrs = {"dtype": embed_dtype(prec, module.param_dtype)}
      else:
        attr = next(a for t, a in _OP_ATTR if isinstance(module, t))
        attrs = {attr: OP_FOR_ATTRIBUTE[attr](prec, self.plan.quant)}
        if attr == "dot_general":
          attrs["dot_general_cls"] = None
        else:
          attrs["conv_general_dilated_cls"] = None
      with temporarily(module, **attrs):
        return next_fun(*call_args, **call_kwargs)

    return intercept

  def init(self, *args, **kwargs) -> Any:
    """``module.init`` computing with the plan."""
    precisions = self.precisions(*args, method="init", **kwargs)
    with (
      nn.intercept_methods(self._interceptor(precisions)),
      intercept.linen_scope(self._home),
    ):
      return self.module.init(*args, **kwargs)

  def apply(self, *args, **kwargs) -> Any:
    """``module.apply`` computing with the plan."""
    precisions = self.precisions(*args, method="apply", **kwargs)
    with (
      nn.intercept_methods(self._interceptor(precisions)),
      intercept.linen_scope(self._home),
    ):
      return self.module.apply(*args, **kwargs)


def apply_plan(
  module: nn.Module, plan: PrecisionPlan, *, device_kind: str | None = None
) -> PlannedModule:
  """Returns ``module`` wrapped so that ``init`` / ``apply`` use ``plan``.

  Layer paths are resolved on the first ``init`` / ``apply`` call (a rule
  matching no layer raises :class:`~qsync_jax.plan.precision.PlanError` then).
  """
  return PlannedModule(module, plan, device_kind)
