"""When to retry a failed request, and how long to wait. No I/O.

s3ckpt owns retrying (botocore's own retries are off) so that one policy, stated here, covers
every request, including the body of a ranged GET that breaks off midway.

Retried: HTTP 5xx, 429 and throttling codes (``SlowDown`` and friends), request timeouts, lost or
refused connections, truncated response bodies, and bytes that fail their checksum (damage in
transit; damage at rest fails every attempt and is then raised). Not retried: every other 4xx
(403 bad credentials, 404 missing bucket or key, 400, 412 lost conditional write), TLS
verification failures and configuration errors, which no retry can fix. Waits grow
exponentially from ``BASE_DELAY`` to ``MAX_DELAY`` with full jitter (a uniform draw up to the
bound), and a request gives up after ``max_attempts`` attempts or ``deadline`` seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .errors import EndpointUnreachable, StorageError

__all__ = ["RetryPolicy", "is_transient"]

BASE_DELAY = 0.1
MAX_DELAY = 5.0
_RETRYABLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "RequestThrottled",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Truncated",
    "ChecksumMismatch",
    "BadDigest",
    "InvalidDigest",
    "XAmzContentChecksumMismatch",
}


def is_transient(error: BaseException) -> bool:
    """True if the same request may succeed when sent again."""
    if not isinstance(error, StorageError):
        return False
    if isinstance(error, EndpointUnreachable):
        return getattr(error, "code", None) != "SSLError"
    status = getattr(error, "status", None)
    code = getattr(error, "code", None)
    if code in _RETRYABLE_CODES:
        return True
    return isinstance(status, int) and (status >= 500 or status in (408, 429))


@dataclass
class RetryPolicy:
    """Bounded exponential backoff with full jitter; ``rng`` is injectable for tests."""

    max_attempts: int
    deadline: float
    rng: random.Random = field(default_factory=random.Random)
    never: frozenset[str] = frozenset()  # codes not to retry here, even if transient

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return self.rng.uniform(0, min(MAX_DELAY, BASE_DELAY * 2 ** (attempt - 1)))

    def should_retry(self, error: BaseException, attempt: int, elapsed: float) -> bool:
        return (
            attempt < self.max_attempts
            and elapsed + BASE_DELAY < self.deadline
            and is_transient(error)
            and getattr(error, "code", None) not in self.never
        )
