"""The rate probe of emulated links: TCP flows between network namespaces.

This module owns how :mod:`qsync_jax.launch.links` measures the rate a
link achieves: one or more TCP flows, each from a socket made in one named
network namespace (``ip netns``) to a socket in another, all sending at once,
with the bytes each receiver gets counted over one common window. Sockets
are made in a namespace by switching the calling thread into it
(``setns(2)``) just for the ``socket()`` call; a socket keeps its namespace.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import ctypes
import os
import socket
import threading
import time

_NETNS_RUN = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
# Receive granularity: 64 KiB is 5 ms at 100 Mbit/s, 0.5 ms at 1 Gbit/s.
_RECV_BYTES = 1 << 16
_SEND_BYTES = 1 << 20
# Big buffers ride out a receiver's scheduling gaps on a busy host, which
# would otherwise idle the link and read as a slow one (the kernel caps them
# at net.core.rmem_max / wmem_max).
_BUFFER_BYTES = 8 << 20


def _setns(fd: int) -> None:
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.setns(fd, _CLONE_NEWNET) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
  """Puts this thread in network namespace ``name`` for the body.

  Raises:
    OSError: no such namespace, or the switch is not permitted.
  """
  own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
  try:
    target = os.open(os.path.join(_NETNS_RUN, name), os.O_RDONLY)
    try:
      _setns(target)
      try:
        yield
      finally:
        _setns(own)
    finally:
      os.close(target)
  finally:
    os.close(own)


def measure_rates(
  flows: Sequence[tuple[str, str, str]],
  *,
  seconds: float = 0.5,
  warmup_s: float = 0.1,
) -> list[float]:
  """Achieved rates of concurrent TCP flows, in bits/s.

  Every flow sends for ``warmup_s + seconds``; each receiver counts the bytes
  it gets in the same window of ``seconds`` after the warm-up (which skips
  slow start and a token bucket's initial burst), so rates of flows sharing
  a bottleneck add up to its rate.

  Args:
    flows: (source namespace, destination namespace, destination address)
      per flow.
    seconds: The measured window.
    warmup_s: Sending before the window opens.

  Returns:
    One rate per flow, in order.

  Raises:
    ValueError: no flows, or a window that is not positive.
    OSError: a socket could not be made or connected.
  """
  if not flows or seconds <= 0 or warmup_s < 0:
    raise ValueError(
      f"need flows and seconds > 0, warmup_s >= 0; got "
      f"{len(flows)} flows, {seconds} s, {warmup_s} s"
    )
  servers, clients = [], []
  with contextlib.ExitStack() as stack:
    for src, dst, address in flows:
      with in_netns(dst):
        server = stack.enter_context(
          socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        )
      server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
      server.bind((address, 0))
      server.listen(1)
      with in_netns(src):
        client = stack.enter_context(
          socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        )
      client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
      client.settimeout(10)
      client.connect((address, server.getsockname()[1]))
      conn, _ = server.accept()
      servers.append(stack.enter_context(conn))
      clients.append(client)
    received = [0] * len(flows)
    start = time.perf_counter()
    opens, closes = start + warmup_s, start + warmup_s + seconds

    def receive(k: int, conn: socket.socket) -> None:
      buf = bytearray(_RECV_BYTES)
      conn.settimeout(0.05)
      while time.perf_counter() < closes:
        try:
          n = conn.recv_into(buf)
        except TimeoutError:
          continue
        if n == 0:
          return
        if time.perf_counter() >= opens:
          received[k] += n

    def send(client: socket.socket) -> None:
      chunk = b"\0" * _SEND_BYTES
      client.settimeout(0.05)
      while time.perf_counter() < closes:
        with contextlib.suppress(TimeoutError):
          client.sendall(chunk)

    threads = [
      threading.Thread(target=receive, args=(k, c), daemon=True)
      for k, c in enumerate(servers)
    ]
    threads += [
      threading.Thread(target=send, args=(c,), daemon=True) for c in clients
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=warmup_s + seconds + 10)
  return [8.0 * b / seconds for b in received]


def measure_rate(
  src_ns: str,
  dst_ns: str,
  dst_address: str,
  *,
  seconds: float = 0.5,
  warmup_s: float = 0.1,
) -> float:
  """Achieved rate of one TCP flow from ``src_ns`` to ``dst_ns``, in bits/s.

  See :func:`measure_rates`.
  """
  return measure_rates(
    [(src_ns, dst_ns, dst_address)], seconds=seconds, warmup_s=warmup_s
  )[0]
