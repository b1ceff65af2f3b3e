"""What a prefix holds: a committed checkpoint, an incomplete one, nothing, or an unreadable
record. The one reader of commit records: loads, verify, the catalog, gc and the commit's
read-back all go through `read_prefix`, so they agree on what each state means.

A prefix that holds nothing is often a run's prefix (``run7`` for ``run7/step-000300``): then
`read_prefix` looks one level down, so that the error names the run's latest checkpoint.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore, RetryPolicy, StoredObject, Upload
from ..errors import CheckpointNotFound, IncompleteCheckpoint, MetadataError, ObjectNotFound
from ..format import layout
from ..format.layout import Location
from ..format.record import Checkpoint, check_record_size, decode

__all__ = [
    "AtPrefix",
    "Saves",
    "State",
    "live_saves",
    "read_prefix",
    "read_record",
    "saves",
]

# Child prefixes whose ``.metadata`` a prefix holding nothing checks (one HEAD each, the highest
# steps first): enough to name a run's latest checkpoint, bounded for a run of thousands.
_MAX_BELOW = 128


class State(enum.Enum):
    COMMITTED = "committed"  # a readable ``.metadata``
    INCOMPLETE = "incomplete"  # no ``.metadata``, but data objects or uploads of a save
    NOTHING = "nothing"  # neither
    UNREADABLE = "unreadable"  # a ``.metadata`` that cannot be decoded (or is too large)


@dataclass(frozen=True)
class AtPrefix:
    """What `read_prefix` found at ``location``."""

    location: Location
    state: State
    checkpoint: Checkpoint | None = None  # COMMITTED
    etag: str | None = None  # COMMITTED: the record's, for removals that must not race a save
    record_size: int = 0  # COMMITTED
    error: MetadataError | None = None  # UNREADABLE: why
    data: tuple[StoredObject, ...] = ()  # INCOMPLETE: the data objects (and leases) of saves
    uploads: tuple[Upload, ...] = ()  # INCOMPLETE without data objects: uploads of saves
    below: tuple[Location, ...] = ()  # NOTHING: committed checkpoints one level down, latest first
    children: int = 0  # NOTHING: child prefixes one level down (at most _MAX_BELOW checked)

    def require(self) -> Checkpoint:
        """The committed checkpoint, or the error that says why there is none."""
        location = self.location
        if self.checkpoint is not None:
            return self.checkpoint
        if self.error is not None:
            raise self.error
        if self.state is State.INCOMPLETE:
            example = self.data[0].key if self.data else self.uploads[0].key
            raise IncompleteCheckpoint(
                f"{location.url} is incomplete: objects or uploads exist (e.g. s3://"
                f"{location.bucket}/{example}) but no .metadata — a save failed, was killed, "
                "or is running",
                url=location.url,
            )
        if self.below:
            count = len(self.below)
            counted = f"{count} checkpoint{'s' if count > 1 else ''}"
            if self.children > _MAX_BELOW:
                counted = (
                    f"at least {counted} (in the {_MAX_BELOW} highest-numbered of its "
                    f"{self.children} child prefixes)"
                )
            raise CheckpointNotFound(
                f"{location.url} is a run with {counted}, not a checkpoint; the latest is "
                f"{self.below[0].url} (`s3ckpt ls {location.url}` lists them)",
                url=location.url,
            )
        raise CheckpointNotFound(
            f"no checkpoint at {location.url}: nothing is stored at this prefix (no .metadata, "
            "no data objects of a save) nor directly below it",
            url=location.url,
        )


async def read_record(
    store: ObjectStore, location: Location, retry: RetryPolicy | None = None
) -> tuple[bytes, str | None] | None:
    """The raw record and its ETag (``None``: there is none); one over
    ``max_record_size`` raises MetadataError before its body is read."""
    limit, url = store.config.max_record_size, location.metadata_url
    try:
        blob = await store.get(
            location.bucket,
            location.metadata_key,
            check_size=lambda size: check_record_size(size, limit, url),
            retry=retry,
        )
    except ObjectNotFound:
        return None
    return blob.data, blob.etag


async def read_prefix(store: ObjectStore, location: Location, *, below: bool = True) -> AtPrefix:
    """One GET of ``.metadata``; without one, a listing of data objects (and of uploads if
    there are none); if there are none either and ``below``, a listing of the child prefixes and
    a HEAD of the ``.metadata`` of each (at most `_MAX_BELOW`, the highest steps first), for
    `AtPrefix.require`'s error. Tools that walk a listing of prefixes pass ``below=False``."""
    try:
        found = await read_record(store, location)
    except MetadataError as e:
        return AtPrefix(location, State.UNREADABLE, error=e)
    if found is not None:
        raw, etag = found
        try:
            checkpoint = decode(
                raw, url=location.metadata_url, max_size=store.config.max_record_size
            )
        except MetadataError as e:
            return AtPrefix(location, State.UNREADABLE, error=e)
        return AtPrefix(location, State.COMMITTED, checkpoint, etag, len(raw))
    data = tuple(obj for obj, _ in (await saves(store, location)).objects)
    if data:
        return AtPrefix(location, State.INCOMPLETE, data=data)
    start = len(location.listing_prefix)
    listed = await store.list_uploads(location.bucket, location.key("data-"))
    uploads = tuple(u for u in listed if layout.save_of(u.key[start:]) is not None)
    if uploads:
        return AtPrefix(location, State.INCOMPLETE, uploads=uploads)
    if not below:
        return AtPrefix(location, State.NOTHING)
    committed, children = await _committed_below(store, location)
    return AtPrefix(location, State.NOTHING, below=committed, children=children)


