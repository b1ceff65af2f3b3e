"""Memory for requests in flight: reusable part buffers for uploads, and a scatter router that
streams a download straight into the memory that wants it. No I/O.

A part that spans several tensors must be assembled before it is sent. A fresh 16 MiB buffer per
part costs the kernel a page fault and zeroing for every byte uploaded; `PartBuffers` lends
buffers from a pool that lives while uploads are running (at most one per request slot) and is
dropped when the last upload ends, so an idle training process holds nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["PartBuffers", "Scatter"]


class PartBuffers:
    """A pool of ``size``-byte buffers, alive while at least one upload holds it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[bytearray] = []
        self._holders = 0

    @contextmanager
    def held(self) -> Iterator[None]:
        """Keep the pool for the duration of one upload."""
        self._holders += 1
        try:
            yield
        finally:
            self._holders -= 1
            if self._holders == 0:
                self._free.clear()

    @contextmanager
    def borrow(self, length: int) -> Iterator[memoryview]:
        """A writable view of ``length`` bytes; pooled when it fits in ``size``."""
        pooled = length <= self.size
        buffer = (self._free.pop() if self._free else bytearray(self.size)) if pooled else None
        buffer = buffer if buffer is not None else bytearray(length)
        try:
            yield memoryview(buffer)[:length]
        finally:
            if pooled and self._holders > 0:
                self._free.append(buffer)


class Scatter:
    """Copies a byte stream that starts at ``start`` into the views waiting for its ranges.

    ``segments`` are ``(offset, view)`` pairs: the view wants the stream's bytes from absolute
    offset ``offset`` on, for ``len(view)`` bytes. Segments may overlap; bytes nobody wants are
    dropped. ``position`` is how far the stream has got, so a broken stream can resume there.
    """

    def __init__(self, start: int, segments: Sequence[tuple[int, memoryview]]) -> None:
        self.position = start
        self._segments = sorted(segments, key=lambda s: s[0])
        self._starts = [offset for offset, _ in self._segments]
        self._first = 0

    def views(self, start: int, end: int) -> list[tuple[int, memoryview]]:
        """The memory that wants bytes ``[start, end)``: ``(offset from start, view)`` of each
        segment's part of them, so they can be produced there in place instead of written
        through `write`."""
        stop = bisect.bisect_left(self._starts, end)
        wanting = []
        for offset, view in self._segments[:stop]:
            lo, hi = max(offset, start), min(offset + len(view), end)
            if lo < hi:
                wanting.append((lo - start, view[lo - offset : hi - offset]))
        return wanting

    def rewind(self, position: int) -> None:
        """Continue from an earlier ``position`` (a retry re-reads from there)."""
        self.position = position
        self._first = 0

    def write(self, data: bytes | memoryview) -> None:
        begin, end = self.position, self.position + len(data)
        while self._first < len(self._segments):
            offset, view = self._segments[self._first]
            if offset + len(view) > begin:
                break
            self._first += 1
        stop = bisect.bisect_left(self._starts, end, lo=self._first)
        for offset, view in self._segments[self._first : stop]:
            lo, hi = max(offset, begin), min(offset + len(view), end)
            if lo < hi:
                view[lo - offset : hi - offset] = data[lo - begin : hi - begin]
        self.position = end
