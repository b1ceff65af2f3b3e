"""How checkpoints are found under a prefix: the listings and GETs behind `catalog` and `removal`.

A checkpoint is a "directory" holding ``.metadata`` (committed) or only ``data-<id>/`` objects (a
save that failed or is still running). Discovery goes one level deep with ``Delimiter="/"``, so a
parent prefix costs a listing page per 1000 children plus one small GET per checkpoint, never a
listing of the bucket. Everything here is a coroutine for the `bridge` loop; the synchronous API
is in `s3ckpt.tools.catalog`.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from ..config import S3Config, parse_s3_url
from ..engine.clients import map_error
from ..engine.store import Transfer, gather_or_cancel, get_transfer
from ..errors import MetadataError, ObjectNotFound
from ..format import layout
from ..format.layout import Location
from ..format.record import Checkpoint, check_record_size, decode

__all__ = [
    "CheckpointInfo",
    "Found",
    "Progress",
    "StoredObject",
    "Upload",
    "candidates",
    "committed",
    "data_objects",
    "is_lease",
    "is_old",
    "live_saves",
    "location_of",
    "newness",
    "readable",
    "run_all",
    "step_of",
    "survey",
    "transfer_for",
    "uploads",
    "utc",
]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while a long operation runs (objects, uploads or bytes)."""

# The last path component: "step-1000", "step_1000", "global_step1000", "ckpt-00042", "1000".
_STEP = re.compile(r"(?:[A-Za-z][A-Za-z_]*[-_]?)?(\d+)")
# An object of a save relative to its checkpoint (layout.data_key, with or without its hash
# directory, or layout.lease_key); the group is the save id.
_DATA = re.compile(r"data-([^/]+)/(?:[0-9a-f]+/)?[^/]+")


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
class Upload:
    """A multipart upload in progress."""

    key: str
    upload_id: str
    initiated: datetime


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    modified: datetime


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


def transfer_for(config: S3Config | None) -> Transfer:
    return get_transfer(config or S3Config())


def step_of(location: Location) -> int | None:
    match = _STEP.fullmatch(location.prefix.rpartition("/")[2])
    return int(match.group(1)) if match else None


def newness(info: CheckpointInfo) -> tuple[bool, int, datetime]:
    """Sort key: any step beats none, then the higher step, then the later creation."""
    return (info.step is not None, info.step or 0, info.created)


async def run_all(
    call: Callable[[T], Awaitable[R]], items: Iterable[T], transfer: Transfer
) -> list[R]:
    """``call`` on every item, at most ``max_concurrency`` at a time; results in order."""
    slots = asyncio.Semaphore(transfer.config.max_concurrency)

    async def one(item: T) -> R:
        async with slots:
            return await call(item)

    return await gather_or_cancel(one(item) for item in items)


def _server_time(reply: dict[str, Any]) -> datetime:
    """The reply's Date, so that ages do not depend on this machine's clock."""
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return datetime.now(timezone.utc)


def utc(when: datetime) -> datetime:
    return when.astimezone(timezone.utc)


def is_old(when: datetime, cutoff: datetime) -> bool:
    """In whole seconds, like the Date header: with ``older_than=0`` all that was listed is old."""
    return when.replace(microsecond=0) <= cutoff


async def _list(
    transfer: Transfer, bucket: str, prefix: str, *, delimiter: bool = False
) -> tuple[list[StoredObject], list[str], datetime]:
    """Objects under ``prefix`` (with LastModified), child prefixes, and the server's time."""
    objects: list[StoredObject] = []
    prefixes: list[str] = []
    params: dict[str, Any] = {"Delimiter": "/"} if delimiter else {}
    now: datetime | None = None
    while True:
        reply = await transfer._call(
            "list_objects_v2", bucket, prefix or None, Prefix=prefix, MaxKeys=1000, **params
        )
        now = now or _server_time(reply)
        objects += [
            StoredObject(o["Key"], int(o["Size"]), utc(o["LastModified"]))
            for o in reply.get("Contents", [])
        ]
        prefixes += [p["Prefix"] for p in reply.get("CommonPrefixes", [])]
        if not reply.get("IsTruncated"):
            return objects, prefixes, now
        params["ContinuationToken"] = reply["NextContinuationToken"]


def is_lease(key: str) -> bool:
    return key.rpartition("/")[2] == layout.LEASE_NAME


def live_saves(data: Iterable[tuple[StoredObject, str]], now: datetime) -> set[str]:
    """Ids of the saves whose lease was refreshed within ``LEASE_TTL`` before ``now``."""
    fresh = now - timedelta(seconds=layout.LEASE_TTL)
    return {save_id for obj, save_id in data if is_lease(obj.key) and obj.modified > fresh}


async def data_objects(
    transfer: Transfer, location: Location
) -> tuple[list[tuple[StoredObject, str]], datetime]:
    """The checkpoint's ``data-<id>/`` objects (leases included) with their save ids, and the
    server's time."""
    objects, _, now = await _list(transfer, location.bucket, location.key("data-"))
    start = len(location.listing_prefix)
    matches = ((obj, _DATA.fullmatch(obj.key[start:])) for obj in objects)
    return [(obj, match.group(1)) for obj, match in matches if match], now


