"""Averagers' encode/decode profiled by the processes of one launched run.

This module owns :func:`profile_codecs_in_processes`: the encode/decode of
each averager (:func:`~qsync_jax.predictor.codec.profile_codec` over the
run's mesh, the workers meeting where the collectives are) timed by
``num_processes`` localhost processes, one CPU device each, as a launched
training run on one host has them. Where those processes share the host's
cores, each has its own XLA thread pool, and that contention is not the one
of fake devices in one process, which time the encode/decode short.

Each of those processes runs :func:`worker_main`.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import pickle
import sys
import tempfile

from qsync_jax.launch import local
from qsync_jax.parallel.wire import Averager
from qsync_jax.predictor.codec import AXIS
from qsync_jax.predictor.codec import CodecCost
from qsync_jax.predictor.codec import profile_codec
from qsync_jax.process import initialize


def profile_codecs_in_processes(
  averagers: Mapping[str, Averager],
  num_elements: int,
  num_processes: int,
  *,
  repeats: int = 5,
  calls: int = 3,
  error_feedback: Mapping[str, bool | None] | None = None,
  timeout_s: float = 1800,
) -> dict[str, CodecCost]:
  """Profiles each averager's encode/decode in launched processes.

  Starts ``num_processes`` processes of one localhost run
  (:func:`qsync_jax.launch.local.launch`, loopback, no emulated
  link); each profiles every averager at once with the others, a barrier
  before each timed block, and process 0's fits are returned. The workers
  meet at each collective (:func:`~qsync_jax.predictor.codec.
  local_program`), so the collectives of at most
  :data:`~qsync_jax.predictor.codec.SMALL_COLLECTIVE_BYTES` per worker are
  timed here over loopback; a prediction that also prices them on its link
  counts them twice (for PowerSGD's two factors, a few ms).

  Args:
    averagers: ``{name: averager}``, each picklable (the library's are).
    num_elements: float32 elements per worker (fitted at it and a quarter).
    num_processes: processes, which are the average's workers.
    repeats: timed blocks per size.
    calls: calls per block.
    error_feedback: ``{name: None, True or False}``, as
      :func:`~qsync_jax.predictor.codec.profile_codec` takes it (None, the
      averager's own call, for a name not in it): True or False to time the
      trainer's average, as a training run pays it.
    timeout_s: the launch's time limit.

  Returns:
    ``{name: CodecCost}``.

  Raises:
    ValueError: fewer than 2 elements, 1 process, repeat or call, or
      ``error_feedback`` names an averager not in ``averagers``.
    RuntimeError: a process failed (its output was relayed with a
      ``[p<id>]`` prefix).
  """
  if num_elements < 2 or min(num_processes, repeats, calls) < 1:
    raise ValueError(
      f"need >= 2 elements and at least one process, repeat "
      f"and call; got {num_elements} elements, "
      f"{num_processes} processes, {repeats} repeats, {calls} "
      "calls"
    )
  unknown = sorted(set(error_feedback or {}) - set(averagers))
  if unknown:
    raise ValueError(
      f"error_feedback names averagers {unknown} that are "
      f"not profiled; averagers: {sorted(averagers)}"
    )
  with tempfile.TemporaryDirectory(prefix="qsync_codec_") as tmp:
    spec, out = os.path.join(tmp, "spec.pkl"), os.path.join(tmp, "out.pkl")
    with open(spec, "wb") as f:
      pickle.dump(
        {
          "averagers": dict(averagers),
          "error_feedback": dict(error_feedback or {}),
          "num_elements": int(num_elements),
          "repeats": repeats,
          "calls": calls,
        },
        f,
      )
    # Through -c, not -m: the package imports this module, and runpy warns
    # about running a module that is already imported.
    code = local.launch(
      [
        sys.executable,
        "-c",
        f"import sys; import {__name__} as m; m.worker_main(*sys.argv[1:3])",
        spec,
        out,
      ],
      num_processes,
      timeout_s=timeout_s,
    )
    if code != 0 or not os.path.exists(out):
      raise RuntimeError(
        f"profiling the encode/decode in {num_processes} "
        f"processes failed (exit {code}); see the relayed "
        "[p<id>] lines above"
      )
    with open(out, "rb") as f:
      return pickle.load(f)


def worker_main(spec_path: str, out_path: str) -> None:
  """One process of :func:`profile_codecs_in_processes`: profiles the
  averagers pickled in ``spec_path``; process 0 pickles the fits
  (:class:`~qsync_jax.predictor.codec.CodecCost`) to ``out_path``."""
  # The runs' host allocator (every binary's): the codec's time hangs on it.
  from qsync_jax import host_malloc

  host_malloc.configure_from_env()
  import jax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh
  import numpy as np

  with open(spec_path, "rb") as f:
    spec = pickle.load(f)
  initialize.initialize()
  mesh = Mesh(np.array(jax.devices()), (AXIS,))

  def barrier():
    multihost_utils.sync_global_devices("profile_codecs_in_processes")

  fits = {
    name: profile_codec(
      averager,
      spec["num_elements"],
      mesh=mesh,
      repeats=spec["repeats"],
      calls=spec["calls"],
      sync=barrier,
      error_feedback=spec["error_feedback"].get(name),
    )
    for name, averager in spec["averagers"].items()
  }
  if jax.process_index() == 0:
    with open(out_path, "wb") as out_file:
      pickle.dump(fits, out_file)
  initialize.shutdown()
