"""How fast an endpoint moves bytes for s3ckpt (``s3ckpt bench``): one object of random bytes
uploaded as a save uploads, then read back with one ranged GET per part as a load reads,
checked, and deleted (with its bucket, if the probe made one) whatever happens."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from ..config import S3Config, parse_s3_url
from ..crc32c import checksum
from ..dcp.fetching import run_all
from ..engine import bridge
from ..engine.contract import ObjectStore, Stats
from ..engine.store import get_store
from ..errors import S3CkptError
from ..format.readplan import Fetch, Target
from .listing import Transfer

__all__ = ["Probe", "probe"]

_MB = 1e6  # throughput in decimal MB/s, as storage vendors quote it
_TICK_S = 0.2  # how often the upload bar reads the bytes sent so far
Bars = Callable[[str, str], contextlib.AbstractContextManager[Transfer | None]]


@dataclass(frozen=True)
class Probe:
    """Where the probe ran, and its ``upload`` and ``download`` phases: seconds, MB/s,
    requests."""

    endpoint: str
    url: str
    phases: dict[str, dict[str, float]]


def probe(
    url: str | None,
    size: int,
    config: S3Config | None = None,
    bars: Bars | None = None,
    *,
    announce: Callable[[str, int], None] | None = None,
) -> Probe:
    """Probe with ``size`` bytes under ``url`` (``None``: in a bucket of its own, made and
    deleted); ``bars(unit, title)`` shows each phase's progress, ``announce(where, size)`` says
    where it writes before it starts."""
    store = get_store(config)
    token = secrets.token_hex(6)
    if url is None:
        bucket, prefix, temporary = f"s3ckpt-bench-{token}", "", True
    else:
        (bucket, prefix), temporary = parse_s3_url(url), False
    key = f"{prefix}/s3ckpt-bench-{token}" if prefix else f"s3ckpt-bench-{token}"
    if announce is not None:
        announce(f"s3://{bucket}/{key} at {store.endpoint}", size)
    payload = _Random(os.urandom(size))
    phases = bridge.run(_measure(store, bucket, key, payload, temporary, bars or _no_bars))
    return Probe(store.endpoint, f"s3://{bucket}/{key}", phases)


@contextlib.contextmanager
def _no_bar(unit: str, title: str) -> Any:
    yield None


_no_bars: Bars = _no_bar


@dataclass(frozen=True)
class _Random:
    """Random bytes (no store can compress or deduplicate them), served as `Payload` views."""

    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    def views(self, start: int, end: int) -> list[memoryview]:
        return [memoryview(self.data)[start:end]]

    def read(self, start: int, end: int, scratch: memoryview) -> memoryview:
        return memoryview(self.data)[start:end]

    def checksum(self, start: int, end: int) -> int:
        return checksum(memoryview(self.data)[start:end])


async def _measure(
    store: ObjectStore, bucket: str, key: str, payload: _Random, temporary: bool, bars: Bars
) -> dict[str, dict[str, float]]:
    """Upload, then read back with one ranged GET per part (as loads do), checking the bytes;
    ``bars(unit, title)`` shows each phase's progress. The object, and a temporary bucket, are
    deleted whatever happens."""
    step = store.config.part_size
    ranges = [(at, min(at + step, payload.size)) for at in range(0, payload.size, step)]
    parts = len(ranges) if payload.size > store.config.multipart_threshold else 1
    if temporary:
        await store.create_bucket(bucket)
    try:
        with bars("parts", "bench: upload") as bar:
            started = time.perf_counter()
            await _watched(
                store.upload(bucket, key, payload), store.stats, payload.size, parts, bar
            )
            upload_s = time.perf_counter() - started
        sink = memoryview(bytearray(payload.size))
        plan = [Fetch(key, s, e, [Target(0, key, s, e, sink=sink[s:e])]) for s, e in ranges]
        with bars("GETs", "bench: download") as bar:
            started = time.perf_counter()
            await run_all(store, bucket, plan, {}, _counter(len(plan), payload.size, bar))
            download_s = time.perf_counter() - started
        if sink != payload.data:
            raise S3CkptError(f"s3://{bucket}/{key}: the bytes read back differ from those sent")
    finally:
        await asyncio.shield(_clean_up(store, bucket, key, temporary))
    return {
        "upload": _phase(payload.size, upload_s, parts),
        "download": _phase(payload.size, download_s, len(ranges)),
    }


async def _watched(
    upload: Coroutine[Any, Any, None], stats: Stats, size: int, parts: int, bar: Transfer | None
) -> None:
    """Run ``upload`` of ``size`` bytes in ``parts``, showing the bytes acknowledged so far on
    ``bar``: the store reports nothing until the whole object is up, so its byte counter is read
    every tick (the parts done are estimated from it)."""
    if bar is None:
        await upload
        return
    base = stats.bytes_sent

    async def tick() -> None:
        while True:
            sent = stats.bytes_sent - base
            bar(sent * parts // size, parts, sent, size)
            await asyncio.sleep(_TICK_S)

    ticker = asyncio.ensure_future(tick())
    try:
        await upload
    finally:
        ticker.cancel()
    bar(parts, parts, size, size)


def _counter(fetches: int, size: int, bar: Transfer | None) -> Callable[[Fetch], None] | None:
    """``run_all``'s ``done`` callback counting GETs and bytes into ``bar``."""
    if bar is None:
        return None
    done = [0, 0]

    def count(fetch: Fetch) -> None:
        done[0] += 1
        done[1] += fetch.end - fetch.start
        bar(done[0], fetches, done[1], size)

    return count


def _phase(size: int, seconds: float, requests: int) -> dict[str, float]:
    return {"seconds": seconds, "mb_per_s": size / _MB / seconds, "requests": requests}


async def _clean_up(store: ObjectStore, bucket: str, key: str, temporary: bool) -> None:
    await store.delete(bucket, [key])
    if temporary:
        await store.delete_bucket(bucket)
