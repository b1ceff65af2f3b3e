"""Part buffer pool and scatter routing (no I/O)."""

from __future__ import annotations

import random

from s3ckpt.engine.partpool import PartBuffers
from s3ckpt.scatter import Scatter


def test_scatter_routes_every_wanted_byte_whatever_the_chunking() -> None:
    rng = random.Random(5)
    for _ in range(300):
        start = rng.randrange(0, 50)
        stream = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        end = start + len(stream)
        wanted = []
        for _ in range(rng.randrange(1, 6)):  # may overlap, may leave gaps
            lo = rng.randrange(start, end)
            hi = rng.randrange(lo, end) + 1
            wanted.append((lo, memoryview(bytearray(hi - lo))))
        scatter = Scatter(start, wanted)
        at = 0
        while at < len(stream):
            step = rng.randrange(1, 64)
            scatter.write(stream[at : at + step])
            at += step
        assert scatter.position == end
        for offset, view in wanted:
            assert bytes(view) == stream[offset - start : offset - start + len(view)]


def test_scatter_resumes_from_its_position() -> None:
    view = memoryview(bytearray(10))
    scatter = Scatter(100, [(100, view)])
    scatter.write(b"abcd")
    assert scatter.position == 104
    scatter.write(b"efghij")
    assert bytes(view) == b"abcdefghij"


def test_part_buffers_are_reused_while_held_and_dropped_after() -> None:
    pool = PartBuffers(1024)
    with pool.held():
        with pool.borrow(1000) as first:
            first[:3] = b"xyz"
            address = first.obj
        with pool.borrow(500) as second:
            assert second.obj is address, "a returned buffer is lent again"
            assert len(second) == 500
        with pool.borrow(4096) as big:
            assert len(big) == 4096 and big.obj is not address
    assert pool._free == []
    with pool.borrow(10) as after:
        assert after.obj is not address


def test_views_are_the_parts_of_a_range_that_segments_want() -> None:
    a, b, c = bytearray(100), bytearray(50), bytearray(10)
    scatter = Scatter(0, [(0, memoryview(a)), (200, memoryview(b)), (220, memoryview(c))])
    ((at, view),) = scatter.views(10, 60)
    assert at == 0 and len(view) == 50
    view[:] = b"x" * 50
    assert a[10:60] == b"x" * 50 and a[:10] == bytes(10)
    assert [(at, len(v)) for at, v in scatter.views(90, 110)] == [(0, 10)], "clipped at its end"
    assert scatter.views(150, 160) == [], "nobody wants these bytes"
    assert [(at, len(v)) for at, v in scatter.views(215, 235)] == [(0, 20), (5, 10)]
    for at, v in scatter.views(215, 235):
        v[:] = bytes(range(at + 1, at + 1 + len(v)))
    assert b[15:35] == bytes(range(1, 21)) and c == bytes(range(6, 16))
