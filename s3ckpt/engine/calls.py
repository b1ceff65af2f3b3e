"""Requests to the object store: clients, the concurrency bound, retries, and small operations.

`Requests` is the base of the transfer engine (`s3ckpt.engine.store.Transfer`): every S3 call goes
through `Requests._call`, which maps errors (one place: `s3ckpt.engine.clients.map_error`), counts, and
retries as `s3ckpt.engine.retry` says. The small bucket operations that tools, the commit and garbage
collection need live here; moving data lives in `downloads` and `transfer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import ResolvedConfig
from ..errors import AccessDenied, BucketNotFound, ObjectNotFound, StorageError
from .clients import ClientHolder, map_error
from .retry import RetryPolicy, is_repeat_limited, is_transient

__all__ = ["Requests", "TransferStats"]

T = TypeVar("T")
log = logging.getLogger("s3ckpt.engine.store")


@dataclass
class TransferStats:
    """Counters for one process and configuration; benchmarks and the tools read them."""

    requests: int = 0
    failed_requests: int = 0
    retries: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class Requests:
    """S3 calls under one concurrency bound, for one resolved configuration, on the bridge loop."""

    def __init__(self, resolved: ResolvedConfig, retry: RetryPolicy | None = None) -> None:
        self.resolved = resolved
        self.config = resolved.config
        self.stats = TransferStats()
        self.retry = retry or RetryPolicy(self.config.max_attempts, self.config.retry_timeout)
        self._clients = [ClientHolder(resolved, url) for url in resolved.endpoint_urls or [None]]
        self._turn = itertools.count()
        self._slots: asyncio.Semaphore | None = None
        self._down_until = 0.0  # loop time until which the store counts as down (`_retrying`)

    @property
    def endpoint(self) -> str:
        return self.resolved.endpoint_name

    def _semaphore(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
        return self._slots

    async def _call(
        self,
        operation: str,
        bucket: str,
        key: str | None,
        *,
        retry: RetryPolicy | None = None,
        on_failure: Callable[[StorageError], None] | None = None,
        **params: Any,
    ) -> Any:
        """One S3 operation, retried as `s3ckpt.engine.retry` says (or as ``retry`` says);
        ``on_failure`` sees every failed attempt (the commit asks whether any may have landed)."""
        policy = retry or self.retry

        async def attempt() -> Any:
            client = await self._client()
            return await getattr(client, operation)(Bucket=bucket, **params)

        return await self._retrying(operation, bucket, key, attempt, policy, on_failure=on_failure)

    async def _client(self) -> Any:
        """The next endpoint's client: requests (and retries) rotate over all endpoints."""
        return await self._clients[next(self._turn) % len(self._clients)].get()

    async def _retrying(
        self,
        operation: str,
        bucket: str,
        key: str | None,
        attempt: Callable[[], Awaitable[T]],
        policy: RetryPolicy | None = None,
        progress: Callable[[], int] | None = None,
        on_failure: Callable[[StorageError], None] | None = None,
    ) -> T:
        """Run ``attempt`` until it succeeds or ``policy`` gives up. ``progress`` is a resumable
        read's position: an attempt that moved it restarts the window, the backoff and the count
        (not the repeats: a persistent trickle must still fail), since what is left is in effect
        a new, smaller request.

        A request that failed transiently until its window closed found the store down: for the
        next window, until a request succeeds, requests get a single attempt, so that the
        cleanup of a failed save (aborts, deletes) and a save tried again at once fail fast
        instead of waiting out one more window each. Giving up on ``max_attempts`` (a cap the
        caller chose, such as a single attempt) says nothing about the store.
        """
        policy = policy or self.retry
        clock = asyncio.get_running_loop().time
        known_down = clock() < self._down_until
        if known_down:
            policy = dataclasses.replace(policy, max_attempts=1)
        started, number, repeats = clock(), 0, 0
        while True:
            number += 1
            reached = progress() if progress is not None else 0
            self.stats.requests += 1
            try:
                result = await attempt()
            except Exception as e:
                self.stats.failed_requests += 1
                error = map_error(
                    e, endpoint=self.endpoint, bucket=bucket, key=key, operation=operation
                )
                if on_failure is not None:
                    on_failure(error)
                if progress is not None and progress() != reached:
                    started, number = clock(), 1
                repeats += is_repeat_limited(error)
                elapsed = clock() - started
                if not policy.should_retry(error, number, elapsed, repeats):
                    # Not for a damaged or slow answer: the store is up.
                    down = is_transient(error) and not is_repeat_limited(error)
                    if down and not known_down and policy.window_closed(elapsed):
                        self._down_until = clock() + policy.deadline
                    raise error from e
                delay = policy.delay(number, elapsed)
                # A window holds tens of attempts: the first failure says at WARNING that (and for
                # how long) s3ckpt keeps trying; the rest go to INFO, not to bury other output.
                log.log(
                    logging.WARNING if number == 1 else logging.INFO,
                    "%s; attempt %d failed, retrying in %.2f s (for up to %g s)",
                    error,
                    number,
                    delay,
                    policy.deadline,
                )
                self.stats.retries += 1
                await asyncio.sleep(delay)
            else:
                self._down_until = 0.0
                return result

    def slot(self) -> asyncio.Semaphore:
        """One of the ``max_concurrency`` request slots; hold it around `get_scattered`."""
        return self._semaphore()

    async def head(self, bucket: str, key: str) -> dict[str, Any] | None:
        """The object's headers, or ``None`` if it does not exist."""
        try:
            reply: dict[str, Any] = await self._call("head_object", bucket, key, Key=key)
        except ObjectNotFound:
            return None
        return reply

    async def check_bucket(self, bucket: str) -> None:
        """Raise BucketNotFound if the bucket is missing (some servers would create it on PUT).

        Credentials scoped to a prefix may not be allowed HeadBucket; that is not an error.
        """
        with contextlib.suppress(AccessDenied):
            await self._call("head_bucket", bucket, None)

    async def create_bucket(self, bucket: str) -> None:
        """Create the bucket unless it exists (tools and the demo; checkpoints never create one)."""
        try:
            await self.check_bucket(bucket)
        except BucketNotFound:
            params = {}
            if self.resolved.region != "us-east-1":
                params["CreateBucketConfiguration"] = {"LocationConstraint": self.resolved.region}
            await self._call("create_bucket", bucket, None, **params)

    async def list_objects(
        self, bucket: str, prefix: str, *, limit: int | None = None
    ) -> list[tuple[str, int]]:
        """``(key, size)`` of objects under ``prefix``, paginated; at most ``limit`` of them."""
        found: list[tuple[str, int]] = []
        token: dict[str, str] = {}
        while True:
            page_size = 1000 if limit is None else min(1000, limit - len(found))
            reply = await self._call(
                "list_objects_v2", bucket, prefix or None, Prefix=prefix, MaxKeys=page_size, **token
            )
            found.extend((o["Key"], int(o["Size"])) for o in reply.get("Contents", []))
            if not reply.get("IsTruncated") or (limit is not None and len(found) >= limit):
                return found
            token = {"ContinuationToken": reply["NextContinuationToken"]}

    async def delete(self, bucket: str, keys: Iterable[str]) -> None:
        """Delete keys in batches of 1000; raises if the server refused any of them."""
        pending = sorted(set(keys))
        for i in range(0, len(pending), 1000):
            batch = pending[i : i + 1000]
            reply = await self._call(
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
                    status=None,
                )

    async def list_uploads(self, bucket: str, prefix: str) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of multipart uploads in progress under ``prefix``."""
        found: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            reply = await self._call(
                "list_multipart_uploads", bucket, prefix, Prefix=prefix, **markers
            )
            found.extend((u["Key"], u["UploadId"]) for u in reply.get("Uploads", []))
            if not reply.get("IsTruncated"):
                return found
            markers = {
                "KeyMarker": reply["NextKeyMarker"],
                "UploadIdMarker": reply["NextUploadIdMarker"],
            }

    async def abort(self, bucket: str, key: str, upload_id: str) -> None:
        """Abort a multipart upload; failures are swallowed (gc finds what is left)."""
        with contextlib.suppress(StorageError):
            await self._call("abort_multipart_upload", bucket, key, Key=key, UploadId=upload_id)
