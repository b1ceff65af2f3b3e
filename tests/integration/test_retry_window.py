"""Retries last as long as ``retry_timeout`` allows, and a trickling body or head cannot hold
a load or a save.

A store that restarts or browns out (every request answered 503 SlowDown for a few seconds) must
cost a save or a load time, not the checkpoint; one that stays down must fail, typed, soon after
one window; a GET whose body trickles is cut at its deadline and resumed where it got; a response
head that trickles is cut at its request's deadline and the request retried. Bounds on how long a
failure takes are generous: they catch a hang or a second window, no performance goal.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.exceptions import ClientError

from s3ckpt import EndpointUnreachable, S3Config, S3Reader, S3Writer, StorageError, WriteOptions
from s3ckpt.cli.main import FIRST_CONTACT_S, main
from s3ckpt.config import MiB
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.testing.faultproxy import FaultProxy, Status, Trickle, TrickleHead
from tests.helpers import listing, raised
from tests.integration.test_faultproxy import client_for
from tests.integration.test_faults import assert_equal, state, zeros

# Retry windows are the client's and the proxy makes the faults: the strict server is enough.
pytestmark = pytest.mark.stores("seaweedfs")

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}
BROWNOUT_S = 5.0
# A store that stays down: a short window and short timeouts, so that failing takes seconds.
SHORT = {"retry_timeout": 3.0, "connect_timeout": 1.0, "read_timeout": 1.0}
WINDOW_S = SHORT["retry_timeout"]
FAILS_WITHIN_S = WINDOW_S + SHORT["connect_timeout"] + SHORT["read_timeout"] + 5
# A response head relayed at 4 B/s: its few hundred bytes take over a minute, each byte well
# within read_timeout of the one before, so only a deadline on the whole request ends the wait.
HEAD_TRICKLE = TrickleHead(4)
# Each attempt's deadline is 2 s, so that the 7 s window holds a retry even on a busy machine
# (with 5 s, one run at load average 15 made a single attempt).
TIGHT = {"connect_timeout": 1.0, "read_timeout": 1.0, "retry_timeout": 7.0}
# Far below the minute one trickled head takes: a bound against a hang, not a goal.
NO_HANG_S = 30.0


def timed_failure(call: Callable[[], Any]) -> tuple[BaseException, float]:
    began = time.monotonic()
    error = raised(call)
    return error, time.monotonic() - began


_RESERVED: list[socket.socket] = []


def dead_endpoint() -> str:
    """A port on 127.0.0.1 that nothing listens on: connections are refused. The socket stays
    bound (never listening) for the session, so that no later test gets the same port, and
    with it the same store, which would remember the earlier test's outage."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    _RESERVED.append(probe)
    return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_the_proxy_can_brown_out_for_a_while_and_trickle(s3: Any, bucket: str) -> None:
    """What the tests below rely on: a rule ``for_seconds`` stops firing when its time is up;
    `Trickle` delivers the whole body, intact, at its rate, in pieces a read timeout tolerates."""
    data = os.urandom(64 * 1024)
    s3.client.put_object(Bucket=bucket, Key="k", Body=data)
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url, read_timeout=0.5)
        brownout = proxy.add_rule(Status(503, "SlowDown"), for_seconds=0.5)
        with pytest.raises(ClientError, match="SlowDown"):
            client.get_object(Bucket=bucket, Key="k")
        time.sleep(0.6)
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == data
        assert brownout.fired == 1
        proxy.add_rule(Trickle(128 * 1024), op="GetObject", times=1)
        began = time.monotonic()
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == data
        assert time.monotonic() - began >= 0.4, "64 KiB at 128 KiB/s take half a second"


