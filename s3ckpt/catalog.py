"""Find, inspect and clean up checkpoints under a prefix: what ``s3ckpt ls/latest/rm/prune/gc`` do.

A checkpoint is a "directory" holding ``.metadata`` (committed) or only ``data-<id>/`` objects (a
save that failed or is still running). Discovery goes one level deep with ``Delimiter="/"``, so a
parent prefix costs a listing page per 1000 children plus one small GET per checkpoint, never a
listing of the bucket. Removal deletes ``.metadata`` first, so a checkpoint stops being loadable
at once and a crash midway leaves only unreferenced objects, which `gc` finds later. `gc` judges
each save (``data-<id>/``) as a whole, by its newest object or uploaded part, so a save that is
still running somewhere is left alone even if it started long ago.

The functions are synchronous; the I/O runs on the `bridge` loop through the shared `Transfer`.
Removals plan, then call ``confirm`` (in the caller's thread) with what they would remove, and
only then delete.
"""

from __future__ import annotations

import asyncio
import email.utils
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from . import bridge
from .client import map_error
from .config import S3Config, parse_s3_url
from .errors import (
    AccessDenied,
    CheckpointNotFound,
    ConfigError,
    IncompleteCheckpoint,
    MetadataError,
    ObjectNotFound,
    StorageError,
)
from .layout import Location
from .metadata import Checkpoint, decode
from .transfer import Transfer, gather_or_cancel, get_transfer

__all__ = [
    "CheckpointInfo",
    "GcReport",
    "Progress",
    "Removal",
    "Upload",
    "delete",
    "describe",
    "gc",
    "latest",
    "list_checkpoints",
    "prune",
]

T = TypeVar("T")
R = TypeVar("R")

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)``, counting objects and uploads, while a removal runs."""

# The last path component: "step-1000", "step_1000", "global_step1000", "ckpt-00042", "1000".
_STEP = re.compile(r"(?:[A-Za-z][A-Za-z_]*[-_]?)?(\d+)")
# A data object's key relative to its checkpoint (layout.data_key); the group is the save id.
_DATA = re.compile(r"data-([^/]+)/[^/]+")
_BATCH = 1000  # DeleteObjects' limit


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as a listing shows it.

    A committed one counts ``.metadata`` and the objects it references (leftovers of failed saves
    are `gc`'s business). An incomplete one counts its data objects (none, if a save died before
    one was complete: it has only multipart uploads), and ``created`` is its latest write.
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


@dataclass(frozen=True)
class Upload:
    """A multipart upload in progress."""

    key: str
    upload_id: str
    initiated: datetime


@dataclass(frozen=True)
class Removal:
    """What a removal deleted; ``confirm`` gets one that says what it would delete."""

    bucket: str
    deleted: tuple[str, ...] = ()
    aborted: tuple[Upload, ...] = ()
    bytes_freed: int = 0


@dataclass(frozen=True)
class GcReport(Removal):
    """`gc`'s result; ``skipped`` were too young (or their checkpoint changed while gc ran)."""

    skipped: tuple[str, ...] = ()
    skipped_uploads: tuple[Upload, ...] = ()
    dry_run: bool = False


@dataclass(frozen=True)
class _Object:
    key: str
    size: int
    modified: datetime


@dataclass(frozen=True)
class _Found:
    info: CheckpointInfo
    location: Location
    etag: str | None = None
    record_size: int = 0
    checkpoint: Checkpoint | None = None


@dataclass(eq=False)
class _Target:
    """One checkpoint's share of a removal. ``etag`` is its ``.metadata``'s when planned (None:
    absent); a guarded removal skips the target if it has changed since."""

    location: Location
    etag: str | None
    record_size: int | None = None  # a .metadata to delete first
    objects: list[_Object] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)
    young: list[str] = field(default_factory=list)  # gc: kept, their save is recent
    young_uploads: list[Upload] = field(default_factory=list)


# ------------------------------------------------------------------------------- public API


def list_checkpoints(url: str, config: S3Config | None = None) -> list[CheckpointInfo]:
    """Checkpoints at ``url`` and directly under it, oldest first (by step, then creation)."""
    return [found.info for found in bridge.run(_survey(_transfer(config), _location(url)))]


