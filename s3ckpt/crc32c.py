"""CRC32C over bytes, and the check of a stream of checksummed ranges as it is read. No I/O.

Shared by the format (each frame's checksum in the commit record) and the engine (checksums on
the wire, reads verified as they stream), which otherwise know nothing of each other.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c

__all__ = ["Checksums", "StreamCheck", "checksum", "combine"]

_POLY = 0x82F63B78  # CRC32C, bit-reflected


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (hardware-accelerated), continuing from ``value``."""
    return int(crc32c.crc32c(data, value))


def combine(first: int, second: int, second_length: int) -> int:
    """The CRC32C of two byte strings back to back, from their CRCs and the second's length,
    without reading them again (so a part's checksum comes from its frames' checksums)."""
    return _multiply(_x_to_the_8n(second_length), first) ^ second


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both bit-reflected."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=64)
def _x_to_the_8n(n: int) -> int:
    """x^(8n) modulo the polynomial: what appending ``n`` zero bytes multiplies a CRC by."""
    result, power = 1 << 31, 1 << 30  # x^0 and x^1
    n *= 8
    while n:
        if n & 1:
            result = _multiply(power, result)
        power = _multiply(power, power)
        n >>= 1
    return result


@dataclass(frozen=True)
class Checksums:
    """Consecutive byte ranges of one object with their CRC32C: range ``i`` is bytes
    ``starts[i]`` to ``starts[i + 1]``; the last start is the object's size."""

    starts: Sequence[int]
    crcs: Sequence[int]

    @property
    def object_size(self) -> int:
        return self.starts[-1]

    def check(self, start: int) -> StreamCheck:
        """A check for a read that begins at ``start``, which must be a range boundary."""
        return StreamCheck(self, start)


class StreamCheck:
    """Checks the ranges of one read as its bytes stream past.

    `feed` raises `Mismatch` at the end of a range whose checksum differs; `resume_point`
    tells a retry where to start again (the beginning of the range in progress).
    """

    class Mismatch(Exception):
        def __init__(self, start: int, end: int, expected: int, actual: int) -> None:
            super().__init__(start, end, expected, actual)
            self.start, self.end, self.expected, self.actual = start, end, expected, actual

    def __init__(self, checksums: Checksums, start: int) -> None:
        self._starts, self._crcs = checksums.starts, checksums.crcs
        self._range = self._starts.index(start)
        self._crc = 0

    @property
    def object_size(self) -> int:
        """The object's size, as the checksums record it."""
        return self._starts[-1]

    def resume_point(self) -> int:
        self._crc = 0
        return self._starts[self._range]

    def feed(self, position: int, data: bytes | bytearray | memoryview) -> None:
        """``data`` are the bytes from ``position`` on."""
        view = memoryview(data)
        while view:
            range_end = self._starts[self._range + 1]
            take = min(len(view), range_end - position)
            self._crc = checksum(view[:take], self._crc)
            position += take
            view = view[take:]
            if position == range_end:
                expected = self._crcs[self._range]
                if self._crc != expected:
                    range_start = self._starts[self._range]
                    raise StreamCheck.Mismatch(range_start, range_end, expected, self._crc)
                self._range += 1
                self._crc = 0
