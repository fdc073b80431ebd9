"""torchft's side of a torch run: the lighthouse, the manager, the algorithm.

This module owns what a torchft replica needs besides the torch trainer of
:mod:`.torch_worker`: the lighthouse (the quorum server; process 0 starts
it, bound to its own address, so that every network namespace reaches it;
a recovery run starts it as a process of its own in process 0's namespace,
run as ``python -m experiments.benches.peers.torchft_side HOST:PORT K``),
the replica group's ``TCPStore`` (created here, in the process, before the
:class:`torchft.Manager` that connects to it as a client) and the manager,
and the algorithm each variant runs:

* ``localsgd``: :class:`torchft.local_sgd.LocalSGD`, parameters averaged
  every :data:`SYNC_EVERY` steps;
* ``diloco``: :class:`torchft.local_sgd.DiLoCo` on the whole model as one
  fragment, ``H`` = :data:`SYNC_EVERY`, the outer optimizer the main job's
  DiLoCo runs (SGD, lr 0.7, momentum 0.9, Nesterov);
* ``streaming``: DiLoCo over :data:`STREAMING_FRAGMENTS` fragments (the
  model's layers split in order), each synchronized at staggered steps with
  a delay of :data:`STREAMING_DELAY` steps, so that its all-reduce overlaps
  the next steps' compute.

Every replica group is one process (rank 0 of a world of 1); replicas
average across groups through the manager, unquantized
(``should_quantize=False``: torchft's quantized all-reduce needs Triton and
a GPU). torch and torchft are imported by the torch worker only.
"""

from __future__ import annotations

from collections.abc import Callable
import datetime
import itertools
import sys
import time
from typing import Any

import torch
from torch import nn
import torchft
from torchft import local_sgd

VARIANTS = ("localsgd", "diloco", "streaming")
#: LocalSGD's and DiLoCo's period: the main job's ``h_base``.
SYNC_EVERY = 4
#: Streaming DiLoCo's fragments and their sync delay (steps): ``sync_every``
#: a multiple of the fragments, the delay smaller than their spacing.
STREAMING_FRAGMENTS = 2
STREAMING_SYNC_EVERY = 8
STREAMING_DELAY = 1
#: The main job's DiLoCo outer optimizer (experiments/configs/default.py).
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
#: How long a collective or quorum waits for a peer before giving up: what
#: a replica that died costs the survivors at most.
TIMEOUT_S = 20.0


def start_lighthouse(bind: str, min_replicas: int) -> Any:
  """The quorum server, bound to ``bind`` (``host:port``).

  ``min_replicas`` replicas form a quorum; a replica silent for
  5 s leaves it.
  """
  from torchft._torchft import LighthouseServer  # pylint: disable=g-import-not-at-top

  return LighthouseServer(
    bind=bind,
    min_replicas=min_replicas,
    join_timeout_ms=10_000,
    quorum_tick_ms=100,
    heartbeat_timeout_ms=5_000,
  )


def make_manager(
  replica: int,
  host: str,
  lighthouse: str,
  min_replicas: int,
  load_state_dict: Callable[[Any], None],
  state_dict: Callable[[], Any],
) -> tuple[torchft.Manager, Any]:
  """The replica's manager and the store it needs (keep both alive).

  Args:
    replica: this replica's index (its id is ``replica<i>``).
    host: this process's address as its peers reach it (its own in its
      network namespace: peers fetch a newcomer's state from it).
    lighthouse: the lighthouse's ``http://host:port``.
    min_replicas: the fewest replicas a step commits with.
    load_state_dict: restores the trainer's state (a newcomer's heal).
    state_dict: the trainer's state a peer sends a newcomer.

  Returns:
    ``(manager, store)``.
  """
  from torch.distributed import TCPStore  # pylint: disable=g-import-not-at-top

  # The replica group's store, which the manager joins as a client: made
  # first, or the manager waits for it forever.
  store = TCPStore(
    host_name=host, port=0, is_master=True, wait_for_workers=False
  )
  timeout = datetime.timedelta(seconds=TIMEOUT_S)
  manager = torchft.Manager(
    checkpoint_transport=_transport(host, timeout),
    pg=torchft.ProcessGroupGloo(timeout=timeout),
    min_replica_size=min_replicas,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"replica{replica}",
    store_addr=host,
    hostname=host,
    store_port=store.port,
    rank=0,
    world_size=1,
    lighthouse_addr=lighthouse,
    use_async_quorum=False,  # DiLoCo needs it; LocalSGD runs alike
    timeout=timeout,
    quorum_timeout=timeout,
    connect_timeout=timeout,
  )
  return manager, store


def _transport(host: str, timeout: datetime.timedelta) -> Any:
  """torchft's HTTP checkpoint transport, advertised at ``host``: its own
  address names this machine by its hostname, which every network
  namespace resolves to its own address."""
  from torchft.checkpointing import HTTPTransport  # pylint: disable=g-import-not-at-top

  class Transport(HTTPTransport):
    def address(self) -> str:
      port = self._server.socket.getsockname()[1]
      return f"http://{host}:{port}/checkpoint/"

  return Transport(timeout=timeout, num_chunks=0)


def fragments(model: nn.Module, count: int) -> list[nn.Module]:
  """The model's layers in ``count`` consecutive groups (Streaming
  DiLoCo's fragments), each an ``nn.ModuleList``."""
  layers = [m for m in model.children() if any(True for _ in m.parameters())]
  if not 1 <= count <= len(layers):
    raise ValueError(f"{count} fragments of {len(layers)} layers")
  bounds = [len(layers) * k // count for k in range(count + 1)]
  return [nn.ModuleList(layers[a:b]) for a, b in itertools.pairwise(bounds)]


def algorithm(
  variant: str,
  manager: torchft.Manager,
  model: nn.Module,
  optimizer: torch.optim.Optimizer,
) -> Any:
  """The context manager that runs ``variant`` around the training loop
  (its hooks on ``optimizer.step`` synchronize)."""
  if variant == "localsgd":
    return local_sgd.LocalSGD(manager, model, optimizer, SYNC_EVERY)
  if variant not in ("diloco", "streaming"):
    raise ValueError(f"unknown torchft variant {variant!r}; valid: {VARIANTS}")
  streaming = variant == "streaming"
  parts = fragments(model, STREAMING_FRAGMENTS if streaming else 1)
  outer = [
    torch.optim.SGD(
      p.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
    )
    for p in parts
  ]
  return local_sgd.DiLoCo(
    manager,
    parts,
    optimizer,
    outer,
    sync_every=STREAMING_SYNC_EVERY if streaming else SYNC_EVERY,
    pin_memory=False,
    use_bucketization=False,
    should_quantize=False,
    fragment_sync_delay=STREAMING_DELAY if streaming else 0,
  )


def in_sync_after(variant: str, step: int) -> bool:
  """Whether every replica holds the same parameters after ``step`` steps
  (an evaluation then needs no mean): LocalSGD and one-fragment DiLoCo
  right after a sync; Streaming DiLoCo's fragments never all at once."""
  return variant != "streaming" and step % SYNC_EVERY == 0


def main(argv: list[str]) -> None:
  """``python -m experiments.benches.peers.torchft_side HOST:PORT K``: a
  lighthouse for ``K`` replicas until killed (the recovery runs' own, so
  that it outlives every replica)."""
  lighthouse = start_lighthouse(argv[0], int(argv[1]))
  try:
    while True:
      time.sleep(3600)
  finally:
    lighthouse.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])
