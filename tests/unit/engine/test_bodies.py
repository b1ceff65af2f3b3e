"""Body: buffers sent back to back in slices, never joined. No I/O."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from s3ckpt.engine.bodies import SLICE, Body


class _Writer:
    """What aiohttp's StreamWriter does with a body: takes chunks, in order."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.given: list[Any] = []

    async def write(self, chunk: Any) -> None:
        self.chunks.append(bytes(chunk))
        self.given.append(chunk)


def _writer_of(body: Body, length: int | None) -> _Writer:
    writer = _Writer()
    asyncio.run(body.write_with_length(writer, length))  # type: ignore[arg-type]
    return writer


def _written(body: Body, length: int | None) -> list[bytes]:
    return _writer_of(body, length).chunks


@pytest.mark.parametrize("length", [None, 0, 5, SLICE + 7, 3 * SLICE])
def test_a_body_writes_its_buffers_in_order_up_to_the_length(length: int | None) -> None:
    buffers = [b"head", bytes(range(256)) * (SLICE // 128), memoryview(b"tail" * 3)]
    whole = b"".join(bytes(b) for b in buffers)
    body = Body(buffers)
    assert len(body) == len(whole) and body.size == len(whole)
    chunks = _written(body, length)
    assert b"".join(chunks) == whole[:length]
    assert all(len(c) <= SLICE for c in chunks)


def test_a_large_buffer_is_written_as_views_of_its_own_memory() -> None:
    big = bytearray(5 * SLICE + 1)
    writer = _writer_of(Body([big]), None)
    assert [len(c) for c in writer.chunks] == [SLICE] * 5 + [1]
    assert all(isinstance(c, memoryview) and c.obj is big for c in writer.given)


def test_runs_of_small_buffers_are_written_together() -> None:
    small = [bytes([i % 256]) * 100 for i in range(3000)]  # 300 KB of 100-byte tensors
    big = bytearray(b"x" * (SLICE // 2))
    writer = _writer_of(Body([*small, big, b"tail"]), None)
    assert b"".join(writer.chunks) == b"".join([*small, bytes(big), b"tail"])
    assert len(writer.chunks) == 3  # the small ones, the big one (itself), the tail
    assert writer.given[1].obj is big


def test_an_empty_body_writes_nothing() -> None:
    assert len(Body([])) == 0
    assert _written(Body([b""]), None) == []
