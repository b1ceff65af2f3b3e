"""End-to-end integrity: damaged bytes never load silently, whole or partial; verify finds them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import ChecksumMismatch, S3Reader, S3Writer, WriteOptions
from s3ckpt.cli import main
from s3ckpt.engine.store import get_store
from s3ckpt.testing.faultproxy import Corrupt, FaultProxy
from s3ckpt.tools.verify import verify
from tests.helpers import raised

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

FRAME = 16 * 1024


def saved_checkpoint(s3: Any, bucket: str) -> dict[str, torch.Tensor]:
    state = {"hit": torch.randn(40_000), "spared": torch.randn(40_000)}
    writer = S3Writer(
        bucket, "ck", config=s3.config(), options=WriteOptions(frame_size=FRAME, objects_per_rank=1)
    )
    dcp.save(state, storage_writer=writer)
    return state


def flip_byte_of(s3: Any, bucket: str, fqn: str, at: int) -> tuple[str, int]:
    """Damage one stored byte of tensor ``fqn`` with a plain client; returns (key, offset)."""
    reader = S3Reader(bucket, "ck", config=s3.config())
    reader.read_metadata()
    assert reader.checkpoint is not None
    locator = next(loc for index, loc in reader.checkpoint.locators.items() if index.fqn == fqn)
    key = f"ck/{locator.key}"
    data = bytearray(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[locator.offset + at] ^= 0x40
    s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    return key, locator.offset + at


def load(s3: Any, bucket: str, names: list[str], **config: Any) -> dict[str, torch.Tensor]:
    loaded = {name: torch.zeros(40_000) for name in names}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config(**config)))
    return loaded


def test_a_flipped_byte_fails_full_and_partial_loads_and_verify(s3: Any, bucket: str) -> None:
    state = saved_checkpoint(s3, bucket)
    key, offset = flip_byte_of(s3, bucket, "hit", at=1000)
    frame_start = offset // FRAME * FRAME

    for names in (["hit", "spared"], ["hit"]):
        error = raised(lambda names=names: load(s3, bucket, names, max_attempts=2))
        assert isinstance(error, ChecksumMismatch), error
        assert (error.key, error.start, error.end) == (key, frame_start, frame_start + FRAME)
        assert error.expected != error.actual
        assert f"s3://{bucket}/{key} bytes {frame_start}-{frame_start + FRAME - 1}" in str(error)
        assert f"{error.expected:#010x}" in str(error) and f"{error.actual:#010x}" in str(error)

    with pytest.raises(ChecksumMismatch, match=r"1 damaged range"):
        verify(f"s3://{bucket}/ck", config=s3.config(max_attempts=1))

    spared = load(s3, bucket, ["spared"])
    assert torch.equal(spared["spared"], state["spared"])


@pytest.mark.stores("moto", "seaweedfs")  # through the fault proxy
def test_damage_in_transit_is_retried_and_the_load_is_exact(s3: Any, bucket: str) -> None:
    state = saved_checkpoint(s3, bucket)
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Corrupt(where="response"), op="GetObject", key="/data-", times=1)
        config = s3.config(endpoint_url=proxy.endpoint_url)
        retries = get_store(config).stats.retries
        loaded = {name: torch.zeros(40_000) for name in state}
        dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
        assert len(proxy.faults) == 1
        assert get_store(config).stats.retries == retries + 1
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)


def test_verify_reads_every_frame_of_a_good_checkpoint(s3: Any, bucket: str) -> None:
    saved_checkpoint(s3, bucket)
    report = verify(f"s3://{bucket}/ck", config=s3.config(part_size=5 * 1024 * 1024))
    stored = sum(
        size
        for key, size in (
            (o["Key"], o["Size"])
            for o in s3.client.list_objects_v2(Bucket=bucket, Prefix="ck/")["Contents"]
        )
        if "/data-" in key
    )
    assert report.objects == 1 and report.bytes == stored
    assert report.frames == -(-stored // FRAME)


def test_cli_verify_reports_a_good_checkpoint_and_fails_on_damage(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)
    saved_checkpoint(s3, bucket)
    url = f"s3://{bucket}/ck"
    assert main(["--endpoint-url", s3.endpoint_url, "--json", "verify", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["url"] == url and report["frames"] > 0
    key, _ = flip_byte_of(s3, bucket, "spared", at=5)
    assert main(["--endpoint-url", s3.endpoint_url, "verify", url]) == 1
    assert key in capsys.readouterr().err
