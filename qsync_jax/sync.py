"""Synchronization schedules: when workers average, and what.

A schedule tells the trainer whether gradients are averaged every step (data
parallel) and at which steps workers synchronize. Local-SGD schedules (constant
H, post-local, QSR) average parameters every few steps instead and plug into
the same interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EveryStep:
  """Synchronous data parallelism: average gradients at every step."""

  name: str = "dp"
  averages_gradients: bool = True

  def is_sync_step(self, step: int) -> bool:
    """Returns True: every step is a synchronization."""
    del step
    return True

  def state_dict(self) -> dict[str, Any]:
    """Returns the schedule's state for checkpoints (none for this one)."""
    return {}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores :meth:`state_dict` output."""
    del state
