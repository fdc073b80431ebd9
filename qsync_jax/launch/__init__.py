"""Starting the processes of a multi-process run.

This subpackage owns the launchers (what each started process does is
:mod:`qsync_jax.process`'s):

* :mod:`~qsync_jax.launch.local`: the localhost launcher
  (:func:`~qsync_jax.launch.local.launch`: N processes of one run, relayed
  output, none left behind);
* :mod:`~qsync_jax.launch.elastic`: its elastic mode (worlds of a pool's
  slots, restarted as slots are reclaimed, die and come back), and
  :mod:`~qsync_jax.launch.pool` the pool it runs (the availability trace,
  the options, which slots are available when);
* :mod:`~qsync_jax.launch.links`: the emulated links its processes can run
  behind (network namespaces, tc shaping, cgroup CPU quotas), and
  :mod:`~qsync_jax.launch.link_probe` their measured rate;
* :mod:`~qsync_jax.launch.cli`: all of it as the command
  ``python -m qsync_jax.distributed`` (not imported here: it is run).

The modules are re-exported, and the launchers' entry points.
"""

from qsync_jax.launch import elastic
from qsync_jax.launch import link_probe
from qsync_jax.launch import links
from qsync_jax.launch import local
from qsync_jax.launch import pool
from qsync_jax.launch.elastic import launch_elastic
from qsync_jax.launch.local import launch
from qsync_jax.launch.pool import Availability
from qsync_jax.launch.pool import ElasticOptions

__all__ = [
  "Availability",
  "ElasticOptions",
  "elastic",
  "launch",
  "launch_elastic",
  "link_probe",
  "links",
  "local",
  "pool",
]
