"""A training run's directory: made, held, checked, and its metrics.

This subpackage owns the directory a training run writes into (the main job's
``--out_dir``, or a user's own loop's), apart from its checkpoints
(:class:`qsync_jax.Checkpointer`) and the files written whole
(:mod:`qsync_jax.files`):

* :mod:`~qsync_jax.rundir.directory`: creating it
  (:func:`~qsync_jax.rundir.directory.make_out_dir`), one run at a time in
  it (:class:`~qsync_jax.rundir.directory.OutDirLock`), a refused run
  leaving no directory it created, nothing standing where the run writes;
* :mod:`~qsync_jax.rundir.metrics`: the one metrics writer
  (:class:`~qsync_jax.rundir.metrics.MetricWriter`: ``metrics.jsonl`` and
  TensorBoard event files) and what a resumed run keeps of them;
* :mod:`~qsync_jax.rundir.tfevents`: the bytes of those event files.

Example::

  from qsync_jax import rundir

  rundir.make_out_dir(out_dir)
  with rundir.OutDirLock(out_dir), rundir.MetricWriter(
      out_dir, start_step=state.step) as metrics:
    ...
    metrics.write(step, {"loss": loss})
"""

from qsync_jax.rundir import directory
from qsync_jax.rundir import metrics
from qsync_jax.rundir import tfevents
from qsync_jax.rundir.directory import make_out_dir
from qsync_jax.rundir.directory import OutDirLock
from qsync_jax.rundir.metrics import MetricWriter

__all__ = [
  "MetricWriter",
  "OutDirLock",
  "directory",
  "make_out_dir",
  "metrics",
  "tfevents",
]