def test_a_five_second_brownout_fails_neither_a_save_nor_a_load(s3: Any, bucket: str) -> None:
    saved = state(5)
    with FaultProxy(s3.endpoint_url) as proxy:
        config = s3.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        writer = S3Writer(bucket, "ck", config=config)
        save_brownout = proxy.add_rule(Status(503, "SlowDown"), for_seconds=BROWNOUT_S)
        dcp.save(saved, storage_writer=writer)
        assert save_brownout.until is not None and time.monotonic() > save_brownout.until
        loaded = zeros(saved)
        reader = S3Reader(bucket, "ck", config=config)
        load_brownout = proxy.add_rule(Status(503, "SlowDown"), for_seconds=BROWNOUT_S)
        dcp.load(loaded, storage_reader=reader)
        assert load_brownout.until is not None and time.monotonic() > load_brownout.until
    assert_equal(loaded, saved)
    assert save_brownout.fired and load_brownout.fired, "both were browned out, and outlasted it"


def test_one_request_outlasts_more_failures_than_five_attempts_allowed(
    s3: Any, bucket: str
) -> None:
    """Each first request (the bucket check, the record's GET) fails six times in a row: the
    old five attempts would have failed the save and the load; the window does not. Counted,
    not timed: how many failures fit in a timed brownout depends on the machine's load."""
    saved = state(1)
    with FaultProxy(s3.endpoint_url) as proxy:
        config = s3.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        check = proxy.add_rule(Status(503, "SlowDown"), op="HeadBucket", times=6)
        dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=config))
        record = proxy.add_rule(Status(503, "SlowDown"), op="GetObject", key=".metadata", times=6)
        loaded = zeros(saved)
        dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
    assert_equal(loaded, saved)
    assert check.fired == 6 and record.fired == 6


@pytest.mark.parametrize("operation", ["save", "load"])
@pytest.mark.parametrize("outage", ["503 SlowDown", "connection refused"])
def test_a_store_that_stays_down_fails_typed_after_one_window(
    s3: Any, bucket: str, outage: str, operation: str
) -> None:
    saved = {"w": torch.arange(1000.0)}
    dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    with FaultProxy(s3.endpoint_url) as proxy:
        if outage == "503 SlowDown":
            proxy.add_rule(Status(503, "SlowDown"))
            endpoint, expected, status = proxy.endpoint_url, StorageError, 503
        else:
            endpoint, expected, status = dead_endpoint(), EndpointUnreachable, None
        config = s3.config(endpoint_url=endpoint, **SHORT)
        if operation == "save":
            writer = S3Writer(bucket, "other", config=config)
            error, elapsed = timed_failure(lambda: dcp.save(saved, storage_writer=writer))
        else:
            error, elapsed = timed_failure(S3Reader(bucket, "ck", config=config).read_metadata)
    assert isinstance(error, expected), error
    assert error.status == status and bucket in str(error), error
    # It kept trying for the whole window (the old five attempts gave up after 1.5 s), then
    # gave up within one more attempt.
    assert WINDOW_S - 0.2 <= elapsed < FAILS_WITHIN_S, elapsed


def test_a_store_that_goes_down_mid_save_fails_it_after_one_window(s3: Any, bucket: str) -> None:
    """The cleanup of the failed save (aborts, deletes) does not wait out windows of its own: the
    store was just found down. The window is long enough that neither the old five attempts per
    step (1.5 s each) nor a window per cleanup step fit the bounds."""
    window = {**SHORT, "retry_timeout": 8.0}
    with FaultProxy(s3.endpoint_url) as proxy:
        config = s3.config(endpoint_url=proxy.endpoint_url, **window, **SMALL_PARTS)
        proxy.add_rule(Status(503, "SlowDown"), after=10)  # down from the 11th request on
        writer = S3Writer(bucket, "ck", config=config)
        error, elapsed = timed_failure(lambda: dcp.save(state(6), storage_writer=writer))
    assert isinstance(error, StorageError) and error.status == 503, error
    assert 8.0 - 0.2 <= elapsed < 8.0 + 2 + 5, elapsed


