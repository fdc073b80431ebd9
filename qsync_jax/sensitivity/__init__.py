"""Sensitivity: how much each layer suffers at each precision.

The first stage of the data flow: from a model and a few FP32 batches to
``scores[layer][precision]``, which the allocator trades against speed.

* :func:`compute` scores every (layer, precision) with one of
  :data:`METHODS` (by default :data:`DEFAULT_METHOD`, ``qsync_var``) and
  returns :class:`Scores` (:mod:`.scores`, which also runs the capture pass
  of the gradient-statistics methods);
* the per-method formulas, QSync's indicator among them (:mod:`.methods`);
* :func:`measure`, the ground truth the methods are judged by: one layer
  switched at a time (:mod:`.measure`).
"""

from qsync_jax.sensitivity.measure import measure
from qsync_jax.sensitivity.methods import DEFAULT_METHOD
from qsync_jax.sensitivity.methods import hutchinson_traces
from qsync_jax.sensitivity.methods import METHODS
from qsync_jax.sensitivity.scores import compute
from qsync_jax.sensitivity.scores import DEFAULT_PRECISIONS
from qsync_jax.sensitivity.scores import Scores

__all__ = [
  "DEFAULT_METHOD",
  "DEFAULT_PRECISIONS",
  "METHODS",
  "Scores",
  "compute",
  "hutchinson_traces",
  "measure",
]
