"""`Scatter`: a byte stream routed into the memory that wants its ranges. No I/O.

Shared by the engine (a ranged GET streams straight into tensors) and the DCP reader (a decoded
frame lands in the destinations of its raw bytes), which otherwise meet only at the contract.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["Scatter"]


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