def test_a_trickling_get_is_cut_at_its_deadline_and_resumed(s3: Any, bucket: str) -> None:
    saved = {"w": torch.randn(2 * MiB)}  # 8 MiB, checked in frames of 4 KiB
    dcp.save(
        saved,
        storage_writer=S3Writer(
            bucket, "ck", config=s3.config(), options=WriteOptions(frame_size=4096)
        ),
    )
    with FaultProxy(s3.endpoint_url) as proxy:
        # A GET's deadline: 1 s + its size at 8 MiB/s; the trickle sends 64 KiB/s.
        config = s3.config(endpoint_url=proxy.endpoint_url, read_timeout=1.0, min_read_rate=8 * MiB)
        stats = get_store(config).stats

        def load() -> tuple[dict[str, torch.Tensor], int, int]:
            before = dataclasses.replace(stats)
            loaded = {"w": torch.zeros(2 * MiB)}
            dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
            return (
                loaded,
                stats.requests - before.requests,
                stats.bytes_received - before.bytes_received,
            )

        _, requests, received = load()
        rule = proxy.add_rule(Trickle(64 * 1024), op="GetObject", key="/data-", times=1)
        loaded, trickled_requests, trickled_received = load()
    assert torch.equal(loaded["w"], saved["w"])
    assert rule.fired == 1
    assert trickled_requests == requests + 1, "the trickling GET was cut and sent once more"
    # Resumed at its first missing frame: at most the frame in progress was read twice, not the
    # ~64 KiB that trickled in before the cut.
    assert received <= trickled_received < received + 4096


def test_a_body_that_stays_too_slow_fails_typed(s3: Any, bucket: str) -> None:
    saved = {"w": torch.randn(256 * 1024)}  # 1 MiB
    dcp.save(
        saved,
        storage_writer=S3Writer(
            bucket, "ck", config=s3.config(), options=WriteOptions(frame_size=4096)
        ),
    )
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Trickle(16 * 1024), op="GetObject", key="/data-")
        config = s3.config(endpoint_url=proxy.endpoint_url, read_timeout=0.5, min_read_rate=4 * MiB)
        reader = S3Reader(bucket, "ck", config=config)
        error = raised(lambda: dcp.load({"w": torch.zeros(256 * 1024)}, storage_reader=reader))
    assert isinstance(error, StorageError) and error.code == "TooSlow", error
    assert "slower than min_read_rate" in str(error) and "/data-" in str(error)


def assert_timed_out(error: BaseException, bucket: str, operation: str, key: str) -> None:
    """The typed error of a request whose answer did not arrive within its deadline."""
    assert isinstance(error, StorageError) and error.code == "ResponseTimeout", error
    assert error.bucket == bucket and error.operation == operation, error
    assert error.key is not None and key in error.key, error
    bound = TIGHT["connect_timeout"] + TIGHT["read_timeout"]
    assert f"the response did not arrive within {bound:.1f} s" in str(error), error


@pytest.mark.timeout(120)
def test_a_record_whose_response_head_trickles_once_is_read_on_the_retry(
    s3: Any, bucket: str
) -> None:
    saved = {"w": torch.arange(1000.0)}
    dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(HEAD_TRICKLE, op="GetObject", key=".metadata", times=1)
        config = s3.config(endpoint_url=proxy.endpoint_url, **TIGHT)
        loaded = {"w": torch.zeros(1000)}
        began = time.monotonic()
        dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
        elapsed = time.monotonic() - began
    assert torch.equal(loaded["w"], saved["w"])
    assert rule.fired == 1 and rule.matched >= 2, "the trickled GET was cut and sent again"
    assert elapsed < NO_HANG_S, elapsed


@pytest.mark.timeout(120)
def test_a_record_whose_response_head_always_trickles_fails_the_load_typed(
    s3: Any, bucket: str
) -> None:
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(HEAD_TRICKLE, op="GetObject", key=".metadata")
        config = s3.config(endpoint_url=proxy.endpoint_url, **TIGHT)
        began = time.monotonic()
        # Not through dcp.load, which reports a failed read_metadata as a message in a string.
        error = raised(S3Reader(bucket, "ck", config=config).read_metadata)
        elapsed = time.monotonic() - began
    assert_timed_out(error, bucket, "get_object", "ck/.metadata")
    assert rule.fired >= 2, "retried within the window"
    assert elapsed < NO_HANG_S, elapsed


