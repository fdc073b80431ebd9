"""A user's dataset factory: resolving it, calling it, checking what it gives.

This module owns ``package.module:factory`` dataset specs. The factory is
called as ``factory(split="train"|"test", **kwargs)`` and returns either
``(inputs, labels)`` arrays (held in memory: a :class:`~qsync_jax.data.Dataset`,
batched exactly as the built-in datasets are) or a Grain ``MapDataset`` /
``IterDataset`` of ``(inputs, labels)`` examples (a
:class:`~qsync_jax.data.StreamedDataset`, read as training goes). What it
gives is checked before anything runs: the type, equal lengths, a non-empty
split, integer labels where the objective needs them, and the same example
shapes in both splits. A Grain dataset is checked on its length and first
example only, never read whole. A factory, or its module, that raises is a
:class:`FactoryError` carrying the user's exception.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import importlib
import inspect
import sys
from typing import Any, NoReturn

import numpy as np

from qsync_jax.data import streams
from qsync_jax.data.base import Dataset

# Raised here too; defined beside the streams that raise it as they are read.
from qsync_jax.data.streams import FactoryError  # noqa: F401


def is_factory_spec(spec: str) -> bool:
  """Whether ``spec`` names a factory (``package.module:factory``) rather
  than a built-in dataset."""
  return ":" in spec


_one_line = streams.one_line


def _user_code_failed(err: BaseException, spec: str, doing: str) -> NoReturn:
  """Raises a :class:`FactoryError` whose cause is ``err`` without this
  module's frame: its traceback starts in the user's code."""
  streams.user_code_failed(err, f"dataset {spec!r}", doing)


def load_factory(spec: str, hint: str) -> Callable[..., Any]:
  """Resolves ``"package.module:factory"`` to the callable it names.

  Args:
    spec: the spec.
    hint: what else the caller accepts, for messages.

  Raises:
    ValueError: a malformed spec, a module that does not exist, or no
      callable of that name in it.
    FactoryError: importing the module raised.
  """
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr.isidentifier():
    raise ValueError(f"invalid dataset {spec!r}: {hint}")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as err:
    missing = err.name or ""
    if module_name == missing or module_name.startswith(missing + "."):
      raise ValueError(
        f"dataset {spec!r}: cannot import module {module_name!r} "
        f"(no module named {missing!r} on the path); {hint}"
      ) from None
    _user_code_failed(err, spec, f"while importing module {module_name!r}")
  except Exception as err:  # the module's own code failed
    _user_code_failed(err, spec, f"while importing module {module_name!r}")
  found = getattr(module, attr, None)
  if found is None:
    raise ValueError(
      f"dataset {spec!r}: module {module_name!r} has no attribute "
      f"{attr!r}; {hint}"
    )
  if not callable(found):
    raise ValueError(f"dataset {spec!r}: {module_name}.{attr} is not callable")
  return found


def _call(
  factory: Callable[..., Any],
  spec: str,
  split: str,
  kwargs: Mapping[str, Any],
) -> Any:
  """``factory(split=split, **kwargs)``; a call its signature refuses is a
  one-line ``ValueError``, an exception from inside a
  :class:`FactoryError`."""
  try:
    signature = inspect.signature(factory)
  except (TypeError, ValueError):  # no signature to check: the call tells
    signature = None
  if signature is not None:
    try:
      signature.bind(split=split, **kwargs)
    except TypeError as err:
      accepted = ", ".join(signature.parameters) or "nothing"
      raise ValueError(
        f"dataset {spec!r} cannot be called as factory(split={split!r}"
        f"{''.join(f', {k}=...' for k in kwargs)}): {err}; it accepts: "
        f"{accepted}"
      ) from None
  try:
    return factory(split=split, **kwargs)
  except Exception as err:  # the user's code failed
    _user_code_failed(err, spec, f"for split={split!r}")


def _arrays(value: Any, what: str, integer_labels: bool) -> tuple[Any, Any]:
  """A split given as ``(inputs, labels)``, as checked numpy arrays."""
  if len(value) != 2:
    raise ValueError(
      f"{what} is a {type(value).__name__} of {len(value)} items; expected "
      "(inputs, labels)"
    )
  try:
    x, y = np.asarray(value[0]), np.asarray(value[1])
  except ValueError as err:  # ragged nested lists
    raise ValueError(
      f"{what}: examples of inconsistent shapes ({_one_line(err)})"
    ) from None
  for name, a in (("inputs", x), ("labels", y)):
    if a.dtype == object:
      raise ValueError(
        f"{what}: its {name} are not one numeric array (examples of "
        "inconsistent shapes, or objects)"
      )
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
      raise ValueError(f"{what}: its {name} are not numbers (dtype {a.dtype})")
    if a.ndim == 0:
      raise ValueError(f"{what}: its {name} have no leading example axis")
  if len(x) != len(y):
    raise ValueError(f"{what}: {len(x)} inputs but {len(y)} labels")
  if len(x) == 0:
    raise ValueError(f"{what} is empty")
  streams.check_finite(x, what)
  streams.check_labels(y, what, integer_labels)
  return x, y


def _first_example(
  value: Any, kind: str, what: str, integer_labels: bool
) -> tuple[np.ndarray, np.ndarray]:
  """A Grain split's first example, checked, after its length."""
  if kind == "map":
    n = len(value)
    if n == 0:
      raise ValueError(f"{what} is empty")
    if n >= sys.maxsize:
      raise ValueError(
        f"{what} is an endless MapDataset (repeat() without num_epochs); "
        "return it without repeat(): training runs its epochs"
      )
  first = next(iter(streams.first_examples(value, kind, 1, what)), None)
  if first is None:
    raise ValueError(f"{what} is empty")
  return streams.as_example(first[1], f"{what}, example 0", integer_labels)


