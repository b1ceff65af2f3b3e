"""How checkpoints are found under a prefix: the listings and GETs behind `catalog` and `removal`.

A checkpoint is a "directory" holding ``.metadata`` (committed) or only ``data-<id>/`` objects (a
save that failed or is still running). The removals go one level deep (`candidates`, with
``Delimiter="/"``), so a parent prefix costs a listing page per 1000 children plus one small GET
per checkpoint, never a listing of the bucket; listing and ``latest`` search every depth
(`s3ckpt.tools.search`). An incomplete checkpoint costs one ListParts per multipart upload, since a
save killed mid-upload holds its bytes there. Everything here is a coroutine for the `bridge`
loop; the synchronous API is in `s3ckpt.tools.catalog`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from ..config import parse_s3_url
from ..dcp.prefix import AtPrefix, State, live_saves, read_prefix
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
    "Transfer",
    "candidates",
    "committed",
    "found",
    "incomplete",
    "is_old",
    "live_saves",
    "location_of",
    "newness",
    "readable",
    "run_all",
    "survey",
    "upload_bytes",
    "uploads",
]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while a long operation runs (objects, uploads or bytes)."""
Transfer = Callable[[int, int, int, int], None]
"""Called as ``progress(done, total, done_bytes, total_bytes)``: objects and their bytes."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as a listing shows it; ``state`` is committed, incomplete or unreadable
    (or, in ``s3ckpt ls``, referenced: removed, but later checkpoints of the run reference all
    of its remaining objects, which stay until none does).

    A committed one counts ``.metadata`` and the objects it references (leftovers of failed saves
    are `gc`'s business). An incomplete one counts its data objects and the parts of its
    multipart uploads (a save killed early has nothing else: ``num_objects`` 0), and ``created``
    is its latest write. One whose ``.metadata`` cannot be read (damaged, or from a newer s3ckpt)
    is listed like an incomplete one, with the reason in ``unreadable``; removals never delete it.

    What the record says of the save (``None`` for an incomplete one): ``world_size``,
    ``tensors``, ``logical_bytes`` (the state's bytes), ``stored_bytes`` (its own data objects')
    and ``referenced_bytes`` (the state's bytes it references in earlier checkpoints of the run
    instead of storing them: incremental saves), ``references`` (those checkpoints' names),
    ``frame_size``, and what `S3Writer` records in ``extra`` (``None`` in records written before
    it did): ``compression`` (``"zstd"``; ``None`` with ``torch_version`` set: stored raw),
    ``compression_level``, ``s3ckpt_version``, ``torch_version``.
    """

    url: str
    prefix: str
    state: str
    committed: bool
    total_bytes: int
    num_objects: int
    created: datetime
    step: int | None
    save_id: str | None
    world_size: int | None = None
    compression: str | None = None
    compression_level: int | None = None
    frame_size: int | None = None
    s3ckpt_version: str | None = None
    torch_version: str | None = None
    tensors: int | None = None
    logical_bytes: int | None = None
    stored_bytes: int = 0
    referenced_bytes: int = 0
    references: tuple[str, ...] = ()
    uploads: int = 0  # multipart uploads in progress (counted for incomplete checkpoints)
    upload_bytes: int = 0  # the bytes of their parts so far
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
    own = own or any(layout.is_save_dir(name) for name in names)
    bucket = location.bucket
    children = [Location(bucket, location.key(n)) for n in names if n and not layout.is_save_dir(n)]
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
    extra = checkpoint.extra
    frame_sizes = {table.frame_size for table in checkpoint.frames.values()}
    info = CheckpointInfo(
        url=location.url,
        prefix=location.prefix,
        state="committed",
        committed=True,
        total_bytes=checkpoint.stored_bytes + at.record_size,
        num_objects=sum(not layout.is_reference(key) for key in checkpoint.objects) + 1,
        created=created,
        step=layout.step_of(location.prefix),
        save_id=checkpoint.save_id,
        world_size=_recorded(extra, "world_size", int),
        compression=_recorded(extra, "compression", str),
        compression_level=_recorded(extra, "compression_level", int),
        frame_size=frame_sizes.pop() if len(frame_sizes) == 1 else None,
        s3ckpt_version=_recorded(extra, "s3ckpt_version", str),
        torch_version=_recorded(extra, "torch_version", str),
        tensors=checkpoint.tensors,
        logical_bytes=checkpoint.logical_bytes,
        stored_bytes=checkpoint.stored_bytes,
        referenced_bytes=checkpoint.referenced_bytes,
        references=tuple(sorted({sibling for sibling, _ in checkpoint.referenced_saves})),
    )
    return Found(info, location, at.etag, at.record_size, checkpoint)


def _recorded(extra: dict[str, Any], name: str, kind: type[R]) -> R | None:
    """``extra[name]`` if the record holds one of ``kind`` (``extra`` is free-form, and records
    from older writers lack the field)."""
    value = extra.get(name)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


async def committed(store: ObjectStore, location: Location) -> Found | None:
    """The committed checkpoint at ``location``, or None; MetadataError if its record cannot
    be read."""
    at = await read_prefix(store, location, below=False)
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


async def upload_bytes(store: ObjectStore, bucket: str, pending: Iterable[Upload]) -> int:
    """The bytes of the parts uploaded so far (one ListParts per upload)."""
    parts = await run_all(lambda u: store.list_parts(bucket, u), pending, store)
    return sum(part.size for listed in parts for part in listed)


async def incomplete(
    store: ObjectStore,
    location: Location,
    data: list[StoredObject],
    pending: list[tuple[Upload, str]],
    unreadable: str | None = None,
) -> Found:
    """A checkpoint without a readable record, from its saves' objects and uploads: their parts
    are listed, since a save killed mid-upload holds its bytes there."""
    parts = await run_all(lambda u: store.list_parts(location.bucket, u[0]), pending, store)
    start = len(location.listing_prefix)
    ids = {layout.save_of(obj.key[start:]) for obj in data} | {save for _, save in pending}
    stored = sum(obj.size for obj in data)
    in_parts = sum(part.size for listed in parts for part in listed)
    written = [obj.modified for obj in data] + [u.initiated for u, _ in pending]
    written += [part.modified for listed in parts for part in listed]
    info = CheckpointInfo(
        url=location.url,
        prefix=location.prefix,
        state="incomplete" if unreadable is None else "unreadable",
        committed=False,
        total_bytes=stored + in_parts,
        num_objects=len(data),
        created=max(written, default=datetime.fromtimestamp(0, timezone.utc)),
        step=layout.step_of(location.prefix),
        save_id=ids.pop() if len(ids) == 1 else None,
        stored_bytes=stored,
        uploads=len(pending),
        upload_bytes=in_parts,
        unreadable=unreadable,
    )
    return Found(info, location)


async def survey(store: ObjectStore, location: Location) -> list[Found]:
    """The committed checkpoints at and directly under ``location``, oldest first; one whose
    record cannot be read is skipped with a warning."""
    found_at, _ = await candidates(store, location)
    found = await run_all(lambda c: readable(store, c), found_at, store)
    return sorted((f for f in found if f is not None), key=lambda f: newness(f.info))
