"""The process side of a multi-process run: what each of its processes does.

This subpackage owns, for one process of a run that several processes share:

* :mod:`~qsync_jax.process.detection`: which launcher started it (srun,
  mpirun, Kubernetes, explicit flags, the localhost launcher) and where it
  sits in the run (:class:`~qsync_jax.process.detection.Launch`);
* :mod:`~qsync_jax.process.initialize`: joining the run through
  ``jax.distributed`` (:func:`~qsync_jax.process.initialize.initialize`) and
  leaving it;
* :mod:`~qsync_jax.process.coordination`: small values shared through the
  coordination service's key-value store;
* :mod:`~qsync_jax.process.agreement`: the check that every process has the
  same versions, config, initial parameters and plans;
* :mod:`~qsync_jax.process.preemption`: SIGTERM, agreed on a step by every
  process;
* :mod:`~qsync_jax.process.membership`: the slots of an elastic world, as its
  launcher tells each process, and the world's share of the pool's workers;
* :mod:`~qsync_jax.process.run_start`: whether a run continues its
  directory's checkpoint, and the global batch a resume keeps;
* :mod:`~qsync_jax.process.previous_run`: the ``PREEMPTED`` file a run that
  checkpointed on a notice leaves, and what the next run reads of it;
* :mod:`~qsync_jax.process.membership_record`: the membership changes a run
  directory went through, with what each cost.

Starting the processes is :mod:`qsync_jax.launch`'s. The modules are
re-exported, and the two classes a caller builds or reads, except the last
three, which load the checkpoints', the cluster specs' and the run
directory's modules: the launcher imports this package and needs none of
them. Import those three by their full names.
"""

from qsync_jax.process import agreement
from qsync_jax.process import coordination
from qsync_jax.process import detection
from qsync_jax.process import initialize
from qsync_jax.process import membership
from qsync_jax.process import preemption
from qsync_jax.process.detection import Launch
from qsync_jax.process.membership import ElasticWorld

__all__ = [
  "ElasticWorld",
  "Launch",
  "agreement",
  "coordination",
  "detection",
  "initialize",
  "membership",
  "preemption",
]