def _task(x: np.ndarray, y: np.ndarray) -> str:
  """The task one example's (or one split's) inputs and labels show."""
  if not np.issubdtype(y.dtype, np.integer):
    return "regression"
  per_position = y.ndim >= 1 and y.shape == x.shape
  return "lm" if per_position else "classification"


def load_user_dataset(
  spec: str | Callable[..., Any],
  *,
  integer_labels: bool = False,
  **kwargs: Any,
) -> Dataset | streams.StreamedDataset:
  """Calls a user's dataset factory for both splits and checks them.

  Args:
    spec: ``"package.module:factory"``, or the factory itself; it is
      called as ``factory(split="train", **kwargs)`` and
      ``factory(split="test", **kwargs)``.
    integer_labels: the labels must be non-negative integer class ids (the
      default classification or language-modelling objective).
    **kwargs: the factory's keyword arguments.

  Returns:
    A :class:`~qsync_jax.data.Dataset` when both splits are arrays
    (``num_classes``: the largest label plus one, or the target width for
    float labels); otherwise a :class:`~qsync_jax.data.StreamedDataset`.

  Raises:
    ValueError: a bad spec, a call the factory's signature refuses, or an
      unusable split: not arrays or a Grain dataset, inputs and labels of
      different lengths, an empty split, labels that are not class ids
      where ``integer_labels``, or examples of other shapes than the first
      training example's.
    FactoryError: the factory or its module raised.
  """
  if callable(spec):
    factory = spec
    spec = f"{factory.__module__}:{factory.__qualname__}"
  else:
    factory = load_factory(
      spec, "expected a built-in dataset name or 'package.module:factory'"
    )
  splits: dict[str, tuple[Any, str]] = {}
  for split in ("train", "test"):
    value = _call(factory, spec, split, kwargs)
    kind = streams.split_kind(value)
    what = f"dataset {spec!r}, split {split!r}"
    if kind is None:
      raise ValueError(
        f"{what} is a {type(value).__name__}; a dataset factory returns "
        "(inputs, labels) arrays, a grain.MapDataset or a grain.IterDataset"
      )
    splits[split] = (value, kind)
  firsts = {}
  for split, (value, kind) in splits.items():
    what = f"dataset {spec!r}, split {split!r}"
    if kind == "arrays":
      value = _arrays(value, what, integer_labels)
      splits[split] = (value, kind)
      firsts[split] = (value[0][0], value[1][0])
    else:
      firsts[split] = _first_example(value, kind, what, integer_labels)
  train_spec, test_spec = (streams.ExampleSpec.of(*firsts[s]) for s in firsts)
  if (train_spec.x_shape, train_spec.y_shape) != (
    test_spec.x_shape,
    test_spec.y_shape,
  ):
    raise ValueError(
      f"dataset {spec!r}: examples of inconsistent shapes: the training "
      f"split's inputs and labels are {train_spec.x_shape} and "
      f"{train_spec.y_shape}, the test split's {test_spec.x_shape} and "
      f"{test_spec.y_shape}"
    )
  task = _task(*firsts["train"])
  (train, train_kind), (test, test_kind) = splits["train"], splits["test"]
  if task == "regression":
    num_classes: int | None = int(np.prod(train_spec.y_shape, dtype=int))
  else:
    num_classes = None
  if train_kind == test_kind == "arrays":
    if task != "regression":
      num_classes = int(max(train[1].max(), test[1].max())) + 1
    return Dataset(
      x_train=train[0],
      y_train=train[1],
      x_test=test[0],
      y_test=test[1],
      num_classes=num_classes,
      task=task,
      name=spec,
    )
  return streams.StreamedDataset(
    train,
    test,
    train_kind,
    test_kind,
    train_spec,
    task,
    num_classes,
    spec,
    integer_labels,
  )
