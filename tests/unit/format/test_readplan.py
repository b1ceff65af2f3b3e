"""Tests for the byte-range planner: hand-written cases plus seeded randomized invariants.

The randomized tests compare against brute force (enumerating every element of a rectangle), so
they check the planner against the definition rather than against its own arithmetic.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import pytest

from s3ckpt.format.frames import ZSTD, FrameTable
from s3ckpt.format.readplan import (
    Merged,
    Target,
    check_plan,
    coalesce,
    covering_range,
    is_exact,
    plan_fetches,
    row_major_strides,
    split_rect,
)

SEED = 20240613
CASES = 3000

Rect = tuple[tuple[int, ...], tuple[int, ...]]


# --- brute force -------------------------------------------------------------------------------


def linear(shape: Sequence[int], index: Sequence[int]) -> int:
    """Row-major linear index by Horner's rule (independent of row_major_strides)."""
    lin = 0
    for dim, i in zip(shape, index, strict=True):
        lin = lin * dim + i
    return lin


def elements(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """Linear indices of the rectangle's elements, in row-major order."""
    axes = [range(o, o + n) for o, n in zip(offsets, lengths, strict=True)]
    return [linear(shape, idx) for idx in itertools.product(*axes)]


def brute_cover(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    lins = elements(shape, offsets, lengths)
    if not lins:
        return (0, 0)
    return (min(lins) * itemsize, (max(lins) + 1) * itemsize)


def random_rect(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A random chunk shape and sub-rectangle, biased towards full and length-1 dimensions."""
    ndim = rng.randint(0, 4)
    shape = tuple(0 if rng.random() < 0.03 else rng.randint(1, 6) for _ in range(ndim))
    offsets: list[int] = []
    lengths: list[int] = []
    for dim in shape:
        kind = rng.random()
        if kind < 0.35:
            o, n = 0, dim
        elif kind < 0.6 and dim > 0:
            o, n = rng.randrange(dim), 1
        else:
            o = rng.randint(0, dim)
            n = (
                rng.randint(0, dim - o)
                if rng.random() < 0.05
                else rng.randint(min(1, dim - o), dim - o)
            )
        offsets.append(o)
        lengths.append(n)
    return shape, tuple(offsets), tuple(lengths)


# --- row_major_strides / covering_range / is_exact: hand-written ---------------------------------


def test_strides() -> None:
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides((5,)) == (1,)
    assert row_major_strides(()) == ()
    assert row_major_strides((3, 0, 2)) == (0, 2, 1)


def test_1d() -> None:
    assert covering_range((10,), (2,), (3,), 4) == (8, 20)
    assert is_exact((10,), (2,), (3,))


def test_2d_row_slice_is_exact() -> None:
    assert covering_range((4, 5), (1, 0), (2, 5), 2) == (10, 30)
    assert is_exact((4, 5), (1, 0), (2, 5))
    # Part of a single row is contiguous too.
    assert covering_range((4, 5), (2, 1), (1, 3), 1) == (11, 14)
    assert is_exact((4, 5), (2, 1), (1, 3))


def test_2d_column_slice_is_not_exact() -> None:
    assert covering_range((4, 5), (0, 1), (4, 2), 1) == (1, 18)
    assert not is_exact((4, 5), (0, 1), (4, 2))


def test_3d() -> None:
    assert covering_range((2, 3, 4), (1, 1, 0), (1, 2, 4), 8) == (128, 192)
    assert is_exact((2, 3, 4), (1, 1, 0), (1, 2, 4))
    assert covering_range((2, 3, 4), (0, 1, 1), (2, 1, 2), 8) == (40, 152)
    assert not is_exact((2, 3, 4), (0, 1, 1), (2, 1, 2))
    # Full inner dims but a partial middle dim under an outer length > 1: not contiguous.
    assert not is_exact((2, 3, 4), (0, 0, 0), (2, 2, 4))


def test_0d() -> None:
    assert covering_range((), (), (), 4) == (0, 4)
    assert is_exact((), (), ())
    assert split_rect((), (), (), 4, 1) == [((), ())]


def test_empty() -> None:
    assert covering_range((4, 5), (1, 0), (0, 5), 4) == (0, 0)
    assert covering_range((0, 5), (0, 0), (0, 5), 4) == (0, 0)
    assert is_exact((4, 5), (0, 1), (4, 0))
    assert split_rect((4, 5), (1, 0), (0, 5), 4, 8) == []


# --- split_rect: hand-written ------------------------------------------------------------------


def test_split_rect_fits_unchanged() -> None:
    # The column block covers bytes [1, 18): 17 bytes.
    assert split_rect([4, 5], [0, 1], [4, 2], 1, 17) == [((0, 1), (4, 2))]  # lists in, tuples out
    assert split_rect((4, 5), (0, 1), (4, 2), 1, 16) == [((0, 1), (3, 2)), ((3, 1), (1, 2))]


def test_split_rect_rows() -> None:
    assert split_rect((4, 5), (0, 0), (4, 5), 4, 40) == [((0, 0), (2, 5)), ((2, 0), (2, 5))]
    assert split_rect((4, 5), (0, 0), (4, 5), 4, 59) == [((0, 0), (2, 5)), ((2, 0), (2, 5))]
    assert split_rect((4, 5), (0, 0), (4, 5), 4, 60) == [((0, 0), (3, 5)), ((3, 0), (1, 5))]


def test_split_rect_within_rows() -> None:
    pieces = split_rect((4, 5), (0, 0), (4, 5), 4, 12)
    assert pieces == [p for r in range(4) for p in [((r, 0), (1, 3)), ((r, 3), (1, 2))]]


def test_split_rect_column_slice() -> None:
    # Two rows of a 2-wide column block cover 5 + 2 = 7 bytes; three would cover 12.
    assert split_rect((4, 5), (0, 1), (4, 2), 1, 7) == [((0, 1), (2, 2)), ((2, 1), (2, 2))]


def test_split_rect_skips_leading_unit_dims() -> None:
    got = split_rect((3, 4, 5), (1, 0, 0), (1, 4, 5), 1, 10)
    assert got == [((1, 0, 0), (1, 2, 5)), ((1, 2, 0), (1, 2, 5))]


def test_split_rect_single_elements_when_itemsize_exceeds_limit() -> None:
    assert split_rect((3,), (0,), (3,), 8, 4) == [((0,), (1,)), ((1,), (1,)), ((2,), (1,))]


# --- coalesce: hand-written ------------------------------------------------------


def test_coalesce_basic_and_unsorted() -> None:
    got = coalesce([(0, 10), (12, 20), (100, 110)], max_gap=5, max_size=100)
    assert got == [Merged(0, 20, (0, 1)), Merged(100, 110, (2,))]
    got = coalesce([(100, 110), (0, 10), (12, 20)], max_gap=5, max_size=100)
    assert got == [Merged(0, 20, (1, 2)), Merged(100, 110, (0,))]


def test_coalesce_gap_and_size_limits_are_inclusive() -> None:
    assert coalesce([(0, 10), (15, 20)], max_gap=5, max_size=20) == [Merged(0, 20, (0, 1))]
    assert len(coalesce([(0, 10), (16, 20)], max_gap=5, max_size=20)) == 2
    assert len(coalesce([(0, 10), (15, 21)], max_gap=5, max_size=20)) == 2


def test_coalesce_overlapping_and_empty() -> None:
    assert coalesce([(0, 10), (5, 15)], max_gap=0, max_size=100) == [Merged(0, 15, (0, 1))]
    assert coalesce([(5, 5), (0, 10)], max_gap=0, max_size=100) == [Merged(0, 10, (1, 0))]
    assert coalesce([(7, 7)], max_gap=0, max_size=1) == [Merged(7, 7, (0,))]
    assert coalesce([], max_gap=0, max_size=1) == []


def test_coalesce_oversized_stays_alone_but_absorbs_contained() -> None:
    assert coalesce([(0, 100)], max_gap=0, max_size=10) == [Merged(0, 100, (0,))]
    assert coalesce([(0, 100), (10, 20)], max_gap=0, max_size=10) == [Merged(0, 100, (0, 1))]
    got = coalesce([(0, 100), (95, 105)], max_gap=0, max_size=10)
    assert got == [Merged(0, 100, (0,)), Merged(95, 105, (1,))]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: row_major_strides((2, -1)), "negative"),
        (lambda: covering_range((4,), (3,), (2,), 1), "exceeds"),
        (lambda: covering_range((4,), (-1,), (2,), 1), "negative"),
        (lambda: covering_range((4,), (0,), (-1,), 1), "negative"),
        (lambda: covering_range((4, 2), (0,), (1,), 1), "same number of dimensions"),
        (lambda: covering_range((4,), (0,), (1,), 0), "itemsize"),
        (lambda: is_exact((4,), (2,), (3,)), "exceeds"),
        (lambda: split_rect((4,), (0,), (4,), 1, 0), "max_bytes"),
        (lambda: split_rect((4,), (0,), (5,), 1, 8), "exceeds"),
        (lambda: coalesce([(0, 1)], max_gap=0, max_size=0), "max_size"),
        (lambda: coalesce([(0, 1)], max_gap=-1, max_size=1), "max_gap"),
        (lambda: coalesce([(0, 1), (5, 3)], max_gap=0, max_size=8), "range 1"),
        (lambda: coalesce([(-2, 1)], max_gap=0, max_size=8), "range 0"),
    ],
)
def test_validation(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# --- randomized invariants ---------------------------------------------------------------------


def test_random_covering_range_and_is_exact() -> None:
    rng = random.Random(SEED)
    seen = {True: 0, False: 0}
    for _ in range(CASES):
        shape, offsets, lengths = random_rect(rng)
        itemsize = rng.choice([1, 2, 4, 8])
        assert covering_range(shape, offsets, lengths, itemsize) == brute_cover(
            shape, offsets, lengths, itemsize
        ), (shape, offsets, lengths)
        lins = elements(shape, offsets, lengths)
        contiguous = not lins or max(lins) - min(lins) + 1 == len(lins)
        assert is_exact(shape, offsets, lengths) == contiguous, (shape, offsets, lengths)
        seen[contiguous] += 1
    assert min(seen.values()) > CASES // 10  # the generator exercises both outcomes


def _union(p: Rect, q: Rect) -> Rect | None:
    """The rectangle p + q when q continues p along exactly one dimension, else None."""
    differ = [k for k in range(len(p[0])) if (p[0][k], p[1][k]) != (q[0][k], q[1][k])]
    if len(differ) != 1 or p[0][differ[0]] + p[1][differ[0]] != q[0][differ[0]]:
        return None
    lens = list(p[1])
    lens[differ[0]] += q[1][differ[0]]
    return p[0], tuple(lens)


def test_random_split_rect() -> None:
    rng = random.Random(SEED + 1)
    multi = 0
    for _ in range(CASES):
        shape, offsets, lengths = random_rect(rng)
        itemsize = rng.choice([1, 2, 4, 8])
        start, end = brute_cover(shape, offsets, lengths, itemsize)
        max_bytes = rng.randint(1, end - start + 2 * itemsize)
        pieces = split_rect(shape, offsets, lengths, itemsize, max_bytes)
        ctx = (shape, offsets, lengths, itemsize, max_bytes, pieces)
        want = elements(shape, offsets, lengths)
        if not want:
            assert pieces == [], ctx
            continue
        if end - start <= max_bytes:
            assert pieces == [(offsets, lengths)], ctx
        # Row-major concatenation of the pieces is the rectangle itself: disjoint, exact tiling.
        got = [lin for offs, lens in pieces for lin in elements(shape, offs, lens)]
        assert got == want, ctx
        for offs, lens in pieces:
            assert all(n > 0 for n in lens), ctx
            lo, hi = brute_cover(shape, offs, lens, itemsize)
            assert hi - lo <= max(max_bytes, itemsize), ctx
        # Not needlessly fine: two consecutive pieces that form a rectangle would not fit.
        for p, q in itertools.pairwise(pieces):
            union = _union(p, q)
            if union is not None:
                lo, hi = brute_cover(shape, *union, itemsize)
                assert hi - lo > max_bytes, ctx
        multi += len(pieces) > 1
    assert multi > CASES // 4  # the generator exercises real splitting


def test_random_coalesce() -> None:
    rng = random.Random(SEED + 2)
    merges = 0
    for _ in range(CASES):
        n = rng.randint(0, 12)
        ranges = []
        for _ in range(n):
            s = rng.randint(0, 200)
            ranges.append((s, s + (0 if rng.random() < 0.1 else rng.randint(1, 40))))
        max_gap, max_size = rng.randint(0, 20), rng.randint(1, 80)
        got = coalesce(ranges, max_gap=max_gap, max_size=max_size)
        ctx = (ranges, max_gap, max_size, got)
        assert sorted(i for m in got for i in m.members) == list(range(n)), ctx
        for m in got:
            spans = [ranges[i] for i in m.members]
            assert [s for s, _ in spans] == sorted(s for s, _ in spans), ctx
            assert all(m.start <= s and e <= m.end for s, e in spans), ctx
            assert (m.start, m.end) == (min(s for s, _ in spans), max(e for _, e in spans)), ctx
            if m.end - m.start > max_size:
                assert ranges[m.members[0]] == (m.start, m.end), ctx
        for a, b in itertools.pairwise(got):
            assert a.start <= b.start, ctx
            fits = b.end <= a.end or b.end - a.start <= max_size
            assert b.start - a.end > max_gap or not fits, ctx
        merges += n - len(got)
    assert merges > CASES  # the generator exercises real merging


# --- check_plan: what `s3ckpt verify` reads ---------------------------------------------------

FRAME = 4096
RAW_SIZE = 9 * FRAME + 1000  # 10 frames, the last one short


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(FRAME, 10), (3 * FRAME, 4), (1 << 40, 1)],
    ids=["one-frame", "three-frames", "huge"],
)
def test_check_plan_covers_the_object_in_whole_frames_of_about_limit(
    limit: int, expected: int
) -> None:
    table = FrameTable.raw(FRAME, range(10), RAW_SIZE)
    fetches = check_plan("ck/data-x/00000-000", table, limit)
    assert len(fetches) == expected
    assert fetches[0].start == 0 and fetches[-1].end == RAW_SIZE
    for before, after in itertools.pairwise(fetches):
        assert before.end == after.start, "contiguous: no gap, no overlap"
    for fetch in fetches:
        assert fetch.key == "ck/data-x/00000-000" and fetch.targets == []
        assert fetch.start % FRAME == 0
        assert fetch.end % FRAME == 0 or fetch.end == RAW_SIZE, "whole frames"
        frames = table.frames(fetch.start, fetch.end)
        assert (frames.start, frames.stop) == (fetch.start // FRAME, -(-fetch.end // FRAME))
        stored_start, stored_end = table.covering(fetch.start, fetch.end)
        stored = stored_end - stored_start
        if fetch is not fetches[-1]:
            assert limit <= stored < limit + FRAME, "about limit stored bytes"
        else:
            assert 0 < stored < limit + FRAME
    assert (
        sum(table.covering(f.start, f.end)[1] - table.covering(f.start, f.end)[0] for f in fetches)
        == table.size
    )


def test_check_plan_of_a_compressed_table_counts_stored_bytes() -> None:
    """Frames stored in 1000 bytes each: a limit of 2500 stored bytes takes 3 frames a fetch,
    while the fetches' ranges stay in raw bytes."""
    table = FrameTable(FRAME, (1000,) * 10, (0,) * 10, (ZSTD,) * 10, RAW_SIZE)
    assert table.size == 10_000
    fetches = check_plan("k", table, 2500)
    assert [(f.start, f.end) for f in fetches] == [
        (0, 3 * FRAME),
        (3 * FRAME, 6 * FRAME),
        (6 * FRAME, 9 * FRAME),
        (9 * FRAME, RAW_SIZE),
    ]


def test_an_object_without_frames_is_fetched_at_exact_ranges() -> None:
    sink = memoryview(bytearray(250))
    targets = [
        Target(0, "f", 1003, 1253, sink=sink),  # cut every max_size bytes: concurrent GETs
        Target(1, "f", 1260, 1270, place=lambda data: None),  # merged across a small gap
        Target(2, "f", 5000, 5004, place=lambda data: None),  # too far: a GET of its own
    ]
    fetches = plan_fetches(targets, max_gap=64, max_size=100, align={})
    assert [(f.start, f.end) for f in fetches] == [
        (1003, 1100),
        (1100, 1200),
        (1200, 1270),
        (5000, 5004),
    ]
    assert sum(len(t.sink or b"") for f in fetches for t in f.targets) == 250
