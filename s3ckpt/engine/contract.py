"""The transport contract: everything the rest of s3ckpt may ask of an object store.

The DCP adapters and the tools are written against `ObjectStore`, never against the engine's
classes; `s3ckpt.engine.store.S3Store` is the implementation (`get_store`). Every method is a
coroutine for the `bridge` loop, retries transient failures within the configured window, and
raises the errors of `s3ckpt.errors`, each naming bucket, key, endpoint and cause.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from ..config import S3Config
from ..crc32c import Checksums, StreamCheck
from ..errors import StorageError
from .retry import RetryPolicy

__all__ = [
    "Blob",
    "Listing",
    "ObjectStore",
    "Outcome",
    "Part",
    "Payload",
    "RetryPolicy",
    "Stats",
    "StoredObject",
    "Upload",
]


@dataclass(frozen=True)
class StoredObject:
    """An object as a listing or a HEAD shows it (a listing gives no ETag)."""

    key: str
    size: int
    modified: datetime
    etag: str | None = None


@dataclass(frozen=True)
class Listing:
    """Objects under a prefix, the child prefixes (with ``delimiter``), and the server's time
    (its Date header: ages never depend on this machine's clock)."""

    objects: list[StoredObject]
    prefixes: list[str]
    server_time: datetime


@dataclass(frozen=True)
class Upload:
    """A multipart upload in progress."""

    key: str
    upload_id: str
    initiated: datetime


@dataclass(frozen=True)
class Part:
    """One uploaded part of a multipart upload."""

    number: int
    size: int
    modified: datetime


@dataclass(frozen=True)
class Blob:
    """A whole object, read."""

    data: bytes
    etag: str | None


@dataclass(frozen=True)
class Outcome:
    """What a PUT did: ``error`` is None if it succeeded; ``failures`` are its failed attempts
    as the server answered each; ``retriable`` says whether the store's retry policy would
    send it again after ``error``."""

    error: StorageError | None
    failures: tuple[StorageError, ...] = ()
    retriable: bool = False


@dataclass
class Stats:
    """Counters for one process and configuration; benchmarks and the tools read them.
    ``throttled``: failed requests that were throttling answers (503, 429, ``SlowDown`` ...)."""

    requests: int = 0
    failed_requests: int = 0
    retries: int = 0
    throttled: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class Payload(Protocol):
    """The bytes of one object to upload, produced part by part."""

    @property
    def size(self) -> int: ...

    def views(self, start: int, end: int) -> list[memoryview] | None:
        """Bytes ``[start, end)`` as views of existing memory, in order, if they all are in CPU
        memory (then they are sent as they are, never assembled)."""
        ...

    def read(self, start: int, end: int, scratch: memoryview) -> memoryview:
        """Bytes ``[start, end)``: a view of existing memory, or ``scratch`` filled with them."""
        ...

    def checksum(self, start: int, end: int) -> int:
        """CRC32C of bytes ``[start, end)`` (called in a worker thread); a payload that keeps
        checksums of its pieces combines them rather than reading the bytes again."""
        ...


class ObjectStore(Protocol):
    """S3 operations under one concurrency bound (``config.max_concurrency`` requests)."""

    @property
    def config(self) -> S3Config: ...

    @property
    def endpoint(self) -> str:
        """The endpoint's name for messages (never credentials)."""
        ...

    @property
    def stats(self) -> Stats: ...

    @property
    def retry(self) -> RetryPolicy:
        """How failed requests are retried, unless a call passes its own policy."""
        ...

    def slot(self) -> AbstractAsyncContextManager[Any]:
        """One of the request slots. Hold it around `read_range` and `read_frames`, and while
        the memory that a read fills is allocated, so that reads in flight stay bounded."""
        ...

    async def prepare(self) -> None:
        """Do now, sending no request, the one-time work of the first request (clients, their
        HTTP sessions); errors are left for that request to raise."""
        ...

    async def check_bucket(self, bucket: str) -> None:
        """Raise BucketNotFound if the bucket is missing (some servers create it on a PUT)."""
        ...

    async def create_bucket(self, bucket: str) -> None:
        """Create the bucket unless it exists (tools; checkpoints never create one)."""
        ...

    async def delete_bucket(self, bucket: str) -> None: ...

    async def head(self, bucket: str, key: str) -> StoredObject | None:
        """The object's size, time and ETag; ``None`` if it does not exist."""
        ...

    async def check_size(self, bucket: str, key: str, size: int) -> None:
        """Raise (code SizeMismatch; ObjectNotFound if it is gone) unless the object holds
        ``size`` bytes: one HEAD, for a reader about to allocate what a record claims."""
        ...

    async def get(
        self,
        bucket: str,
        key: str,
        *,
        check_size: Callable[[int], None] | None = None,
        retry: RetryPolicy | None = None,
    ) -> Blob:
        """A whole (small) object. ``check_size(length)`` may refuse it by raising before its
        body is read; that error is raised as it is."""
        ...

    async def read_range(
        self,
        bucket: str,
        key: str,
        start: int,
        end: int,
        segments: Sequence[tuple[int, memoryview]],
        check: StreamCheck | None = None,
    ) -> None:
        """Stream bytes ``[start, end)`` into the views that want them: each ``(offset, view)``
        receives the bytes from absolute ``offset`` on; bytes between them are dropped. With
        ``check`` every checksummed range is verified as it streams past (ChecksumMismatch),
        and an object not of ``check.object_size`` bytes fails at once (code SizeMismatch). A
        body that breaks off resumes at the first missing byte."""
        ...

    async def read_frames(
        self,
        bucket: str,
        key: str,
        checksums: Checksums,
        frames: range,
        consume: Callable[[int, bytes], None],
    ) -> None:
        """Stream whole checksummed ranges (frames) in order; each is verified and handed to
        ``consume(number, stored)``, both in a worker thread. A broken stream resumes at the
        first frame not yet consumed."""
        ...

    async def put(
        self,
        bucket: str,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        retry: RetryPolicy | None = None,
    ) -> None:
        """One PutObject; ``if_none_match`` makes it fail (PreconditionFailed) if the key
        exists. ``retry`` replaces the store's policy."""
        ...

    async def try_put(
        self,
        bucket: str,
        key: str,
        body: bytes | bytearray | memoryview,
        *,
        if_none_match: bool,
        once: bool,
    ) -> Outcome:
        """`put` that reports instead of raising: a single attempt if ``once``, else the
        store's policy. For the commit, which judges from every failed attempt whether the
        PUT may have been applied before it sends it again."""
        ...

    async def upload(self, bucket: str, key: str, payload: Payload) -> None:
        """One PutObject up to the multipart threshold, else a multipart upload; a failed or
        cancelled multipart upload is aborted before the error propagates."""
        ...

    async def upload_stream(
        self, bucket: str, key: str, chunks: AsyncIterator[bytes | memoryview]
    ) -> None:
        """Store bytes whose total is known only at the end, holding at most
        ``max_concurrency`` parts."""
        ...

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
        """Objects under ``prefix`` (all pages, at most ``limit``); with ``delimiter`` the
        child prefixes too, one level down. ``start_after``: only keys after it; ``end``: no
        further page once a key at or past it is listed (so that several listings of one prefix
        can cover its ranges concurrently)."""
        ...

    async def list_uploads(self, bucket: str, prefix: str) -> list[Upload]:
        """Multipart uploads in progress under ``prefix``."""
        ...

    async def list_parts(self, bucket: str, upload: Upload) -> list[Part]:
        """The parts uploaded so far; none if the upload is gone (completed or aborted)."""
        ...

    async def abort(self, bucket: str, upload: Upload) -> bool:
        """Abort a multipart upload; ``False`` if it was already gone (where the server says
        so: SeaweedFS answers success)."""
        ...

    async def delete(
        self, bucket: str, keys: Sequence[str], *, deleted: Callable[[int], None] | None = None
    ) -> None:
        """Delete keys in batches, in order, calling ``deleted(count)`` after each; raises if
        the server refused any of them."""
        ...
