"""TensorBoard event records: the few ``Event`` messages a scalar log needs.

This module owns the bytes of a TensorBoard event file: the ``Event``
messages of TensorBoard's ``event.proto`` that :class:`~qsync_jax.rundir.
metrics.MetricWriter` writes (the file version, a purge at a step, scalars at
a step), encoded in the protocol-buffer wire format, each framed as a
TFRecord (length, masked CRC-32C of the length, message, masked CRC-32C of the
message).

The encoding is written out here rather than taken from generated message
classes: the package that ships them for PyTorch users (``tensorboardX``)
imports PyTorch whenever it is installed, seconds at every process start.
The tests check every byte against those generated classes.

Example:
  >>> record = scalars_record(wall_time=1.5, step=3, scalars={"loss": 0.25})
  >>> len(record)
  42
"""

from __future__ import annotations

from collections.abc import Mapping
import math
import struct

# Field numbers of TensorBoard's event.proto and summary.proto.
_EVENT_WALL_TIME = 1  # double
_EVENT_STEP = 2  # int64
_EVENT_FILE_VERSION = 3  # string
_EVENT_SUMMARY = 5  # Summary
_EVENT_SESSION_LOG = 7  # SessionLog
_SESSION_LOG_STATUS = 1  # enum SessionStatus
_SESSION_LOG_START = 1
_SUMMARY_VALUE = 1  # repeated Summary.Value
_VALUE_TAG = 1  # string
_VALUE_SIMPLE_VALUE = 2  # float

# Wire types of the protocol-buffer encoding.
_VARINT = 0
_FIXED64 = 1
_LENGTH_DELIMITED = 2
_FIXED32 = 5

#: The ``file_version`` TensorBoard expects in a file's first event.
FILE_VERSION = "brain.Event:2"

_FLOAT32_MAX = 3.4028234663852886e38


def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # negative int64s: ten bytes of two's complement
  out = bytearray()
  while value > 0x7F:
    out.append((value & 0x7F) | 0x80)
    value >>= 7
  out.append(value)
  return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _key(field, _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
  # A float field holds a float32: beyond its range a number is infinite
  # (as the generated classes store it), where struct.pack would raise.
  if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
    value = math.copysign(math.inf, value)
  return struct.pack("<f", value)


def _event(wall_time: float, step: int, body: bytes) -> bytes:
  # proto3: a scalar field at its default value is left out.
  head = b""
  if wall_time != 0.0:
    head += _key(_EVENT_WALL_TIME, _FIXED64) + struct.pack("<d", wall_time)
  if step != 0:
    head += _key(_EVENT_STEP, _VARINT) + _varint(step)
  return head + body


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """The CRC-32C (Castagnoli) checksum of ``data``.

  Args:
    data: the bytes.

  Returns:
    The checksum, an unsigned 32-bit integer.

  Example:
    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
  """
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """The masked CRC-32C of ``data`` that frames a TFRecord.

  Args:
    data: the bytes.

  Returns:
    The checksum rotated right by 15 bits plus ``0xA282EAD8`` (modulo
    2**32), as TFRecord readers check it.
  """
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(message: bytes) -> bytes:
  """``message`` framed as a TFRecord.

  Args:
    message: an encoded ``Event``.

  Returns:
    Its length (8 bytes, little-endian), that length's masked CRC-32C, the
    message, the message's masked CRC-32C.
  """
  header = struct.pack("<Q", len(message))
  return (
    header
    + struct.pack("<I", masked_crc32c(header))
    + message
    + struct.pack("<I", masked_crc32c(message))
  )


def file_version_record(wall_time: float) -> bytes:
  """The record that opens an event file: its ``file_version``.

  Args:
    wall_time: seconds since the epoch.

  Returns:
    The framed ``Event(wall_time, file_version="brain.Event:2")``.
  """
  body = _length_delimited(_EVENT_FILE_VERSION, FILE_VERSION.encode())
  return frame(_event(wall_time, 0, body))


def purge_record(wall_time: float, step: int) -> bytes:
  """A ``SessionLog.START`` at ``step``: TensorBoard then hides the events
  of earlier files from ``step`` on (a resumed run's purge).

  Args:
    wall_time: seconds since the epoch.
    step: the first step whose earlier events are hidden.

  Returns:
    The framed ``Event(wall_time, step, session_log=SessionLog(START))``.
  """
  session_log = _key(_SESSION_LOG_STATUS, _VARINT) + _varint(_SESSION_LOG_START)
  body = _length_delimited(_EVENT_SESSION_LOG, session_log)
  return frame(_event(wall_time, step, body))


def scalars_record(
  wall_time: float, step: int, scalars: Mapping[str, float]
) -> bytes:
  """Scalars at ``step``, each a ``Summary.Value`` with a ``simple_value``.

  Args:
    wall_time: seconds since the epoch.
    step: the step they are of.
    scalars: ``{tag: number}``, in the order TensorBoard lists them; each
      number is stored as a float32 (beyond its range, infinite).

  Returns:
    The framed ``Event(wall_time, step, summary=Summary(value=[...]))``.
  """
  summary = b"".join(
    _length_delimited(
      _SUMMARY_VALUE,
      # proto3 leaves out an empty string.
      (_length_delimited(_VALUE_TAG, tag.encode()) if tag else b"")
      + _key(_VALUE_SIMPLE_VALUE, _FIXED32)
      + _float32(float(number)),
    )
    for tag, number in scalars.items()
  )
  return frame(
    _event(wall_time, step, _length_delimited(_EVENT_SUMMARY, summary))
  )
