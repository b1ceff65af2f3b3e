"""Packed: the bytes of an object of many items, read back by any range. No I/O."""

from __future__ import annotations

import random

import pytest
import torch

from s3ckpt.crc32c import checksum
from s3ckpt.format.packing import ALIGN, Packed


def _reference(values: list[torch.Tensor | bytes]) -> bytes:
    """The object as the format defines it: items back to back, each 8-byte aligned."""
    out = bytearray()
    for value in values:
        out += bytes(-len(out) % ALIGN)
        out += value if isinstance(value, bytes) else value.numpy().tobytes()
    return bytes(out)


def _items(rng: random.Random, count: int) -> list[torch.Tensor | bytes]:
    values: list[torch.Tensor | bytes] = []
    for _ in range(count):
        length = rng.choice([0, 1, 3, 8, 13, 64, 1000])
        if rng.random() < 0.3:
            values.append(rng.randbytes(length))
        else:
            values.append(torch.randint(0, 256, (length,), dtype=torch.uint8))
    return values


@pytest.mark.parametrize("seed", range(5))
def test_any_range_reads_the_packed_bytes(seed: int) -> None:
    rng = random.Random(seed)
    values = _items(rng, 200)
    packed = Packed(values, [None] * len(values), 1000)
    expected = _reference(values)
    assert packed.size == len(expected)
    scratch = memoryview(bytearray(packed.size))
    for _ in range(300):
        start = rng.randrange(packed.size)
        end = rng.randrange(start, packed.size + 1)
        assert bytes(packed.read(start, end, scratch)) == expected[start:end]


def test_a_range_inside_one_tensor_is_a_view_of_its_memory() -> None:
    tensor = torch.arange(100, dtype=torch.uint8)
    packed = Packed([b"abc", tensor, b""], [None, None, None], 1000)
    view = packed.view(10, 50)
    assert view is not None
    tensor[12] = 0  # a view, not a copy: it sees the change
    assert bytes(view) == bytes(tensor[2:42].numpy())
    assert packed.view(0, 20) is None  # spans the alignment gap after b"abc"


def test_views_give_any_range_without_a_copy() -> None:
    rng = random.Random(5)
    values = _items(rng, 40)
    packed = Packed(values, [None] * len(values), 1000)
    expected = _reference(values)
    for _ in range(300):
        start = rng.randrange(packed.size)
        end = rng.randrange(start, packed.size + 1)
        views = packed.views(start, end)
        assert views is not None
        assert b"".join(views) == expected[start:end]
    tensor = torch.arange(100, dtype=torch.uint8)
    views = Packed([b"abc", tensor], [None, None], 1000).views(0, 20)
    assert views is not None and [len(v) for v in views] == [3, 5, 12]  # item, gap, item
    tensor[0] = 99
    assert views[2][0] == 99  # the tensor's own memory, not a copy


def test_views_are_refused_for_memory_off_the_cpu() -> None:
    packed = Packed([b"abc", torch.empty(64, dtype=torch.uint8, device="meta")], [None, None], 1000)
    assert packed.views(0, 3) is not None
    assert packed.views(0, 20) is None


def test_frame_table_checksums_every_frame_of_the_packed_bytes() -> None:
    values = _items(random.Random(7), 300)
    packed = Packed(values, [None] * len(values), 1000)
    expected = _reference(values)
    table = packed.frame_table()
    assert table.raw_size == len(expected)
    assert list(table.crcs) == [
        checksum(expected[s : s + 1000]) for s in range(0, len(expected), 1000)
    ]


def test_checksum_of_any_range_matches_its_bytes() -> None:
    rng = random.Random(11)
    values = _items(rng, 300)
    packed = Packed(values, [None] * len(values), 1000)
    expected = _reference(values)
    ends = [0, 1000, 3000, packed.size]  # frame-aligned ranges reuse the frames' checksums
    ranges = [(a, b) for a in ends for b in ends if a <= b]
    for _ in range(200):
        start = rng.randrange(packed.size)
        ranges.append((start, rng.randrange(start, packed.size + 1)))
    for start, end in ranges:
        assert packed.checksum(start, end) == checksum(expected[start:end]), (start, end)
    assert list(packed.frame_table().crcs) == [
        checksum(expected[s : s + 1000]) for s in range(0, len(expected), 1000)
    ]
