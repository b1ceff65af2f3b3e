"""zstd frames: exact round trips, ranged loads that fetch only their frames, integrity."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import ChecksumMismatch, S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.engine.store import get_store
from s3ckpt.format.frames import RAW
from s3ckpt.tools.verify import verify
from tests.helpers import listing, raised

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

FRAME = 256 * 1024
PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


def state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    return {
        "bf16": torch.randn(1500, 1000, generator=generator).to(torch.bfloat16),
        "f32": torch.randn(1_000_000, generator=generator),
        "noise": torch.randint(0, 256, (700_000,), dtype=torch.uint8, generator=generator),
        "zeros": torch.zeros(500_000),
        "c64": torch.randn(1000, dtype=torch.complex64, generator=generator),
        "small": torch.arange(10, dtype=torch.int32),
        "step": 42,
    }


def zeros_like(saved: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in saved.items()}


def save(s3: Any, bucket: str, saved: dict[str, Any], **writer: Any) -> None:
    config = s3.config(**PARTS)
    options = WriteOptions(**{"compression": "zstd", "frame_size": FRAME, **writer})
    dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=config, options=options))


def test_compressed_round_trip_is_exact_and_smaller(s3: Any, bucket: str) -> None:
    saved = state()
    save(s3, bucket, saved)
    loaded = zeros_like(saved)
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config()))
    for name, value in saved.items():
        assert (
            torch.equal(loaded[name], value)
            if isinstance(value, torch.Tensor)
            else loaded[name] == value
        )
    stored = sum(size for key, size in listing(s3.client, bucket).items() if "/data-" in key)
    raw = sum(v.numel() * v.element_size() for v in saved.values() if isinstance(v, torch.Tensor))
    assert stored < raw / 1.3
    reader = S3Reader(bucket, "ck", config=s3.config())
    reader.read_metadata()
    assert reader.checkpoint is not None
    codecs = {c for table in reader.checkpoint.frames.values() for c in table.codecs}
    assert RAW in codecs, "incompressible frames (the uint8 noise) are stored raw"
    assert 0x21 in codecs and 0x41 in codecs, "bf16 and fp32 frames are shuffled"


def test_a_partial_load_fetches_only_its_frames_and_one_more_at_most(s3: Any, bucket: str) -> None:
    saved = state()
    save(s3, bucket, saved, objects_per_rank=1)
    reader = S3Reader(bucket, "ck", config=s3.config())
    reader.read_metadata()
    assert reader.checkpoint is not None
    (table,) = reader.checkpoint.frames.values()
    locator = next(loc for i, loc in reader.checkpoint.locators.items() if i.fqn == "f32")
    frames = table.frames(locator.offset, locator.offset + locator.length)
    own = table.starts[frames.stop] - table.starts[frames.start]
    neighbours = max(table.sizes[frames.start - 1 : frames.start] or [0]) + max(
        table.sizes[frames.stop : frames.stop + 1] or [0]
    )
    stats = get_store(s3.config()).stats
    metadata = listing(s3.client, bucket)["ck/.metadata"]
    before = stats.bytes_received
    loaded = {"f32": torch.zeros(1_000_000)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config()))
    assert torch.equal(loaded["f32"], saved["f32"])
    fetched = stats.bytes_received - before - metadata
    assert own <= fetched <= own + neighbours


def test_damage_in_a_compressed_frame_is_caught(s3: Any, bucket: str) -> None:
    save(s3, bucket, state())
    assert verify(f"s3://{bucket}/ck", config=s3.config()).frames > 0
    key = next(k for k in listing(s3.client, bucket) if "/data-" in k)
    data = bytearray(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 3] ^= 0x01
    s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    error = raised(
        lambda: dcp.load(
            zeros_like(state()),
            storage_reader=S3Reader(bucket, "ck", config=s3.config(max_attempts=2)),
        )
    )
    assert isinstance(error, ChecksumMismatch) and error.key == key
    with pytest.raises(ChecksumMismatch):
        verify(f"s3://{bucket}/ck", config=s3.config(max_attempts=1))
