"""The main job's config in an elastic world: the ConfigDict glue.

The process side of elastic membership is the library's
(:mod:`qsync_jax.process.membership`, :mod:`~qsync_jax.process.run_start`,
:mod:`~qsync_jax.process.previous_run`,
:mod:`~qsync_jax.process.membership_record`); this module only applies it to
the main job's ``ml_collections.ConfigDict``:

- :func:`world_config`: in a world an elastic launcher started,
  ``--cluster`` names the pool, one worker per slot, and this run's workers
  are the kinds of the slots running now (``--cluster=auto``: the devices
  of this world), with the plans of those kinds;
- :func:`sized_for`: the config whose per-worker batch covers the batches a
  resume keeps, for the memory checks.
"""

from __future__ import annotations

from collections.abc import Sequence
import math

import ml_collections

from experiments import config_lib
from qsync_jax.parallel import cluster as cluster_lib
from qsync_jax.process import membership
from qsync_jax.process.membership import ElasticWorld


def world_config(
  config: ml_collections.ConfigDict, world: ElasticWorld | None
) -> ml_collections.ConfigDict:
  """``config`` with the cluster of this elastic world.

  ``config.cluster`` names the pool, one worker per slot; the world's
  cluster is the kinds of its slots, in process order
  (:func:`qsync_jax.process.membership.world_kinds`). Manual plans for
  kinds of the pool that no slot of this world runs are dropped
  (:func:`~qsync_jax.process.membership.world_plans`): the command is the
  same in every world.

  Args:
    config: the job's config (left unchanged).
    world: the world, or None when the run is not elastic.

  Returns:
    ``config`` itself when there is no world or its cluster is ``auto``
    (resolved from this world's devices); otherwise a copy.

  Raises:
    ValueError: ``config.cluster`` does not name one worker per slot.
  """
  cluster = str(config.cluster)
  if world is None or cluster.strip().lower() == cluster_lib.AUTO:
    return config
  kinds = membership.world_kinds(
    cluster_lib.parse_cluster(cluster).kinds, world
  )
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.cluster = cluster_lib.cluster_string(
      cluster_lib.ClusterSpec(tuple(kinds))
    )
    plans = config_lib.to_plain(config.plans) or {}
    kept = membership.world_plans(plans, kinds)
    if kept != plans:
      config.plans = ml_collections.ConfigDict(kept)
  return config


def sized_for(
  config: ml_collections.ConfigDict, batch_sizes: Sequence[int] | None
) -> ml_collections.ConfigDict:
  """``config`` whose per-worker batch covers ``batch_sizes``, for the
  memory checks (a resume onto fewer workers gives each a larger batch).

  Args:
    config: the job's config (left unchanged).
    batch_sizes: the per-worker batches a resume keeps, or None.

  Returns:
    ``config`` itself when its ``batch_size`` is at least the even share
    of the global batch; else a copy with that share.
  """
  if not batch_sizes:
    return config
  share = math.ceil(sum(batch_sizes) / len(batch_sizes))
  if share <= config.batch_size:
    return config
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.batch_size = share
  return config
