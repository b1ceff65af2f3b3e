"""What the record's tables are made of: columns of little-endian int64s (and bytes), deflated
with zlib and base64'd into one JSON string, and read back to exactly the size their counts make.
No torch.

zlib, not zstd: every reader has it, and a record must load where the optional ``zstandard`` is
not installed. Inflating stops at the expected size, so a stream that would inflate further (a
few bytes of deflate can stand for gigabytes) allocates nothing more.
"""

from __future__ import annotations

import base64
import binascii
import sys
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

from ..jsoncheck import as_str, fail

__all__ = ["deflate", "from_int64s", "has_negative", "inflate", "to_int64s"]

_LEVEL = 6  # zlib's default: level 9 saves under 1% more of a table, at twice the time
_NON_NEGATIVE = bytes(range(128))  # the top bytes of non-negative little-endian int64s


def deflate(parts: list[bytes]) -> str:
    """The ``deflated`` base64 of a table's inflated ``parts``."""
    return base64.b64encode(zlib.compress(b"".join(parts), _LEVEL)).decode("ascii")


def inflate(value: Any, size: int, where: str) -> memoryview:
    """A table's ``deflated`` base64, inflated to exactly the ``size`` bytes its counts make;
    anything else is refused (`Invalid`) naming ``where``."""
    try:
        deflated = base64.b64decode(as_str(value, where, "deflated"), validate=True)
    except binascii.Error as e:
        fail(f"{where}.deflated: not base64: {e}")
    inflater = zlib.decompressobj()
    try:
        raw = memoryview(inflater.decompress(deflated, size + 1))
    except zlib.error as e:
        fail(f"{where}.deflated: does not inflate: {e}")
    del deflated
    if len(raw) != size or not inflater.eof or inflater.unused_data:
        fail(f"{where}.deflated: inflates to other than the {size} bytes its counts make")
    return raw


def has_negative(data: memoryview) -> bool:
    """Whether little-endian int64s hold a negative value: a sign bit, found by a byte loop."""
    return bool(bytes(data[7::8]).translate(None, _NON_NEGATIVE))


def to_int64s(values: Sequence[int]) -> bytes:
    """Little-endian int64s."""
    packed = array("q", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def from_int64s(data: memoryview) -> array[int]:
    """Little-endian int64s as an array."""
    unpacked = array("q")
    unpacked.frombytes(data)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked
