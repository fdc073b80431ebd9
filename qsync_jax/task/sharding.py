"""Parameter sharding annotations of models the library did not write.

flax models annotate a parameter with the mesh axis (or logical axis) of each
of its dimensions: Linen's ``nn.with_partitioning`` and
``nn.with_logical_partitioning`` box the value, NNX's ``nnx.with_partitioning``
and a variable's ``out_sharding=`` (formerly ``sharding=``) metadata sit on
the ``nnx.Variable``. flax applies an annotation where the parameter is
created (NNX's eager sharding) and where a Linen module reads it, and fails
when no mesh is in context or the mesh lacks a named axis.

The library keeps every annotation as the model wrote it and applies only its
*kept part*: the dimensions whose axes the mesh has (logical names resolved
through flax's logical axis rules; a logical name no rule maps names no
axis); every other dimension is left unsharded, as if unannotated. The mesh
is the annotation's own (``mesh=``) if it names one, else the mesh in context
(``jax.set_mesh``); a ``jax.shard_map``'s manual axes are not the mesh's.
This module owns that rule (:func:`kept_names`) and the contexts the library
runs a model's code in:

* :func:`creating`: a model built inside creates its parameters without
  applying their annotations (flax's eager sharding off, no mesh in view);
  :func:`place` then applies the kept parts on the mesh in context;
* :func:`no_mesh`: the library's own device work (a profile on one device,
  the trainer's workers on the trainer's own mesh) runs with no mesh of the
  caller's in context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import functools
from typing import Any, TypeVar

from flax import nnx
from flax.core import spmd as core_spmd
import flax.linen as nn
import jax
from jax.sharding import AbstractMesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

F = TypeVar("F", bound=Callable[..., Any])

_NO_MESH = AbstractMesh((), ())


def _axes_of(entry: Any) -> tuple[str, ...]:
  """The mesh axes one dimension's entry names (None and
  ``P.UNCONSTRAINED`` name none)."""
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return ()


def _annotation(variable: nnx.Variable) -> tuple[tuple[Any, ...], Any] | None:
  """``(names, mesh)`` of a variable's annotation (the mesh it names, or
  None), or None without one."""
  names: Any = variable.get_metadata("out_sharding", None)
  mesh: Any = variable.get_metadata("mesh", None)
  if isinstance(names, NamedSharding):
    mesh, names = names.mesh, names.spec
  if not names:
    return None
  return tuple(names), mesh


def _mesh_axes_of(variable: nnx.Variable, names: tuple[Any, ...]) -> P:
  """The mesh axes each dimension's name maps to, by flax's rules."""
  rules = variable.get_metadata("sharding_rules", None)
  linen_type = variable.get_metadata("linen_meta_type", None)
  if isinstance(linen_type, type) and issubclass(
    linen_type, nn.LogicallyPartitioned
  ):
    # Linen's rule: a logical name no rule maps is unsharded.
    return nn.logical_to_mesh_axes(names, rules) or P()
  # NNX's rule (nnx.get_var_pspec): a name no rule maps is a mesh axis.
  rules = core_spmd.composite_rules(
    core_spmd.get_logical_axis_rules(), rules or ()
  )
  return P(*core_spmd.from_sharding_rules(names, rules))


def _usable_axes(mesh: Any) -> frozenset[str]:
  """The axes of ``mesh`` a sharding can name: all but a ``shard_map``'s
  manual ones."""
  manual = getattr(mesh, "manual_axes", ())
  return frozenset(mesh.axis_names) - frozenset(manual)


def _kept(variable: nnx.Variable) -> tuple[tuple[Any, ...], P, Any] | None:
  """``(names, spec, mesh)`` of a variable's kept part: the annotation's
  names and their mesh axes where kept (None elsewhere), and the mesh; None
  when nothing is kept."""
  found = _annotation(variable)
  if found is None:
    return None
  names, own_mesh = found
  mesh = own_mesh if own_mesh is not None else jax.sharding.get_abstract_mesh()
  usable = _usable_axes(mesh)
  resolved = _mesh_axes_of(variable, names)
  keep = [bool(_axes_of(r)) and set(_axes_of(r)) <= usable for r in resolved]
  if not any(keep):
    return None
  return (
    tuple(n if k else None for n, k in zip(names, keep)),
    P(*(r if k else None for r, k in zip(resolved, keep))),
    mesh,
  )


def kept_names(variable: nnx.Variable) -> tuple[Any, ...] | None:
  """A variable's annotation in its own names, the dimensions not kept None.

  Args:
    variable: an ``nnx.Variable`` (NNX's, or one holding a Linen box).

  Returns:
    The annotation's names (logical or mesh axes, as written) where the
    dimension's mesh axes are all axes of the mesh (the annotation's own,
    else the one in context), None elsewhere; None when no dimension is
    kept or the variable has no annotation.
  """
  kept = _kept(variable)
  return None if kept is None else kept[0]


@contextlib.contextmanager
def creating() -> Iterator[None]:
  """Parameters created inside do not apply their annotations.

  NNX variables are created with flax's eager sharding off (the setting is
  recorded on each, so no later copy applies it) and no mesh is in view, so
  a Linen module reads its boxed parameters without a sharding constraint.
  The annotations stay on the parameters; :func:`place` applies their kept
  parts afterwards.
  """
  with nnx.use_eager_sharding(False), jax.sharding.use_abstract_mesh(_NO_MESH):
    yield


def place(model: Any) -> None:
  """Applies each annotated variable's kept part to its value.

  Each variable of ``model`` (an NNX module) whose annotation keeps a
  dimension is sharded over its mesh (its own, else the one in context) as
  the kept part says, as flax's eager sharding would; a variable that keeps
  nothing is left where it is. Works inside a trace (``nnx.eval_shape``).
  """
  for _, variable in nnx.iter_graph(model):
    if not isinstance(variable, nnx.Variable):
      continue
    kept = _kept(variable)
    if kept is None:
      continue
    _, spec, mesh = kept
    sharding = NamedSharding(mesh, spec)
    value = variable.get_value()
    if mesh.are_all_axes_explicit:
      value = jax.sharding.reshard(value, sharding)
    else:
      value = jax.lax.with_sharding_constraint(value, sharding)
    variable.set_value(value)


@contextlib.contextmanager
def no_mesh() -> Iterator[None]:
  """No mesh of the caller's in context for the block.

  The library places its own device work (one device for a profile, the
  trainer's own ``workers`` mesh): a jitted call on one device refuses a
  context mesh over other devices. Outside any trace only; a no-op when no
  mesh is set.
  """
  if jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty:
    yield
    return
  with jax.set_mesh(None):
    yield


def without_mesh(fn: F) -> F:
  """``fn`` run under :func:`no_mesh`."""

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    with no_mesh():
      return fn(*args, **kwargs)

  return wrapped  # type: ignore[return-value]
