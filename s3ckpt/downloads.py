"""Downloads: whole small objects, and ranged reads streamed into memory that wants them.

`Downloads` sits between `Requests` (calls, retries) and `Transfer` (which adds uploads). A
ranged read that breaks off resumes at the first byte still missing; with a `FrameCheck` it
verifies every frame's CRC32C as the bytes stream past and resumes at a damaged frame.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from .buffers import Scatter
from .errors import ChecksumMismatch, StorageError
from .frames import FrameCheck, FrameTable
from .requests import Requests

__all__ = ["Downloads"]

_READ_CHUNK = 1024 * 1024


class Downloads(Requests):
    """Reads under the concurrency bound of `Requests`. Call only on the `bridge` loop."""

    async def get(self, bucket: str, key: str) -> bytes:
        """A whole object (for small ones such as ``.metadata``); a broken body is retried."""

        async def attempt() -> bytes:
            reply = await (await self._client()).get_object(Bucket=bucket, Key=key)
            async with reply["Body"] as body:
                data: bytes = await body.read()
            if len(data) != reply["ContentLength"]:
                ended = f"after {len(data)} of {reply['ContentLength']} bytes"
                raise self._truncated(bucket, key, ended)
            return data

        async with self._semaphore():
            data = await self._retrying("get_object", bucket, key, attempt)
        self.stats.bytes_received += len(data)
        return data

    async def get_scattered(
        self,
        bucket: str,
        key: str,
        start: int,
        end: int,
        segments: Sequence[tuple[int, memoryview]],
        check: FrameCheck | None = None,
    ) -> None:
        """Stream bytes ``[start, end)`` of an object into the views that want them.

        Each segment ``(offset, view)`` receives the bytes from absolute ``offset`` on; bytes
        between segments are read and dropped. With ``check`` every frame's checksum is verified
        (a mismatch raises ChecksumMismatch). The caller holds a `slot`. A body that breaks off
        is retried from the first missing byte (from the start of its frame when checked).
        """
        scatter = Scatter(start, segments)

        async def attempt() -> None:
            if check is not None:
                scatter.rewind(check.resume_point())
            reply = await (await self._client()).get_object(
                Bucket=bucket, Key=key, Range=f"bytes={scatter.position}-{end - 1}"
            )
            async with reply["Body"] as body:
                while scatter.position < end:
                    chunk = await body.read(min(_READ_CHUNK, end - scatter.position))
                    if not chunk:
                        break
                    # Scatter first: a chunk may end verified frames before a damaged one, and a
                    # retry resumes at the damaged frame, rewriting only its bytes.
                    position = scatter.position
                    scatter.write(chunk)
                    self.stats.bytes_received += len(chunk)
                    if check is not None:
                        try:
                            check.feed(position, chunk)
                        except FrameCheck.Mismatch as m:
                            raise self._mismatch(bucket, key, m) from None
            if scatter.position != end:
                ended = f"at byte {scatter.position} of bytes {start}-{end - 1}"
                raise self._truncated(bucket, key, ended)

        await self._retrying("get_object", bucket, key, attempt)

    async def get_frames(
        self,
        bucket: str,
        key: str,
        table: FrameTable,
        frames: range,
        consume: Callable[[int, bytes], None],
    ) -> None:
        """Stream whole stored frames in order; each is checked against its CRC32C and handed to
        ``consume(number, stored)``, both in a worker thread. The caller holds a `slot`; a broken
        or damaged stream is retried from the first frame not yet consumed."""
        loop = asyncio.get_running_loop()
        following = frames.start

        def check_and_consume(check: FrameCheck, number: int, stored: bytes) -> None:
            check.feed(table.starts[number], stored)
            consume(number, stored)

        async def attempt() -> None:
            nonlocal following
            start, end = table.starts[following], table.starts[frames.stop]
            check = FrameCheck(table, start)
            reply = await (await self._client()).get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"
            )
            async with reply["Body"] as body:
                while following < frames.stop:
                    chunks, wanted = [], table.sizes[following]
                    while wanted:
                        chunk = await body.read(min(_READ_CHUNK, wanted))
                        if not chunk:
                            break
                        self.stats.bytes_received += len(chunk)
                        chunks.append(chunk)
                        wanted -= len(chunk)
                    if wanted:
                        break
                    stored = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    try:
                        await loop.run_in_executor(
                            None, check_and_consume, check, following, stored
                        )
                    except FrameCheck.Mismatch as m:
                        raise self._mismatch(bucket, key, m) from None
                    following += 1
            if following < frames.stop:
                raise self._truncated(bucket, key, f"before frame {following} was complete")

        await self._retrying("get_object", bucket, key, attempt)

    def _truncated(self, bucket: str, key: str, ended: str) -> StorageError:
        """A response body that ended early: retried like a lost connection."""
        message = f"get_object s3://{bucket}/{key} at {self.endpoint}: response ended {ended}"
        context = {"endpoint": self.endpoint, "bucket": bucket, "key": key}
        return StorageError(
            message, operation="get_object", code="Truncated", status=None, **context
        )

    def _mismatch(self, bucket: str, key: str, m: FrameCheck.Mismatch) -> ChecksumMismatch:
        return ChecksumMismatch(
            f"s3://{bucket}/{key} bytes {m.start}-{m.end - 1} at {self.endpoint}: CRC32C "
            f"{m.actual:#010x}, the commit recorded {m.expected:#010x}; the stored object is "
            "damaged (or was damaged in transit)",
            endpoint=self.endpoint,
            bucket=bucket,
            key=key,
            operation="get_object",
            code="ChecksumMismatch",
            status=None,
            start=m.start,
            end=m.end,
            expected=m.expected,
            actual=m.actual,
        )
