"""How the workers of a trainer synchronize, as one typed structure.

This module owns :class:`SyncSettings`: when the workers average (the
schedule), what goes on the wire (the averager, with or without error
feedback), how a parameter average is applied (plain, or through an outer
optimizer), which optimizer-state fields are averaged with the parameters,
and each worker's share of an average. A combination in which one setting
would be ignored is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses

import optax

from qsync_jax.parallel import averagers
from qsync_jax.parallel import schedules


def _default_schedule() -> schedules.Schedule:
  return schedules.EveryStep()


def _default_averager() -> averagers.Averager:
  return averagers.MeanAverager()


@dataclasses.dataclass(frozen=True)
class SyncSettings:
  """When and how a :class:`~qsync_jax.train.trainer.HybridTrainer`'s
  workers synchronize.

  Attributes:
    schedule: when workers average (:mod:`qsync_jax.parallel.schedules`;
      default: gradients every step).
    averager: what goes on the wire (:mod:`qsync_jax.parallel.averagers`;
      default: the exact float32 mean).
    error_feedback: keep each worker's compression error (unscaled) and
      send it again with the next average
      (:func:`qsync_jax.parallel.averagers.compress_with_feedback`); needs
      an averager that compresses.
    outer_tx: an optax outer optimizer (DiLoCo, arXiv 2311.08105) stepping
      the anchor by ``anchor - mean`` at each parameter average; None:
      plain averaging. Needs a schedule that averages parameters.
    opt_fields_to_average: optimizer-state fields (``"mu"``, ``"trace"``,
      ...) averaged with the parameters at each sync of a local schedule
      (the QSR code's ``optim_fields_to_average``). Needs a local schedule.
    grad_weights: each worker's share of an average (summing to 1); None:
      ``b_i / sum(b)`` from the workers' batch sizes, so that every example
      counts once.

  Raises:
    ValueError: a setting the others would leave unused (naming both), or
      a malformed one.

  Example:
    >>> import qsync_jax as qs
    >>> settings = qs.SyncSettings(
    ...     schedule=qs.make_schedule("local", total_steps=8, h_base=4),
    ...     averager=qs.make_averager("gqsgd"),
    ...     error_feedback=True,
    ... )
    >>> settings.schedule.name, settings.averager.name
    ('local', 'gqsgd')
  """

  schedule: schedules.Schedule = dataclasses.field(
    default_factory=_default_schedule
  )
  averager: averagers.Averager = dataclasses.field(
    default_factory=_default_averager
  )
  error_feedback: bool = False
  outer_tx: optax.GradientTransformation | None = None
  opt_fields_to_average: tuple[str, ...] = ()
  grad_weights: tuple[float, ...] | None = None

  def __post_init__(self):
    fields = self.opt_fields_to_average
    if isinstance(fields, str) or not isinstance(fields, Sequence):
      raise ValueError(
        "SyncSettings.opt_fields_to_average must be a sequence of field "
        f"names, got {fields!r}"
      )
    object.__setattr__(self, "opt_fields_to_average", tuple(fields))
    if self.grad_weights is not None:
      object.__setattr__(
        self, "grad_weights", tuple(float(w) for w in self.grad_weights)
      )
    every_step = isinstance(self.schedule, schedules.EveryStep)
    if self.outer_tx is not None and every_step:
      raise ValueError(
        "SyncSettings: outer_tx steps parameter averages, which the "
        "schedule 'dp' (EveryStep) never makes; use a local schedule "
        "(local, postlocal, qsr) or no outer_tx"
      )
    if self.opt_fields_to_average and every_step:
      raise ValueError(
        "SyncSettings: opt_fields_to_average are averaged at the "
        "parameter averages of a local schedule, which the schedule 'dp' "
        "(EveryStep) never makes; its optimizer state is the same on every "
        "worker already"
      )
    if self.error_feedback and isinstance(
      self.averager, averagers.MeanAverager
    ):
      raise ValueError(
        "SyncSettings: error_feedback keeps what compression lost, and the "
        "averager 'mean' sends exact float32 (nothing lost); use a "
        "compressing averager (fp16, bf16, gqsgd, ...) or no error_feedback"
      )
