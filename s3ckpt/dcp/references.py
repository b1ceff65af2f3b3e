"""What a run's committed records reference: the objects that no removal may delete.

An incremental save references its siblings' objects (`layout.reference`), so an object of one
checkpoint may be needed by any committed record under the same parent prefix: `in_use` reads
them all (a listing of the run's child prefixes, a HEAD per record, and a GET and decode only of
records not seen before in this process: the ETag names the content). A record that cannot be
read references what nobody knows; removals then keep every data object of the run.

`protected` is what removals and an overwriting commit consult last, before they delete data:
the references, then the leases of the saves they would delete from, listed within
`layout.PIN_GRACE` of reading the records. Incremental saves pin what they reference until
their commit and leave the pins to expire `layout.LEASE_TTL` after it, so a save that commits
between the two steps is seen by its record or by its pins, and one that pins after the leases
were listed finds the records it would have referenced already deleted. A pin names the save
that holds it (`layout.pin_owner`): once that save's record is read committed, the record
protects what it references and the pin no longer counts, so retention need not wait for it
to expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore
from ..errors import MetadataError
from ..format import layout
from ..format.layout import Location
from ..format.record import decode
from .prefix import live_saves, read_record, saves

__all__ = ["InUse", "Protected", "Record", "in_use", "protected", "records", "run_of", "siblings"]

log = logging.getLogger(__name__)

_CONCURRENCY = 16


@dataclass(frozen=True)
class Record:
    """What removals need of one committed record: its ETag and size, its save's id and the
    absolute keys of the objects it references in its siblings; or, when it cannot be read
    (damaged, from a newer s3ckpt), why (``unreadable``): then what it references is unknown."""

    location: Location
    etag: str | None
    size: int
    save_id: str = ""
    references: frozenset[str] = frozenset()
    unreadable: str | None = None


# (bucket, record key, ETag) -> what was read of the record; bounded, oldest out first.
_SEEN: OrderedDict[tuple[str, str, str], Record] = OrderedDict()
_SEEN_MAX = 1024


@dataclass(frozen=True)
class InUse:
    """The objects a run's committed records reference in their siblings (absolute keys), the
    saves those records committed, and the records whose references are unknown because they
    cannot be read."""

    keys: frozenset[str]
    unknown: tuple[str, ...] = ()
    saves: frozenset[str] = frozenset()

    def keeps(self, key: str) -> bool:
        return bool(self.unknown) or key in self.keys


@dataclass(frozen=True)
class Protected:
    """What no removal may delete: objects that records of the run reference, and the objects
    of saves (``(checkpoint prefix, save id)``) whose lease is live."""

    used: dict[str | None, InUse]  # by `run_of`
    live: frozenset[tuple[str, str]]

    def keeps(self, location: Location, key: str) -> bool:
        """Whether ``key`` (absolute, an object of the checkpoint at ``location``) stays."""
        used = self.used.get(run_of(location))
        if used is None or used.keeps(key):
            return True
        save = layout.save_of(key[len(location.listing_prefix) :])
        return (location.prefix, save or "") in self.live


def run_of(location: Location) -> str | None:
    """The run a checkpoint belongs to (its parent prefix); None for the bucket's root, which
    is no top-level checkpoint's sibling."""
    return location.parent.prefix if location.prefix else None


