"""`S3Reader.check` raises s3ckpt's typed errors before DCP is involved, and a ``checkpoint_id``
in another bucket than the adapter's is refused, not followed."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt import (
    AccessDenied,
    BucketNotFound,
    CheckpointNotFound,
    ConfigError,
    EndpointUnreachable,
    IncompleteCheckpoint,
    MetadataError,
    S3Reader,
    S3Writer,
)
from s3ckpt.tools.localserver import free_port

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

STATE = {"w": torch.arange(10.0)}


def save(s3: Any, bucket: str, prefix: str = "ck") -> None:
    dcp.save(dict(STATE), storage_writer=S3Writer(bucket, prefix, config=s3.config()))


def check(reader: S3Reader) -> Exception:
    """What ``reader.check()`` raises: an ordinary Exception, no DCP wrapper."""
    with pytest.raises(Exception) as info:
        reader.check()
    return info.value


def test_check_passes_a_committed_checkpoint_and_the_load_follows(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    reader = S3Reader(bucket, "ck", config=s3.config())
    reader.check()
    loaded = {"w": torch.zeros(10)}
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["w"], STATE["w"])


def test_missing_checkpoint_is_checkpoint_not_found(s3: Any, bucket: str) -> None:
    error = check(S3Reader(bucket, "never/saved", config=s3.config()))
    assert isinstance(error, CheckpointNotFound), error
    assert f"s3://{bucket}/never/saved" in str(error)


def test_dcp_load_hides_what_check_raises(s3: Any, bucket: str) -> None:
    """Why `check` exists: torch 2.13's load raises a BaseException around an AssertionError."""
    reader = S3Reader(bucket, "never/saved", config=s3.config())
    typed = check(reader)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(10)}, storage_reader=reader)
    assert not isinstance(info.value, Exception)
    [(inner, _trace)] = info.value.failures.values()
    assert isinstance(inner, AssertionError) and str(typed) in str(inner)


def test_data_objects_without_record_are_incomplete(s3: Any, bucket: str) -> None:
    s3.client.put_object(
        Bucket=bucket, Key="half/data-abcabcabcabcabcabcabcabc/00000-000", Body=b"x" * 10
    )
    error = check(S3Reader(bucket, "half", config=s3.config()))
    assert isinstance(error, IncompleteCheckpoint), error
    assert "half/data-abcabcabcabcabcabcabcabc/00000-000" in str(error)


def test_uploads_without_objects_are_incomplete(s3: Any, bucket: str) -> None:
    s3.client.create_multipart_upload(
        Bucket=bucket, Key="up/data-defdefdefdefdefdefdefdef/00000-000"
    )
    error = check(S3Reader(bucket, "up", config=s3.config()))
    assert isinstance(error, IncompleteCheckpoint), error
    assert "up/data-defdefdefdefdefdefdefdef/00000-000" in str(error)


def test_garbled_record_is_a_metadata_error(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    body = s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read()
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=body[: len(body) // 2])
    error = check(S3Reader(bucket, "ck", config=s3.config()))
    assert isinstance(error, MetadataError), error
    assert f"s3://{bucket}/ck/.metadata" in str(error)


def test_record_over_the_size_limit_is_a_metadata_error(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    error = check(S3Reader(bucket, "ck", config=s3.config(max_record_size=100)))
    assert isinstance(error, MetadataError), error
    assert "max_record_size" in str(error)


def test_missing_bucket_is_bucket_not_found(s3: Any) -> None:
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    error = check(S3Reader(missing, "ck", config=s3.config()))
    assert isinstance(error, BucketNotFound), error
    assert missing in str(error) and s3.endpoint_url in str(error)


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)  # moto accepts any signature
def test_wrong_credentials_are_access_denied(s3: Any, bucket: str) -> None:
    config = s3.config(secret_access_key="wrong-secret-0123456789", max_attempts=1)
    error = check(S3Reader(bucket, "ck", config=config))
    assert isinstance(error, AccessDenied), error
    assert bucket in str(error) and "wrong-secret" not in str(error)


def test_unreachable_endpoint(s3: Any, bucket: str) -> None:
    port = free_port()
    config = s3.config(endpoint_url=f"http://127.0.0.1:{port}", connect_timeout=1.0, max_attempts=2)
    error = check(S3Reader(bucket, "ck", config=config))
    assert isinstance(error, EndpointUnreachable), error
    assert f"127.0.0.1:{port}" in str(error)


def _buckets(s3: Any) -> list[str]:
    return [b["Name"] for b in s3.client.list_buckets()["Buckets"]]


def test_writer_refuses_a_checkpoint_id_in_another_bucket(s3: Any, bucket: str) -> None:
    other = f"other-{uuid.uuid4().hex[:12]}"
    writer = S3Writer(bucket, "run1", config=s3.config())
    with pytest.raises(ConfigError) as info:
        dcp.save(dict(STATE), checkpoint_id=f"s3://{other}/run1/step-1", storage_writer=writer)
    assert repr(other) in str(info.value) and repr(bucket) in str(info.value)
    with pytest.raises(ConfigError):
        dcp.async_save(
            dict(STATE), checkpoint_id=f"s3://{other}/run1/step-2", storage_writer=writer
        ).result(timeout=120)
    # SeaweedFS creates a bucket on PUT: nothing may have been sent there.
    assert other not in _buckets(s3)
    # The writer stays usable, in its own bucket.
    url = f"s3://{bucket}/run1/step-3"
    dcp.async_save(dict(STATE), checkpoint_id=url, storage_writer=writer).result(timeout=120)
    assert writer.checkpoint_id == url
    assert "run1/step-3/.metadata" in [
        o["Key"] for o in s3.client.list_objects_v2(Bucket=bucket)["Contents"]
    ]


def test_reader_refuses_a_checkpoint_id_in_another_bucket(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    other = f"other-{uuid.uuid4().hex[:12]}"
    reader = S3Reader(bucket, "ck", config=s3.config())
    with pytest.raises(ConfigError) as info:
        dcp.load({"w": torch.zeros(10)}, checkpoint_id=f"s3://{other}/ck", storage_reader=reader)
    assert repr(other) in str(info.value) and "S3Reader" in str(info.value)
    loaded = {"w": torch.zeros(10)}
    dcp.load(loaded, checkpoint_id=f"s3://{bucket}/ck", storage_reader=reader)
    assert torch.equal(loaded["w"], STATE["w"])


def test_reset_refuses_another_bucket_and_keeps_the_location() -> None:
    """The direct path (DCP's ``reset``): no server needed, the check makes no request."""
    for adapter in (S3Writer("mine", "a"), S3Reader("mine", "a")):
        with pytest.raises(ConfigError) as info:
            adapter.reset("s3://theirs/b")
        assert "'theirs'" in str(info.value) and "'mine'" in str(info.value)
        assert adapter.checkpoint_id == "s3://mine/a"
        adapter.reset("s3://mine/c")
        assert adapter.checkpoint_id == "s3://mine/c"
        adapter.reset("d/e")
        assert adapter.checkpoint_id == "s3://mine/d/e"
