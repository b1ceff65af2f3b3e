"""Runs a read plan (`s3ckpt.format.readplan`): the fetches of a load, a verify or a bench.

Each fetch takes a request slot, allocates the buffers of its non-zero-copy targets only then,
reads its bytes (checking every frame when the object has a frame table, decoding compressed
frames in worker threads), and hands buffered bytes to their targets. A fetch without targets
only checks the stored frames it covers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore
from ..errors import StorageError
from ..format import frames
from ..format.frames import FrameTable
from ..format.readplan import Fetch, Target, destinations
from ..scatter import Scatter

__all__ = ["run_all", "run_fetch"]


async def run_all(
    store: ObjectStore,
    bucket: str,
    fetches: Sequence[Fetch],
    tables: Mapping[str, FrameTable],
    done: Callable[[Fetch], None] | None = None,
) -> None:
    """Every fetch, concurrently; ``done(fetch)`` after each. The first failure cancels the
    rest. ``tables[key]`` frames the object ``key``; an object without one is read unchecked."""

    async def one(fetch: Fetch) -> None:
        await run_fetch(store, bucket, fetch, tables.get(fetch.key))
        if done is not None:
            done(fetch)

    await gather_or_cancel(one(fetch) for fetch in fetches)


async def run_fetch(
    store: ObjectStore, bucket: str, fetch: Fetch, table: FrameTable | None
) -> None:
    """One fetch, under a request slot."""
    async with store.slot():
        segments, buffered = destinations(fetch)
        if table is None:
            await store.read_range(bucket, fetch.key, fetch.start, fetch.end, segments)
        elif table.compressed and fetch.targets:
            await _read_compressed(store, bucket, fetch, table, segments)
        else:
            start, end = table.covering(fetch.start, fetch.end)
            check = table.checksums.check(start)
            await store.read_range(bucket, fetch.key, start, end, segments, check)
        if buffered:
            await asyncio.get_running_loop().run_in_executor(None, _place_all, buffered)


def _place_all(buffered: list[tuple[Target, memoryview]]) -> None:
    for target, data in buffered:
        if target.place is not None:
            target.place(data)


async def _read_compressed(
    store: ObjectStore,
    bucket: str,
    fetch: Fetch,
    table: FrameTable,
    segments: list[tuple[int, memoryview]],
) -> None:
    """Fetch the frames holding a fetch's raw range and decode each, in a worker thread, into the
    destinations of its raw bytes (a frame that none wants is only checked)."""
    scatter = Scatter(0, segments)

    def place(number: int, stored: bytes) -> None:
        start, size = number * table.frame_size, table.raw_length(number)
        parts = scatter.views(start, start + size)
        if not parts:
            return
        try:
            frames.decode_into(stored, table.codecs[number], size, parts)
        except ValueError as e:
            raise StorageError(
                f"s3://{bucket}/{fetch.key} frame {number} (stored bytes {table.starts[number]}-"
                f"{table.starts[number + 1]}, raw bytes {start}-{start + size}): {e}",
                bucket=bucket,
                key=fetch.key,
                endpoint=store.endpoint,
                operation="decode",
                code="Undecodable",
            ) from None

    wanted = table.frames(fetch.start, fetch.end)
    await store.read_frames(bucket, fetch.key, table.checksums, wanted, place)
