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

    async def write(self, chunk: Any) -> None:
        self.chunks.append(bytes(chunk))


def _written(body: Body, length: int | None) -> list[bytes]:
    writer = _Writer()
    asyncio.run(body.write_with_length(writer, length))  # type: ignore[arg-type]
    return writer.chunks


@pytest.mark.parametrize("length", [None, 0, 5, SLICE + 7, 3 * SLICE])
def test_a_body_writes_its_buffers_in_order_up_to_the_length(length: int | None) -> None:
    buffers = [b"head", bytes(range(256)) * (SLICE // 128), memoryview(b"tail" * 3)]
    whole = b"".join(bytes(b) for b in buffers)
    body = Body(buffers)
    assert len(body) == len(whole) and body.size == len(whole)
    chunks = _written(body, length)
    assert b"".join(chunks) == whole[:length]
    assert all(len(c) <= SLICE for c in chunks)


def test_a_body_never_copies_a_buffer_into_a_bigger_one() -> None:
    big = bytearray(5 * SLICE + 1)
    chunks = _written(Body([big]), None)
    assert [len(c) for c in chunks] == [SLICE] * 5 + [1]


def test_an_empty_body_writes_nothing() -> None:
    assert len(Body([])) == 0
    assert _written(Body([b""]), None) == []