def latest(url: str, config: S3Config | None = None) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step (then the newest), or None."""
    return bridge.run(_latest(_transfer(config), _location(url)))


def describe(url: str, config: S3Config | None = None) -> tuple[CheckpointInfo, Checkpoint]:
    """The committed checkpoint at ``url`` and its record; else CheckpointNotFound or
    IncompleteCheckpoint."""
    return bridge.run(_describe(_transfer(config), _location(url)))


def delete(
    url: str,
    config: S3Config | None = None,
    *,
    confirm: Callable[[Removal], bool] | None = None,
    progress: Progress | None = None,
) -> Removal:
    """Delete the checkpoint at ``url``: ``.metadata``, then its data objects, then abort its
    multipart uploads. If ``confirm`` declines, nothing is deleted (an empty Removal returns)."""
    location, transfer = _location(url), _transfer(config)
    target = bridge.run(_plan_delete(transfer, location))
    if confirm is not None and not confirm(_preview(location.bucket, [target])):
        return Removal(location.bucket)
    return bridge.run(_remove(transfer, location, [target], progress, guarded=False))[0]


def prune(
    url: str,
    keep: int,
    config: S3Config | None = None,
    *,
    confirm: Callable[[list[CheckpointInfo]], bool] | None = None,
    progress: Progress | None = None,
) -> list[CheckpointInfo]:
    """Delete all but the newest ``keep`` (>= 1) committed checkpoints under ``url``; returns
    those deleted. Incomplete ones are left to `gc`: they may be saves in progress."""
    if keep < 1:
        raise ConfigError(f"keep must be >= 1 (the latest checkpoint is never pruned), got {keep}")
    location, transfer = _location(url), _transfer(config)
    plan = bridge.run(_plan_prune(transfer, location, keep))
    if not plan or (confirm is not None and not confirm([info for info, _ in plan])):
        return []
    targets = [target for _, target in plan]
    _, dropped = bridge.run(_remove(transfer, location, targets, progress, guarded=True))
    return [info for info, target in plan if target not in dropped]


def gc(
    url: str,
    older_than: timedelta = timedelta(hours=1),
    config: S3Config | None = None,
    dry_run: bool = False,
    *,
    confirm: Callable[[GcReport], bool] | None = None,
    progress: Progress | None = None,
) -> GcReport:
    """Delete data objects no committed ``.metadata`` references and abort multipart uploads, in
    the checkpoint at ``url`` and those directly under it, of saves that have written nothing for
    ``older_than`` by the server's clock: a more recent one may still be running."""
    if older_than < timedelta(0):
        raise ConfigError(f"older_than must not be negative, got {older_than}")
    location, transfer = _location(url), _transfer(config)
    targets = bridge.run(_plan_gc(transfer, location, older_than))
    young = [key for t in targets for key in t.young]
    young_uploads = [upload for t in targets for upload in t.young_uploads]
    targets = [t for t in targets if t.objects or t.uploads]
    report = _report(_preview(location.bucket, targets), young, young_uploads)
    if dry_run or (confirm is not None and not confirm(report)):
        return report
    removal, dropped = bridge.run(_remove(transfer, location, targets, progress, guarded=True))
    young += [obj.key for t in dropped for obj in t.objects]
    return _report(removal, young, young_uploads + [u for t in dropped for u in t.uploads], False)


def _report(
    removal: Removal, young: list[str], young_uploads: list[Upload], dry_run: bool = True
) -> GcReport:
    skipped = {"skipped": tuple(young), "skipped_uploads": tuple(young_uploads)}
    return GcReport(**vars(removal), **skipped, dry_run=dry_run)


# ------------------------------------------------------------------------------- discovery


def _location(url: str) -> Location:
    return Location(*parse_s3_url(url))


def _transfer(config: S3Config | None) -> Transfer:
    return get_transfer(config or S3Config())


def _step(location: Location) -> int | None:
    match = _STEP.fullmatch(location.prefix.rpartition("/")[2])
    return int(match.group(1)) if match else None


def _newness(info: CheckpointInfo) -> tuple[bool, int, datetime]:
    """Sort key: any step beats none, then the higher step, then the later creation."""
    return (info.step is not None, info.step or 0, info.created)


