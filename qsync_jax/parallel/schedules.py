"""Synchronization schedules: when workers average, and what.

This module owns the host-side decision, per training step, of whether the
workers communicate and whether they exchange gradients or parameters. It
holds no arrays; the trainer runs the collectives.

Steps are counted from 1: step ``t`` is the ``t``-th optimizer update (its
optax count is ``t - 1``), and after it the trainer's ``self.step == t``.
Every schedule provides

* ``averages_gradients_at(t) -> bool``: step ``t`` averages gradients
  (synchronous data parallelism: parameters and optimizer state stay
  identical); otherwise each worker steps on its own gradient;
* ``is_sync_step(t) -> bool``: after step ``t`` every worker holds the same
  parameters. A step that averages gradients is a sync step; at a sync step
  that does not, the trainer averages the parameters (optimizer state stays
  local, as in QSR's official code, hmgxr128/QSR, ``LocalOptimizer``);
* ``sync_steps(total_steps) -> list[int]``: every sync step in
  ``1..total_steps``, the same answers as ``is_sync_step``, known before
  training;
* ``sync_table(total_steps) -> np.ndarray``: the same answers as a boolean
  array, ``table[t - 1] == is_sync_step(t)``, for a jitted step to index
  with its step counter (and feed to ``lax.cond``), so one compiled step
  serves local and sync steps;
* ``round_length(t) -> int``: ``H``, the number of steps in the round that
  contains step ``t`` (1 for a step that averages gradients);
* ``state_dict()`` / ``load_state_dict(state)``: JSON-able state so a
  resumed run continues the same schedule. Stateless schedules return ``{}``
  and ignore what they are given, so a run may resume under another
  schedule (e.g. QSR from a constant-H checkpoint);
* ``name``.

With ``total_steps`` given, the local-SGD schedules also synchronize at the
last step, so training ends with one averaged model.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
import numbers
from typing import Any, Protocol

import jax
import numpy as np


class Schedule(Protocol):
  """What the trainer needs from a synchronization schedule."""

  @property
  def name(self) -> str:
    """The schedule's name."""
    ...

  def averages_gradients_at(self, step: int) -> bool: ...

  def is_sync_step(self, step: int) -> bool: ...

  def sync_steps(self, total_steps: int) -> list[int]: ...

  def sync_table(self, total_steps: int) -> np.ndarray: ...

  def round_length(self, step: int) -> int: ...

  def state_dict(self) -> dict[str, Any]: ...

  def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_period(h: int, what: str = "h") -> None:
  if not _is_int(h) or h < 1:
    raise ValueError(f"{what} must be a positive integer, got {h!r}")


def _periodic_round(
  step: int, offset: int, h: int, total_steps: int | None
) -> int:
  """Length of the round holding ``step`` when rounds of ``h`` start at
  ``offset`` and the last one ends at ``total_steps``."""
  start = offset + (step - offset - 1) // h * h
  end = start + h if total_steps is None else min(start + h, total_steps)
  return max(end - start, 1)


class _SyncTable:
  """Gives a schedule ``sync_table`` from its ``sync_steps``."""

  def sync_steps(self, total_steps: int) -> list[int]:
    """Every sync step in ``1..total_steps``, which every schedule defines."""
    raise NotImplementedError

  def sync_table(self, total_steps: int) -> np.ndarray:
    """``table[t - 1] == is_sync_step(t)`` for ``t`` in ``1..total_steps``.

    Built from ``sync_steps``, so a stateful schedule (QSR) answers from a
    fresh start without touching its state.

    Args:
      total_steps: the table's length.

    Returns:
      A boolean numpy array, to index inside ``jit`` with the step counter.

    Raises:
      ValueError: ``total_steps`` is not a positive integer.
    """
    _check_period(total_steps, "total_steps")
    table = np.zeros(total_steps, bool)
    table[np.asarray(self.sync_steps(total_steps), np.int64) - 1] = True
    return table


