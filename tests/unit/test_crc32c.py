"""CRC32C and the check of checksummed ranges as a read streams them. No server."""

from __future__ import annotations

import itertools
import random

import pytest

from s3ckpt.crc32c import Checksums, StreamCheck, checksum, combine
from s3ckpt.format.frames import FrameTable


def ranges_of(data: bytes, starts: tuple[int, ...]) -> Checksums:
    """The checksums of ``data`` cut at ``starts`` (which end with ``len(data)``)."""
    crcs = tuple(checksum(data[a:b]) for a, b in itertools.pairwise(starts))
    return Checksums(starts, crcs)


DATA = bytes(random.Random(7).randrange(256) for _ in range(10_000))
STARTS = (0, 3000, 7000, 10_000)


def test_frame_check_finds_the_damaged_frame_and_restarts_it() -> None:
    data = bytearray(range(256)) * 40  # 10,240 bytes: frames of 4096, 4096, 2048
    crcs = [checksum(bytes(data[i : i + 4096])) for i in range(0, len(data), 4096)]
    table = FrameTable.raw(4096, crcs, len(data))
    check = table.checksums.check(4096)
    check.feed(4096, data[4096:6000])
    assert check.resume_point() == 4096, "a broken stream restarts at its frame's start"
    data[9000] ^= 1
    with pytest.raises(StreamCheck.Mismatch) as info:
        check.feed(4096, data[4096:])
    assert (info.value.start, info.value.end) == (8192, 10_240)


def test_a_check_must_start_at_a_range_boundary() -> None:
    checksums = ranges_of(DATA, STARTS)
    assert checksums.object_size == 10_000
    for start in STARTS[:-1]:
        assert checksums.check(start).resume_point() == start
    for start in (1, 2999, 3001, 9999):
        with pytest.raises(ValueError):
            checksums.check(start)


@pytest.mark.parametrize("piece", [len(DATA), 1], ids=["whole", "1-byte-pieces"])
def test_an_intact_object_passes_fed_whole_or_in_pieces(piece: int) -> None:
    check = ranges_of(DATA, STARTS).check(0)
    for position in range(0, len(DATA), piece):
        check.feed(position, DATA[position : position + piece])
    assert check.resume_point() == STARTS[-1], "every range was checked"


@pytest.mark.parametrize("piece", [len(DATA), 1], ids=["whole", "1-byte-pieces"])
def test_a_flipped_byte_in_the_second_range_is_a_mismatch_of_that_range(piece: int) -> None:
    checksums = ranges_of(DATA, STARTS)
    damaged = bytearray(DATA)
    damaged[5000] ^= 0x10
    check = checksums.check(0)
    with pytest.raises(StreamCheck.Mismatch) as info:
        for position in range(0, len(damaged), piece):
            check.feed(position, damaged[position : position + piece])
    assert (info.value.start, info.value.end) == (3000, 7000)
    assert info.value.expected == checksums.crcs[1]
    assert info.value.actual == checksum(damaged[3000:7000]) != info.value.expected
    assert check.resume_point() == 3000, "a retry starts again at the damaged range"


def test_crc32c_of_nothing_and_continued_over_a_split() -> None:
    assert checksum(b"") == 0
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value
    for k in (0, 1, 4321, len(DATA)):
        assert checksum(DATA) == checksum(DATA[k:], checksum(DATA[:k]))
    assert checksum(DATA[1:], checksum(DATA[:1])) != checksum(DATA[1:]), "the seed counts"


@pytest.mark.parametrize("lengths", [(0, 0), (0, 7), (7, 0), (1, 1), (1000, 4096), (5 << 20, 3)])
def test_combine_gives_the_checksum_of_the_concatenation(lengths: tuple[int, int]) -> None:
    rng = random.Random(sum(lengths))
    first, second = (rng.randbytes(n) for n in lengths)
    combined = combine(checksum(first), checksum(second), len(second))
    assert combined == checksum(first + second)
