"""The retry loop itself (`Calls.retrying`), with fake attempts: fresh windows for reads that
make progress, failing fast once a window ran out, retries logged at INFO; and each attempt's
deadline (`Calls.request`), with a fake client that never answers. No server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest

from s3ckpt import StorageError
from s3ckpt.config import S3Config
from s3ckpt.engine.boto import ClientHolder
from s3ckpt.engine.calls import Calls


def requests_for(**settings: Any) -> Calls:
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    return Calls(dataclasses.replace(config, **settings).resolve({}))


def failing(code: str, status: int | None) -> StorageError:
    return StorageError(f"failed: {code}", code=code, status=status, bucket="b", key="k")


def test_a_read_that_made_progress_gets_a_fresh_window() -> None:
    """Each attempt outlasts the window but moves the read on: it is resumed, not given up."""
    requests, position = requests_for(retry_timeout=0.2), 0

    async def attempt() -> str:
        nonlocal position
        await asyncio.sleep(0.3)
        position += 1
        if position < 3:
            raise failing("Truncated", None)
        return "done"

    run = requests.retrying("get_object", "b", "k", attempt, progress=lambda: position)
    assert asyncio.run(run) == "done" and position == 3


def test_once_a_window_ran_out_the_next_requests_fail_fast_until_one_succeeds() -> None:
    requests, outcomes = requests_for(retry_timeout=0.5), ["down"] * 1000

    async def attempt() -> str:
        if outcomes.pop(0) == "down":
            raise failing("SlowDown", 503)
        return "ok"

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(StorageError):
            await requests.retrying("put_object", "b", "k", attempt)
        assert loop.time() - began >= 0.4 and requests.stats.requests > 2
        before = requests.stats.requests
        with pytest.raises(StorageError):  # the cleanup of what failed: one attempt
            await requests.retrying("delete_objects", "b", "k", attempt)
        assert requests.stats.requests == before + 1
        outcomes[:] = ["ok", "down", "ok"]
        assert await requests.retrying("head_object", "b", "k", attempt) == "ok"
        assert await requests.retrying("head_object", "b", "k", attempt) == "ok", "retried again"
        # Giving up on a cap the caller chose (one attempt here) says nothing about the store.
        once = requests.retry.once()
        outcomes[:] = ["down", "down", "ok"]
        with pytest.raises(StorageError):
            await requests.retrying("put_object", "b", "k", attempt, once)
        assert await requests.retrying("get_object", "b", "k", attempt) == "ok"

    asyncio.run(scenario())


def test_retries_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A window holds tens of attempts; they go to INFO (the CLI's -v), never WARNING."""
    requests = requests_for(retry_timeout=0.5)

    async def attempt() -> None:
        raise failing("SlowDown", 503)

    with caplog.at_level(logging.INFO, logger="s3ckpt.engine"), pytest.raises(StorageError):
        asyncio.run(requests.retrying("put_object", "b", "k", attempt))
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) > 1 and {r.levelno for r in retries} == {logging.INFO}
    assert "for up to 0.5 s" in retries[0].getMessage()


class Unanswered:
    """A client whose calls never return: a server that never finishes its answer."""

    def __init__(self) -> None:
        self.calls = 0

    async def head_object(self, **params: Any) -> None:
        self.calls += 1
        await asyncio.Event().wait()

    put_object = head_object


@pytest.fixture
def unanswered(monkeypatch: pytest.MonkeyPatch) -> Unanswered:
    client = Unanswered()

    async def get(holder: ClientHolder) -> Unanswered:
        return client

    monkeypatch.setattr(ClientHolder, "get", get)
    return client


def test_an_unanswered_request_is_cut_at_its_deadline_and_retried_within_the_window(
    unanswered: Unanswered,
) -> None:
    requests = requests_for(connect_timeout=0.1, read_timeout=0.2, retry_timeout=1.0)

    async def call() -> tuple[BaseException, float]:
        clock = asyncio.get_running_loop().time
        began = clock()
        with pytest.raises(StorageError) as info:
            await requests.call("head_object", "b", "run/.metadata", Key="run/.metadata")
        return info.value, clock() - began

    error, elapsed = asyncio.run(call())
    assert isinstance(error, StorageError) and error.code == "ResponseTimeout", error
    assert (error.bucket, error.key, error.operation) == ("b", "run/.metadata", "head_object")
    assert "s3://b/run/.metadata" in str(error), error
    assert "the response did not arrive within 0.3 s" in str(error), error
    assert unanswered.calls >= 3, "retried for the window"
    # The window, then one more attempt's deadline at most; the rest is slack for a busy machine.
    assert 1.0 - 0.2 <= elapsed < 1.0 + 0.3 + 2.0, elapsed


def test_a_request_body_lengthens_the_deadline_at_min_read_rate(unanswered: Unanswered) -> None:
    requests = requests_for(
        connect_timeout=0.1, read_timeout=0.1, min_read_rate=1000, max_attempts=1
    )
    call = requests.call("put_object", "b", "k", Key="k", Body=b"x" * 300)
    with pytest.raises(StorageError) as info:
        asyncio.run(call)
    assert info.value.code == "ResponseTimeout" and unanswered.calls == 1
    assert "within 0.5 s" in str(info.value) and "300 request bytes" in str(info.value)
