"""Every failure a user meets first gets a clear, picklable error naming where and why."""

from __future__ import annotations

import logging
import pickle
import socket
import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import (
    AccessDenied,
    BucketNotFound,
    CheckpointNotFound,
    EndpointUnreachable,
    IncompleteCheckpoint,
    MetadataError,
    S3Reader,
    S3Writer,
)
from tests.helpers import raised

STATE = {"w": torch.arange(10.0)}


def save(config: Any, bucket: str, prefix: str = "ck") -> None:
    dcp.save(dict(STATE), storage_writer=S3Writer(bucket, prefix, config=config))


def load(config: Any, bucket: str, prefix: str = "ck") -> None:
    """A load's metadata read on its own: the typed error, as `S3Reader.read_metadata` raises it.

    Through ``dcp.load`` torch 2.13 re-raises a failed metadata read as ``AssertionError`` whose
    text carries s3ckpt's message; `assert_load_says` checks that path.
    """
    S3Reader(bucket, prefix, config=config).read_metadata()


def assert_load_says(config: Any, bucket: str, message: str, prefix: str = "ck") -> None:
    reader = S3Reader(bucket, prefix, config=config)
    error = raised(lambda: dcp.load({"w": torch.zeros(10)}, storage_reader=reader))
    assert message in str(error)


def test_missing_bucket_on_save_and_load(s3: Any) -> None:
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    for call in (lambda: save(s3.config(), missing), lambda: load(s3.config(), missing)):
        error = raised(call)
        assert isinstance(error, BucketNotFound), error
        assert missing in str(error) and s3.endpoint_url in str(error)
    # Some servers (SeaweedFS) create a bucket on PUT; a typo must not create one.
    buckets = [b["Name"] for b in s3.client.list_buckets()["Buckets"]]
    assert missing not in buckets
    assert_load_says(s3.config(), missing, f"bucket {missing!r} does not exist")


def test_missing_checkpoint_says_nothing_is_there(s3: Any, bucket: str) -> None:
    error = raised(lambda: load(s3.config(), bucket, "never/saved"))
    assert isinstance(error, CheckpointNotFound)
    assert f"s3://{bucket}/never/saved" in str(error) and "nothing is stored" in str(error)
    assert_load_says(s3.config(), bucket, str(error), prefix="never/saved")


def test_incomplete_checkpoint_is_reported_as_such(s3: Any, bucket: str) -> None:
    s3.client.put_object(
        Bucket=bucket, Key="half/data-abcabcabcabcabcabcabcabc/00000-000", Body=b"x" * 10
    )
    error = raised(lambda: load(s3.config(), bucket, "half"))
    assert isinstance(error, IncompleteCheckpoint)
    assert "half/data-abcabcabcabcabcabcabcabc/00000-000" in str(error) and "no .metadata" in str(
        error
    )
    assert_load_says(s3.config(), bucket, str(error), prefix="half")


def test_garbled_metadata_is_a_metadata_error(s3: Any, bucket: str) -> None:
    save(s3.config(), bucket)
    body = s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read()
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=body[: len(body) // 2])
    error = raised(lambda: load(s3.config(), bucket))
    assert isinstance(error, MetadataError)
    assert f"s3://{bucket}/ck/.metadata" in str(error)


def test_wrong_credentials_are_access_denied_and_never_leak(
    seaweedfs: Any, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "wrong-secret-0123456789abcdef"
    config = seaweedfs.config(secret_access_key=secret, max_attempts=1)
    seaweedfs.client.create_bucket(Bucket="creds-test")
    with caplog.at_level(logging.DEBUG):
        error = raised(lambda: save(config, "creds-test"))
    assert isinstance(error, AccessDenied), error
    assert "creds-test" in str(error) and "credentials" in str(error)
    for text in (str(error), repr(error), caplog.text, pickle.dumps(error).decode("latin-1")):
        assert secret not in text


def test_unreachable_endpoint_fails_fast(bucket: str, s3: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = s3.config(endpoint_url=f"http://127.0.0.1:{port}", connect_timeout=1.0, max_attempts=2)
    for call in (lambda: save(config, bucket), lambda: load(config, bucket)):
        error = raised(call)
        assert isinstance(error, EndpointUnreachable), error
        assert f"127.0.0.1:{port}" in str(error) and bucket in str(error)


def test_errors_pickle_with_their_context(s3: Any) -> None:
    error = raised(lambda: load(s3.config(), "no-such-bucket-xyz"))
    assert isinstance(error, BucketNotFound)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.bucket == "no-such-bucket-xyz" and copy.endpoint == s3.endpoint_url
