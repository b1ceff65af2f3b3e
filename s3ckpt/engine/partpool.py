"""Memory for requests in flight: reusable part buffers for uploads. No I/O.

A part that spans several tensors must be assembled before it is sent. A fresh 16 MiB buffer per
part costs the kernel a page fault and zeroing for every byte uploaded; `PartBuffers` lends
buffers from a pool that lives while uploads are running (at most one per request slot) and is
dropped when the last upload ends, so an idle training process holds nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PartBuffers"]


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