async def _committed_below(
    store: ObjectStore, location: Location
) -> tuple[tuple[Location, ...], int]:
    """The committed checkpoints directly below ``location`` (of the `_MAX_BELOW` children
    with the highest steps), latest first, and how many children there are."""
    listing = await store.list_objects(location.bucket, location.listing_prefix, delimiter=True)
    start = len(location.listing_prefix)
    names = [p[start:].rstrip("/") for p in listing.prefixes]
    children = [
        Location(location.bucket, location.key(name))
        for name in names
        if name and not layout.is_save_dir(name)
    ]
    children.sort(
        key=lambda c: (layout.step_of(c.prefix) is not None, layout.step_of(c.prefix) or 0)
    )
    checked = children[::-1][:_MAX_BELOW]
    heads = await gather_or_cancel(store.head(c.bucket, c.metadata_key) for c in checked)
    found = [c for c, head in zip(checked, heads, strict=True) if head is not None]
    return tuple(found), len(children)


class Saves(NamedTuple):
    """What the ``data-`` keys at a prefix hold: the objects of saves (data objects and leases,
    committed or not) with their save ids, the server's time, and the keys that s3ckpt's writer
    does not name (`layout.save_of`), which no removal touches."""

    objects: list[tuple[StoredObject, str]]
    now: datetime
    foreign: tuple[str, ...]


async def saves(store: ObjectStore, location: Location) -> Saves:
    """One listing of the ``data-`` keys at ``location`` (a page per 1000)."""
    listing = await store.list_objects(location.bucket, location.key("data-"))
    start = len(location.listing_prefix)
    objects, foreign = [], []
    for obj in listing.objects:
        save = layout.save_of(obj.key[start:])
        if save is None:
            foreign.append(obj.key)
        else:
            objects.append((obj, save))
    return Saves(objects, listing.server_time, tuple(foreign))


def live_saves(
    data: Iterable[tuple[StoredObject, str]],
    now: datetime,
    *,
    writers: bool = True,
    pins: bool = True,
    committed: Collection[str] = (),
) -> set[str]:
    """Ids of the saves whose lease was refreshed within ``LEASE_TTL`` before ``now``. Without
    ``writers``, the writers' own leases do not count (gc ``--break-leases`` breaks those);
    without ``pins``, pins do not (readers', and incremental saves' on what they reference:
    `layout.is_pin`); nor does the pin of a save in ``committed``, whose record is known to be
    committed and so protects what it references (`layout.pin_owner`)."""
    fresh = now - timedelta(seconds=layout.LEASE_TTL)
    live = set()
    for obj, save_id in data:
        if not layout.is_lease(obj.key) or obj.modified <= fresh:
            continue
        if layout.is_pin(obj.key):
            counts = pins and layout.pin_owner(obj.key) not in committed
        else:
            counts = writers
        if counts:
            live.add(save_id)
    return live