async def _map(
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


def _utc(when: datetime) -> datetime:
    return when.astimezone(timezone.utc)


def _is_old(when: datetime, cutoff: datetime) -> bool:
    """In whole seconds, like the Date header: with ``older_than=0`` all that was listed is old."""
    return when.replace(microsecond=0) <= cutoff


async def _list(
    transfer: Transfer, bucket: str, prefix: str, *, delimiter: bool = False
) -> tuple[list[_Object], list[str], datetime]:
    """Objects under ``prefix`` (with LastModified), child prefixes, and the server's time."""
    objects: list[_Object] = []
    prefixes: list[str] = []
    params: dict[str, str] = {"Delimiter": "/"} if delimiter else {}
    now: datetime | None = None
    while True:
        reply = await transfer._call(
            "list_objects_v2", bucket, prefix or None, Prefix=prefix, MaxKeys=1000, **params
        )
        now = now or _server_time(reply)
        contents = reply.get("Contents", [])
        objects += [_Object(o["Key"], int(o["Size"]), _utc(o["LastModified"])) for o in contents]
        prefixes += [p["Prefix"] for p in reply.get("CommonPrefixes", [])]
        if not reply.get("IsTruncated"):
            return objects, prefixes, now
        params["ContinuationToken"] = reply["NextContinuationToken"]


async def _data_objects(
    transfer: Transfer, location: Location
) -> tuple[list[tuple[_Object, str]], datetime]:
    """The checkpoint's ``data-<id>/`` objects with their save ids, and the server's time."""
    objects, _, now = await _list(transfer, location.bucket, location.key("data-"))
    start = len(location.listing_prefix)
    matches = ((obj, _DATA.fullmatch(obj.key[start:])) for obj in objects)
    return [(obj, match.group(1)) for obj, match in matches if match], now


async def _uploads(transfer: Transfer, location: Location) -> dict[str, list[tuple[Upload, str]]]:
    """Multipart uploads of data objects at ``location`` or a child, with their save ids, by
    checkpoint prefix."""
    owners: dict[str, list[tuple[Upload, str]]] = {}
    prefix, markers = location.listing_prefix, {}
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
                upload = Upload(raw["Key"], raw["UploadId"], _utc(raw["Initiated"]))
                owners.setdefault(owner, []).append((upload, match.group(1)))
        if not reply.get("IsTruncated"):
            return owners
        markers = {"KeyMarker": reply["NextKeyMarker"]}
        markers["UploadIdMarker"] = reply["NextUploadIdMarker"]


async def _candidates(
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
    uploads = await _uploads(transfer, location) if with_uploads else {}
    known = {c.prefix for c in found}
    return found + [Location(bucket, p) for p in uploads if p not in known], uploads


async def _committed(transfer: Transfer, location: Location) -> _Found | None:
    """The committed checkpoint at ``location`` (one GET of ``.metadata``), or None."""
    key = location.metadata_key
    try:
        reply = await transfer._call("get_object", location.bucket, key, Key=key)
    except ObjectNotFound:
        return None
    try:
        async with reply["Body"] as body:
            raw: bytes = await body.read()
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
        step=_step(location),
        save_id=checkpoint.save_id,
        world_size=world_size if isinstance(world_size, int) else None,
        compression=compression if isinstance(compression, str) else None,
    )
    return _Found(info, location, str(reply["ETag"]), len(raw), checkpoint)


async def _inspect(
    transfer: Transfer, location: Location, uploads: list[tuple[Upload, str]]
) -> _Found | None:
    """The checkpoint at ``location``, committed or not (its ``uploads`` count only for an
    incomplete one: a save killed early has nothing else); None if there is none."""
    found = await _committed(transfer, location)
    if found is not None:
        return found
    data, _ = await _data_objects(transfer, location)
    if not data and not uploads:
        return None
    ids = {save_id for _, save_id in data + uploads}
    info = CheckpointInfo(
        url=location.url,
        prefix=location.prefix,
        committed=False,
        total_bytes=sum(obj.size for obj, _ in data),
        num_objects=len(data),
        created=max([obj.modified for obj, _ in data] + [u.initiated for u, _ in uploads]),
        step=_step(location),
        save_id=ids.pop() if len(ids) == 1 else None,
        world_size=None,
        compression=None,
    )
    return _Found(info, location)


async def _survey(transfer: Transfer, location: Location) -> list[_Found]:
    candidates, uploads = await _candidates(transfer, location, with_uploads=True)
    found = await _map(
        lambda c: _inspect(transfer, c, uploads.get(c.prefix, [])), candidates, transfer
    )
    return sorted((f for f in found if f is not None), key=lambda f: _newness(f.info))


async def _latest(transfer: Transfer, location: Location) -> CheckpointInfo | None:
    """Reads records from the highest step down, so a long run costs a few GETs, not one each."""
    by_step: dict[int | None, list[Location]] = {}
    for candidate in (await _candidates(transfer, location))[0]:
        by_step.setdefault(_step(candidate), []).append(candidate)
    for step in sorted(by_step, key=lambda s: (s is not None, s or 0), reverse=True):
        found = await _map(lambda c: _committed(transfer, c), by_step[step], transfer)
        committed = [f.info for f in found if f is not None]
        if committed:
            return max(committed, key=_newness)
    return None


async def _describe(transfer: Transfer, location: Location) -> tuple[CheckpointInfo, Checkpoint]:
    found = await _committed(transfer, location)
    if found is not None and found.checkpoint is not None:
        return found.info, found.checkpoint
    data, _ = await _data_objects(transfer, location)
    if data:
        raise IncompleteCheckpoint(
            f"{location.url} is incomplete: data objects exist (e.g. s3://{location.bucket}/"
            f"{data[0][0].key}) but no .metadata — a save failed, was killed, or is running",
            url=location.url,
        )
    raise CheckpointNotFound(
        f"no checkpoint at {location.url} (no .metadata and no data objects)", url=location.url
    )


# ------------------------------------------------------------------------------- removal


async def _plan_delete(transfer: Transfer, location: Location) -> _Target:
    head = await transfer.head(location.bucket, location.metadata_key)
    data, _ = await _data_objects(transfer, location)
    uploads = [u for u, _ in (await _uploads(transfer, location)).get(location.prefix, [])]
    size = None if head is None else int(head["ContentLength"])
    target = _Target(location, None, size, [obj for obj, _ in data], uploads)
    if head is None and not target.objects and not target.uploads:
        raise CheckpointNotFound(
            f"no checkpoint at {location.url} (no .metadata, data objects or uploads)",
            url=location.url,
        )
    return target


async def _plan_prune(
    transfer: Transfer, location: Location, keep: int
) -> list[tuple[CheckpointInfo, _Target]]:
    committed = [f for f in await _survey(transfer, location) if f.info.committed]
    victims = sorted(committed, key=lambda f: _newness(f.info), reverse=True)[keep:]
    if not victims:
        return []
    uploads = await _uploads(transfer, location)
    data = await _map(lambda f: _data_objects(transfer, f.location), victims, transfer)
    plan = []
    for f, (objects, _) in zip(victims, data, strict=True):
        mine = [u for u, _ in uploads.get(f.location.prefix, [])]
        target = _Target(f.location, f.etag, f.record_size, [o for o, _ in objects], mine)
        plan.append((f.info, target))
    return plan


async def _plan_gc(transfer: Transfer, location: Location, older_than: timedelta) -> list[_Target]:
    candidates, uploads = await _candidates(transfer, location, with_uploads=True)
    return await _map(
        lambda c: _gc_one(transfer, c, uploads.get(c.prefix, []), older_than), candidates, transfer
    )


async def _gc_one(
    transfer: Transfer,
    location: Location,
    uploads: list[tuple[Upload, str]],
    older_than: timedelta,
) -> _Target:
    """Reads ``.metadata`` before listing: objects that a concurrent commit adds are recent."""
    found = await _committed(transfer, location)
    keep_id, referenced = None, set()
    if found is not None and found.checkpoint is not None:
        keep_id = found.checkpoint.save_id
        referenced = {location.key(key) for key in found.checkpoint.objects}
    data, now = await _data_objects(transfer, location)
    saves: dict[str, tuple[list[_Object], list[Upload]]] = {}
    for obj, save_id in data:
        if save_id != keep_id and obj.key not in referenced:
            saves.setdefault(save_id, ([], []))[0].append(obj)
    for upload, save_id in uploads:
        saves.setdefault(save_id, ([], []))[1].append(upload)
    target = _Target(location, None if found is None else found.etag)
    for objects, save_uploads in saves.values():
        if await _idle(transfer, location.bucket, objects, save_uploads, now - older_than):
            target.objects += objects
            target.uploads += save_uploads
        else:
            target.young += [obj.key for obj in objects]
            target.young_uploads += save_uploads
    return target


async def _idle(
    transfer: Transfer,
    bucket: str,
    objects: list[_Object],
    uploads: list[Upload],
    cutoff: datetime,
) -> bool:
    """Whether one save has written nothing since ``cutoff``: neither an object, nor an upload
    or a part of one (a large upload can start long before its last part arrives)."""
    written = [obj.modified for obj in objects] + [upload.initiated for upload in uploads]
    if not all(_is_old(when, cutoff) for when in written):
        return False
    newest = await _map(lambda u: _last_part(transfer, bucket, u), uploads, transfer)
    return all(_is_old(t, cutoff) for t in newest if t is not None)


async def _last_part(transfer: Transfer, bucket: str, upload: Upload) -> datetime | None:
    """When the upload's newest part arrived; None if it has none or is gone."""
    newest: datetime | None = None
    marker: dict[str, Any] = {}
    while True:
        try:
            reply = await transfer._call(
                "list_parts",
                bucket,
                upload.key,
                Key=upload.key,
                UploadId=upload.upload_id,
                **marker,
            )
        except ObjectNotFound:  # completed or aborted meanwhile: nothing left to age
            return None
        for part in reply.get("Parts", []):
            modified = _utc(part["LastModified"])
            newest = modified if newest is None else max(newest, modified)
        if not reply.get("IsTruncated"):
            return newest
        marker = {"PartNumberMarker": reply["NextPartNumberMarker"]}


def _preview(bucket: str, targets: list[_Target]) -> Removal:
    records = [t.location.metadata_key for t in targets if t.record_size is not None]
    return Removal(
        bucket,
        tuple(records + [obj.key for t in targets for obj in t.objects]),
        tuple(upload for t in targets for upload in t.uploads),
        sum((t.record_size or 0) + sum(obj.size for obj in t.objects) for t in targets),
    )


async def _unchanged(transfer: Transfer, target: _Target) -> bool:
    head = await transfer.head(target.location.bucket, target.location.metadata_key)
    return (None if head is None else str(head["ETag"])) == target.etag


async def _remove(
    transfer: Transfer,
    location: Location,
    targets: list[_Target],
    progress: Progress | None,
    *,
    guarded: bool,
) -> tuple[Removal, list[_Target]]:
    """Every ``.metadata`` first, then data objects, then uploads. Returns what was removed and
    (when ``guarded``) the targets skipped because their ``.metadata`` changed since planning."""
    dropped: list[_Target] = []
    if guarded:
        same = await _map(lambda t: _unchanged(transfer, t), targets, transfer)
        dropped = [t for t, ok in zip(targets, same, strict=True) if not ok]
        targets = [t for t, ok in zip(targets, same, strict=True) if ok]
    plan = _preview(location.bucket, targets)
    total, done = len(plan.deleted) + len(plan.aborted), 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    advance(0)
    records = [t.location.metadata_key for t in targets if t.record_size is not None]
    await _delete(transfer, plan.bucket, records, advance, f"cannot remove {location.url}")
    doing = f"deleting unreferenced data objects under {location.url} failed"
    if records:
        doing = (
            f"{len(records)} checkpoint(s) at {location.url} no longer load (.metadata deleted), "
            "but not all of their data objects could be deleted (run rm or gc again)"
        )
    await _delete(transfer, plan.bucket, list(plan.deleted[len(records) :]), advance, doing)
    doing = f"{location.url}: objects deleted, but a multipart upload could not be aborted"
    aborted = await _map(
        lambda u: _abort(transfer, plan.bucket, u, advance, doing), plan.aborted, transfer
    )
    done_uploads = tuple(u for u, ok in zip(plan.aborted, aborted, strict=True) if ok)
    return Removal(plan.bucket, plan.deleted, done_uploads, plan.bytes_freed), dropped


async def _delete(
    transfer: Transfer, bucket: str, keys: list[str], advance: Callable[[int], None], doing: str
) -> None:
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        try:
            await transfer.delete(bucket, batch)
        except StorageError as e:
            raise _refused(e, doing) from e
        advance(len(batch))


async def _abort(
    transfer: Transfer, bucket: str, upload: Upload, advance: Callable[[int], None], doing: str
) -> bool:
    """Abort one upload (`Transfer.abort` hides failures); False if it was already gone."""
    try:
        await transfer._call(
            "abort_multipart_upload", bucket, upload.key, Key=upload.key, UploadId=upload.upload_id
        )
    except ObjectNotFound:  # completed or aborted since it was listed
        advance(1)
        return False
    except StorageError as e:
        raise _refused(e, f"{doing} (s3://{bucket}/{upload.key})") from e
    advance(1)
    return True


def _refused(error: StorageError, doing: str) -> StorageError:
    """The same error, saying how far the removal got. DeleteObjects reports a refused key in its
    reply, which `Transfer.delete` raises as a plain StorageError: type it AccessDenied."""
    kind = AccessDenied if getattr(error, "code", None) == "AccessDenied" else type(error)
    context = {name: value for name, value in vars(error).items() if name != "message"}
    return kind(f"{doing}: {error.message}", **context)
