"""Predictor: the step time and memory of any per-device precision plan.

QSync's replayer and cost mapper (arXiv 2407.02327; QSync's official code,
bytedance/QSync, ``qsync/Predictor``) in JAX. In the data flow it sits between
the indicator and the allocator: a model and a cluster come in, a
:class:`Prediction` per plan goes out. Read its modules in this order:

* :func:`trace_graph`: a model's layers in forward order, their operand
  shapes, data flow and dtype cascades (:mod:`.graph`);
* :func:`profile`: per-layer forward and backward times per precision, the
  rest of the step, the optimizer, cast costs and memory, measured on the
  device at hand and cached as a :class:`Profile` (:mod:`.profiling`; what
  it times is :mod:`.pieces`, the calls that time it :mod:`.calls`, the
  clock :mod:`.timing`);
* :func:`analytic_profile`: the same table for a GPU kind of the device
  table (:mod:`qsync_jax.plan.devices`) that is not present, through the
  roofline (:mod:`.analytic`, :mod:`.roofline`);
* :class:`MemoryModel`, :func:`compiled_step_bytes` (:mod:`.memory`) and
  :class:`CastModel` (:mod:`.casting`): the memory and cast parts of a
  profile;
* :func:`simulate` / :func:`predict`: a synchronous step over hybrid workers
  with gradient buckets overlapping the backward pass and all-reduces aligned
  across workers, returning a :class:`Prediction` (:mod:`.simulation`);
* :class:`Link`, :func:`averaging_time`, :func:`profile_codec`: what one
  average costs on a link, with the bytes an averager's compiled program
  moves and its measured encode/decode (:mod:`.communication`,
  :mod:`.codec`; :func:`profile_codecs_in_processes`, :mod:`.codec_processes`,
  profiles it in launched processes as a run on one host has them);
  :func:`predict` takes them;
* :func:`profile_collectives`, :class:`CollectiveCost`: each kind and wire
  type of collective timed alone on the link at hand, which prices the host
  CPU's share of a collective that the link's rate leaves out
  (:mod:`.collective_cost`); :func:`averaging_time` takes it.

The step it profiles is the trainer's own (:mod:`qsync_jax.train.step` and
:mod:`qsync_jax.train.programs`); the predictor never imports the trainer.
"""

from qsync_jax.predictor.analytic import analytic_profile
from qsync_jax.predictor.casting import analytic_cast_model
from qsync_jax.predictor.casting import CastModel
from qsync_jax.predictor.casting import fit_cast_model
from qsync_jax.predictor.codec import CodecCost
from qsync_jax.predictor.codec import profile_codec
from qsync_jax.predictor.codec_processes import profile_codecs_in_processes
from qsync_jax.predictor.collective_cost import CollectiveCost
from qsync_jax.predictor.collective_cost import profile_collectives
from qsync_jax.predictor.communication import averaging_time
from qsync_jax.predictor.communication import Link
from qsync_jax.predictor.graph import casts
from qsync_jax.predictor.graph import input_dtypes
from qsync_jax.predictor.graph import LayerNode
from qsync_jax.predictor.graph import ModelGraph
from qsync_jax.predictor.graph import trace_graph
from qsync_jax.predictor.memory import compiled_step_bytes
from qsync_jax.predictor.memory import MemoryModel
from qsync_jax.predictor.profiling import Profile
from qsync_jax.predictor.profiling import profile
from qsync_jax.predictor.simulation import predict
from qsync_jax.predictor.simulation import Prediction
from qsync_jax.predictor.simulation import resolve_plan
from qsync_jax.predictor.simulation import simulate
from qsync_jax.predictor.simulation import SimWorker

__all__ = [
  "CastModel",
  "CodecCost",
  "CollectiveCost",
  "Link",
  "LayerNode",
  "MemoryModel",
  "ModelGraph",
  "Prediction",
  "Profile",
  "SimWorker",
  "analytic_cast_model",
  "analytic_profile",
  "averaging_time",
  "casts",
  "compiled_step_bytes",
  "fit_cast_model",
  "input_dtypes",
  "predict",
  "profile",
  "profile_codec",
  "profile_codecs_in_processes",
  "profile_collectives",
  "resolve_plan",
  "simulate",
  "trace_graph",
]