async def protected(
    store: ObjectStore,
    checkpoints: Collection[Location],
    *,
    ignoring: Collection[str] = (),
    writers: bool = True,
) -> Protected:
    """What must stay of the objects of ``checkpoints``: the references of their runs' records
    (but those in ``ignoring``: being deleted), then the live leases of their saves (without
    ``writers``, only pins: gc breaking writers' leases), listed within `layout.PIN_GRACE` of
    reading the records. A pin held by a save whose record was read committed does not count:
    that record protects what the save references. Slower than that three times, it keeps
    everything."""
    semaphore = asyncio.Semaphore(_CONCURRENCY)

    async def leased(checkpoint: Location, committed: frozenset[str]) -> set[tuple[str, str]]:
        async with semaphore:
            data, now, _ = await saves(store, checkpoint)
        found = live_saves(data, now, writers=writers, committed=committed)
        return {(checkpoint.prefix, s) for s in found}

    for _ in range(3):
        began = time.monotonic()
        used: dict[str | None, InUse] = {}
        for checkpoint in checkpoints:
            run = run_of(checkpoint)
            if run not in used:
                used[run] = await in_use(store, checkpoint, ignoring=ignoring)
        listing = (leased(c, used[run_of(c)].saves) for c in checkpoints)
        live = set().union(*await gather_or_cancel(listing))
        if time.monotonic() - began < layout.PIN_GRACE:
            return Protected(used, frozenset(live))
        log.info("reading the records and leases took over %.0f s: again", layout.PIN_GRACE)
    log.warning("records and leases could not be read within %.0f s: all kept", layout.PIN_GRACE)
    everything = InUse(frozenset(), ("(not read in time)",))
    return Protected({run_of(c): everything for c in checkpoints}, frozenset())


async def siblings(store: ObjectStore, location: Location) -> list[Location]:
    """The checkpoints of ``location``'s run (itself included): the child prefixes of its
    parent, but not the parent's own ``data-`` directories. A checkpoint at the bucket's root
    has no run: just itself."""
    if not location.prefix:
        return [location]
    parent = location.parent
    listing = await store.list_objects(parent.bucket, parent.listing_prefix, delimiter=True)
    start = len(parent.listing_prefix)
    names = {p[start:].rstrip("/") for p in listing.prefixes} | {location.name}
    return [
        Location(parent.bucket, parent.key(name))
        for name in sorted(names)
        if name and not layout.is_save_dir(name)
    ]


async def in_use(
    store: ObjectStore, location: Location, *, ignoring: Collection[str] = ()
) -> InUse:
    """What the committed records of ``location``'s run reference, leaving out the records
    whose keys are in ``ignoring`` (those a removal is deleting)."""
    found = [c for c in await siblings(store, location) if c.metadata_key not in ignoring]
    keys: set[str] = set()
    unknown, committed = [], set()
    for record in await records(store, found):
        if record is None:
            continue
        if record.unreadable is not None:
            unknown.append(record.location.metadata_url)
        else:
            keys |= record.references
            committed.add(record.save_id)
    return InUse(frozenset(keys), tuple(unknown), frozenset(committed))


async def records(store: ObjectStore, checkpoints: Collection[Location]) -> list[Record | None]:
    """The committed record at each of ``checkpoints`` (None: there is none): a HEAD each, and
    a GET and decode only of records not seen before in this process (the ETag names the
    content). One that cannot be read is logged and returned with why."""
    semaphore = asyncio.Semaphore(_CONCURRENCY)

    async def one(checkpoint: Location) -> Record | None:
        async with semaphore:
            return await _record(store, checkpoint)

    return await gather_or_cancel(one(c) for c in checkpoints)


async def _record(store: ObjectStore, location: Location) -> Record | None:
    head = await store.head(location.bucket, location.metadata_key)
    if head is None:
        return None
    seen = (location.bucket, location.metadata_key, head.etag or "")
    if head.etag and seen in _SEEN:
        _SEEN.move_to_end(seen)
        return _SEEN[seen]
    try:
        found = await read_record(store, location)
        if found is None:
            return None
        raw, etag = found
        checkpoint = decode(raw, url=location.metadata_url, max_size=store.config.max_record_size)
    except MetadataError as e:
        log.warning("%s: what it references is unknown, its data is kept: %s", location.url, e)
        return Record(location, head.etag, head.size, unreadable=str(e))
    keys = frozenset(location.key(key) for key in checkpoint.objects if layout.is_reference(key))
    record = Record(location, etag, len(raw), checkpoint.save_id, keys)
    if etag:
        _SEEN[(location.bucket, location.metadata_key, etag)] = record
        while len(_SEEN) > _SEEN_MAX:
            _SEEN.popitem(last=False)
    return record
