"""The frame codec's stored format: what a reader of any version must be able to decode."""

from __future__ import annotations

import os

import pytest
import torch
import zstandard

from s3ckpt.format import frames


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
