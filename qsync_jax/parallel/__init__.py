"""How the workers of a hybrid cluster are laid out, and how they synchronize.

In the data flow this subpackage sits between the precision plan and the
training step: it owns

* the cluster (:mod:`~qsync_jax.parallel.cluster`): which device kind each
  worker is, which JAX device runs it, and the dynamic-batch-sizing split;
* what goes on the wire when workers average
  (:mod:`~qsync_jax.parallel.averagers`, built on
  :mod:`~qsync_jax.parallel.wire` and :mod:`~qsync_jax.parallel.buckets`,
  with Global-QSGD in :mod:`~qsync_jax.parallel.global_qsgd` and PowerSGD
  in :mod:`~qsync_jax.parallel.powersgd`);
* when they average, and whether gradients or parameters
  (:mod:`~qsync_jax.parallel.schedules`), and the QSR code's learning-rate
  schedules QSR's period reads (:mod:`~qsync_jax.parallel.lr_schedules`);
* the optax transformation averaging updates in a user's own ``shard_map``
  (:mod:`~qsync_jax.parallel.transform`).

The trainer (:mod:`qsync_jax.train`) runs the collectives; nothing here
holds model state. How the processes of a multi-process run start and join
it is :mod:`qsync_jax.launch`'s and :mod:`qsync_jax.process`'s.
"""

from qsync_jax.parallel import averagers
from qsync_jax.parallel import cluster
from qsync_jax.parallel import schedules
from qsync_jax.parallel import transform
from qsync_jax.parallel.averagers import average_tree
from qsync_jax.parallel.averagers import CastAverager
from qsync_jax.parallel.averagers import compress_with_feedback
from qsync_jax.parallel.averagers import make_averager
from qsync_jax.parallel.averagers import MeanAverager
from qsync_jax.parallel.averagers import QSGD
from qsync_jax.parallel.averagers import ravel_floats
from qsync_jax.parallel.cluster import assign_devices
from qsync_jax.parallel.cluster import ClusterSpec
from qsync_jax.parallel.cluster import dynamic_batch_sizes
from qsync_jax.parallel.cluster import parse_cluster
from qsync_jax.parallel.cluster import parse_speeds
from qsync_jax.parallel.cluster import split_batch
from qsync_jax.parallel.global_qsgd import GlobalQSGD
from qsync_jax.parallel.global_qsgd import GlobalQSGDExp
from qsync_jax.parallel.lr_schedules import LearningRateSchedule
from qsync_jax.parallel.powersgd import PowerSGD
from qsync_jax.parallel.schedules import ConstantLocalSGD
from qsync_jax.parallel.schedules import EveryStep
from qsync_jax.parallel.schedules import make_schedule
from qsync_jax.parallel.schedules import PostLocalSGD
from qsync_jax.parallel.schedules import QSR
from qsync_jax.parallel.schedules import Schedule
from qsync_jax.parallel.transform import averaged
from qsync_jax.parallel.transform import AveragedState
from qsync_jax.parallel.wire import Averager
from qsync_jax.parallel.wire import ring_allgather_bytes
from qsync_jax.parallel.wire import ring_allreduce_bytes

__all__ = [
  "AveragedState",
  "Averager",
  "average_tree",
  "averaged",
  "ravel_floats",
  "transform",
  "CastAverager",
  "ClusterSpec",
  "ConstantLocalSGD",
  "EveryStep",
  "GlobalQSGD",
  "GlobalQSGDExp",
  "LearningRateSchedule",
  "MeanAverager",
  "PostLocalSGD",
  "PowerSGD",
  "QSGD",
  "QSR",
  "Schedule",
  "assign_devices",
  "averagers",
  "cluster",
  "compress_with_feedback",
  "dynamic_batch_sizes",
  "make_averager",
  "make_schedule",
  "parse_cluster",
  "parse_speeds",
  "ring_allgather_bytes",
  "ring_allreduce_bytes",
  "schedules",
  "split_batch",
]
