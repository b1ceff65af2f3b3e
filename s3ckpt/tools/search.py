"""Checkpoints at every depth below a URL: what ``s3ckpt ls`` and ``latest`` search.

One listing of the URL's prefix without a delimiter finds them all, whatever the depth (``run7/``,
``team/run7/``, the bucket's root): it costs one LIST request per 1000 keys below the URL (every
data object is a key), plus one small GET per checkpoint listed (``latest``: only per step, from
the highest down) and, for incomplete checkpoints, one ListParts per multipart upload. A URL with
ten runs of a hundred checkpoints of 33 objects each is 33 LIST requests.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from ..dcp.prefix import State, read_prefix
from ..engine.contract import ObjectStore, StoredObject, Upload
from ..format import layout
from ..format.layout import Location
from .listing import Found, found, incomplete, newness, readable, run_all

__all__ = ["Listed", "highest", "latest", "listed", "survey_all", "tree_order"]

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"(\d+(?:\.\d+)?)")


@dataclass
class Listed:
    """A checkpoint prefix as one listing of everything under a URL shows it: whether it holds
    ``.metadata``, its saves' objects, and (when asked for) its uploads with their save ids."""

    location: Location
    record: bool = False
    data: list[StoredObject] = field(default_factory=list)
    uploads: list[tuple[Upload, str]] = field(default_factory=list)


def tree_order(prefix: str) -> list[tuple[list[Any], str]]:
    """Sort key: by path, each component in natural order, its numbers by value (``step-2``
    before ``step-10``, ``kill0.03`` before ``kill0.1``); equal values (``step-01``, ``step-1``)
    by their text."""
    # Split on the numbers, text and numbers alternate, so equal positions compare alike.
    return [
        ([Decimal(piece) if i % 2 else piece for i, piece in enumerate(_NUMBER.split(part))], part)
        for part in prefix.split("/")
    ]


def _owner(relative: str) -> tuple[str, str | None] | None:
    """The checkpoint (its prefix relative to the listing) that a key belongs to, and the save
    that wrote it (None: it is the checkpoint's ``.metadata``); None for any other key."""
    parts = relative.split("/")
    for i, part in enumerate(parts[:-1]):
        if layout.is_save_dir(part):
            save = layout.save_of("/".join(parts[i:]))
            if save is not None:
                return "/".join(parts[:i]), save
    head, _, name = relative.rpartition("/")
    return (head, None) if name == layout.METADATA_NAME else None


async def listed(
    store: ObjectStore, location: Location, *, with_uploads: bool = False
) -> list[Listed]:
    """Every prefix at or below ``location``, at any depth, that holds a ``.metadata`` or a
    save's objects (or, ``with_uploads``, a save's multipart uploads), in `tree_order`.

    One listing without a delimiter: one LIST request per 1000 keys under ``location``, and as
    many for the uploads when asked for.
    """
    start, bucket = len(location.listing_prefix), location.bucket
    by_prefix: dict[str, Listed] = {}

    def at(relative: str) -> Listed:
        prefix = location.key(relative) if relative else location.prefix
        if prefix not in by_prefix:
            by_prefix[prefix] = Listed(Location(bucket, prefix))
        return by_prefix[prefix]

    for obj in (await store.list_objects(bucket, location.listing_prefix)).objects:
        owner = _owner(obj.key[start:])
        if owner is not None:
            relative, save = owner
            if save is None:
                at(relative).record = True
            else:
                at(relative).data.append(obj)
    if with_uploads:
        for upload in await store.list_uploads(bucket, location.listing_prefix):
            owner = _owner(upload.key[start:])
            if owner is not None and owner[1] is not None:
                at(owner[0]).uploads.append((upload, owner[1]))
    return sorted(by_prefix.values(), key=lambda c: tree_order(c.location.prefix))


async def _inspect_listed(store: ObjectStore, candidate: Listed) -> Found | None:
    """The checkpoint a listing found: its record is read if the listing showed one."""
    location = candidate.location
    if candidate.record:
        at = await read_prefix(store, location, below=False)
        if at.state is State.COMMITTED:
            return found(at)
        if at.error is not None:
            log.warning("%s: %s", location.url, at.error)
            return await incomplete(
                store, location, candidate.data, candidate.uploads, str(at.error)
            )
    if not candidate.data and not candidate.uploads:
        return None  # its .metadata was deleted after the listing
    return await incomplete(store, location, candidate.data, candidate.uploads)


async def survey_all(store: ObjectStore, location: Location) -> list[Found]:
    """Every checkpoint at or below ``location``, at any depth, committed or not, in
    `tree_order` (see `listed` for what it costs)."""
    candidates = await listed(store, location, with_uploads=True)
    found = await run_all(lambda c: _inspect_listed(store, c), candidates, store)
    referenced = {
        f.location.key(key)
        for f in found
        if f is not None and f.checkpoint is not None
        for key in f.checkpoint.objects
        if layout.is_reference(key)
    }
    for i, (candidate, f) in enumerate(zip(candidates, found, strict=True)):
        if f is not None and f.info.state == "incomplete" and not candidate.uploads:
            data = [obj.key for obj in candidate.data if not layout.is_lease(obj.key)]
            if data and all(key in referenced for key in data):
                found[i] = dataclasses.replace(
                    f, info=dataclasses.replace(f.info, state="referenced")
                )
    return [f for f in found if f is not None]


async def latest(store: ObjectStore, location: Location) -> Found | None:
    """The committed checkpoint with the highest step at or below ``location`` (then the
    newest). Records are read from the highest step down, so a long run costs a few GETs."""
    tied = await highest(store, location)
    return tied[0] if tied else None


async def highest(store: ObjectStore, location: Location) -> list[Found]:
    """Every committed checkpoint at or below ``location`` with the highest step, newest first:
    several runs under one URL may tie."""
    by_step: dict[int | None, list[Location]] = {}
    for candidate in await listed(store, location):
        if candidate.record:
            by_step.setdefault(layout.step_of(candidate.location.prefix), []).append(
                candidate.location
            )
    for step in sorted(by_step, key=lambda s: (s is not None, s or 0), reverse=True):
        found = await run_all(lambda c: readable(store, c), by_step[step], store)
        committed = [f for f in found if f is not None]
        if committed:
            return sorted(committed, key=lambda f: newness(f.info), reverse=True)
    return []
