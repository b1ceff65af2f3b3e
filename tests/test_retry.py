"""The retry policy: what is retried, and that attempts and waits stay bounded. No server."""

from __future__ import annotations

import random

import pytest

from s3ckpt.errors import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    EndpointUnreachable,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from s3ckpt.retry import BASE_DELAY, MAX_DELAY, RetryPolicy, is_transient


def failure(cls: type[StorageError], code: str, status: int | None) -> StorageError:
    return cls("failed", code=code, status=status, bucket="b", key="k", endpoint="e")


@pytest.mark.parametrize(
    "error",
    [
        failure(StorageError, "InternalError", 500),
        failure(StorageError, "SlowDown", 503),
        failure(StorageError, "", 502),
        failure(StorageError, "TooManyRequests", 429),
        failure(StorageError, "RequestTimeout", 400),
        failure(StorageError, "Truncated", None),
        failure(EndpointUnreachable, "ConnectTimeoutError", None),
        failure(EndpointUnreachable, "ServerDisconnectedError", None),
    ],
)
def test_transient_failures_are_retried(error: StorageError) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        failure(AccessDenied, "SignatureDoesNotMatch", 403),
        failure(BucketNotFound, "NoSuchBucket", 404),
        failure(ObjectNotFound, "NoSuchKey", 404),
        failure(PreconditionFailed, "PreconditionFailed", 412),
        failure(StorageError, "InvalidArgument", 400),
        failure(EndpointUnreachable, "SSLError", None),
        failure(StorageError, "ValueError", None),
        ConfigError("bad setting"),
        RuntimeError("a bug is not a network problem"),
    ],
)
def test_permanent_failures_are_not(error: BaseException) -> None:
    assert not is_transient(error)


def test_attempts_and_time_are_bounded() -> None:
    policy = RetryPolicy(max_attempts=4, deadline=10.0, rng=random.Random(7))
    slow_down = failure(StorageError, "SlowDown", 503)
    assert [policy.should_retry(slow_down, n, 0.0) for n in (1, 2, 3, 4)] == [1, 1, 1, 0]
    assert not policy.should_retry(slow_down, 1, elapsed=9.95)


def test_backoff_grows_with_full_jitter_up_to_a_cap() -> None:
    policy = RetryPolicy(max_attempts=20, deadline=600.0, rng=random.Random(3))
    for attempt in range(1, 15):
        bound = min(MAX_DELAY, BASE_DELAY * 2 ** (attempt - 1))
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= bound for d in delays)
        assert max(delays) > 0.8 * bound, "waits spread over the whole range"
