"""How the library calls and scores a user's model (the model-call contract).

:mod:`.calling` owns how a model is called (inputs, train/eval mode, rngs)
and the :class:`Probe` every tracer runs; :mod:`.objective` owns the
:class:`Objective` (loss and metrics on a batch) built from a user's
``loss_fn``; :mod:`.losses` the float32 losses and metrics; :mod:`.sharding`
what the library does with the parameters' sharding annotations. The package
sits below every other part of the library, which all call models through
it.
"""

from qsync_jax.task.calling import abstract
from qsync_jax.task.calling import as_probe
from qsync_jax.task.calling import call_model
from qsync_jax.task.calling import input_probe
from qsync_jax.task.calling import load_callable
from qsync_jax.task.calling import mode
from qsync_jax.task.calling import Probe
from qsync_jax.task.calling import split_inputs
from qsync_jax.task.objective import as_objective
from qsync_jax.task.objective import batch_size
from qsync_jax.task.objective import classification
from qsync_jax.task.objective import from_loss_fn
from qsync_jax.task.objective import Objective

__all__ = [
  "Objective",
  "Probe",
  "abstract",
  "as_objective",
  "as_probe",
  "batch_size",
  "call_model",
  "classification",
  "from_loss_fn",
  "input_probe",
  "load_callable",
  "mode",
  "split_inputs",
]
