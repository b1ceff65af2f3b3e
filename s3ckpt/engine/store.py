"""`S3Store`, the engine's implementation of the `contract`, composed of its parts.

One `S3Store` exists per resolved configuration per process (`get_store`), on the private loop
of `bridge`. Its `calls.Calls` sends every request (clients, the request slots that bound the
requests in flight, the throttle, deadlines, retries); `downloads.Downloads` (reads) and
`uploads.Uploads` (writes, multipart uploads in progress) send theirs through it. The store
answers the contract by delegating to them, and does the small operations itself: HEAD,
listings, deletes and buckets.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ..config import ResolvedConfig, S3Config
from ..errors import AccessDenied, BucketNotFound, ObjectNotFound, StorageError
from . import memory
from .calls import Calls
from .contract import Listing, ObjectStore, Stats, StoredObject
from .downloads import Downloads
from .replies import etag_of, server_time, utc
from .retry import RetryPolicy
from .uploads import Uploads

__all__ = ["S3Store", "get_store"]

_DELETE_BATCH = 1000  # the most keys one DeleteObjects takes


class S3Store:
    """The `ObjectStore` over aiobotocore. Call only on the `bridge` loop. Its parts, ``calls``,
    ``downloads`` and ``uploads``, are not the contract: tests and benchmarks reach them (the
    probed `Uploads.wire_mode`, the `Calls.clients`)."""

    def __init__(self, resolved: ResolvedConfig, retry: RetryPolicy | None = None) -> None:
        self.calls = Calls(resolved, retry)
        self.downloads = Downloads(self.calls)
        self.uploads = Uploads(self.calls)
        # The contract's operations that a part owns, delegated: the part's own methods.
        self.prepare = self.calls.prepare
        self.slot = self.calls.slot
        self.get = self.downloads.get
        self.read_range = self.downloads.read_range
        self.read_frames = self.downloads.read_frames
        self.check_size = self.downloads.check_size
        self.put = self.uploads.put
        self.try_put = self.uploads.try_put
        self.upload = self.uploads.upload
        self.upload_stream = self.uploads.upload_stream
        self.list_uploads = self.uploads.list_uploads
        self.list_parts = self.uploads.list_parts
        self.abort = self.uploads.abort

    @property
    def config(self) -> S3Config:
        return self.calls.config

    @property
    def endpoint(self) -> str:
        return self.calls.endpoint

    @property
    def stats(self) -> Stats:
        return self.calls.stats

    @property
    def retry(self) -> RetryPolicy:
        return self.calls.retry

    async def head(self, bucket: str, key: str) -> StoredObject | None:
        try:
            reply = await self.calls.call("head_object", bucket, key, Key=key)
        except ObjectNotFound:
            return None
        modified = utc(reply["LastModified"]) if "LastModified" in reply else server_time(reply)
        return StoredObject(key, int(reply["ContentLength"]), modified, etag_of(reply))

    async def check_bucket(self, bucket: str) -> None:
        """Credentials scoped to a prefix may not be allowed HeadBucket; that is not an error."""
        with contextlib.suppress(AccessDenied):
            await self.calls.call("head_bucket", bucket, None)

    async def create_bucket(self, bucket: str) -> None:
        try:
            await self.check_bucket(bucket)
        except BucketNotFound:
            params: dict[str, Any] = {}
            region = self.calls.resolved.region
            if region != "us-east-1":
                params["CreateBucketConfiguration"] = {"LocationConstraint": region}
            await self.calls.call("create_bucket", bucket, None, **params)

    async def delete_bucket(self, bucket: str) -> None:
        await self.calls.call("delete_bucket", bucket, None)

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
        objects: list[StoredObject] = []
        prefixes: list[str] = []
        params: dict[str, Any] = {"Delimiter": "/"} if delimiter else {}
        if start_after is not None:
            params["StartAfter"] = start_after
        now: datetime | None = None
        while True:
            size = 1000 if limit is None else min(1000, limit - len(objects))
            reply = await self.calls.call(
                "list_objects_v2", bucket, prefix or None, Prefix=prefix, MaxKeys=size, **params
            )
            now = now or server_time(reply)
            objects += [
                StoredObject(o["Key"], int(o["Size"]), utc(o["LastModified"]))
                for o in reply.get("Contents", [])
            ]
            prefixes += [p["Prefix"] for p in reply.get("CommonPrefixes", [])]
            if (
                not reply.get("IsTruncated")
                or (limit is not None and len(objects) >= limit)
                or (end is not None and objects and objects[-1].key >= end)
            ):
                return Listing(objects, prefixes, now)
            params["ContinuationToken"] = reply["NextContinuationToken"]

    async def delete(
        self, bucket: str, keys: Sequence[str], *, deleted: Callable[[int], None] | None = None
    ) -> None:
        pending = list(dict.fromkeys(keys))
        for i in range(0, len(pending), _DELETE_BATCH):
            batch = pending[i : i + _DELETE_BATCH]
            reply = await self.calls.call(
                "delete_objects",
                bucket,
                batch[0],
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = reply.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"delete_objects in s3://{bucket} at {self.endpoint}: {len(errors)} keys not "
                    f"deleted, first s3://{bucket}/{first.get('Key')}: {first.get('Code')} "
                    f"({first.get('Message')})",
                    endpoint=self.endpoint,
                    bucket=bucket,
                    key=first.get("Key"),
                    operation="delete_objects",
                    code=first.get("Code"),
                )
            if deleted is not None:
                deleted(len(batch))


_stores: dict[ResolvedConfig, S3Store] = {}


def get_store(config: S3Config | None = None) -> ObjectStore:
    """The process's store for ``config`` (default `S3Config()`, resolved against the current
    environment); ``endpoint_url="memory://NAME"`` is the in-memory store of that name."""
    config = config or S3Config()
    if memory.is_memory(config):
        return memory.named(config)
    resolved = config.resolve()
    store = _stores.get(resolved)
    if store is None:
        store = _stores.setdefault(resolved, S3Store(resolved))
    return store


# A forked child gets a fresh bridge loop; the parent's clients are bound to the old one.
os.register_at_fork(after_in_child=_stores.clear)
