"""The frame codec's stored format: what a reader of any version must be able to decode; and
frame tables: their JSON form, and what `FrameTable.from_json` refuses. No server."""

from __future__ import annotations

import base64
import os
import random
import struct

import pytest
import torch
import zstandard

from s3ckpt.checksums import checksum
from s3ckpt.format import frames
from s3ckpt.format.frames import ZSTD, FrameTable


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_shuffled_frame_is_zstd_of_the_byte_planes_in_order(dtype: torch.dtype) -> None:
    values = torch.linspace(-3, 3, 10_000, dtype=torch.float64).sin().to(dtype)
    raw, itemsize, n = _bytes(values), values.element_size(), len(values)
    stored, codec = frames.encode(raw, 1, itemsize)
    assert codec == itemsize << 4 | frames.ZSTD
    planes = zstandard.ZstdDecompressor().decompress(bytes(stored))
    for plane in range(itemsize):
        assert planes[plane * n : (plane + 1) * n] == bytes(raw[plane::itemsize])
    assert bytes(frames.decode(stored, codec, len(raw))) == bytes(raw)
    out = memoryview(bytearray(len(raw)))
    assert frames.decode(stored, codec, len(raw), out=out) is out and bytes(out) == bytes(raw)


def test_bytes_that_do_not_shrink_are_stored_raw() -> None:
    raw = memoryview(os.urandom(1 << 16))
    stored, codec = frames.encode(raw, 1, 4)
    assert codec == frames.RAW and bytes(stored) == bytes(raw)
    assert bytes(frames.decode(stored, codec, len(raw))) == bytes(raw)


def test_a_length_that_is_not_a_whole_number_of_elements_is_not_shuffled() -> None:
    raw = memoryview(bytes(range(256)) * 33 + b"x")
    stored, codec = frames.encode(raw, 3, 4)
    assert codec == frames.ZSTD
    assert bytes(frames.decode(stored, codec, len(raw))) == bytes(raw)


def test_frames_that_do_not_decode_raise_value_error() -> None:
    stored, codec = frames.encode(memoryview(bytes(1 << 16)), 1, 2)
    with pytest.raises(ValueError, match="expected"):
        frames.decode(stored, codec, (1 << 16) + 2)
    with pytest.raises(ValueError, match="does not decompress"):
        frames.decode(b"not zstd at all", codec, 1 << 16)


def test_frame_table_round_trip_and_validation() -> None:
    rng = random.Random(1)
    data = bytes(rng.randrange(256) for _ in range(10_000))
    crcs = [checksum(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    table = FrameTable.raw(4096, crcs, len(data))
    assert table.sizes == (4096, 4096, 1808) and table.size == len(data)
    assert FrameTable.from_json(table.to_json(), len(data)) == table
    assert table.covering(5000, 5001) == (4096, 8192)
    assert table.covering(0, 10_000) == (0, 10_000)
    with pytest.raises(ValueError, match="add up"):
        FrameTable.from_json(table.to_json(), len(data) + 1)
    with pytest.raises(ValueError, match="base64"):
        FrameTable.from_json({"frame_size": 4096, "table": "@@"}, len(data))


def _table(stored: int, codec: int) -> str:
    """A frame table of one frame (with a CRC no read will get to check)."""
    return base64.b64encode(struct.pack("<IIB", stored, 0, codec)).decode()


@pytest.mark.parametrize(
    ("frame_size", "raw_size", "cause"),
    [
        (4096, 100, "do not fit its codec"),
        (4 << 20, 4 << 20, "do not fit its codec"),  # 100 stored bytes: zstd makes 3.2 MB at most
        (2**40, 2**40, "a frame holds at most"),
    ],
    ids=["compressed-not-smaller", "more-than-zstd-holds", "frame-too-large"],
)
def test_frame_tables_must_fit_their_objects(frame_size: int, raw_size: int, cause: str) -> None:
    table = {"frame_size": frame_size, "raw_size": raw_size, "table": _table(100, ZSTD)}
    with pytest.raises(ValueError, match=cause):
        FrameTable.from_json(table, 100)


def test_frame_lookups_past_the_table_are_value_errors() -> None:
    table = FrameTable.raw(4096, [0, 0, 0], 10_000)
    assert table.frames(8192, 12_288) == range(2, 3)
    for start, end in ((8192, 12_289), (20_000, 20_001), (5, 4)):
        with pytest.raises(ValueError, match="not inside the 3 frames"):
            table.covering(start, end)
