"""Precision plans for Flax Linen models, through method interception.

Linen modules are frozen dataclasses created anew inside every ``init`` /
``apply``, so a plan cannot be written into them ahead of time. Instead
:func:`apply_plan` returns a :class:`PlannedModule` whose ``init`` and
``apply`` run the original module under ``nn.intercept_methods``: when an
addressable layer is called, the interceptor hands it the plan's op for the
duration of that call. Addressable Linen layers are ``nn.Dense``,
``nn.DenseGeneral`` (``dot_general``), ``nn.Conv`` (``conv_general_dilated``)
and ``nn.Embed`` (``dtype``); Linen's ``nn.Einsum`` has no injection hook.
Paths are the Linen module paths joined by ``/`` (``"Conv_0"``,
``"encoder/layer_1/Dense_0"``). The ops and forced precisions are those of
the NNX API (:mod:`qsync_jax.plan.rules`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax

from qsync_jax.numerics.precision import Precision
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


def layer_paths(
  module: nn.Module, *args, method: str = "init", **kwargs
) -> list[str]:
  """Returns the paths of ``module``'s addressable layers in forward order.

  Args:
    module: a Linen module.
    *args: the arguments of ``module.init`` (``method="init"``: an rng and
      sample inputs) or ``module.apply`` (``method="apply"``).
    method: which entry point to trace (abstractly, no FLOPs).
    **kwargs: keyword arguments of that entry point.
  """
  order: list[str] = []

  def record(next_fun, call_args, call_kwargs, context):
    path = _layer_path(context)
    if path is not None and path not in order:
      order.append(path)
    return next_fun(*call_args, **call_kwargs)

  def run():
    with nn.intercept_methods(record):
      return getattr(module, method)(*args, **kwargs)

  jax.eval_shape(run)
  if not order:
    raise ValueError(
      f"{type(module).__name__} has no layer a precision plan "
      "can address (nn.Dense, nn.DenseGeneral, nn.Conv, "
      "nn.Embed)"
    )
  return order


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

  def precisions(
    self, *args, method: str = "init", **kwargs
  ) -> dict[str, Precision]:
    """Returns {layer path: precision}, resolving it from a traced call."""
    if self._precisions is None:
      embeds: set[str] = set()

      def record(next_fun, call_args, call_kwargs, context):
        if isinstance(context.module, nn.Embed):
          embeds.add("/".join(context.module.path))
        return next_fun(*call_args, **call_kwargs)

      with nn.intercept_methods(record):
        paths = layer_paths(self.module, *args, method=method, **kwargs)
      effective = resolve_with_forced(paths, embeds, self.plan)
      if self.device_kind is not None:
        PrecisionPlan.from_precisions(effective).validate_for(
          self.device_kind, paths
        )
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
    with nn.intercept_methods(self._interceptor(precisions)):
      return self.module.init(*args, **kwargs)

  def apply(self, *args, **kwargs) -> Any:
    """``module.apply`` computing with the plan."""
    precisions = self.precisions(*args, method="apply", **kwargs)
    with nn.intercept_methods(self._interceptor(precisions)):
      return self.module.apply(*args, **kwargs)


def apply_plan(
  module: nn.Module, plan: PrecisionPlan, *, device_kind: str | None = None
) -> PlannedModule:
  """Returns ``module`` wrapped so that ``init`` / ``apply`` use ``plan``.

  Layer paths are resolved on the first ``init`` / ``apply`` call (a rule
  matching no layer raises :class:`~qsync_jax.plan.precision.PlanError` then).
  """
  return PlannedModule(module, plan, device_kind)