class _Stateless(_SyncTable):
  """Schedules that are a pure function of the step: no checkpoint state."""

  def is_sync_step(self, step: int) -> bool:
    """Whether step ``step`` ends a round, which every schedule defines."""
    raise NotImplementedError

  def sync_steps(self, total_steps: int) -> list[int]:
    """Every sync step in ``1..total_steps``."""
    return [t for t in range(1, total_steps + 1) if self.is_sync_step(t)]

  def state_dict(self) -> dict[str, Any]:
    """Returns ``{}``: the schedule is a function of the step."""
    return {}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Ignores ``state`` (nothing to restore)."""
    del state


@dataclasses.dataclass(frozen=True)
class EveryStep(_Stateless):
  """Synchronous data parallelism: average gradients at every step.

  ``averages_gradients`` is kept for callers that predate
  :meth:`averages_gradients_at`.
  """

  name: str = "dp"
  averages_gradients: bool = True

  def averages_gradients_at(self, step: int) -> bool:
    """Returns True: every step averages gradients."""
    del step
    return True

  def is_sync_step(self, step: int) -> bool:
    """Returns True: every step is a synchronization."""
    del step
    return True

  def round_length(self, step: int) -> int:
    """Returns 1: every round is one step."""
    del step
    return 1


@dataclasses.dataclass(frozen=True)
class ConstantLocalSGD(_Stateless):
  """Local SGD: average parameters every ``h`` steps.

  Attributes:
    h: the synchronization period.
    total_steps: if given, the last step also synchronizes.
    name: the schedule's name.
  """

  h: int
  total_steps: int | None = None
  name: str = "local"

  def __post_init__(self):
    _check_period(self.h)

  def averages_gradients_at(self, step: int) -> bool:
    """Returns False: workers step on their own gradients."""
    del step
    return False

  def is_sync_step(self, step: int) -> bool:
    """Whether parameters are averaged after step ``step`` (1-based)."""
    return step >= 1 and (step % self.h == 0 or step == self.total_steps)

  def round_length(self, step: int) -> int:
    """``h``, or less for a last round cut at ``total_steps``."""
    return _periodic_round(step, 0, self.h, self.total_steps)


@dataclasses.dataclass(frozen=True)
class PostLocalSGD(_Stateless):
  """Data parallel for the first ``switch_step`` steps, then local SGD.

  Steps ``1..switch_step`` average gradients; afterwards parameters are
  averaged every ``h`` steps counted from the switch.

  References:
    Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD",
    arXiv 1808.07217.

  Attributes:
    switch_step: the number of data-parallel steps.
    h: the period after the switch.
    total_steps: if given, the last step also synchronizes.
    name: the schedule's name.
  """

  switch_step: int
  h: int
  total_steps: int | None = None
  name: str = "post_local"

  def __post_init__(self):
    if not _is_int(self.switch_step) or self.switch_step < 0:
      raise ValueError(
        f"switch_step must be a non-negative integer, got {self.switch_step!r}"
      )
    _check_period(self.h)

  def averages_gradients_at(self, step: int) -> bool:
    """Whether step ``step`` (1-based) averages gradients."""
    return step <= self.switch_step

  def is_sync_step(self, step: int) -> bool:
    """Whether workers hold the same parameters after step ``step``."""
    if step < 1:
      return False
    return (
      step <= self.switch_step
      or (step - self.switch_step) % self.h == 0
      or step == self.total_steps
    )

  def round_length(self, step: int) -> int:
    """1 up to the switch, then ``h`` (less for a cut last round)."""
    if step <= self.switch_step:
      return 1
    return _periodic_round(step, self.switch_step, self.h, self.total_steps)


LearningRate = float | Callable[[int], Any]


def _float64_lr(value: Any, step: int) -> float:
  """``value``, a learning rate, as a Python float, refusing lower precision.

  Args:
    value: what the learning-rate schedule returned (or the constant LR).
    step: the step it was asked for, for the message.

  Returns:
    The learning rate, exactly.

  Raises:
    ValueError: ``value`` is not a real scalar, is held in a float type
      narrower than float64, or is not finite.
  """
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  else:
    dtype = np.dtype(dtype)
    ok = np.size(value) == 1 and (
      dtype == np.float64 or np.issubdtype(dtype, np.integer)
    )
  if not ok:
    # Rounding in float32 moves (alpha / lr) ** gamma across integers, so
    # the floor would not be the official rule's.
    raise ValueError(
      f"QSR reads the learning rate in float64; the learning rate at step "
      f"{step} is {value!r} ({dtype or type(value).__name__}): give a "
      "Python float or a schedule computing in float64"
    )
  lr = float(value)
  if not math.isfinite(lr):
    raise ValueError(f"the learning rate at step {step} is {lr}, not finite")
  return lr


def _lr_at(lr_schedule: LearningRate, step: int) -> float:
  """``lr_schedule`` at optax count ``step`` (or the constant), in float64.

  Raises:
    ValueError: it is not a finite float64 number.
  """
  if not callable(lr_schedule):
    return _float64_lr(lr_schedule, step)
  # jax computes in float32 unless 64-bit types are on; with them an
  # optax schedule's own formula runs in float64.
  with jax.enable_x64(True):
    return _float64_lr(lr_schedule(step), step)


def default_alpha(peak_lr: float, h_base: int, gamma: float = 2.0) -> float:
  """QSR's growth coefficient for a peak learning rate: the period is
  ``h_base`` at the peak and grows as the learning rate decays.

  ``alpha = peak_lr * h_base ** (1 / gamma)``, so that
  ``(alpha / lr) ** gamma = h_base * (peak_lr / lr) ** gamma``: QSR starts
  where constant-period local SGD with ``h_base`` would, and the period
  grows from the first step the learning rate falls below its peak. It is
  the paper's choice relative to the peak learning rate: the ViT-B runs
  (peak 0.008, ``H_base = 4``) use ``alpha = 0.0175``, whose period at the
  peak, ``floor((0.0175 / 0.008) ** 2) = 4``, is ``H_base``.

  Args:
    peak_lr: the largest learning rate (after warmup), > 0.
    h_base: the smallest period.
    gamma: the rule's exponent (2 for QSR).

  Returns:
    ``alpha``.

  Raises:
    ValueError: a peak learning rate, ``h_base`` or ``gamma`` out of range.

  Example:
    >>> from qsync_jax.parallel.schedules import default_alpha
    >>> default_alpha(0.008, 4)
    0.016
  """
  _check_period(h_base, "h_base")
  if not (math.isfinite(peak_lr) and peak_lr > 0) or not gamma > 0:
    raise ValueError(
      "default_alpha needs peak_lr > 0 (finite) and gamma > 0, got "
      f"peak_lr={peak_lr!r}, gamma={gamma!r}"
    )
  return float(peak_lr) * h_base ** (1.0 / gamma)


class QSR(_SyncTable):
  """Quadratic Synchronization Rule: the period grows as the LR decays.

  Right after each averaging, at ``s`` completed steps, the next period is

      H = max(1, min(T - s, max(h_base, floor((alpha / lr) ** gamma))))

  with ``lr = lr_schedule(s)``, the learning rate of the next step (optax
  count ``s``), and ``H = init_h`` while ``s < warmup_steps`` or when
  ``alpha == 0``. It is the official code's ``adjust_h``, evaluated once
  before training and after every average, in float64 like the official
  ``int((alpha / lr) ** power)``: the learning rate must be a float64
  number (a schedule returning float32 is refused, since its rounding moves
  the floor across integers). A jax schedule such as optax's is evaluated
  with 64-bit types enabled, so it computes its formula in float64; to
  reproduce the official sync steps exactly, give the official scheduler's
  formula (:meth:`.lr_schedules.LearningRateSchedule.float64`). The cap at
  the remaining ``T - s`` steps makes the last round end at step ``T``, so
  training ends with an average. ``H`` is not
  revised inside a round, even when the LR drops (a step decay takes effect
  at the next sync). ``gamma = 2`` is QSR; 1 and 3 give the linear and cubic
  rules the paper compares against. Unlike the official code, the cap also
  applies to ``init_h``, so even a constant-H run (``alpha == 0``) ends
  with an average.

  The sync steps are a deterministic function of the LR schedule. The state
  is the current round: its period ``h`` and its last step ``next_sync``.
  ``is_sync_step`` advances it lazily as steps pass; asking about an earlier
  round replays the rule from step 0 without touching the state.

  References:
    Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for
    Distributed Deep Learning", ICLR 2024, arXiv 2310.14423 (Section 2; the
    update order follows the official code's ``adjust_h``).

  Args:
    lr_schedule: a function of the step count returning a float64 LR
      (Python, numpy, or jax evaluated in 64 bits, e.g. an optax
      schedule), or a constant float LR.
    total_steps: ``T``, the number of training steps.
    alpha: the growth coefficient (0: constant ``init_h``).
    h_base: the smallest period.
    gamma: the exponent (2 for QSR).
    warmup_steps: LR warmup steps, during which ``H = init_h``.
    init_h: the period during warmup (default ``h_base``).
    name: the schedule's name.

  Raises:
    ValueError: a non-positive period or step count, a negative alpha,
      gamma or warmup, or a learning rate that is not a finite float64.
  """

  def __init__(
    self,
    lr_schedule: LearningRate,
    *,
    total_steps: int,
    alpha: float,
    h_base: int,
    gamma: float = 2.0,
    warmup_steps: int = 0,
    init_h: int | None = None,
    name: str = "qsr",
  ):
    _check_period(h_base, "h_base")
    _check_period(total_steps, "total_steps")
    init_h = h_base if init_h is None else init_h
    _check_period(init_h, "init_h")
    if alpha < 0 or gamma <= 0 or warmup_steps < 0:
      raise ValueError(
        "QSR needs alpha >= 0, gamma > 0 and warmup_steps >= "
        f"0, got {alpha}, {gamma}, {warmup_steps}"
      )
    self.lr_schedule = lr_schedule
    self.total_steps = total_steps
    self.alpha = float(alpha)
    self.h_base = h_base
    self.gamma = float(gamma)
    self.warmup_steps = warmup_steps
    self.init_h = init_h
    self.name = name
    if self.alpha > 0:
      self.learning_rate(0)  # refuse a float32 schedule before training
    self._h: int
    self._next_sync: int
    self.load_state_dict({})

  def learning_rate(self, step: int) -> float:
    """The learning rate of optax count ``step``, in float64.

    Raises:
      ValueError: it is not a finite float64 number.
    """
    return _lr_at(self.lr_schedule, step)

  def period(self, step: int) -> int:
    """The period of a round starting after ``step`` completed steps.

    The official ``max(min(max(int((alpha / lr) ** power), min_h),
    remaining), 1)``, with no tolerance: the floor is that of the float64
    value, as in the official code.
    """
    if step < self.warmup_steps or self.alpha == 0:
      h = self.init_h
    else:
      lr = self.learning_rate(step)
      try:
        raw = (self.alpha / lr) ** self.gamma if lr > 0 else math.inf
      except OverflowError:  # a vanishing LR: the cap decides
        raw = math.inf
      # Capping first keeps floor() finite; it commutes with the floor.
      h = max(self.h_base, math.floor(min(raw, self.total_steps)))
    return max(1, min(h, self.total_steps - step))

  def averages_gradients_at(self, step: int) -> bool:
    """Returns False: workers step on their own gradients."""
    del step
    return False

  def is_sync_step(self, step: int) -> bool:
    """Whether parameters are averaged after step ``step`` (1-based)."""
    if step < 1:
      return False
    if step <= self._next_sync - self._h:
      return step in self._replay(step)
    self._advance_to(step)
    return step == self._next_sync

  def _advance_to(self, step: int) -> None:
    """Moves the state forward to the round containing ``step``."""
    while self._next_sync < step:
      start = self._next_sync
      self._h = self.period(start)
      self._next_sync = start + self._h

  def round_length(self, step: int) -> int:
    """The period ``H`` of the round that contains step ``step``."""
    self._advance_to(step)
    if self._next_sync - self._h < step <= self._next_sync:
      return self._h
    s = 0
    while True:  # an earlier round: replay
      h = self.period(s)
      if step <= s + h:
        return h
      s += h

  def _replay(self, total_steps: int) -> list[int]:
    """The sync steps in ``1..total_steps`` from a fresh start."""
    steps: list[int] = []
    s = 0
    while True:
      s += self.period(s)
      if s > total_steps:
        return steps
      steps.append(s)

  def sync_steps(self, total_steps: int) -> list[int]:
    """Every sync step in ``1..total_steps``, without touching the state."""
    return self._replay(total_steps)

  def state_dict(self) -> dict[str, Any]:
    """Returns ``{"h", "next_sync"}``, the current round."""
    return {"h": self._h, "next_sync": self._next_sync}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores :meth:`state_dict` output; ``{}`` restarts from step 0.

    Raises:
      ValueError: ``state`` is neither empty nor a QSR state.
    """
    if not state:
      self._h = self.period(0)
      self._next_sync = self._h
      return
    if set(state) != {"h", "next_sync"}:
      raise ValueError(
        f"a QSR state holds exactly 'h' and 'next_sync', got {sorted(state)}"
      )
    self._h, self._next_sync = int(state["h"]), int(state["next_sync"])


