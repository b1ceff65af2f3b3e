"""Request bodies that reach the socket without being copied, written a slice at a time.

Handed one 16 MiB buffer, aiohttp (before Python 3.12.9) joins it with the request headers into a
new bytes object, and asyncio's transport copies whatever the socket does not take at once into
its own buffer: two copies and 16 MiB of fresh memory (page faults, zeroing) per part, all on the
event loop, which shares its core with training. A `Body` writes its buffers in slices no larger
than a socket's send buffer takes, waiting for the transport to drain between them, so most bytes
go from the caller's memory straight to the kernel. It also sends several buffers as one body, so
a part spanning tensors is never assembled (only runs of small ones are, into one buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

__all__ = ["SLICE", "Body"]

SLICE = 1 << 20
_SMALL = 64 << 10  # buffers under this are copied together: one write each would cost more


class Body(Payload):
    """``buffers``, back to back, as one request body; botocore takes its length from ``len``."""

    def __init__(self, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
        views = _coalesced([memoryview(b).cast("B") for b in buffers])
        super().__init__(views)
        self._views = views
        self._size = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self._size or 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._views).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: Any) -> None:
        left = len(self) if content_length is None else min(len(self), content_length)
        for view in self._views:
            end = min(len(view), left)
            for start in range(0, end, SLICE):
                # write() waits for the transport to drain once it holds more than 64 KiB.
                await writer.write(view[start : min(start + SLICE, end)])
            left -= end
            if left == 0:
                return


def _coalesced(views: list[memoryview]) -> list[memoryview]:
    """Runs of small views (many small tensors, alignment gaps) joined into buffers of up to
    `SLICE`; large views are kept as they are."""
    out: list[memoryview] = []
    run = bytearray()
    for view in views:
        if len(view) >= _SMALL:
            if run:
                out.append(memoryview(run))
                run = bytearray()
            out.append(view)
            continue
        run += view
        if len(run) >= SLICE:
            out.append(memoryview(run))
            run = bytearray()
    if run:
        out.append(memoryview(run))
    return out
