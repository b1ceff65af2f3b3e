"""Faults injected between s3ckpt and a real server (`s3ckpt.testing.faultproxy`): retries, lost
answers, permanent failures, TLS, and credentials kept out of logs."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import EndpointUnreachable, S3Reader, S3Writer, StorageError
from s3ckpt.config import MiB
from s3ckpt.testing.faultproxy import (
    FaultProxy,
    ResetAfter,
    ResetBefore,
    ResetMidBody,
    Status,
    Truncate,
)
from tests.helpers import listing, raised, uploads_in_progress

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 4}


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB, generator=generator),  # 12 MiB: a multipart upload
        "mid": torch.randn(300, 300, generator=generator).to(torch.bfloat16),
        **{f"small{i}": torch.randn(100 + i, generator=generator) for i in range(20)},
    }


def zeros(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in like.items()}


def assert_equal(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_ten_percent_transient_faults_on_every_request_type(s3: Any, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url, rng=random.Random(11)) as proxy:
        for action in (
            Status(500, "InternalError"),
            Status(503, "SlowDown"),
            ResetBefore(),
            ResetMidBody(),
            Truncate(),
        ):
            proxy.add_rule(action, probability=0.02)
        config = s3.config(endpoint_url=proxy.endpoint_url, max_attempts=10, **SMALL_PARTS)
        for cycle in range(4):
            saved = state(cycle)
            writer = S3Writer(bucket, "ck", config=config, overwrite=True)
            dcp.save(saved, storage_writer=writer)
            loaded = zeros(saved)
            dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
            assert_equal(loaded, saved)
        assert len(proxy.faults) >= 5, "the faults must actually have happened"
    assert uploads_in_progress(s3.client, bucket) == []


@pytest.mark.parametrize("operation", ["CompleteMultipartUpload", "PutObject"])
def test_an_answer_lost_after_the_server_acted_still_counts_once(
    s3: Any, bucket: str, operation: str
) -> None:
    """The server completed the upload (or committed .metadata) but the client never heard."""
    with FaultProxy(s3.endpoint_url) as proxy:
        key = ".metadata" if operation == "PutObject" else None
        proxy.add_rule(ResetAfter(), op=operation, key=key, times=1)
        config = s3.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        saved = state(1)
        dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=config))
        assert len(proxy.faults) == 1
    loaded = zeros(saved)
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config()))
    assert_equal(loaded, saved)


@pytest.mark.timeout(120)
def test_a_save_under_permanent_failure_fails_and_leaves_the_previous_checkpoint(
    s3: Any, bucket: str
) -> None:
    previous = state(1)
    dcp.save(previous, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    before = listing(s3.client, bucket)
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Status(500, "InternalError"), op="UploadPart", after=1)
        config = s3.config(
            endpoint_url=proxy.endpoint_url, max_attempts=3, retry_timeout=10, **SMALL_PARTS
        )
        writer = S3Writer(bucket, "ck", config=config, overwrite=True)
        error = raised(lambda: dcp.save(state(2), storage_writer=writer))
    assert isinstance(error, StorageError) and "upload_part" in str(error)
    assert "InternalError" in str(error) and "/data-" in str(error)
    assert uploads_in_progress(s3.client, bucket) == []
    assert listing(s3.client, bucket) == before
    loaded = zeros(previous)
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config()))
    assert_equal(loaded, previous)


@pytest.mark.timeout(120)
def test_a_load_under_permanent_failure_raises_instead_of_returning_half_filled(
    s3: Any, bucket: str
) -> None:
    saved = state(3)
    dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=s3.config(**SMALL_PARTS)))
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Status(503, "SlowDown"), op="GetObject", key="/data-", after=2)
        config = s3.config(
            endpoint_url=proxy.endpoint_url, max_attempts=3, retry_timeout=10, **SMALL_PARTS
        )
        loaded = zeros(saved)
        error = raised(
            lambda: dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
        )
    assert isinstance(error, StorageError) and "SlowDown" in str(error)
    assert f"s3://{bucket}/ck/data-" in str(error)


def test_tls_with_a_self_signed_certificate(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {"w": torch.randn(1000)}
    with FaultProxy(s3.endpoint_url, tls=True) as proxy:
        assert proxy.endpoint_url.startswith("https://")
        refused = raised(
            lambda: dcp.save(
                saved,
                storage_writer=S3Writer(
                    bucket, "a", config=s3.config(endpoint_url=proxy.endpoint_url)
                ),
            )
        )
        assert isinstance(refused, EndpointUnreachable)
        assert "TLS" in str(refused) and "ca_bundle" in str(refused)

        trusted = s3.config(endpoint_url=proxy.endpoint_url, ca_bundle=proxy.ca_bundle)
        dcp.save(saved, storage_writer=S3Writer(bucket, "b", config=trusted))
        loaded = {"w": torch.zeros(1000)}
        dcp.load(loaded, storage_reader=S3Reader(bucket, "b", config=trusted))
        assert torch.equal(loaded["w"], saved["w"])

        monkeypatch.setenv("AWS_CA_BUNDLE", proxy.ca_bundle)
        from_env = s3.config(endpoint_url=proxy.endpoint_url)
        dcp.save(saved, storage_writer=S3Writer(bucket, "c", config=from_env))
        assert "c/.metadata" in listing(s3.client, bucket)


def test_debug_logs_and_errors_carry_no_credentials(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret, token = "SECRET-do-not-log-0123456789", "TOKEN-do-not-log-9876543210"
    with FaultProxy(s3.endpoint_url) as proxy, caplog.at_level(logging.DEBUG):
        proxy.add_rule(Status(500, "InternalError"))
        config = s3.config(
            endpoint_url=proxy.endpoint_url,
            secret_access_key=secret,
            session_token=token,
            max_attempts=2,
        )
        error = raised(
            lambda: dcp.save(state(4), storage_writer=S3Writer(bucket, "ck", config=config))
        )
    assert isinstance(error, StorageError)
    assert "botocore" in caplog.text, "botocore's DEBUG output was captured"
    for text in (caplog.text, str(error), repr(error)):
        assert secret not in text and token not in text