# The save's HEADs of its data objects before the commit, and its leases.
# (operation, the rule's key, the engine's operation, what the error's key holds): the commit
# lists its save directory before and after the PUT; leases are PUT while it uploads.
SAVE_REQUESTS = {
    "commit-listings": ("ListObjectsV2", None, "list_objects_v2", "/data-"),
    "lease-puts": ("PutObject", "/.lease", "put_object", "/.lease"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requests", SAVE_REQUESTS)
def test_a_save_whose_response_heads_trickle_once_is_retried(
    s3: Any, bucket: str, requests: str
) -> None:
    op, key, _, _ = SAVE_REQUESTS[requests]
    saved = {"w": torch.arange(1000.0)}
    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(HEAD_TRICKLE, op=op, key=key, times=1)
        config = s3.config(endpoint_url=proxy.endpoint_url, **TIGHT)
        began = time.monotonic()
        dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=config))
        elapsed = time.monotonic() - began
    loaded = {"w": torch.zeros(1000)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config()))
    assert torch.equal(loaded["w"], saved["w"])
    assert rule.fired == 1 and rule.matched >= 2, "the trickled request was cut and sent again"
    assert elapsed < NO_HANG_S, elapsed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("requests", SAVE_REQUESTS)
def test_a_save_whose_response_heads_always_trickle_fails_typed(
    s3: Any, bucket: str, requests: str
) -> None:
    op, key, operation, named = SAVE_REQUESTS[requests]
    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(HEAD_TRICKLE, op=op, key=key)
        config = s3.config(endpoint_url=proxy.endpoint_url, **TIGHT)
        writer = S3Writer(bucket, "ck", config=config)
        began = time.monotonic()
        error = raised(lambda: dcp.save({"w": torch.arange(1000.0)}, storage_writer=writer))
        elapsed = time.monotonic() - began
    assert_timed_out(error, bucket, operation, named)
    assert rule.fired >= 2, "retried within the window"
    assert elapsed < NO_HANG_S, elapsed
    assert "ck/.metadata" not in listing(s3.client, bucket, "ck/"), "nothing was committed"


def test_the_cli_takes_a_retry_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against a dead endpoint the CLI retries for --retry-timeout, then exits 1 saying why."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    endpoint = dead_endpoint()
    began = time.monotonic()
    code = main(["--endpoint-url", endpoint, "--retry-timeout", "1", "ls", "s3://b/run"])
    elapsed = time.monotonic() - began
    assert code == 1 and endpoint in capsys.readouterr().err
    assert 0.8 <= elapsed < 1 + 5 + 5, elapsed


def test_a_dead_endpoint_is_said_once_per_window_naming_endpoint_cause_and_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Retries stay at INFO, but the first of a window is a WARNING: no minute of silence."""
    endpoint = dead_endpoint()
    # A window the first attempt cannot outlast (it builds the client, seconds on a busy host).
    window = {**SHORT, "retry_timeout": 8.0}
    config = S3Config(endpoint_url=endpoint, access_key_id="a", secret_access_key="b", **window)
    store = get_store(config)
    with caplog.at_level(logging.WARNING, logger="s3ckpt"):
        for key in ("one", "two"):  # the second call falls in the same window
            with pytest.raises(EndpointUnreachable):
                bridge.run(store.head("bucket", key))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert endpoint in warned[0] and "retrying for up to 8 s" in warned[0]


def test_the_cli_fails_a_refused_first_contact_within_seconds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --retry-timeout the CLI retries a store that never answered for FIRST_CONTACT_S,
    not the 60 s window a save keeps."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    endpoint = dead_endpoint()
    began = time.monotonic()
    code = main(["--endpoint-url", endpoint, "ls", "s3://b/run"])
    elapsed = time.monotonic() - began
    err = capsys.readouterr().err
    assert code == 1 and endpoint in err
    assert f"retrying for up to {FIRST_CONTACT_S:g} s" in err, err
    assert elapsed < NO_HANG_S, elapsed  # a hang or the 60 s window, not a performance goal
    assert S3Config().first_contact_timeout is None  # saves and loads keep the whole window
