"""Check a whole checkpoint against its checksums without loading it (and without torch)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..config import S3Config
from ..dcp.fetching import run_fetch
from ..dcp.prefix import read_prefix
from ..engine import bridge
from ..engine.contract import ObjectStore
from ..engine.store import get_store
from ..errors import ChecksumMismatch
from ..format.frames import FrameTable
from ..format.layout import Location
from ..format.readplan import Fetch, check_plan
from .listing import Transfer

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` read: every frame of every data object of the checkpoint at ``url``."""

    url: str
    objects: int
    frames: int
    bytes: int


def verify(
    url: str, config: S3Config | None = None, *, progress: Transfer | None = None
) -> VerifyReport:
    """Read every stored byte of a committed checkpoint and compare it with its CRC32C.

    Reads run concurrently in ranges of up to ``part_size``. ``progress(objects, total, bytes,
    total_bytes)`` counts the objects fully checked and the stored bytes read (from the I/O
    thread). Raises ChecksumMismatch naming the first damaged range (and how many there are), or
    the error that stopped the reading.
    """
    return bridge.run(_verify(Location.of(url), get_store(config), progress))


async def _verify(
    location: Location, store: ObjectStore, progress: Transfer | None
) -> VerifyReport:
    checkpoint = (await read_prefix(store, location)).require()
    tables = {location.key(key): table for key, table in sorted(checkpoint.frames.items())}
    limit = store.config.part_size
    fetches = {key: check_plan(key, table, limit) for key, table in tables.items()}
    plan = [(fetch, tables[key]) for key, planned in fetches.items() for fetch in planned]
    left = {key: len(planned) for key, planned in fetches.items()}
    total = sum(table.size for table in tables.values())
    done = [sum(not count for count in left.values()), 0]  # objects (empty ones are), bytes

    def report() -> None:
        if progress is not None:
            progress(done[0], len(tables), done[1], total)

    async def check(fetch: Fetch, table: FrameTable) -> None:
        await run_fetch(store, location.bucket, fetch, table)
        frames = table.frames(fetch.start, fetch.end)
        done[1] += table.starts[frames.stop] - table.starts[frames.start]
        left[fetch.key] -= 1
        done[0] += not left[fetch.key]
        report()

    report()
    outcomes = await asyncio.gather(
        *(check(fetch, table) for fetch, table in plan), return_exceptions=True
    )
    damaged = [o for o in outcomes if isinstance(o, ChecksumMismatch)]
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, ChecksumMismatch):
            raise outcome
    if damaged:
        first = damaged[0]
        raise first.reworded(f"{first} ({len(damaged)} damaged range(s) in {location.url})")
    return VerifyReport(
        url=location.url,
        objects=len(tables),
        frames=sum(len(t.sizes) for t in tables.values()),
        bytes=sum(t.size for t in tables.values()),
    )
