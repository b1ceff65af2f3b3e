"""Every request the engine sends: clients, the request slots, the throttle, deadlines, retries.

One `Calls` serves all of an `S3Store` (its `downloads.Downloads`, its `uploads.Uploads` and its
small operations), so they share one concurrency bound, one throttle and one idea of whether the
store is down. `Calls.call` is one S3 operation: it maps errors (one place: `boto.map_error`),
counts, and retries as `retry` says; `Calls.retrying` does the same for an attempt the caller
writes itself (a read that resumes where it broke off). Every attempt of every call is one
`Calls.request`, which must be answered within its `Deadline`, and is let through by the store's
`throttle.Throttle`, which sends less once the store throttles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..config import ResolvedConfig, S3Config
from ..errors import StorageError
from .boto import ClientHolder, map_error
from .contract import Stats
from .retry import RetryPolicy, is_repeat_limited, is_throttling, is_transient
from .throttle import Answer, Throttle

__all__ = ["Calls", "Deadline"]

T = TypeVar("T")
log = logging.getLogger("s3ckpt.engine")


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
    """S3 requests under one concurrency bound, for one resolved configuration, on the bridge
    loop. ``clients``: one per endpoint URL, which requests and retries rotate over;
    ``throttle``: the store's, which every attempt waits for."""

    def __init__(self, resolved: ResolvedConfig, retry: RetryPolicy | None = None) -> None:
        self.resolved = resolved
        self._config = resolved.config
        self._stats = Stats()
        self.retry = retry or RetryPolicy(self.config.max_attempts, self.config.retry_timeout)
        self.clients = [ClientHolder(resolved, url) for url in resolved.endpoint_urls or [None]]
        self._turn = itertools.count()
        self._slots: asyncio.Semaphore | None = None
        self._down_until = 0.0  # loop time until which the store counts as down (`retrying`)
        self._answered = False  # the store has answered a request (`first_contact_timeout`)
        self._warned_until = 0.0  # loop time until which retries are not warned about again
        # One for the store, not one per endpoint: its endpoints are addresses of one store,
        # whose limits (per key prefix on AWS S3, per system elsewhere) they share, and every
        # request and retry rotates over all of them.
        self.throttle = Throttle(self.config.max_concurrency)

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
            await asyncio.gather(*(holder.prepare() for holder in self.clients))

    def slot(self) -> asyncio.Semaphore:
        """One of the ``max_concurrency`` request slots, which the store's data requests hold
        (a read's caller around `Downloads.read_range`, an upload around each part)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
        return self._slots

    async def call(
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
            return await self.request(operation, bucket, key, **params)

        return await self.retrying(operation, bucket, key, attempt, policy, on_failure=on_failure)

    async def request(self, operation: str, bucket: str, key: str | None, **params: Any) -> Any:
        """One attempt: the client's ``operation``, on the next endpoint (requests and retries
        rotate over them all). The only place the engine sends a request, so that each is
        answered within `_answer_deadline` or fails transiently (``ResponseTimeout``)."""
        client = await self.clients[next(self._turn) % len(self.clients)].get()
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

    async def retrying(
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
            policy = policy.once()
        first_contact = self.config.first_contact_timeout
        if not self._answered and first_contact is not None and first_contact < policy.deadline:
            policy = dataclasses.replace(policy, deadline=first_contact)
        started, number, repeats = 0.0, 0, 0
        while True:
            number += 1
            reached = progress() if progress is not None else 0
            ticket = await self.throttle.admit()
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
                self.throttle.done(ticket, answer)
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
