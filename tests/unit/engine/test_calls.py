"""The retry loop itself (`Calls._retrying`), with fake attempts: fresh windows for reads that
make progress, failing fast once a window ran out, retries logged at INFO. No server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest

from s3ckpt import StorageError
from s3ckpt.config import S3Config
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

    run = requests._retrying("get_object", "b", "k", attempt, progress=lambda: position)
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
            await requests._retrying("put_object", "b", "k", attempt)
        assert loop.time() - began >= 0.4 and requests.stats.requests > 2
        before = requests.stats.requests
        with pytest.raises(StorageError):  # the cleanup of what failed: one attempt
            await requests._retrying("delete_objects", "b", "k", attempt)
        assert requests.stats.requests == before + 1
        outcomes[:] = ["ok", "down", "ok"]
        assert await requests._retrying("head_object", "b", "k", attempt) == "ok"
        assert await requests._retrying("head_object", "b", "k", attempt) == "ok", "retried again"
        # Giving up on a cap the caller chose (one attempt here) says nothing about the store.
        once = dataclasses.replace(requests.retry, max_attempts=1)
        outcomes[:] = ["down", "down", "ok"]
        with pytest.raises(StorageError):
            await requests._retrying("put_object", "b", "k", attempt, once)
        assert await requests._retrying("get_object", "b", "k", attempt) == "ok"

    asyncio.run(scenario())


def test_retries_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A window holds tens of attempts; they go to INFO (the CLI's -v), never WARNING."""
    requests = requests_for(retry_timeout=0.5)

    async def attempt() -> None:
        raise failing("SlowDown", 503)

    with caplog.at_level(logging.INFO, logger="s3ckpt.engine"), pytest.raises(StorageError):
        asyncio.run(requests._retrying("put_object", "b", "k", attempt))
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) > 1 and {r.levelno for r in retries} == {logging.INFO}
    assert "for up to 0.5 s" in retries[0].getMessage()
