"""Frames: the unit in which stored bytes are checked. No I/O.

An object's bytes are cut into frames of ``frame_size`` bytes (the last may be shorter). The
commit record holds each frame's stored length, codec and CRC32C, so any read, however partial,
can be checked: a reader fetches whole frames and compares their checksums as the bytes stream in.
A frame table is small (9 bytes a frame, 4 MiB frames: about 2 KiB per GiB) and travels in the
commit record as base64.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import crc32c

__all__ = ["RAW", "FrameCheck", "FrameTable", "checksum"]

RAW = 0  # the only codec so far: bytes stored as they are
_ENTRY = struct.Struct("<IIB")  # stored length, CRC32C, codec


def checksum(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32C (hardware-accelerated), continuing from ``value``."""
    return int(crc32c.crc32c(data, value))


@dataclass(frozen=True)
class FrameTable:
    """How one object is framed: sizes, codecs and checksums of its stored frames."""

    frame_size: int
    sizes: tuple[int, ...]
    crcs: tuple[int, ...]
    codecs: tuple[int, ...]

    @classmethod
    def raw(cls, frame_size: int, crcs: Iterable[int], size: int) -> FrameTable:
        """The table of an object stored without compression."""
        crcs = tuple(crcs)
        sizes = tuple(min(frame_size, size - i * frame_size) for i in range(len(crcs)))
        return cls(frame_size, sizes, crcs, (RAW,) * len(crcs))

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Stored offset of each frame, and the object's size at the end."""
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        return tuple(offsets)

    @property
    def size(self) -> int:
        return self.starts[-1]

    def covering(self, start: int, end: int) -> tuple[int, int]:
        """The frame-aligned byte range that contains ``[start, end)`` (raw frames only)."""
        first = start // self.frame_size
        last = max(first, (end - 1) // self.frame_size)
        return self.starts[first], self.starts[min(last + 1, len(self.sizes))]

    def to_json(self) -> dict[str, Any]:
        packed = b"".join(
            _ENTRY.pack(*e) for e in zip(self.sizes, self.crcs, self.codecs, strict=True)
        )
        return {"frame_size": self.frame_size, "table": base64.b64encode(packed).decode()}

    @classmethod
    def from_json(cls, value: Any, size: int) -> FrameTable:
        """Parse and check a table; raises ValueError saying what is wrong."""
        if not isinstance(value, dict) or set(value) != {"frame_size", "table"}:
            raise ValueError("a frame table has exactly 'frame_size' and 'table'")
        frame_size, table = value["frame_size"], value["table"]
        if not isinstance(frame_size, int) or isinstance(frame_size, bool) or frame_size <= 0:
            raise ValueError(f"frame_size must be a positive integer, got {frame_size!r}")
        if not isinstance(table, str):
            raise ValueError("table must be a base64 string")
        try:
            packed = base64.b64decode(table, validate=True)
        except ValueError as e:
            raise ValueError(f"table is not base64: {e}") from None
        if len(packed) % _ENTRY.size:
            raise ValueError(f"table has {len(packed)} bytes, not a multiple of {_ENTRY.size}")
        entries = list(_ENTRY.iter_unpack(packed))
        sizes = tuple(e[0] for e in entries)
        codecs = tuple(e[2] for e in entries)
        parsed = cls(frame_size, sizes, tuple(e[1] for e in entries), codecs)
        if parsed.size != size:
            raise ValueError(f"frames add up to {parsed.size} bytes, the object has {size}")
        if any(codec != RAW for codec in codecs):
            raise ValueError("unknown frame codec (written by a newer s3ckpt?)")
        if any(s != frame_size for s in sizes[:-1]) or (sizes and not 0 < sizes[-1] <= frame_size):
            raise ValueError("raw frames must all be frame_size bytes, the last at most that")
        return parsed


class FrameCheck:
    """Checks the frames of one ranged read as its bytes stream past.

    ``start`` and ``end`` must be frame boundaries of ``table``. `feed` raises `Mismatch` at the
    end of a frame whose checksum differs; `resume_point` tells a retry where to start again
    (the beginning of the frame in progress).
    """

    class Mismatch(Exception):
        def __init__(self, start: int, end: int, expected: int, actual: int) -> None:
            super().__init__(start, end, expected, actual)
            self.start, self.end, self.expected, self.actual = start, end, expected, actual

    def __init__(self, table: FrameTable, start: int, end: int) -> None:
        self._table = table
        self._frame = table.starts.index(start)
        self._end = end
        self._crc = 0

    def resume_point(self) -> int:
        self._crc = 0
        return self._table.starts[self._frame]

    def feed(self, position: int, data: bytes | memoryview) -> None:
        """``data`` are the stored bytes from ``position`` on."""
        view = memoryview(data)
        while view:
            frame_end = self._table.starts[self._frame + 1]
            take = min(len(view), frame_end - position)
            self._crc = checksum(view[:take], self._crc)
            position += take
            view = view[take:]
            if position == frame_end:
                expected = self._table.crcs[self._frame]
                if self._crc != expected:
                    frame_start = self._table.starts[self._frame]
                    raise FrameCheck.Mismatch(frame_start, frame_end, expected, self._crc)
                self._frame += 1
                self._crc = 0