async def uploads(transfer: Transfer, location: Location) -> dict[str, list[tuple[Upload, str]]]:
    """Multipart uploads of data objects at ``location`` or a child, with their save ids, by
    checkpoint prefix."""
    owners: dict[str, list[tuple[Upload, str]]] = {}
    prefix, markers = location.listing_prefix, dict[str, Any]()
    while True:
        reply = await transfer._call(
            "list_multipart_uploads", location.bucket, prefix, Prefix=prefix, **markers
        )
        for raw in reply.get("Uploads", []):
            rest = raw["Key"][len(prefix) :]
            child, _, tail = rest.partition("/")
            owner, match = location.prefix, _DATA.fullmatch(rest)
            if match is None and child:
                owner, match = location.key(child), _DATA.fullmatch(tail)
            if match is not None:
                upload = Upload(raw["Key"], raw["UploadId"], utc(raw["Initiated"]))
                owners.setdefault(owner, []).append((upload, match.group(1)))
        if not reply.get("IsTruncated"):
            return owners
        markers = {"KeyMarker": reply["NextKeyMarker"]}
        markers["UploadIdMarker"] = reply["NextUploadIdMarker"]


async def candidates(
    transfer: Transfer, location: Location, *, with_uploads: bool = False
) -> tuple[list[Location], dict[str, list[tuple[Upload, str]]]]:
    """``location`` if it holds a checkpoint, then every child prefix (checkpoint or not), then
    (``with_uploads``) prefixes that hold only uploads; and the uploads by prefix."""
    objects, prefixes, _ = await _list(
        transfer, location.bucket, location.listing_prefix, delimiter=True
    )
    names = [p[len(location.listing_prefix) :].rstrip("/") for p in prefixes]
    own = any(o.key == location.metadata_key for o in objects)
    own = own or any(name.startswith("data-") for name in names)
    bucket = location.bucket
    children = [Location(bucket, location.key(n)) for n in names if n and not n.startswith("data-")]
    found = [location, *children] if own else children
    pending = await uploads(transfer, location) if with_uploads else {}
    known = {c.prefix for c in found}
    return found + [Location(bucket, p) for p in pending if p not in known], pending


async def committed(transfer: Transfer, location: Location) -> Found | None:
    """The committed checkpoint at ``location`` (one GET of ``.metadata``), or None."""
    key = location.metadata_key
    try:
        reply = await transfer._call("get_object", location.bucket, key, Key=key)
    except ObjectNotFound:
        return None
    try:
        async with reply["Body"] as body:
            limit = transfer.config.max_record_size
            check_record_size(reply["ContentLength"], limit, location.metadata_url)
            raw: bytes = await body.read()
    except MetadataError:
        raise
    except Exception as e:  # the connection broke mid-body
        raise map_error(
            e, endpoint=transfer.endpoint, bucket=location.bucket, key=key, operation="get_object"
        ) from e
    checkpoint = decode(raw, url=location.metadata_url)
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
        total_bytes=sum(checkpoint.objects.values()) + len(raw),
        num_objects=len(checkpoint.objects) + 1,
        created=created,
        step=step_of(location),
        save_id=checkpoint.save_id,
        world_size=world_size if isinstance(world_size, int) else None,
        compression=compression if isinstance(compression, str) else None,
    )
    return Found(info, location, str(reply["ETag"]), len(raw), checkpoint)


async def readable(transfer: Transfer, location: Location) -> Found | None:
    """Like `committed`, but an unreadable record is skipped with a warning (listing, latest)."""
    try:
        return await committed(transfer, location)
    except MetadataError as e:
        log.warning("skipping %s: %s", location.url, e)
        return None


async def _inspect(
    transfer: Transfer, location: Location, pending: list[tuple[Upload, str]]
) -> Found | None:
    """The checkpoint at ``location``, committed or not (its ``pending`` uploads count only for an
    incomplete one: a save killed early has nothing else); None if there is none."""
    unreadable = None
    try:
        found = await committed(transfer, location)
    except MetadataError as e:
        log.warning("%s: %s", location.url, e)
        found, unreadable = None, str(e)
    if found is not None:
        return found
    data, _ = await data_objects(transfer, location)
    if not data and not pending and unreadable is None:
        return None
    ids = {save_id for _, save_id in data + pending}
    info = CheckpointInfo(
        url=location.url,
        prefix=location.prefix,
        committed=False,
        total_bytes=sum(obj.size for obj, _ in data),
        num_objects=len(data),
        created=max(
            [obj.modified for obj, _ in data] + [u.initiated for u, _ in pending],
            default=datetime.fromtimestamp(0, timezone.utc),
        ),
        step=step_of(location),
        save_id=ids.pop() if len(ids) == 1 else None,
        world_size=None,
        compression=None,
        unreadable=unreadable,
    )
    return Found(info, location)


async def survey(transfer: Transfer, location: Location) -> list[Found]:
    """Every checkpoint at and directly under ``location``, committed or not, oldest first."""
    found_at, pending = await candidates(transfer, location, with_uploads=True)
    found = await run_all(
        lambda c: _inspect(transfer, c, pending.get(c.prefix, [])), found_at, transfer
    )
    return sorted((f for f in found if f is not None), key=lambda f: newness(f.info))
