"""Layer depths over the forward graph, as QSync's indicator uses them.

This module owns :func:`forward_structure`: each addressable layer's depth, the
breadth-first distance from the model input over the forward data-flow graph
(QSync's official code, bytedance/QSync, its function
``utils.get_depth_of_nodes``: BFS layers from the first node of the forward
DAG), and the output size of each embedding's lookup (its ``Dvv``).

The graph is the traced forward pass (a jaxpr). Its nodes are the top-level
equations, with each layer's op traced as one named call and every other
call (an activation's ``custom_jvp``, a jitted helper) as one node, like the
one op per call of QSync's PyTorch graph. Equations that read only
parameters or constants (weight casts) are off the activation path and are
not nodes. Where a graph merges, BFS keeps the shortest path, so a layer
behind identity skip connections is shallower than its forward index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax import nnx
import jax
from jax.extend import core as jex_core
import numpy as np

from qsync_jax.plan import policy
from qsync_jax.task import calling

_MARK = "qsync_depth_layer_"
# Loops and branches run their body more than once or not at all: a BFS
# over their equations would not be the forward graph's.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def forward_structure(
  model: nnx.Module, layer_list: Sequence[policy.Layer], sample: Any
) -> tuple[list[int], list[int | None]]:
  """Each layer's BFS depth, and each embedding's lookup output size.

  Args:
    model: the NNX model (left unchanged).
    layer_list: its addressable layers in forward order.
    sample: the model's inputs (arrays or ``jax.ShapeDtypeStruct``: one, a
      tuple or a dict) or a :class:`qsync_jax.task.Probe` of its forward
      pass; every array of the probe's data is a model input.

  Returns:
    ``(depths, lookup_numel)`` in ``layer_list`` order: depth 0 for a
    layer fed by the input directly (or an embedding, whose table is its
    input), else one more than its nearest producer on the activation path;
    ``lookup_numel[i]`` the size of the gather that reads embedding ``i``'s
    table (None for other layers).

  Raises:
    ValueError: a layer is called inside a loop or a branch, or never called.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]

  def make_wrapper(i, layer, base):
    if policy.is_embedding(layer.module):

      def promote(arrays, **kw):
        def body(table):
          return base((table,), **kw)[0]

        body.__name__ = f"{_MARK}{i}"
        return (jax.jit(body)(arrays[0]),)

      return promote
    li, ri = policy.operand_positions(layer.module)

    def wrapped(*args, **kwargs):
      def body(a, b):
        full = list(args)
        full[li], full[ri] = a, b
        return base(*full, **kwargs)

      body.__name__ = f"{_MARK}{i}"
      return jax.jit(body)(args[li], args[ri])

    return wrapped

  probe = calling.as_probe(model, sample)
  data = calling.abstract(probe.data)

  def forward(p, r, d):
    # Instrument a fresh copy so the caller's model is left as it was.
    m = nnx.merge(graphdef, p, jax.tree.map(lambda v: v, r))
    found = policy.addressable_modules(m)
    policy.instrument(
      m,
      [policy.Layer(l.path, found[l.path], l.kind) for l in layer_list],
      make_wrapper,
    )
    return probe.fn(m, d)

  closed = jax.make_jaxpr(forward)(params, rest, data)
  jaxpr = closed.jaxpr
  env: dict[Any, int | None] = dict.fromkeys(jaxpr.invars)
  # The data's arrays are the model inputs: their readers are depth 0.
  num_data = len(jax.tree.leaves(data))
  for v in jaxpr.invars[len(jaxpr.invars) - num_data :]:
    env[v] = -1
  walk = _Walk(
    len(layer_list),
    {i for i, l in enumerate(layer_list) if policy.is_embedding(l.module)},
  )
  walk.run(jaxpr, env)
  missing = [l.path for i, l in enumerate(layer_list) if walk.depths[i] is None]
  if missing:
    raise ValueError(
      f"layers {missing} are never called in the forward "
      f"pass, so they have no depth"
    )
  return [int(d) for d in walk.depths if d is not None], walk.lookup


def _sub_jaxpr(eqn):
  for key in _CALL_PARAMS:
    sub = eqn.params.get(key)
    if sub is not None:
      return getattr(sub, "jaxpr", sub)
  return None


def _has_marker(jaxpr) -> bool:
  return any(
    str(eqn.params.get("name", "")).startswith(_MARK)
    or _has_marker_anywhere(eqn)
    for eqn in jaxpr.eqns
  )


class _Walk:
  """BFS depths by one pass over the equations in (topological) order."""

  def __init__(self, n: int, embeds: set[int]):
    self.depths: list[int | None] = [None] * n
    self.lookup: list[int | None] = [None] * n
    self.embeds = embeds
    self.table_of: dict[Any, int] = {}  # embedding marker output -> layer

  def run(self, jaxpr, env: dict[Any, int | None]) -> None:
    for eqn in jaxpr.eqns:
      reads = [
        env.get(v) for v in eqn.invars if not isinstance(v, jex_core.Literal)
      ]
      active = [d for d in reads if d is not None]
      depth = 1 + min(active) if active else None
      for v in eqn.invars:
        i = None if isinstance(v, jex_core.Literal) else self.table_of.get(v)
        if i is not None and self.lookup[i] is None:
          self.lookup[i] = int(np.prod(eqn.outvars[0].aval.shape))
      name = str(eqn.params.get("name", ""))
      if name.startswith(_MARK):
        i = int(name[len(_MARK) :])
        # An embedding's table is its input: it starts a path at depth 0.
        depth = 0 if depth is None else depth
        known = self.depths[i]
        if known is None or depth < known:
          self.depths[i] = depth
        if i in self.embeds:
          self.table_of[eqn.outvars[0]] = i
      elif _has_marker_anywhere(eqn):
        sub = _sub_jaxpr(eqn)
        if sub is None or len(sub.invars) != len(eqn.invars):
          raise ValueError(
            f"a layer is called inside {eqn.primitive.name!r} (a loop or "
            f"branch): QSync's BFS depth needs each layer called once"
          )
        inner = {
          iv: (None if isinstance(ov, jex_core.Literal) else env.get(ov))
          for iv, ov in zip(sub.invars, eqn.invars)
        }
        self.run(sub, inner)
        for ov, iv in zip(eqn.outvars, sub.outvars):
          env[ov] = None if isinstance(iv, jex_core.Literal) else inner.get(iv)
        continue
      for v in eqn.outvars:
        env[v] = depth


def _has_marker_anywhere(eqn) -> bool:
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns") and _has_marker(inner):
        return True
  return False
