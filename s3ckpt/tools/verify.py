"""Check a whole checkpoint against its checksums without loading it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..config import S3Config
from ..dcp.prefix import read_prefix
from ..dcp.reads import run_fetch
from ..engine import bridge
from ..engine.contract import ObjectStore
from ..engine.store import get_store
from ..errors import ChecksumMismatch
from ..format.layout import Location
from ..format.readplan import check_plan

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """What `verify` read: every frame of every data object of the checkpoint at ``url``."""

    url: str
    objects: int
    frames: int
    bytes: int


def verify(url: str, config: S3Config | None = None) -> VerifyReport:
    """Read every stored byte of a committed checkpoint and compare it with its CRC32C.

    Reads run concurrently in ranges of up to ``part_size``. Raises ChecksumMismatch naming the
    first damaged range (and how many there are), or the error that stopped the reading.
    """
    return bridge.run(_verify(Location.of(url), get_store(config)))


async def _verify(location: Location, store: ObjectStore) -> VerifyReport:
    checkpoint = (await read_prefix(store, location)).require()
    tables = {location.key(key): table for key, table in sorted(checkpoint.frames.items())}
    limit = store.config.part_size
    plan = [
        (fetch, table) for key, table in tables.items() for fetch in check_plan(key, table, limit)
    ]
    outcomes = await asyncio.gather(
        *(run_fetch(store, location.bucket, fetch, table) for fetch, table in plan),
        return_exceptions=True,
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
