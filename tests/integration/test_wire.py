"""Checksums on the wire: the server refuses bytes damaged on the way up, and s3ckpt resends."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.testing.faultproxy import Corrupt, FaultProxy
from tests.helpers import listing

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


def test_auto_mode_finds_what_the_server_validates(s3: Any, bucket: str) -> None:
    store = get_store(s3.config())
    mode = bridge.run(store.uploads.wire_mode(bucket, "run/step-1/data-x/00000-000"))
    assert mode == {"moto": "off", "seaweedfs": "crc32c"}[s3.name]
    assert listing(s3.client, bucket) == {}, "the probe object is removed"


@pytest.mark.parametrize("operation", ["UploadPart", "PutObject"])
def test_a_body_damaged_on_the_way_up_is_refused_and_resent(seaweedfs: Any, operation: str) -> None:
    bucket = f"wire-{operation.lower()}"
    seaweedfs.client.create_bucket(Bucket=bucket)
    state = {"big": torch.randn(3 * MiB), "small": torch.randn(1000)}
    with FaultProxy(seaweedfs.endpoint_url) as proxy:
        proxy.add_rule(Corrupt(where="request"), op=operation, key="/00000-00", times=1)
        config = seaweedfs.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        retries = get_store(config).stats.retries
        dcp.save(
            state,
            storage_writer=S3Writer(
                bucket, "ck", config=config, options=WriteOptions(objects_per_rank=2)
            ),
        )
        assert len(proxy.faults) == 1
        assert get_store(config).stats.retries > retries
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=seaweedfs.config()))
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("mode", ["crc32c", "md5", "off"])
def test_each_explicit_mode_round_trips(s3: Any, bucket: str, mode: str) -> None:
    config = s3.config(checksum=mode, **SMALL_PARTS)
    state = {"big": torch.randn(2 * MiB), "small": torch.randn(10)}
    dcp.save(state, storage_writer=S3Writer(bucket, "ck", config=config))
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
