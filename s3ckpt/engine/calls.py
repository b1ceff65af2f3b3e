"""Calls to the object store: clients, the concurrency bound, retries, and small operations.

`Calls` is the base of the engine's `S3Store`: every S3 call goes through `Calls._call`, which
maps errors (one place: `boto.map_error`), counts, and retries as `retry` says. Every attempt
of every call is one `Calls._request`, which must be answered within its `Deadline`, and is let
through by the store's `throttle.Throttle`, which sends less once the store throttles. The small
operations of the `contract` (HEAD, listings, deletes, buckets, aborts) live here; moving data
lives in `downloads` and `store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timezone
from typing import Any, TypeVar

from ..config import ResolvedConfig, S3Config
from ..errors import AccessDenied, BucketNotFound, ObjectNotFound, StorageError
from .boto import ClientHolder, map_error
from .contract import Listing, Part, Stats, StoredObject, Upload
from .retry import RetryPolicy, is_repeat_limited, is_throttling, is_transient
from .throttle import Answer, Throttle

__all__ = ["Calls", "Deadline", "etag_of"]

T = TypeVar("T")
log = logging.getLogger("s3ckpt.engine")
_DELETE_BATCH = 1000  # the most keys one DeleteObjects takes


@dataclasses.dataclass
class Deadline:
    """The time one attempt's waits have left, in all. aiohttp's read timeout restarts with every
    chunk received, so a server that trickles a response (its head or its body) would hold a
    request for hours; this bounds the total. Only the time spent in `wait` counts, not the
    checking and decoding between reads."""

    left: float
    expired: Callable[[], StorageError]

    async def wait(self, step: Awaitable[T]) -> T:
        """``await step``; raises ``expired()`` once the time is used up."""
        clock = asyncio.get_running_loop().time
        began = clock()
        try:
            return await asyncio.wait_for(step, max(self.left, 0.0))
        except asyncio.TimeoutError:
            if clock() - began < self.left:
                raise  # aiohttp's own timeout (a silent server), not the deadline
            raise self.expired() from None
        finally:
            self.left -= clock() - began


class Calls:
    """S3 calls under one concurrency bound, for one resolved configuration, on the bridge loop."""

    def __init__(self, resolved: ResolvedConfig, retry: RetryPolicy | None = None) -> None:
        self.resolved = resolved
        self._config = resolved.config
        self._stats = Stats()
        self.retry = retry or RetryPolicy(self.config.max_attempts, self.config.retry_timeout)
        self._clients = [ClientHolder(resolved, url) for url in resolved.endpoint_urls or [None]]
        self._turn = itertools.count()
        self._slots: asyncio.Semaphore | None = None
        self._down_until = 0.0  # loop time until which the store counts as down (`_retrying`)
        self._answered = False  # the store has answered a request (`first_contact_timeout`)
        self._warned_until = 0.0  # loop time until which retries are not warned about again
        # One for the store, not one per endpoint: its endpoints are addresses of one store,
        # whose limits (per key prefix on AWS S3, per system elsewhere) they share, and every
        # request and retry rotates over all of them.
        self._throttle = Throttle(self.config.max_concurrency)

    @property
    def config(self) -> S3Config:
        return self._config

    @property
    def stats(self) -> Stats:
        return self._stats

    @property
    def endpoint(self) -> str:
        return self.resolved.endpoint_name

    async def prepare(self) -> None:
        """Make every endpoint's client now; a failure is left for the first request to
        raise, typed and naming its bucket and key."""
        with contextlib.suppress(Exception):
            await asyncio.gather(*(holder.prepare() for holder in self._clients))

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
            return await self._request(operation, bucket, key, **params)

        return await self._retrying(operation, bucket, key, attempt, policy, on_failure=on_failure)

    async def _request(self, operation: str, bucket: str, key: str | None, **params: Any) -> Any:
        """One attempt: the client's ``operation``, on the next endpoint (requests and retries
        rotate over them all). The only place the engine sends a request, so that each is
        answered within `_answer_deadline` or fails transiently (``ResponseTimeout``)."""
        client = await self._clients[next(self._turn) % len(self._clients)].get()
        deadline = self._answer_deadline(operation, bucket, key, len(params.get("Body", b"")))
        return await deadline.wait(getattr(client, operation)(Bucket=bucket, **params))

    def _answer_deadline(self, operation: str, bucket: str, key: str | None, sent: int) -> Deadline:
        """From the call until its answer: the response head for a GET (its body has a deadline
        of its own, `Downloads`), the whole response otherwise (a few KiB of XML at most).

        ``connect_timeout + read_timeout``, which a healthy server never needs (aiohttp allows
        as much to connect and to wait for the first byte), plus the request's ``sent`` body
        bytes at ``min_read_rate``: an UploadPart's body goes out within the deadline too, at
        the rate a GET must keep.
        """
        c = self.config
        seconds = c.connect_timeout + c.read_timeout + sent / c.min_read_rate
        where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        body, link = "", ""
        if sent:
            body = f", plus {sent} request bytes at min_read_rate"
            link = " (or the link: on one this slow, lower min_read_rate or max_concurrency)"

        def expired() -> StorageError:
            return StorageError(
                f"{operation} {where} at {self.endpoint}: the response did not arrive within "
                f"{seconds:.1f} s (connect_timeout + read_timeout{body}); the server, or a proxy "
                f"on the way, answers too slowly{link}",
                endpoint=self.endpoint,
                bucket=bucket,
                key=key,
                operation=operation,
                code="ResponseTimeout",
            )

        return Deadline(seconds, expired)

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

        Every attempt waits for the store's `Throttle` (which throttling answers tighten). The
        wait for the first one is not part of the window (nothing has failed yet); the waits for
        retries are, so a store that refuses nearly everything still fails a request after about
        one window.
        """
        policy = policy or self.retry
        clock = asyncio.get_running_loop().time
        known_down = clock() < self._down_until
        if known_down:
            policy = dataclasses.replace(policy, max_attempts=1)
        first_contact = self.config.first_contact_timeout
        if not self._answered and first_contact is not None and first_contact < policy.deadline:
            policy = dataclasses.replace(policy, deadline=first_contact)
        started, number, repeats = 0.0, 0, 0
        while True:
            number += 1
            reached = progress() if progress is not None else 0
            ticket = await self._throttle.admit()
            if number == 1:  # waiting for the first attempt to be let through is not failing
                started = clock()
            self.stats.requests += 1
            error: StorageError | None = None
            answer: Answer = "failed"  # unless set below: also when cancelled
            try:
                result = await attempt()
                answer = "admitted"
            except Exception as e:
                cause = e
                error = map_error(
                    e, endpoint=self.endpoint, bucket=bucket, key=key, operation=operation
                )
                answer = self._answer(error)
            finally:
                self._throttle.done(ticket, answer)
            if error is None:
                self._down_until = 0.0
                self._answered = True
                return result
            self._answered = self._answered or error.status is not None
            self.stats.failed_requests += 1
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
                raise error from cause
            delay = policy.delay(number, elapsed)
            self._warn_once(error, number, policy.deadline)
            # INFO, not WARNING: a window holds tens of attempts, and a store that stays down
            # ends in one error that says so; the CLI shows these only with -v.
            log.info(
                "%s; attempt %d failed, retrying in %.2f s (for up to %g s)",
                error,
                number,
                delay,
                policy.deadline,
            )
            self.stats.retries += 1
            await asyncio.sleep(delay)

    def _warn_once(self, error: StorageError, attempt: int, window: float) -> None:
        """One WARNING per retry window, at a call's first retry, so that a dead endpoint is
        not a minute of silence. Not for throttling: that is a store at work, which the
        throttle answers by sending less."""
        now = asyncio.get_running_loop().time()
        if attempt != 1 or is_throttling(error) or now < self._warned_until:
            return
        self._warned_until = now + window
        log.warning(
            "%s; retrying for up to %g s (said once per %g s; each retry is logged at INFO)",
            error,
            window,
            window,
        )

    def _answer(self, error: StorageError) -> Answer:
        """What a failed attempt tells the store's `Throttle`; counts throttling answers."""
        if is_throttling(error):
            self.stats.throttled += 1
            return "throttled" if self.config.adapt_to_throttling else "failed"
        return "failed" if is_transient(error) else "admitted"

    def slot(self) -> asyncio.Semaphore:
        """One of the ``max_concurrency`` request slots; hold it around `read_range`."""
        return self._semaphore()

    async def head(self, bucket: str, key: str) -> StoredObject | None:
        try:
            reply = await self._call("head_object", bucket, key, Key=key)
        except ObjectNotFound:
            return None
        modified = _utc(reply["LastModified"]) if "LastModified" in reply else _server_time(reply)
        return StoredObject(key, int(reply["ContentLength"]), modified, etag_of(reply))

    async def check_bucket(self, bucket: str) -> None:
        """Credentials scoped to a prefix may not be allowed HeadBucket; that is not an error."""
        with contextlib.suppress(AccessDenied):
            await self._call("head_bucket", bucket, None)

    async def create_bucket(self, bucket: str) -> None:
        try:
            await self.check_bucket(bucket)
        except BucketNotFound:
            params: dict[str, Any] = {}
            if self.resolved.region != "us-east-1":
                params["CreateBucketConfiguration"] = {"LocationConstraint": self.resolved.region}
            await self._call("create_bucket", bucket, None, **params)

    async def delete_bucket(self, bucket: str) -> None:
        await self._call("delete_bucket", bucket, None)

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
            reply = await self._call(
                "list_objects_v2", bucket, prefix or None, Prefix=prefix, MaxKeys=size, **params
            )
            now = now or _server_time(reply)
            objects += [
                StoredObject(o["Key"], int(o["Size"]), _utc(o["LastModified"]))
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
                )
            if deleted is not None:
                deleted(len(batch))

    async def list_uploads(self, bucket: str, prefix: str) -> list[Upload]:
        found: list[Upload] = []
        markers: dict[str, Any] = {}
        while True:
            reply = await self._call(
                "list_multipart_uploads", bucket, prefix, Prefix=prefix, **markers
            )
            found += [
                Upload(u["Key"], u["UploadId"], _utc(u["Initiated"]))
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
                reply = await self._call(
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
                Part(int(p["PartNumber"]), int(p["Size"]), _utc(p["LastModified"]))
                for p in reply.get("Parts", [])
            ]
            if not reply.get("IsTruncated"):
                return parts
            marker = {"PartNumberMarker": reply["NextPartNumberMarker"]}

    async def abort(self, bucket: str, upload: Upload) -> bool:
        try:
            await self._call(
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
            await self._call("abort_multipart_upload", bucket, key, Key=key, UploadId=upload_id)


def etag_of(reply: dict[str, Any]) -> str | None:
    etag = reply.get("ETag")
    return None if etag is None else str(etag)


def _utc(when: datetime) -> datetime:
    return when.astimezone(timezone.utc)


def _server_time(reply: dict[str, Any]) -> datetime:
    """The reply's Date, so that ages do not depend on this machine's clock."""
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return datetime.now(timezone.utc)
