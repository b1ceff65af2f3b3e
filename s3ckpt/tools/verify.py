"""Check a whole checkpoint against its checksums without loading it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..config import S3Config
from ..dcp.reader import read_checkpoint
from ..engine import bridge
from ..engine.store import Transfer, get_transfer
from ..errors import ChecksumMismatch
from ..format.frames import FrameCheck, FrameTable
from ..format.layout import Location

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
    return bridge.run(_verify(Location.of(url), get_transfer(config or S3Config())))


async def _verify(location: Location, transfer: Transfer) -> VerifyReport:
    checkpoint = await read_checkpoint(transfer, location)
    ranges = [
        (location.key(key), table, start, end)
        for key, table in sorted(checkpoint.frames.items())
        for start, end in _spans(table, transfer.config.part_size)
    ]

    async def check(key: str, table: FrameTable, start: int, end: int) -> None:
        async with transfer.slot():
            check = FrameCheck(table, start)
            await transfer.get_scattered(location.bucket, key, start, end, [], check)

    outcomes = await asyncio.gather(*(check(*r) for r in ranges), return_exceptions=True)
    damaged = [o for o in outcomes if isinstance(o, ChecksumMismatch)]
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, ChecksumMismatch):
            raise outcome
    if damaged:
        first = damaged[0]
        raise ChecksumMismatch(
            f"{first} ({len(damaged)} damaged range(s) in {location.url})",
            **{k: v for k, v in first.__dict__.items() if k != "message"},
        )
    tables = checkpoint.frames.values()
    return VerifyReport(
        url=location.url,
        objects=len(checkpoint.frames),
        frames=sum(len(t.sizes) for t in tables),
        bytes=sum(t.size for t in tables),
    )


def _spans(table: FrameTable, limit: int) -> list[tuple[int, int]]:
    """Consecutive whole-frame ranges of about ``limit`` bytes that cover the object."""
    spans: list[tuple[int, int]] = []
    start = 0
    for end in table.starts[1:]:
        if end - start >= limit or end == table.size:
            spans.append((start, end))
            start = end
    return spans
