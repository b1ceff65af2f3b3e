"""How checkpoints are found under a prefix: the listings and GETs behind `catalog` and `removal`.

A checkpoint is a "directory" holding ``.metadata`` (committed) or only ``data-<id>/`` objects (a
save that failed or is still running). Discovery goes one level deep with ``Delimiter="/"``, so a
parent prefix costs a listing page per 1000 children plus one small GET per checkpoint, never a
listing of the bucket. Everything here is a coroutine for the `bridge` loop; the synchronous API
is in `s3ckpt.tools.catalog`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TypeVar

from ..config import parse_s3_url
from ..dcp.prefix import AtPrefix, State, read_prefix, saves
from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore, StoredObject, Upload
from ..errors import MetadataError
from ..format import layout
from ..format.layout import Location
from ..format.record import Checkpoint

__all__ = [
    "CheckpointInfo",
    "Found",
    "Progress",
    "candidates",
    "committed",
    "found",
    "is_old",
    "live_saves",
    "location_of",
    "newness",
    "readable",
    "run_all",
    "step_of",
    "survey",
    "uploads",
]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while a long operation runs (objects, uploads or bytes)."""

# The last path component: "step-1000", "step_1000", "global_step1000", "ckpt-00042", "1000".
_STEP = re.compile(r"(?:[A-Za-z][A-Za-z_]*[-_]?)?(\d+)")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as a listing shows it.

    A committed one counts ``.metadata`` and the objects it references (leftovers of failed saves
    are `gc`'s business). An incomplete one counts its data objects (none, if a save died before
    one was complete: it has only multipart uploads), and ``created`` is its latest write. One
    whose ``.metadata`` cannot be read (damaged, or from a newer s3ckpt) is listed like an
    incomplete one, with the reason in ``unreadable``; removals never delete it.
    """

    url: str
    prefix: str
    committed: bool
    total_bytes: int
    num_objects: int
    created: datetime
    step: int | None
    save_id: str | None
    world_size: int | None
    compression: str | None
    unreadable: str | None = None  # why ``.metadata`` cannot be read (then not ``committed``)


@dataclass(frozen=True)
class Found:
    """A checkpoint and what removals need to act on it safely (its record's ETag and size)."""

    info: CheckpointInfo
    location: Location
    etag: str | None = None
    record_size: int = 0
    checkpoint: Checkpoint | None = None


def location_of(url: str) -> Location:
    return Location(*parse_s3_url(url))


def step_of(location: Location) -> int | None:
    match = _STEP.fullmatch(location.prefix.rpartition("/")[2])
    return int(match.group(1)) if match else None


def newness(info: CheckpointInfo) -> tuple[bool, int, datetime]:
    """Sort key: any step beats none, then the higher step, then the later creation."""
    return (info.step is not None, info.step or 0, info.created)


async def run_all(
    call: Callable[[T], Awaitable[R]], items: Iterable[T], store: ObjectStore
) -> list[R]:
    """``call`` on every item, at most ``max_concurrency`` at a time; results in order."""
    slots = asyncio.Semaphore(store.config.max_concurrency)

    async def one(item: T) -> R:
        async with slots:
            return await call(item)

    return await gather_or_cancel(one(item) for item in items)


def is_old(when: datetime, cutoff: datetime) -> bool:
    """In whole seconds, like the Date header: with ``older_than=0`` all that was listed is old."""
    return when.replace(microsecond=0) <= cutoff


def live_saves(data: Iterable[tuple[StoredObject, str]], now: datetime) -> set[str]:
    """Ids of the saves whose lease was refreshed within ``LEASE_TTL`` before ``now``."""
    fresh = now - timedelta(seconds=layout.LEASE_TTL)
    return {save_id for obj, save_id in data if layout.is_lease(obj.key) and obj.modified > fresh}


async def uploads(store: ObjectStore, location: Location) -> dict[str, list[tuple[Upload, str]]]:
    """Multipart uploads of data objects at ``location`` or a child, with their save ids, by
    checkpoint prefix."""
    owners: dict[str, list[tuple[Upload, str]]] = {}
    prefix = location.listing_prefix
    for upload in await store.list_uploads(location.bucket, prefix):
        rest = upload.key[len(prefix) :]
        child, _, tail = rest.partition("/")
        owner, save = location.prefix, layout.save_of(rest)
        if save is None and child:
            owner, save = location.key(child), layout.save_of(tail)
        if save is not None:
            owners.setdefault(owner, []).append((upload, save))
    return owners


async def candidates(
    store: ObjectStore, location: Location, *, with_uploads: bool = False
) -> tuple[list[Location], dict[str, list[tuple[Upload, str]]]]:
    """``location`` if it holds a checkpoint, then every child prefix (checkpoint or not), then
    (``with_uploads``) prefixes that hold only uploads; and the uploads by prefix."""
    listing = await store.list_objects(location.bucket, location.listing_prefix, delimiter=True)
    names = [p[len(location.listing_prefix) :].rstrip("/") for p in listing.prefixes]
    own = any(o.key == location.metadata_key for o in listing.objects)
    own = own or any(name.startswith("data-") for name in names)
    bucket = location.bucket
    children = [Location(bucket, location.key(n)) for n in names if n and not n.startswith("data-")]
    found = [location, *children] if own else children
    pending = await uploads(store, location) if with_uploads else {}
    known = {c.prefix for c in found}
    return found + [Location(bucket, p) for p in pending if p not in known], pending


def found(at: AtPrefix) -> Found:
    """A committed checkpoint as listings show it."""
    location, checkpoint = at.location, at.checkpoint
    assert checkpoint is not None
    try:
        created = datetime.fromtimestamp(checkpoint.created, timezone.utc)
    except (OverflowError, OSError, ValueError):
        message = f"{location.metadata_url}: created {checkpoint.created} is not a valid time"
        raise MetadataError(message, url=location.metadata_url) from None
    world_size = checkpoint.extra.get("world_size")
    compression = checkpoint.extra.get("compression")
    info = CheckpointInfo(
        url=location.url,
        prefix=location.prefix,
        committed=True,
        total_bytes=sum(checkpoint.objects.values()) + at.record_size,
        num_objects=len(checkpoint.objects) + 1,
        created=created,
        step=step_of(location),
        save_id=checkpoint.save_id,
        world_size=world_size if isinstance(world_size, int) else None,
        compression=compression if isinstance(compression, str) else None,
    )
    return Found(info, location, at.etag, at.record_size, checkpoint)


async def committed(store: ObjectStore, location: Location) -> Found | None:
    """The committed checkpoint at ``location``, or None; MetadataError if its record cannot
    be read."""
    at = await read_prefix(store, location)
    if at.error is not None:
        raise at.error
    return found(at) if at.state is State.COMMITTED else None


async def readable(store: ObjectStore, location: Location) -> Found | None:
    """Like `committed`, but an unreadable record is skipped with a warning (listing, latest)."""
    try:
        return await committed(store, location)
    except MetadataError as e:
        log.warning("skipping %s: %s", location.url, e)
        return None


async def _inspect(
    store: ObjectStore, location: Location, pending: list[tuple[Upload, str]]
) -> Found | None:
    """The checkpoint at ``location``, committed or not (its ``pending`` uploads count only for an
    incomplete one: a save killed early has nothing else); None if there is none."""
    at = await read_prefix(store, location)
    if at.state is State.COMMITTED:
        return found(at)
    unreadable = None if at.error is None else str(at.error)
    if unreadable is not None:
        log.warning("%s: %s", location.url, unreadable)
    # read_prefix listed the save objects unless it found a record it could not read
    unlisted = at.state is State.UNREADABLE
    data = [obj for obj, _ in (await saves(store, location))[0]] if unlisted else list(at.data)
    if not data and not pending and unreadable is None:
        return None
    start = len(location.listing_prefix)
    ids = {layout.save_of(obj.key[start:]) for obj in data} | {save for _, save in pending}
    info = CheckpointInfo(
        url=location.url,
        prefix=location.prefix,
        committed=False,
        total_bytes=sum(obj.size for obj in data),
        num_objects=len(data),
        created=max(
            [obj.modified for obj in data] + [u.initiated for u, _ in pending],
            default=datetime.fromtimestamp(0, timezone.utc),
        ),
        step=step_of(location),
        save_id=ids.pop() if len(ids) == 1 else None,
        world_size=None,
        compression=None,
        unreadable=unreadable,
    )
    return Found(info, location)


async def survey(store: ObjectStore, location: Location) -> list[Found]:
    """Every checkpoint at and directly under ``location``, committed or not, oldest first."""
    found_at, pending = await candidates(store, location, with_uploads=True)
    found = await run_all(lambda c: _inspect(store, c, pending.get(c.prefix, [])), found_at, store)
    return sorted((f for f in found if f is not None), key=lambda f: newness(f.info))
