"""Uploads: PutObject, multipart uploads from parts or from a stream, and those in progress.

`Uploads` is the write side of `S3Store`, sending its requests through the store's `Calls`. Data
buffers are only materialised while a request holds one of the store's request slots, so bytes in
flight stay near ``part_size x max_concurrency`` whatever the checkpoint size. A multipart upload
that fails or is cancelled is aborted before the error propagates. Each part goes out as a
`bodies.Body` (views of the caller's memory, or a buffer of `partpool.PartBuffers` where it must
be assembled), with the wire checksum `wire_mode` chose for its bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..errors import ObjectNotFound, StorageError
from . import bridge, wire
from .bodies import Body
from .calls import Calls
from .contract import Outcome, Part, Payload, Upload
from .partpool import PartBuffers
from .replies import utc
from .retry import RetryPolicy

__all__ = ["Uploads"]

log = logging.getLogger(__name__)
_MAX_PARTS = 10_000


class Uploads:
    """Writes under the concurrency bound of ``calls``. Call only on the `bridge` loop."""

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        config = calls.config
        self._parts = PartBuffers(max(config.part_size, config.multipart_threshold))
        self._wire_modes: dict[str, str] = {}
        self._wire_lock = asyncio.Lock()

    async def put(
        self,
        bucket: str,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        retry: RetryPolicy | None = None,
    ) -> None:
        mode = await self.wire_mode(bucket, key)
        digest = wire.digest([body], mode)
        await self._put(bucket, key, [body], digest, if_none_match=if_none_match, retry=retry)

    async def try_put(
        self,
        bucket: str,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        if_none_match: bool,
        once: bool,
    ) -> Outcome:
        failures: list[StorageError] = []
        policy = self._calls.retry
        try:
            mode = await self.wire_mode(bucket, key)
            await self._put(
                bucket,
                key,
                [body],
                wire.digest([body], mode),
                if_none_match=if_none_match,
                retry=policy.once() if once else None,
                on_failure=failures.append,
            )
        except StorageError as e:
            return Outcome(e, tuple(failures), policy.should_retry(e, 1, 0.0))
        return Outcome(None, tuple(failures))

    async def _put(
        self,
        bucket: str,
        key: str,
        buffers: Sequence[bytes | bytearray | memoryview],
        digest: dict[str, Any],
        *,
        if_none_match: bool = False,
        retry: RetryPolicy | None = None,
        on_failure: Callable[[StorageError], None] | None = None,
    ) -> None:
        """PutObject of ``buffers`` back to back; ``digest`` carries their wire checksum, and
        ``on_failure`` sees each failed attempt (`try_put` reports them)."""
        body = Body(buffers)
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        await self._calls.call(
            "put_object",
            bucket,
            key,
            retry=retry,
            on_failure=on_failure,
            Key=key,
            Body=body,
            **digest,
            **extra,
        )
        self._calls.stats.bytes_sent += len(body)

    async def wire_mode(self, bucket: str, key: str) -> str:
        """The checksum sent with uploads to ``bucket``: configured, or probed once (auto)."""
        if self._calls.config.checksum != "auto":
            return self._calls.config.checksum
        if bucket not in self._wire_modes:
            async with self._wire_lock:
                if bucket not in self._wire_modes:
                    prefix = key.rpartition("/")[0] + "/" if "/" in key else ""

                    # A refused digest is the answer; anything else transient is retried.
                    policy = dataclasses.replace(self._calls.retry, never=wire.REFUSED)

                    async def put(probe_key: str, body: bytes, **params: Any) -> None:
                        await self._calls.call(
                            "put_object",
                            bucket,
                            probe_key,
                            retry=policy,
                            Key=probe_key,
                            Body=body,
                            **params,
                        )

                    async def delete(probe_key: str) -> None:
                        with contextlib.suppress(StorageError):
                            await self._calls.call(
                                "delete_object", bucket, probe_key, Key=probe_key
                            )

                    self._wire_modes[bucket] = await wire.probe(put, delete, prefix)
                    log.info(
                        "%s: sending %s checksums to s3://%s",
                        self._calls.endpoint,
                        self._wire_modes[bucket],
                        bucket,
                    )
        return self._wire_modes[bucket]

    async def upload(self, bucket: str, key: str, payload: Payload) -> None:
        with self._parts.held():
            if payload.size <= self._calls.config.multipart_threshold:
                async with self._calls.slot():
                    mode = await self.wire_mode(bucket, key)
                    async with self._bytes(payload, 0, payload.size, mode) as (body, digest):
                        await self._put(bucket, key, body, digest)
                return
            upload_id, retried = await self._create_upload(bucket, key)
            try:
                part_size = max(self._calls.config.part_size, math.ceil(payload.size / _MAX_PARTS))
                starts = range(0, payload.size, part_size)
                parts = await bridge.gather_or_cancel(
                    self._upload_part(bucket, key, upload_id, number, payload, start, part_size)
                    for number, start in enumerate(starts, 1)
                )
                await self._complete(bucket, key, upload_id, parts, payload.size)
            except BaseException:
                await asyncio.shield(self._abort_quietly(bucket, key, upload_id))
                raise
            finally:
                if retried:
                    await asyncio.shield(self._abort_strays(bucket, key))

    async def upload_stream(
        self, bucket: str, key: str, chunks: AsyncIterator[bytes | memoryview]
    ) -> None:
        """Chunks gather into parts of at least ``part_size``; a part's request slot is taken
        before it is cut, so at most ``max_concurrency`` parts are held and the producer waits
        for slots. A stream that ends under the multipart threshold goes up as one PutObject.
        """
        pending: list[asyncio.Future[dict[str, Any]]] = []
        part = bytearray()
        size = 0
        upload: tuple[str, bool] | None = None

        async def send(upload_id: str, body: bytearray) -> None:
            await self._calls.slot().acquire()
            number = len(pending) + 1
            pending.append(asyncio.ensure_future(self._send(bucket, key, upload_id, number, body)))

        try:
            async for chunk in chunks:
                part += chunk
                size += len(chunk)
                if len(part) < self._calls.config.part_size or (
                    upload is None and len(part) <= self._calls.config.multipart_threshold
                ):
                    continue
                upload = upload or await self._create_upload(bucket, key)
                await send(upload[0], part)
                part = bytearray()
            if upload is None:
                async with self._calls.slot():
                    await self.put(bucket, key, part)
                return
            if part:
                await send(upload[0], part)
            parts = await bridge.gather_or_cancel(pending)
            await self._complete(bucket, key, upload[0], parts, size)
        except BaseException:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if upload is not None:
                await asyncio.shield(self._abort_quietly(bucket, key, upload[0]))
            raise
        finally:
            if upload is not None and upload[1]:
                await asyncio.shield(self._abort_strays(bucket, key))

    async def _send(
        self, bucket: str, key: str, upload_id: str, number: int, body: bytearray
    ) -> dict[str, Any]:
        """One part of `upload_stream`; the caller took its slot, which is released here."""
        try:
            mode = await self.wire_mode(bucket, key)
            loop = asyncio.get_running_loop()
            digest = await loop.run_in_executor(None, wire.digest, [body], mode)
            return await self._put_part(bucket, key, upload_id, number, [body], digest)
        finally:
            self._calls.slot().release()

    async def _put_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        number: int,
        buffers: Sequence[bytes | bytearray | memoryview],
        digest: dict[str, Any],
    ) -> dict[str, Any]:
        """UploadPart of ``buffers`` back to back, and the part's entry for
        CompleteMultipartUpload."""
        body = Body(buffers)
        reply = await self._calls.call(
            "upload_part",
            bucket,
            key,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            **digest,
        )
        self._calls.stats.bytes_sent += len(body)
        part = {"PartNumber": number, "ETag": reply["ETag"]}
        if "ChecksumCRC32C" in digest:
            part["ChecksumCRC32C"] = digest["ChecksumCRC32C"]
        return part

    @contextlib.asynccontextmanager
    async def _bytes(
        self, payload: Payload, start: int, end: int, mode: str
    ) -> AsyncIterator[tuple[Sequence[memoryview], dict[str, Any]]]:
        """A part's bytes (as buffers sent back to back) and checksum; a buffer is borrowed only
        if the bytes must be assembled (they are not all in CPU memory)."""
        views = payload.views(start, end)
        if views is not None:

            def sign() -> dict[str, Any]:
                if mode == "crc32c":
                    return wire.crc32c_digest(payload.checksum(start, end))
                return wire.digest(views, mode)

            yield views, await asyncio.get_running_loop().run_in_executor(None, sign)
            return
        with self._parts.borrow(end - start) as scratch:
            yield await _produce(payload, start, end, scratch, mode)

    async def _complete(
        self, bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]], size: int
    ) -> None:
        """CompleteMultipartUpload. If a retry finds the upload gone, an earlier attempt may have
        completed it with its answer lost: the object then exists with the expected size."""
        try:
            await self._calls.call(
                "complete_multipart_upload",
                bucket,
                key,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except ObjectNotFound:
            if await self._stored_size(bucket, key) != size:
                raise

    async def _stored_size(self, bucket: str, key: str) -> int | None:
        """The object's size by a HEAD; None if it does not exist."""
        try:
            reply = await self._calls.call("head_object", bucket, key, Key=key)
        except ObjectNotFound:
            return None
        return int(reply["ContentLength"])

    async def _create_upload(self, bucket: str, key: str) -> tuple[str, bool]:
        """CreateMultipartUpload; also says whether it was sent more than once.

        If cancelled while the request is in flight, it waits for the answer and aborts the
        upload the server created. A retried create may have created an upload whose answer was
        lost: the caller then aborts the strays under the key (`_abort_strays`).
        """
        mode = await self.wire_mode(bucket, key)
        sent = 0

        async def attempt() -> Any:
            nonlocal sent
            sent += 1
            extra = {"ChecksumAlgorithm": "CRC32C"} if mode == "crc32c" else {}
            return await self._calls.request(
                "create_multipart_upload", bucket, key, Key=key, **extra
            )

        create = asyncio.ensure_future(
            self._calls.retrying("create_multipart_upload", bucket, key, attempt)
        )
        try:
            created = await asyncio.shield(create)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._abort_quietly(bucket, key, (await create)["UploadId"])
            raise
        return str(created["UploadId"]), sent > 1

    async def _abort_strays(self, bucket: str, key: str) -> None:
        """Abort every upload left under ``key`` (keys are unique per save, so all are ours)."""
        with contextlib.suppress(StorageError):
            for upload in await self.list_uploads(bucket, key):
                if upload.key == key:
                    await self._abort_quietly(bucket, key, upload.upload_id)

    async def _upload_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        number: int,
        payload: Payload,
        start: int,
        size: int,
    ) -> dict[str, Any]:
        end = min(start + size, payload.size)
        mode = await self.wire_mode(bucket, key)
        async with (
            self._calls.slot(),
            self._bytes(payload, start, end, mode) as (body, digest),
        ):
            return await self._put_part(bucket, key, upload_id, number, body, digest)

    # The uploads in progress, as removals see them; `_abort_strays` looks for its own here.

    async def list_uploads(self, bucket: str, prefix: str) -> list[Upload]:
        found: list[Upload] = []
        markers: dict[str, Any] = {}
        while True:
            reply = await self._calls.call(
                "list_multipart_uploads", bucket, prefix, Prefix=prefix, **markers
            )
            found += [
                Upload(u["Key"], u["UploadId"], utc(u["Initiated"]))
                for u in reply.get("Uploads", [])
            ]
            if not reply.get("IsTruncated"):
                return found
            markers = {
                "KeyMarker": reply["NextKeyMarker"],
                "UploadIdMarker": reply["NextUploadIdMarker"],
            }

    async def list_parts(self, bucket: str, upload: Upload) -> list[Part]:
        parts: list[Part] = []
        marker: dict[str, Any] = {}
        while True:
            try:
                reply = await self._calls.call(
                    "list_parts",
                    bucket,
                    upload.key,
                    Key=upload.key,
                    UploadId=upload.upload_id,
                    **marker,
                )
            except ObjectNotFound:  # completed or aborted meanwhile
                return []
            parts += [
                Part(int(p["PartNumber"]), int(p["Size"]), utc(p["LastModified"]))
                for p in reply.get("Parts", [])
            ]
            if not reply.get("IsTruncated"):
                return parts
            marker = {"PartNumberMarker": reply["NextPartNumberMarker"]}

    async def abort(self, bucket: str, upload: Upload) -> bool:
        try:
            await self._calls.call(
                "abort_multipart_upload",
                bucket,
                upload.key,
                Key=upload.key,
                UploadId=upload.upload_id,
            )
        except ObjectNotFound:  # completed or aborted since it was listed
            return False
        return True

    async def _abort_quietly(self, bucket: str, key: str, upload_id: str) -> None:
        """Abort an upload of ours that failed; failures are swallowed (gc finds what is left)."""
        with contextlib.suppress(StorageError):
            await self._calls.call(
                "abort_multipart_upload", bucket, key, Key=key, UploadId=upload_id
            )


async def _produce(
    payload: Payload, start: int, end: int, scratch: memoryview, mode: str
) -> tuple[Sequence[memoryview], dict[str, Any]]:
    """A part's bytes and their wire checksum, in a worker thread: it may copy megabytes (or
    come from an accelerator) and hash them."""

    def produce() -> tuple[Sequence[memoryview], dict[str, Any]]:
        body = [payload.read(start, end, scratch)]
        return body, wire.digest(body, mode)

    return await asyncio.get_running_loop().run_in_executor(None, produce)
