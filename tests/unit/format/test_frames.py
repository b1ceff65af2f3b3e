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

from s3ckpt.crc32c import checksum
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
    _check_parts(stored, codec, raw)


def _check_parts(stored: bytes | memoryview, codec: int, raw: memoryview) -> None:
    """Decoded into views that start and end mid-element, with gaps between them, each view
    gets exactly its bytes of the frame."""
    cuts = [(0, 3), (3, 5), (7, 1000), (1003, len(raw) // 2), (len(raw) // 2 + 9, len(raw))]
    parts = [(start, memoryview(bytearray(end - start))) for start, end in cuts]
    frames.decode_into(stored, codec, len(raw), parts)
    for start, view in parts:
        assert bytes(view) == bytes(raw[start : start + len(view)]), start


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


@pytest.mark.parametrize("itemsize", [None, 4])
def test_a_frame_larger_than_the_chunk_streams_into_its_parts(itemsize: int | None) -> None:
    values = torch.arange(3 * frames._CHUNK // 4 + 5, dtype=torch.int32) % 1000
    raw = _bytes(values)
    stored, codec = frames.encode(raw, 1, itemsize)
    assert codec != frames.RAW and len(raw) > 2 * frames._CHUNK
    _check_parts(stored, codec, raw)
    assert bytes(frames.decode(stored, codec, len(raw))) == bytes(raw)


def _unsized(data: bytes) -> bytes:
    """A zstd frame whose header does not say how large it is."""
    compressor = zstandard.ZstdCompressor().compressobj()
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("stored", "raw_size", "cause"),
    [
        (zstandard.ZstdCompressor().compress(bytes(2 << 20)), 1 << 20, "header declares 2097152"),
        (_unsized(bytes(2 << 20)), 1 << 20, "decodes to more than the 1048576 bytes"),
        (_unsized(bytes(1 << 20)), 2 << 20, "decodes to 1048576 bytes, 2097152 expected"),
        (zstandard.compress(bytes(1000)) * 2, 1000, "decodes to more than the 1000 bytes"),
        (zstandard.compress(bytes(1000)) + b"junk", 1000, "does not decompress"),
    ],
    ids=["header-claims-more", "more", "fewer", "two-frames", "trailing-junk"],
)
def test_a_frame_decodes_to_the_records_size_or_raises(
    stored: bytes, raw_size: int, cause: str
) -> None:
    for codec in (ZSTD, 0x41):
        whole = memoryview(bytearray(raw_size))
        with pytest.raises(ValueError, match=cause):
            frames.decode_into(stored, codec, raw_size, [(0, whole)])
        with pytest.raises(ValueError, match=cause):
            frames.decode_into(stored, codec, raw_size, [(0, whole[:10]), (100, whole[100:])])


def test_frames_that_do_not_decode_raise_value_error() -> None:
    stored, codec = frames.encode(memoryview(bytes(1 << 16)), 1, 2)
    with pytest.raises(ValueError, match="expected"):
        frames.decode(stored, codec, (1 << 16) + 2)
    with pytest.raises(ValueError, match="65537 bytes are not a whole number of 2-byte elements"):
        frames.decode(stored, codec, (1 << 16) + 1)
    with pytest.raises(ValueError, match="does not decompress"):
        frames.decode(b"not zstd at all", codec, 1 << 16)


def test_frame_table_round_trip_and_validation() -> None:
    rng = random.Random(1)
    data = bytes(rng.randrange(256) for _ in range(10_000))
    crcs = [checksum(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    table = FrameTable.raw(4096, crcs, len(data))
    assert list(table.sizes) == [4096, 4096, 1808] and table.size == len(data)
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