SCHEDULES = ("dp", "local", "postlocal", "qsr")


def make_schedule(
  name: str,
  *,
  total_steps: int,
  lr_schedule: LearningRate | None = None,
  h_base: int = 1,
  alpha: float | None = None,
  gamma: float = 2.0,
  warmup_steps: int = 0,
  switch_step: int = 0,
) -> Schedule:
  """Builds a schedule by name, as the trainer's ``--sync`` flag names it.

  Args:
    name: ``"dp"`` (average gradients every step), ``"local"`` (average
      parameters every ``h_base`` steps), ``"postlocal"`` (``dp`` for
      ``switch_step`` steps, then ``local``) or ``"qsr"``
      (:class:`QSR` with ``alpha``, ``gamma``, ``h_base`` and
      ``warmup_steps``).
    total_steps: the number of training steps; local schedules end with an
      average at the last one.
    lr_schedule: the learning rate QSR reads (see :class:`QSR`): a float64
      function of the step count, or a constant.
    h_base: the constant period, or QSR's smallest one.
    alpha: QSR's growth coefficient; None: :func:`default_alpha` of the
      learning rate at the end of warmup (the peak), so the period starts
      at ``h_base`` and grows as the learning rate decays.
    gamma: QSR's exponent (1 linear, 2 QSR, 3 cubic).
    warmup_steps: QSR keeps ``h_base`` during LR warmup.
    switch_step: post-local SGD's data-parallel steps.

  Returns:
    The schedule.

  Raises:
    ValueError: an unknown name, ``total_steps`` below 1, a post-local
      ``switch_step`` not before ``total_steps``, or QSR without a learning
      rate, with ``alpha <= 0`` (which is constant ``H``: use ``"local"``),
      or with
      neither ``alpha`` nor a learning rate that changes (a constant
      learning rate keeps the period at ``h_base``: use ``"local"``, or
      give a decaying schedule).

  Example:
    >>> import qsync_jax as qs
    >>> qs.make_schedule("local", total_steps=10, h_base=4).sync_steps(10)
    [4, 8, 10]
    >>> qs.make_schedule("dp", total_steps=10).sync_steps(10)[:3]
    [1, 2, 3]
  """
  _check_period(total_steps, "total_steps")
  if name == "dp":
    return EveryStep()
  if name == "local":
    return ConstantLocalSGD(h_base, total_steps=total_steps)
  if name == "postlocal":
    if _is_int(switch_step) and switch_step >= total_steps:
      raise ValueError(
        f"the postlocal schedule's switch_step={switch_step} is not before "
        f"total_steps={total_steps}: it would average gradients every step "
        "of the run (that is sync=dp); give a smaller switch_step"
      )
    return PostLocalSGD(switch_step, h_base, total_steps=total_steps)
  if name == "qsr":
    if lr_schedule is None:
      raise ValueError("the qsr schedule needs the learning-rate schedule")
    if alpha is None:
      if not callable(lr_schedule):
        raise ValueError(
          f"the qsr schedule with a constant learning rate ({lr_schedule}) "
          f"and no alpha keeps the period at h_base={h_base} (that is "
          "sync=local): give a decaying lr_schedule (e.g. cosine), or alpha"
        )
      alpha = default_alpha(_lr_at(lr_schedule, warmup_steps), h_base, gamma)
    if not alpha > 0:
      raise ValueError(
        f"the qsr schedule needs alpha > 0, got {alpha} "
        "(alpha = 0 is a constant period: use sync=local)"
      )
    name_of = {1.0: "qsr_linear", 2.0: "qsr", 3.0: "qsr_cubic"}
    return QSR(
      lr_schedule,
      total_steps=total_steps,
      alpha=alpha,
      h_base=h_base,
      gamma=gamma,
      warmup_steps=warmup_steps,
      name=name_of.get(float(gamma), f"qsr_gamma{gamma:g}"),
    )
  raise ValueError(
    f"unknown sync schedule {name!r}; valid: {', '.join(SCHEDULES)}"
  )
