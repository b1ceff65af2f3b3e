"""The retry policy: what is retried, and that attempts and waits stay bounded. No server."""

from __future__ import annotations

import random

import pytest

from s3ckpt.engine.retry import BASE_DELAY, MAX_DELAY, REPEAT_LIMIT, RetryPolicy, is_transient
from s3ckpt.errors import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    EndpointUnreachable,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)


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
        failure(StorageError, "TooSlow", None),
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


def test_without_max_attempts_the_window_alone_bounds_a_request() -> None:
    policy = RetryPolicy(max_attempts=None, deadline=60.0, rng=random.Random(5))
    slow_down = failure(StorageError, "SlowDown", 503)
    assert policy.should_retry(slow_down, 1000, elapsed=59.0)
    assert not policy.should_retry(slow_down, 2, elapsed=59.95)


def test_a_store_failing_instantly_is_tried_for_the_whole_window() -> None:
    """Waits are capped at a few seconds and never reach past the window, so a request keeps
    trying until the window closes and its last attempt starts inside it."""
    assert MAX_DELAY <= 5.0
    policy = RetryPolicy(max_attempts=None, deadline=60.0, rng=random.Random(9))
    slow_down = failure(StorageError, "SlowDown", 503)
    elapsed, attempt = 0.0, 1
    while policy.should_retry(slow_down, attempt, elapsed):
        elapsed += policy.delay(attempt, elapsed)
        assert elapsed <= policy.deadline
        attempt += 1
    assert elapsed >= policy.deadline - BASE_DELAY
    assert 15 <= attempt <= 60, "tens of attempts over a minute, not five"


def test_damaged_and_too_slow_answers_are_counted_not_timed() -> None:
    """Once is chance, REPEAT_LIMIT times is the object or the store; past the window too, since
    the attempt that met them may have used it up."""
    policy = RetryPolicy(max_attempts=None, deadline=10.0)
    for code in ("ChecksumMismatch", "BadDigest", "TooSlow"):
        error = failure(StorageError, code, None)
        assert policy.should_retry(error, 1, elapsed=100.0, repeats=1)
        assert policy.should_retry(error, 2, elapsed=0.0, repeats=REPEAT_LIMIT - 1)
        assert not policy.should_retry(error, 3, elapsed=0.0, repeats=REPEAT_LIMIT)
    capped = RetryPolicy(max_attempts=2, deadline=10.0)
    assert not capped.should_retry(failure(StorageError, "TooSlow", None), 2, 0.0, repeats=1)
    uncounted = failure(StorageError, "BadDigest", 400)  # a loop that does not count repeats
    assert [policy.should_retry(uncounted, n, 0.0) for n in (1, 2, 3)] == [True, True, False]
