"""When to retry a failed request, and how long to wait. No I/O.

s3ckpt owns retrying (botocore's own retries are off) so that one policy, stated here, covers
every request, including the body of a ranged GET that breaks off midway.

Retried: HTTP 5xx, 429 and throttling codes (``SlowDown`` and friends), request timeouts and
answers that miss their request's deadline (``ResponseTimeout``, see `calls.Calls.request`), lost
or refused connections, response bodies that end early or arrive slower than ``min_read_rate``,
and bytes that fail their checksum (damage in transit). Not retried: every other 4xx (403 bad
credentials, 404 missing bucket or key, 400, 412 lost conditional write), TLS verification
failures and configuration errors, which no retry can fix. A throttling answer (`is_throttling`:
503, 429, ``SlowDown`` and friends) is retried like the others and also makes the store's
`throttle.Throttle` send fewer requests, so that retries do not add up to a storm.

How long: a store that restarts, browns out or sheds load with ``SlowDown`` is back within
seconds, however many requests fail meanwhile, so a request is retried for a time window
(``deadline``, the config's ``retry_timeout``), not for a small count: a new attempt starts only
inside the window, and ``max_attempts``, when set, caps the count as well. Waits grow
exponentially from ``BASE_DELAY`` to ``MAX_DELAY`` with full jitter (a uniform draw up to the
bound), so many clients spread their retries and a 60 s window holds about 30 attempts.

Damaged bytes and bodies slower than ``min_read_rate`` are counted instead (`is_repeat_limited`):
once is chance (damage in transit, one congested connection), but ``REPEAT_LIMIT`` of them in
one request mean damage at rest, a server that computes checksums differently, or a store or path
that slow, which no wait repairs. They are retried even past the window, since the attempt that
met them may have taken most of it (a long body, cut at its deadline).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from ..errors import EndpointUnreachable, StorageError

__all__ = ["REPEAT_LIMIT", "RetryPolicy", "is_repeat_limited", "is_throttling", "is_transient"]

BASE_DELAY = 0.1
MAX_DELAY = 5.0
REPEAT_LIMIT = 3
_REPEAT_LIMITED_CODES = {
    "ChecksumMismatch",
    "BadDigest",
    "InvalidDigest",
    "XAmzContentChecksumMismatch",
    "TooSlow",
}
_THROTTLING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestThrottled",
}
_RETRYABLE_CODES = {
    *_THROTTLING_CODES,
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "ResponseTimeout",
    "Truncated",
    *_REPEAT_LIMITED_CODES,
}


def is_transient(error: BaseException) -> bool:
    """True if the same request may succeed when sent again."""
    if not isinstance(error, StorageError):
        return False
    if isinstance(error, EndpointUnreachable):
        return error.code != "SSLError"
    if error.code in _RETRYABLE_CODES:
        return True
    return error.status is not None and (error.status >= 500 or error.status in (408, 429))


def is_throttling(error: BaseException) -> bool:
    """True for an answer that asks for fewer requests: HTTP 503 (S3's ``SlowDown``, a balancer
    shedding load), 429, or a throttling code; `throttle.Throttle` sends less on it."""
    if not isinstance(error, StorageError):
        return False
    return error.code in _THROTTLING_CODES or error.status in (429, 503)


def is_repeat_limited(error: BaseException) -> bool:
    """True for damaged bytes (either way) and bodies slower than ``min_read_rate``: retried
    ``REPEAT_LIMIT`` times per request at most, not for a time."""
    return isinstance(error, StorageError) and error.code in _REPEAT_LIMITED_CODES


@dataclass
class RetryPolicy:
    """Capped exponential backoff with full jitter within a window of ``deadline`` seconds from
    the first attempt; at most ``max_attempts`` attempts if set (``None``: as many as the window
    holds). ``rng`` is injectable for tests."""

    max_attempts: int | None
    deadline: float
    rng: random.Random = field(default_factory=random.Random)
    never: frozenset[str] = frozenset()  # codes not to retry here, even if transient

    def once(self) -> RetryPolicy:
        """This policy with a single attempt: for a caller that decides itself what a failure
        means (the commit, which must not resend a PUT that may have been applied)."""
        return dataclasses.replace(self, max_attempts=1)

    def delay(self, attempt: int, elapsed: float = 0.0) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based), ``elapsed`` seconds
        into the window; never past the window's end, so the next attempt starts inside it."""
        bound = min(MAX_DELAY, BASE_DELAY * 2 ** min(attempt - 1, 32))
        return min(self.rng.uniform(0, bound), max(0.0, self.deadline - elapsed))

    def should_retry(
        self, error: BaseException, attempt: int, elapsed: float, repeats: int = 0
    ) -> bool:
        """Whether to try again after attempt ``attempt`` failed with ``error``, ``elapsed``
        seconds into the window; ``repeats``: how many of the request's failures so far were
        `is_repeat_limited`, this one included (a caller that does not count them leaves 0, and
        ``attempt``, never fewer, stands in)."""
        if not isinstance(error, StorageError) or not is_transient(error):
            return False
        if error.code in self.never:
            return False
        if self.max_attempts is not None and attempt >= self.max_attempts:
            return False
        if is_repeat_limited(error):
            return (repeats or attempt) < REPEAT_LIMIT
        return not self.window_closed(elapsed)

    def window_closed(self, elapsed: float) -> bool:
        """True once no further attempt may start, ``elapsed`` seconds into the window."""
        return elapsed + BASE_DELAY >= self.deadline
