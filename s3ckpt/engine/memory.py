"""`MemoryStore`: the `contract` held in this process's memory, with no HTTP and no retries.

For tests that exercise s3ckpt's logic rather than the wire (the conformance suite in
``tests/conformance`` holds it to what moto and SeaweedFS do), and for wrapping or replacing
the store in a program of one's own. ``S3Config(endpoint_url="memory://NAME")`` resolves to the
process's store of that name (`named`), so anything that takes a config takes one; a store
lives in one process: a forked or spawned child starts with none.

Semantics are S3's where s3ckpt relies on them: whole-object visibility (an upload appears
complete or not at all; one in progress is listed by `list_uploads`), ``If-None-Match: *``,
listings in key order with their common prefixes, and a server clock (``clock``, settable so
that tests can age objects instead of sleeping).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..config import S3Config
from ..crc32c import Checksums, StreamCheck
from ..errors import (
    BucketNotFound,
    ChecksumMismatch,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from ..scatter import Scatter
from .contract import Blob, Listing, Outcome, Part, Payload, Stats, StoredObject, Upload
from .failures import checksum_mismatch, wrong_size
from .retry import RetryPolicy

__all__ = ["MemoryStore", "is_memory", "named"]

_SCHEME = "memory://"


@dataclass(frozen=True)
class _Object:
    data: bytes
    etag: str
    modified: datetime


@dataclass
class _Upload:
    upload: Upload
    parts: dict[int, tuple[bytes, datetime]] = field(default_factory=dict)


class MemoryStore:
    """An `ObjectStore` whose buckets are dicts. Call on one event loop at a time (the
    `bridge` loop, as every store); the `objects` and `put_object` backdoors are for tests."""

    def __init__(
        self,
        config: S3Config | None = None,
        *,
        name: str = "memory",
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._config = config or S3Config(endpoint_url=_SCHEME + name)
        self._name = name
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self._stats = Stats()
        self._retry = RetryPolicy(self._config.max_attempts, self._config.retry_timeout)
        self._buckets: dict[str, dict[str, _Object]] = {}
        self._uploads: dict[str, dict[str, _Upload]] = {}
        self._ids = itertools.count(1)
        self._slots: asyncio.Semaphore | None = None

    def with_config(self, config: S3Config) -> MemoryStore:
        """A store over the same buckets whose `config` (part sizes, concurrency ...) is
        ``config``: as two configs of one endpoint are two clients of one server."""
        other = MemoryStore(config, name=self._name, clock=self.clock)
        other._buckets, other._uploads, other._ids = self._buckets, self._uploads, self._ids
        return other

    @property
    def config(self) -> S3Config:
        return self._config

    @property
    def endpoint(self) -> str:
        return _SCHEME + self._name

    @property
    def stats(self) -> Stats:
        return self._stats

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

    def slot(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._config.max_concurrency)
        return self._slots

    # The backdoor: what a test would do with a boto3 client, synchronously.

    def buckets(self) -> list[str]:
        return sorted(self._buckets)

    def objects(self, bucket: str) -> dict[str, bytes]:
        """The bucket's objects by key (a copy)."""
        return {key: o.data for key, o in self._bucket(bucket, "list_objects_v2", None).items()}

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        self._store(bucket, key, bytes(data))

    def delete_object(self, bucket: str, key: str) -> None:
        self._bucket(bucket, "delete_object", key).pop(key, None)

    # The contract.

    async def prepare(self) -> None:
        """Nothing to make ahead: no client, no connection."""

    async def check_bucket(self, bucket: str) -> None:
        self._bucket(bucket, "head_bucket", None)

    async def create_bucket(self, bucket: str) -> None:
        self._buckets.setdefault(bucket, {})
        self._uploads.setdefault(bucket, {})

    async def delete_bucket(self, bucket: str) -> None:
        if self._bucket(bucket, "delete_bucket", None):
            raise self._error(StorageError, "delete_bucket", bucket, None, "BucketNotEmpty", 409)
        del self._buckets[bucket], self._uploads[bucket]

    async def head(self, bucket: str, key: str) -> StoredObject | None:
        self._count()
        found = self._buckets.get(bucket, {}).get(key)
        return (
            None
            if found is None
            else StoredObject(key, len(found.data), found.modified, found.etag)
        )

    async def check_size(self, bucket: str, key: str, size: int) -> None:
        found = self._object(bucket, key, "head_object")
        if len(found.data) != size:
            raise self._size_mismatch(bucket, key, 0, size, size, len(found.data))

    async def get(
        self,
        bucket: str,
        key: str,
        *,
        check_size: Callable[[int], None] | None = None,
        retry: RetryPolicy | None = None,
    ) -> Blob:
        async with self.slot():
            found = self._object(bucket, key, "get_object")
            if check_size is not None:
                check_size(len(found.data))
            self._stats.bytes_received += len(found.data)
            return Blob(found.data, found.etag)

    async def read_range(
        self,
        bucket: str,
        key: str,
        start: int,
        end: int,
        segments: Sequence[tuple[int, memoryview]],
        check: StreamCheck | None = None,
    ) -> None:
        data = self._ranged(bucket, key, start, end, check.object_size if check else None)
        scatter = Scatter(start, segments)
        scatter.write(data)
        self._stats.bytes_received += len(data)
        if check is not None:
            try:
                check.feed(start, data)
            except StreamCheck.Mismatch as m:
                raise self._mismatch(bucket, key, m) from None

    async def read_frames(
        self,
        bucket: str,
        key: str,
        checksums: Checksums,
        frames: range,
        consume: Callable[[int, bytes], None],
    ) -> None:
        starts = checksums.starts
        start, end = starts[frames.start], starts[frames.stop]
        data = self._ranged(bucket, key, start, end, checksums.object_size)
        self._stats.bytes_received += len(data)
        check = checksums.check(start)

        def check_and_consume() -> None:  # in a worker thread, as the contract says
            for number in frames:
                stored = data[starts[number] - start : starts[number + 1] - start]
                check.feed(starts[number], stored)
                consume(number, stored)

        try:
            await asyncio.get_running_loop().run_in_executor(None, check_and_consume)
        except StreamCheck.Mismatch as m:
            raise self._mismatch(bucket, key, m) from None

    async def put(
        self,
        bucket: str,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        retry: RetryPolicy | None = None,
    ) -> None:
        if if_none_match and key in self._bucket(bucket, "put_object", key):
            raise self._error(
                PreconditionFailed, "put_object", bucket, key, "PreconditionFailed", 412
            )
        self._store(bucket, key, bytes(body))

    async def try_put(
        self,
        bucket: str,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        if_none_match: bool,
        once: bool,
    ) -> Outcome:
        try:
            await self.put(bucket, key, body, if_none_match=if_none_match)
        except StorageError as e:
            return Outcome(e, (e,))
        return Outcome(None)

    async def upload(self, bucket: str, key: str, payload: Payload) -> None:
        if payload.size <= self._config.multipart_threshold:
            async with self.slot():
                await self.put(bucket, key, _read(payload, 0, payload.size))
            return

        async def parts() -> AsyncIterator[bytes]:
            for start in range(0, payload.size, self._config.part_size):
                yield _read(payload, start, min(start + self._config.part_size, payload.size))

        await self._multipart(bucket, key, parts())

    async def upload_stream(
        self, bucket: str, key: str, chunks: AsyncIterator[bytes | memoryview]
    ) -> None:
        await self._multipart(bucket, key, (bytes(chunk) async for chunk in chunks))

    async def list_objects(
        self,
        bucket: str,
        prefix: str,
        *,
        delimiter: bool = False,
        limit: int | None = None,
        start_after: str | None = None,
        end: str | None = None,
    ) -> Listing:
        """One page holds everything: a listing stops at the first key at or past ``end``."""
        self._count()
        keys = sorted(self._bucket(bucket, "list_objects_v2", prefix or None))
        found = self._buckets[bucket]
        objects: list[StoredObject] = []
        prefixes: list[str] = []
        first = bisect.bisect_left(keys, prefix)
        if start_after is not None:
            first = max(first, bisect.bisect_right(keys, start_after))
        for key in itertools.islice(keys, first, None):
            if not key.startswith(prefix) or (limit is not None and len(objects) >= limit):
                break
            if end is not None and objects and objects[-1].key >= end:
                break
            child, slash, _ = key[len(prefix) :].partition("/")
            if delimiter and slash:
                if not prefixes or prefixes[-1] != prefix + child + "/":
                    prefixes.append(prefix + child + "/")
                continue
            objects.append(StoredObject(key, len(found[key].data), found[key].modified))
        return Listing(objects, prefixes, self.clock())

    async def list_uploads(self, bucket: str, prefix: str) -> list[Upload]:
        self._count()
        uploads = self._bucket_uploads(bucket).values()
        return sorted(
            (u.upload for u in uploads if u.upload.key.startswith(prefix)),
            key=lambda u: (u.key, u.initiated),
        )

    async def list_parts(self, bucket: str, upload: Upload) -> list[Part]:
        self._count()
        found = self._bucket_uploads(bucket).get(upload.upload_id)
        if found is None:
            return []
        return [Part(n, len(data), at) for n, (data, at) in sorted(found.parts.items())]

    async def abort(self, bucket: str, upload: Upload) -> bool:
        self._count()
        return self._bucket_uploads(bucket).pop(upload.upload_id, None) is not None

    async def delete(
        self, bucket: str, keys: Sequence[str], *, deleted: Callable[[int], None] | None = None
    ) -> None:
        objects = self._bucket(bucket, "delete_objects", None)
        pending = list(dict.fromkeys(keys))
        for i in range(0, len(pending), 1000):  # the most keys one DeleteObjects takes
            self._count()
            batch = pending[i : i + 1000]
            for key in batch:
                objects.pop(key, None)
            if deleted is not None:
                deleted(len(batch))

    # Helpers.

    def start_upload(self, bucket: str, key: str) -> Upload:
        """A multipart upload in progress, as a crashed writer leaves one (tests)."""
        uploads = self._bucket_uploads(bucket)
        upload = Upload(key, f"upload-{next(self._ids)}", self.clock())
        uploads[upload.upload_id] = _Upload(upload)
        return upload

    def upload_part(self, bucket: str, upload: Upload, number: int, data: bytes) -> None:
        self._bucket_uploads(bucket)[upload.upload_id].parts[number] = (bytes(data), self.clock())

    async def _multipart(self, bucket: str, key: str, parts: AsyncIterator[bytes]) -> None:
        """Parts are held by an upload in progress, visible to `list_uploads`, until the whole
        object appears at once; a failure or a cancellation aborts it."""
        upload = self.start_upload(bucket, key)
        try:
            number = 0
            async for data in parts:
                number += 1
                async with self.slot():
                    self._count(sent=len(data))
                    self.upload_part(bucket, upload, number, data)
                await asyncio.sleep(0)  # other requests run between parts, as on a wire
            held = self._bucket_uploads(bucket).pop(upload.upload_id, None)
            if held is None:
                raise self._error(
                    ObjectNotFound, "complete_multipart_upload", bucket, key, "NoSuchUpload", 404
                )
            self._store(bucket, key, b"".join(data for _, (data, _) in sorted(held.parts.items())))
        except BaseException:
            self._bucket_uploads(bucket).pop(upload.upload_id, None)
            raise

    def _store(self, bucket: str, key: str, data: bytes) -> None:
        objects = self._bucket(bucket, "put_object", key)
        self._count(sent=len(data))
        objects[key] = _Object(data, f'"{hashlib.md5(data).hexdigest()}"', self.clock())

    def _count(self, sent: int = 0) -> None:
        self._stats.requests += 1
        self._stats.bytes_sent += sent

    def _bucket(self, bucket: str, operation: str, key: str | None) -> dict[str, _Object]:
        objects = self._buckets.get(bucket)
        if objects is None:
            raise BucketNotFound(
                f"bucket {bucket!r} does not exist at {self.endpoint} ({operation})",
                endpoint=self.endpoint,
                bucket=bucket,
                key=key,
                operation=operation,
                code="NoSuchBucket",
                status=404,
            )
        return objects

    def _bucket_uploads(self, bucket: str) -> dict[str, _Upload]:
        self._bucket(bucket, "list_multipart_uploads", None)
        return self._uploads[bucket]

    def _object(self, bucket: str, key: str, operation: str) -> _Object:
        self._count()
        found = self._bucket(bucket, operation, key).get(key)
        if found is None:
            raise self._error(ObjectNotFound, operation, bucket, key, "NoSuchKey", 404)
        return found

    def _ranged(self, bucket: str, key: str, start: int, end: int, size: int | None) -> bytes:
        data = self._object(bucket, key, "get_object").data
        if end > len(data) or (size is not None and len(data) != size):
            raise self._size_mismatch(bucket, key, start, end, size, len(data))
        return data[start:end]

    def _error(
        self,
        kind: type[StorageError],
        operation: str,
        bucket: str,
        key: str | None,
        code: str,
        status: int | None,
    ) -> StorageError:
        where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        return kind(
            f"{operation} {where} at {self.endpoint} failed: {code}",
            endpoint=self.endpoint,
            bucket=bucket,
            key=key,
            operation=operation,
            code=code,
            status=status,
        )

    def _size_mismatch(
        self, bucket: str, key: str, start: int, end: int, size: int | None, stored: int
    ) -> StorageError:
        return wrong_size(self.endpoint, bucket, key, start, end, size, stored)

    def _mismatch(self, bucket: str, key: str, m: StreamCheck.Mismatch) -> ChecksumMismatch:
        return checksum_mismatch(self.endpoint, bucket, key, m)


def _read(payload: Payload, start: int, end: int) -> bytes:
    views = payload.views(start, end)
    if views is not None:
        return b"".join(views)
    return bytes(payload.read(start, end, memoryview(bytearray(end - start))))


_named: dict[str, MemoryStore] = {}
_configured: dict[S3Config, MemoryStore] = {}


def is_memory(config: S3Config) -> bool:
    """Whether ``config`` names a `MemoryStore` (``endpoint_url="memory://NAME"``)."""
    url = config.endpoint_url
    return isinstance(url, str) and url.startswith(_SCHEME)


def named(config: S3Config) -> MemoryStore:
    """The process's `MemoryStore` that ``config``'s ``memory://NAME`` endpoint names."""
    assert isinstance(config.endpoint_url, str)
    store = _configured.get(config)
    if store is None:
        name = config.endpoint_url[len(_SCHEME) :].rstrip("/") or "memory"
        first = _named.setdefault(name, MemoryStore(config, name=name))
        store = _configured.setdefault(config, first.with_config(config))
    return store


def _forget() -> None:
    _named.clear()
    _configured.clear()


os.register_at_fork(after_in_child=_forget)
