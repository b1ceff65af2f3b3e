"""Downloads: whole small objects, and ranged reads streamed into memory that wants them.

`Downloads` is the read side of `S3Store`, sending its requests through the store's `Calls`
(slots, retries). A ranged read that breaks off resumes at the first byte still missing; with a
`StreamCheck` it verifies every range's CRC32C as the bytes stream past and resumes at a damaged
one. Every body must arrive within a `Deadline` set by its size and ``min_read_rate`` (its head
has one of its own, `Calls.request`), or the attempt fails (code ``TooSlow``) and is retried from
where it got.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import botocore.exceptions

from ..crc32c import Checksums, StreamCheck
from ..errors import ChecksumMismatch, StorageError
from ..scatter import Scatter
from .calls import Calls, Deadline
from .contract import Blob
from .failures import checksum_mismatch, failed_get, wrong_size
from .replies import etag_of
from .retry import RetryPolicy

__all__ = ["Downloads"]

_READ_CHUNK = 1024 * 1024


def _chunks(body: Any) -> Callable[[int], Awaitable[bytes]]:
    """The body's next chunk, of at most the given size. aiohttp's ``read(n)`` joins what it has
    buffered into a new bytes; ``readany`` hands over one buffered chunk as it came, so the bytes
    are copied once, into their destination (the sizes are then aiohttp's, never past the body's
    end). Other backends read as asked."""
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    readany = getattr(content, "readany", None)
    if readany is None:
        return body.read  # type: ignore[no-any-return]
    return lambda _size: readany()


def _count(text: Any) -> int | None:
    """A byte count from a header or an error field, if it is one."""
    return int(text) if isinstance(text, str) and text.isdigit() else None


class Downloads:
    """Reads under the concurrency bound of ``calls``. Call only on the `bridge` loop."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls

    async def get(
        self,
        bucket: str,
        key: str,
        *,
        check_size: Callable[[int], None] | None = None,
        retry: RetryPolicy | None = None,
    ) -> Blob:
        """A broken body is retried; a refused one is never downloaded."""
        refused: list[Exception] = []

        async def attempt() -> Blob:
            reply = await self._calls.request("get_object", bucket, key, Key=key)
            deadline = self._deadline(bucket, key, reply["ContentLength"])
            async with reply["Body"] as body:
                if check_size is not None:
                    try:
                        check_size(reply["ContentLength"])
                    except Exception as e:  # a refusal, not a failed request: never retried
                        refused.append(e)
                        return Blob(b"", "")
                data = await deadline.wait(body.read())
            if len(data) != reply["ContentLength"]:
                ended = f"after {len(data)} of {reply['ContentLength']} bytes"
                raise self._truncated(bucket, key, ended)
            return Blob(data, etag_of(reply))

        async with self._calls.slot():
            blob = await self._calls.retrying("get_object", bucket, key, attempt, retry)
        if refused:
            raise refused[0]
        self._calls.stats.bytes_received += len(blob.data)
        return blob

    async def read_range(
        self,
        bucket: str,
        key: str,
        start: int,
        end: int,
        segments: Sequence[tuple[int, memoryview]],
        check: StreamCheck | None = None,
    ) -> None:
        """The caller holds a `slot`. Resumes at the first missing byte, or at the start of
        its checked range."""
        scatter = Scatter(start, segments)

        def resume_point() -> int:
            return check.resume_point() if check is not None else scatter.position

        async def attempt() -> None:
            if check is not None:
                scatter.rewind(check.resume_point())
            size = check.object_size if check is not None else None
            reply = await self._get_range(bucket, key, scatter.position, end, size)
            deadline = self._deadline(bucket, key, end - scatter.position)
            async with reply["Body"] as body:
                read = _chunks(body)
                while scatter.position < end:
                    chunk = await deadline.wait(read(min(_READ_CHUNK, end - scatter.position)))
                    if not chunk:
                        break
                    # Scatter first: a chunk may end verified frames before a damaged one, and a
                    # retry resumes at the damaged frame, rewriting only its bytes.
                    position = scatter.position
                    scatter.write(chunk)
                    self._calls.stats.bytes_received += len(chunk)
                    if check is not None:
                        try:
                            check.feed(position, chunk)
                        except StreamCheck.Mismatch as m:
                            raise self._mismatch(bucket, key, m) from None
            if scatter.position != end:
                ended = f"at byte {scatter.position} of bytes {start}-{end - 1}"
                raise self._truncated(bucket, key, ended)

        await self._calls.retrying("get_object", bucket, key, attempt, progress=resume_point)

    async def read_frames(
        self,
        bucket: str,
        key: str,
        checksums: Checksums,
        frames: range,
        consume: Callable[[int, bytes], None],
    ) -> None:
        """The caller holds a `slot`."""
        loop = asyncio.get_running_loop()
        following = frames.start
        starts = checksums.starts

        def check_and_consume(check: StreamCheck, number: int, stored: bytes) -> None:
            check.feed(starts[number], stored)
            consume(number, stored)

        async def attempt() -> None:
            nonlocal following
            start, end = starts[following], starts[frames.stop]
            check = checksums.check(start)
            reply = await self._get_range(bucket, key, start, end, checksums.object_size)
            deadline = self._deadline(bucket, key, end - start)
            async with reply["Body"] as body:
                while following < frames.stop:
                    chunks, wanted = [], starts[following + 1] - starts[following]
                    while wanted:
                        chunk = await deadline.wait(body.read(min(_READ_CHUNK, wanted)))
                        if not chunk:
                            break
                        self._calls.stats.bytes_received += len(chunk)
                        chunks.append(chunk)
                        wanted -= len(chunk)
                    if wanted:
                        break
                    stored = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    try:
                        await loop.run_in_executor(
                            None, check_and_consume, check, following, stored
                        )
                    except StreamCheck.Mismatch as m:
                        raise self._mismatch(bucket, key, m) from None
                    following += 1
            if following < frames.stop:
                raise self._truncated(bucket, key, f"before frame {following} was complete")

        await self._calls.retrying("get_object", bucket, key, attempt, progress=lambda: following)

    async def check_size(self, bucket: str, key: str, size: int) -> None:
        reply = await self._calls.call("head_object", bucket, key, Key=key)
        if reply["ContentLength"] != size:
            raise self._wrong_size(bucket, key, 0, size, size, reply["ContentLength"])

    async def _get_range(
        self, bucket: str, key: str, start: int, end: int, size: int | None
    ) -> dict[str, Any]:
        """GetObject of bytes ``[start, end)``, from an object of ``size`` bytes if known.

        An object shorter than the commit says would answer with fewer bytes than the read's
        destinations wait for, or 416; a retry cannot make it longer, so either fails at once,
        before any body is read.
        """
        try:
            reply: dict[str, Any] = await self._calls.request(
                "get_object", bucket, key, Key=key, Range=f"bytes={start}-{end - 1}"
            )
        except botocore.exceptions.ClientError as e:
            error = e.response.get("Error", {})
            if error.get("Code") != "InvalidRange":
                raise
            actual = _count(error.get("ActualObjectSize"))
            raise self._wrong_size(bucket, key, start, end, size, actual) from None
        stored = _count(str(reply.get("ContentRange", "")).rpartition("/")[2])  # a-b/SIZE
        if reply["ContentLength"] != end - start or (
            size is not None and stored is not None and stored != size
        ):
            await reply["Body"].aclose()
            raise self._wrong_size(bucket, key, start, end, size, stored)
        return reply

    def _wrong_size(
        self, bucket: str, key: str, start: int, end: int, size: int | None, stored: int | None
    ) -> StorageError:
        return wrong_size(self._calls.endpoint, bucket, key, start, end, size, stored)

    def _deadline(self, bucket: str, key: str, size: int) -> Deadline:
        """``size`` bytes at ``min_read_rate``, plus one ``read_timeout`` of slack: a healthy
        server may stall that long once (a busy disk, a slow start) and still be on time."""
        config = self._calls.config
        rate, seconds = config.min_read_rate, config.read_timeout
        seconds += size / rate

        def too_slow() -> StorageError:
            return self._failed_get(
                bucket,
                key,
                "TooSlow",
                f"the response was slower than min_read_rate ({rate:.0f} bytes/s): {size} bytes "
                f"not read within {seconds:.1f} s (on a link this slow, lower min_read_rate or "
                "max_concurrency)",
            )

        return Deadline(seconds, too_slow)

    def _truncated(self, bucket: str, key: str, ended: str) -> StorageError:
        """A response body that ended early: retried like a lost connection."""
        return self._failed_get(bucket, key, "Truncated", f"response ended {ended}")

    def _failed_get(self, bucket: str, key: str, code: str, what: str) -> StorageError:
        return failed_get(self._calls.endpoint, bucket, key, code, what)

    def _mismatch(self, bucket: str, key: str, m: StreamCheck.Mismatch) -> ChecksumMismatch:
        return checksum_mismatch(self._calls.endpoint, bucket, key, m)
