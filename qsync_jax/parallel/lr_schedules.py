"""The learning-rate schedules of the official QSR code, in two precisions.

This module owns :class:`LearningRateSchedule`: ``constant``; or, after a
linear warmup from ``final`` to ``peak`` over ``warmup`` steps, ``cosine``
(decay to ``final`` at ``total``), ``linear`` (the same, linearly), ``step``
(``peak * factor ** i`` from the ``i``-th of ``decay_steps``) or
``cosine_step`` (the cosine rounded to a power of ``base``), as the QSR code
(hmgxr128/QSR, ``xscheduler.py``) defines them. :meth:`~LearningRateSchedule.optax`
is the schedule for training (an optax schedule), and
:meth:`~LearningRateSchedule.float64` the same formulas in float64, which
QSR's period (:class:`qsync_jax.parallel.schedules.QSR`) reads so that
``int((alpha / lr) ** gamma)`` lands on the official code's integers.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses

import jax.numpy as jnp
import numpy as np
import optax

#: The schedules' names.
NAMES = ("constant", "cosine", "linear", "step", "cosine_step")


@dataclasses.dataclass(frozen=True)
class LearningRateSchedule:
  """A learning-rate schedule of the QSR code.

  Attributes:
    name: one of :data:`NAMES`.
    peak: the learning rate after warmup.
    final: where warmup starts and decay ends (``cosine``, ``linear``,
      ``cosine_step``).
    warmup: linear warmup steps (every schedule but ``constant``).
    total: the steps the decay spans to.
    decay_steps: ``step``'s decay points, increasing.
    factor: ``step``'s factor per decay point.
    base: ``cosine_step`` rounds the learning rate to a power of it.

  Raises:
    ValueError: an unknown name, or fields the schedule cannot use.

  Example:
    >>> from qsync_jax.parallel.lr_schedules import LearningRateSchedule
    >>> lr = LearningRateSchedule("cosine", peak=0.1, final=0.0, warmup=0,
    ...                           total=100)
    >>> round(lr.float64()(50), 6), round(float(lr.optax()(50)), 6)
    (0.05, 0.05)
  """

  name: str
  peak: float
  final: float = 0.0
  warmup: int = 0
  total: int = 1
  decay_steps: tuple[int, ...] = ()
  factor: float = 0.1
  base: float = 2.0

  def __post_init__(self):
    name = self.name
    if name not in NAMES:
      raise ValueError(
        f"unknown lr_schedule {name!r}; valid: {', '.join(NAMES)}"
      )
    if name == "constant":
      return
    if not 0 <= self.warmup < self.total:
      raise ValueError(
        f"lr_schedule={name} needs 0 <= warmup_steps < steps, "
        f"got warmup_steps={self.warmup}, steps={self.total}"
      )
    if name == "step":
      d = self.decay_steps
      if (
        not d
        or any(not isinstance(x, int) or x < 1 for x in d)
        or list(d) != sorted(set(d))
      ):
        raise ValueError(
          "lr_schedule=step needs lr_decay_steps, increasing "
          f"positive step counts, got {d!r}"
        )
      if not self.factor > 0:
        raise ValueError(f"lr_decay_factor must be > 0, got {self.factor}")
    if name == "cosine_step":
      if not (self.base > 0 and self.base != 1):
        raise ValueError(f"lr_round_base must be > 0 and != 1, got {self.base}")
      if not (self.final > 0 and self.peak > 0):  # it rounds log(lr)
        raise ValueError(
          "lr_schedule=cosine_step needs learning_rate and "
          f"final_learning_rate > 0, got {self.peak} and {self.final}"
        )

  def optax(self) -> optax.ScalarOrSchedule:
    """The schedule for training: a constant, or an optax schedule (optax
    count -> learning rate)."""
    peak, final, warmup = self.peak, self.final, self.warmup
    span = self.total - warmup
    if self.name == "constant":
      return peak
    if self.name == "linear":
      after = optax.linear_schedule(peak, final, span)
    elif self.name == "step":
      after = optax.piecewise_constant_schedule(
        peak, {d - warmup: self.factor for d in self.decay_steps}
      )
    else:
      after = optax.cosine_decay_schedule(
        peak, span, alpha=final / peak if peak else 0.0
      )
      if self.name == "cosine_step":
        after = _rounded_to_powers(after, self.base)
    if not warmup:
      return after
    return optax.join_schedules(
      [optax.linear_schedule(final, peak, warmup), after], [warmup]
    )

  def float64(self) -> Callable[[int], float]:
    """The same schedule in float64, formula for formula the official
    ``xscheduler.py``'s (optax's float32, or its float64 formulas, can round
    the other way at an exact integer).

    Returns:
      ``lr(step) -> float``, the learning rate of optax count ``step``.
    """
    peak, final, warmup = self.peak, self.final, self.warmup
    span = self.total - warmup

    def after(step: int) -> float:
      delta = min(step - warmup, span)
      if self.name == "constant":
        return peak
      if self.name == "linear":
        return final + (span - delta) * (peak - final) / span
      if self.name == "step":
        i = sum(step >= d for d in self.decay_steps)
        return peak * self.factor**i
      lr = final + 0.5 * (peak - final) * (1 + np.cos(delta / span * np.pi))
      if self.name == "cosine_step":
        lr = self.base ** np.round(np.log(lr) / np.log(self.base))
      return float(lr)

    def lr(step: int) -> float:
      if self.name != "constant" and step < warmup:
        return final + step * (peak - final) / warmup
      return after(int(step))

    return lr


def _rounded_to_powers(schedule: optax.Schedule, base: float) -> optax.Schedule:
  """``schedule`` rounded to the nearest power of ``base`` in log space."""
  log_base = float(np.log(base))

  def rounded(count):
    return base ** jnp.round(jnp.log(schedule(count)) / log_base)

  return rounded
