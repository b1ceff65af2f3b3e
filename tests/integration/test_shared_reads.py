"""A load on several ranks asks the store for every byte once: replicas, HSDP meshes, resharded and
partial loads, incremental checkpoints (4 ranks, gloo), counted at the fault proxy; each checked
to fetch several times as much with sharing switched off."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Writer
from s3ckpt.format.record import TensorEntry, decode
from s3ckpt.testing.faultproxy import Delay, FaultProxy
from tests import share_workers
from tests.helpers import listing, spawn

pytestmark = pytest.mark.slow

WORLD = 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stored(s3: Any, bucket: str, prefix: str) -> int:
    """The data bytes of the checkpoint at ``prefix``."""
    return sum(size for key, size in listing(s3.client, bucket, f"{prefix}/data-").items())


def frames_of(s3: Any, bucket: str, prefix: str, names: list[str]) -> int:
    """The bytes of the frames that hold the tensors ``names`` (reads fetch whole frames)."""
    raw = s3.client.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    record = decode(raw, url=f"s3://{bucket}/{prefix}/.metadata")
    frames = set()
    for name in names:
        entry = record.entries[name]
        assert isinstance(entry, TensorEntry)
        for chunk in entry.chunks:
            locator = chunk.locator
            size = record.frames[locator.key].frame_size
            first, last = locator.offset, locator.offset + locator.length - 1
            frames |= {(locator.key, n, size) for n in range(first // size, last // size + 1)}
    total = sum(record.objects[key] for key in {key for key, _, _ in frames})
    return min(total, sum(size for _, _, size in frames))


def loaded(s3: Any, url: str, layout: str, share: bool) -> tuple[int, int]:
    """Load on 4 ranks through a proxy: the GET bytes the store served, and its .metadata GETs."""
    with FaultProxy(s3.endpoint_url) as proxy:
        records = proxy.add_rule(Delay(0.0), op="GetObject", key=".metadata")
        config = s3.config(endpoint_url=proxy.endpoint_url)
        args = (WORLD, free_port(), config, url, layout, share)
        spawn(share_workers.load, args=args, nprocs=WORLD)
        return proxy.served["GetObject"], records.fired


def save(s3: Any, bucket: str, prefix: str, **writer: Any) -> str:
    dcp.save(
        share_workers.reference(),
        storage_writer=S3Writer(bucket, prefix, config=s3.config(), **writer),
    )
    return f"s3://{bucket}/{prefix}"


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
@pytest.mark.parametrize("layout", ["replicated", "hsdp", "resharded", "partial"])
def test_every_byte_is_read_once(s3: Any, bucket: str, layout: str) -> None:
    url = save(s3, bucket, "ck")
    data = stored(s3, bucket, "ck")
    if layout == "partial":  # what one rank alone fetches: the frames holding half the tensors
        data = frames_of(s3, bucket, "ck", share_workers.partial(share_workers.reference()))
    served, records = loaded(s3, url, layout, share=True)
    assert served <= 1.1 * data + 64 * 1024, (served, data)
    assert records == 1, "the record is read once, by the coordinator"
    alone, records = loaded(s3, url, layout, share=False)
    assert records == WORLD
    assert alone >= 1.9 * served, "without sharing, ranks fetch the same bytes again"


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
def test_an_incremental_checkpoint_is_read_once_too(s3: Any, bucket: str) -> None:
    """Step 2 stores one tensor and references the rest in step 1's objects."""
    first = share_workers.reference()
    first["t0"] = first["t0"] + 1
    config = s3.config()
    dcp.save(first, storage_writer=S3Writer(bucket, "run/step-1", config=config, incremental=True))
    url = save(s3, bucket, "run/step-2", incremental=True)
    raw = s3.client.get_object(Bucket=bucket, Key="run/step-2/.metadata")["Body"].read()
    record = json.loads(raw)
    assert any(key.startswith("../step-1/") for key in record["objects"]), "it references"
    data = sum(record["objects"].values())
    served, records = loaded(s3, url, "replicated", share=True)
    assert served <= 1.1 * data + 64 * 1024 and records == 1, (served, data)
    alone, _ = loaded(s3, url, "replicated", share=False)
    assert alone >= 1.9 * served


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
def test_a_rank_that_fails_to_plan_fails_every_rank_without_a_hang(s3: Any, bucket: str) -> None:
    url = save(s3, bucket, "ck")
    args = (WORLD, free_port(), s3.config(), url)
    spawn(share_workers.fail_one, args=args, nprocs=WORLD)
