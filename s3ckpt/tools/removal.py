"""Delete checkpoints safely: what ``s3ckpt rm/prune/gc`` do (import them from `catalog`).

Removal deletes ``.metadata`` first, so a checkpoint stops being loadable at once and a crash
midway leaves only unreferenced objects, which `gc` finds later. `gc` judges each save
(``data-<id>/``) as a whole, by its newest object or uploaded part, so a save that is still
running somewhere is left alone even if it started long ago. No removal touches a save whose
lease is live (`s3ckpt.dcp.commit`), whatever ``older_than`` says, nor a checkpoint whose
``.metadata`` it cannot read: what that record references is unknown. Nor any key that s3ckpt's
writer does not name (`layout.save_of`): a bucket is shared with datasets and logs, and what
removals left alone for that reason they report (`Removal.left_alone`).

Incremental saves reference their siblings' objects, so no removal deletes an object that a
committed record of the run lists (`s3ckpt.dcp.references`): such objects are *kept*, in a
directory without a ``.metadata`` once their own checkpoint is gone, until the last record
referencing them is removed. Removals check this (`s3ckpt.dcp.references.protected`: the run's
records, then the leases, which include incremental saves' pins) when they plan, and again after
deleting the records they remove, as the last step before deleting data.

Removals plan, then call ``confirm`` (in the caller's thread) with what they would remove, and
only then delete. The I/O runs on the `bridge` loop through the shared `ObjectStore`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from ..config import S3Config
from ..dcp.prefix import read_prefix, saves
from ..dcp.references import Record, protected, run_of
from ..engine import bridge
from ..engine.contract import ObjectStore, StoredObject, Upload
from ..engine.store import get_store
from ..errors import (
    AccessDenied,
    CheckpointNotFound,
    ConfigError,
    MetadataError,
    StorageError,
)
from ..format import layout
from ..format.layout import Location
from . import listing
from .listing import CheckpointInfo, Progress

__all__ = ["GcReport", "Removal", "StepPolicy", "delete", "gc", "prune", "remove"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Removal:
    """What a removal deleted; ``confirm`` gets one that says what it would delete.

    ``bytes_freed`` counts the objects and the parts of the aborted uploads (ListParts, when
    planned): a save killed mid-upload holds its bytes in parts. ``upload_bytes`` is the parts'
    share of it.
    """

    bucket: str
    deleted: tuple[str, ...] = ()
    aborted: tuple[Upload, ...] = ()
    bytes_freed: int = 0
    upload_bytes: int = 0
    # Objects spared: other checkpoints of the run reference them, or a pin holds them.
    kept: tuple[str, ...] = ()
    # Keys in the ``data-`` directories that s3ckpt's writer does not name (`layout.save_of`):
    # a bucket is shared with other data, so they are never deleted.
    left_alone: tuple[str, ...] = ()


@dataclass(frozen=True)
class GcReport(Removal):
    """`gc`'s result; ``skipped`` were too young, belong to a running save or to a checkpoint
    whose record cannot be read, or their checkpoint changed while gc ran. ``reasons`` pairs
    each key kept (skipped and kept objects, skipped uploads' keys) with the reason that kept
    it."""

    skipped: tuple[str, ...] = ()
    skipped_uploads: tuple[Upload, ...] = ()
    dry_run: bool = False
    reasons: tuple[tuple[str, str], ...] = ()


@dataclass(eq=False)
class _Target:
    """One checkpoint's share of a removal. ``etag`` is its ``.metadata``'s when planned (None:
    absent); a guarded removal skips the target if it has changed since."""

    location: Location
    etag: str | None
    record_size: int | None = None  # a .metadata to delete first
    objects: list[StoredObject] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)
    upload_bytes: int = 0  # what the parts of ``uploads`` hold
    young: list[str] = field(default_factory=list)  # gc: kept, their save is recent
    young_uploads: list[Upload] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # referenced by other records of the run
    why: dict[str, str] = field(default_factory=dict)  # gc: each key kept, and why
    left_alone: tuple[str, ...] = ()  # not s3ckpt's (`Removal.left_alone`)


def delete(
    url: str,
    config: S3Config | None = None,
    *,
    confirm: Callable[[Removal], bool] | None = None,
    progress: Progress | None = None,
) -> Removal:
    """Delete the checkpoint at ``url``: ``.metadata``, then its data objects, then abort its
    multipart uploads. If ``confirm`` declines, nothing is deleted (an empty Removal returns)."""
    location, store = listing.location_of(url), get_store(config)
    target = bridge.run(_plan_delete(store, location))
    if confirm is not None:
        bridge.run(_spare(store, [target]))  # for the preview: `_remove` spares for real
        if not confirm(_preview(location.bucket, [target])):
            return Removal(location.bucket)
    return bridge.run(_remove(store, location, [target], progress, guarded=False))[0]


def remove(url: str, records: Sequence[Record], config: S3Config | None = None) -> list[Location]:
    """Delete the committed checkpoints whose ``records`` (`references.records`) were judged,
    under the run at ``url``, each only if its record is still the one judged (its ETag); returns
    those deleted. What a pin holds of their objects stays (`references.protected`), for a
    later pass or gc: a pin protects what a record references, not the record."""
    location, store = listing.location_of(url), get_store(config)
    judged = [(r.location, r.etag, r.size) for r in records]
    targets = bridge.run(_plan_records(store, location, judged))
    _, dropped = bridge.run(_remove(store, location, targets, None, guarded=True))
    return [t.location for t in targets if t not in dropped]


StepPolicy = Callable[[list[int]], Collection[int]]
"""Given the steps of a run's committed checkpoints, the steps to keep (`Retention.kept`)."""


def prune(
    url: str,
    keep: int | StepPolicy,
    config: S3Config | None = None,
    *,
    confirm: Callable[[list[CheckpointInfo]], bool] | None = None,
    progress: Progress | None = None,
) -> list[CheckpointInfo]:
    """Delete all but the newest ``keep`` (>= 1) committed checkpoints under ``url``, or, with a
    `StepPolicy`, those whose step it does not keep (never the newest, nor one without a step);
    returns those deleted. Incomplete ones are left to `gc`: they may be saves in progress."""
    if isinstance(keep, int) and keep < 1:
        raise ConfigError(f"keep must be >= 1 (the latest checkpoint is never pruned), got {keep}")
    location, store = listing.location_of(url), get_store(config)
    plan = bridge.run(_plan_prune(store, location, keep))
    if not plan or (confirm is not None and not confirm([info for info, _ in plan])):
        return []
    targets = [target for _, target in plan]
    _, dropped = bridge.run(_remove(store, location, targets, progress, guarded=True))
    return [info for info, target in plan if target not in dropped]


def gc(
    url: str,
    older_than: timedelta = timedelta(hours=1),
    config: S3Config | None = None,
    dry_run: bool = False,
    *,
    break_leases: bool = False,
    confirm: Callable[[GcReport], bool] | None = None,
    progress: Progress | None = None,
) -> GcReport:
    """Delete data objects no committed ``.metadata`` references and abort multipart uploads, in
    the checkpoint at ``url`` and those directly under it, of saves that have written nothing for
    ``older_than`` by the server's clock: a more recent one may still be running. A save whose
    lease is live is spared too, unless ``break_leases`` (for writers known to be dead); pins
    (`layout.is_pin`: readers', and incremental saves' on what they reference) are never
    broken, they expire on their own."""
    if older_than < timedelta(0):
        raise ConfigError(f"older_than must not be negative, got {older_than}")
    location, store = listing.location_of(url), get_store(config)
    targets = bridge.run(_plan_gc(store, location, older_than, break_leases))
    bridge.run(_spare(store, targets, writers=not break_leases))
    young = [key for t in targets for key in t.young]
    young_uploads = [upload for t in targets for upload in t.young_uploads]
    why = {key: reason for t in targets for key, reason in t.why.items()}
    left_alone = tuple(key for t in targets for key in t.left_alone)
    if left_alone:
        log.info("%s: %s", location.url, _foreign_text(location.bucket, left_alone))
    targets = [t for t in targets if t.objects or t.uploads]
    preview = dataclasses.replace(_preview(location.bucket, targets), left_alone=left_alone)
    report = _report(preview, young, young_uploads, why)
    if dry_run or (confirm is not None and not confirm(report)):
        return report
    removing = _remove(store, location, targets, progress, guarded=True, writers=not break_leases)
    removal, dropped = bridge.run(removing)
    removal = dataclasses.replace(removal, left_alone=left_alone)
    young += [obj.key for t in dropped for obj in t.objects]
    changed = "its checkpoint's .metadata changed while gc ran"
    why.update({obj.key: changed for t in dropped for obj in t.objects})
    why.update({u.key: changed for t in dropped for u in t.uploads})
    dropped_uploads = [u for t in dropped for u in t.uploads]
    return _report(removal, young, young_uploads + dropped_uploads, why, False)


def _report(
    removal: Removal,
    young: list[str],
    young_uploads: list[Upload],
    why: dict[str, str],
    dry_run: bool = True,
) -> GcReport:
    return GcReport(
        **{f.name: getattr(removal, f.name) for f in dataclasses.fields(Removal)},
        skipped=tuple(young),
        skipped_uploads=tuple(young_uploads),
        dry_run=dry_run,
        reasons=tuple(sorted(why.items())),
    )


# ------------------------------------------------------------------------------- planning


async def _plan_delete(store: ObjectStore, location: Location) -> _Target:
    head = await store.head(location.bucket, location.metadata_key)
    data, now, foreign = await saves(store, location)
    pending = (await listing.uploads(store, location)).get(location.prefix, [])
    size = None if head is None else head.size
    objects, uploads = _not_running(location, data, pending, now)
    in_parts = await listing.upload_bytes(store, location.bucket, uploads)
    target = _Target(location, None, size, objects, uploads, in_parts, left_alone=foreign)
    if head is None and not target.objects and not target.uploads:
        running = " but a running save's (its lease is live)" if data or pending else ""
        if foreign:
            running += f"; {_foreign_text(location.bucket, foreign)}"
        elif not running:
            await _refuse_a_run(store, location)
        raise CheckpointNotFound(
            f"no checkpoint at {location.url} (no .metadata, data objects or uploads{running})",
            url=location.url,
        )
    return target


async def _refuse_a_run(store: ObjectStore, location: Location) -> None:
    """Nothing at ``location`` itself: if checkpoints are below it, it is a run, and the error
    says so as ``info`` does (how many, the latest), and what deletes a run's checkpoints."""
    at = await read_prefix(store, location)
    if not at.below:
        return
    try:
        at.require()
    except CheckpointNotFound as e:
        raise e.reworded(
            f"{e.message}; rm deletes one checkpoint: `s3ckpt prune {location.url} "
            "--keep-last N` thins a run out"
        ) from None


def _foreign_text(bucket: str, keys: tuple[str, ...]) -> str:
    return (
        f"{len(keys)} objects in data-* directories are not s3ckpt's and were left alone "
        f"(e.g. s3://{bucket}/{keys[0]})"
    )


async def _plan_prune(
    store: ObjectStore, location: Location, keep: int | StepPolicy
) -> list[tuple[CheckpointInfo, _Target]]:
    committed = [f for f in await listing.survey(store, location) if f.info.committed]
    newest_first = sorted(committed, key=lambda f: listing.newness(f.info), reverse=True)
    if isinstance(keep, int):
        victims = newest_first[keep:]
    else:
        kept = set(keep([f.info.step for f in newest_first if f.info.step is not None]))
        stepped = [f for f in newest_first[1:] if f.info.step is not None]
        victims = [f for f in stepped if f.info.step not in kept]
    records = [(f.location, f.etag, f.record_size) for f in victims]
    targets = await _plan_records(store, location, records)
    return [(f.info, target) for f, target in zip(victims, targets, strict=True)]


async def _plan_records(
    store: ObjectStore, location: Location, records: list[tuple[Location, str | None, int]]
) -> list[_Target]:
    """Targets for committed checkpoints under ``location``, each given as ``(location, ETag,
    size)`` of the record judged: their objects and uploads but a running save's."""
    if not records:
        return []
    uploads = await listing.uploads(store, location)
    data = await listing.run_all(lambda r: saves(store, r[0]), records, store)
    targets = []
    for (at, etag, size), (found, now, foreign) in zip(records, data, strict=True):
        pending = uploads.get(at.prefix, [])
        objects, mine = _not_running(at, found, pending, now)
        in_parts = await listing.upload_bytes(store, location.bucket, mine)
        targets.append(_Target(at, etag, size, objects, mine, in_parts, left_alone=foreign))
    return targets


def _not_running(
    location: Location,
    data: list[tuple[StoredObject, str]],
    uploads: list[tuple[Upload, str]],
    now: datetime,
) -> tuple[list[StoredObject], list[Upload]]:
    """The objects and uploads of saves at ``location`` whose writer's lease is not live (what
    pins spare is decided last, by `_spare`)."""
    live = listing.live_saves(data, now, pins=False)
    if live:
        log.warning("%s: sparing %d running save(s): %s", location.url, len(live), sorted(live))
    return (
        [obj for obj, save_id in data if save_id not in live],
        [upload for upload, save_id in uploads if save_id not in live],
    )


async def _plan_gc(
    store: ObjectStore, location: Location, older_than: timedelta, break_leases: bool
) -> list[_Target]:
    candidates, uploads = await listing.candidates(store, location, with_uploads=True)

    async def one(candidate: Location) -> _Target:
        pending = uploads.get(candidate.prefix, [])
        return await _gc_one(store, candidate, pending, older_than, break_leases)

    return await listing.run_all(one, candidates, store)


async def _gc_one(
    store: ObjectStore,
    location: Location,
    uploads: list[tuple[Upload, str]],
    older_than: timedelta,
    break_leases: bool,
) -> _Target:
    """Reads ``.metadata`` before listing: objects that a concurrent commit adds are recent."""
    try:
        found = await listing.committed(store, location)
    except MetadataError as e:
        log.warning("%s: nothing collected, its record cannot be read: %s", location.url, e)
        data, _, foreign = await saves(store, location)
        young = [obj.key for obj, _ in data]
        uploaded = [u for u, _ in uploads]
        unreadable = "its checkpoint's .metadata cannot be read"
        why = {key: unreadable for key in [*young, *(u.key for u in uploaded)]}
        return _Target(
            location, None, young=young, young_uploads=uploaded, left_alone=foreign, why=why
        )
    keep_id, referenced = None, set()
    if found is not None and found.checkpoint is not None:
        keep_id = found.checkpoint.save_id
        referenced = {location.key(key) for key in found.checkpoint.objects}
    data, now, foreign = await saves(store, location)
    live = listing.live_saves(data, now, writers=not break_leases, pins=False)  # pins: `_spare`
    by_save: dict[str, tuple[list[StoredObject], list[Upload]]] = {}
    for obj, save_id in data:
        # The committed save's objects stay, but not its lease once that has expired.
        ours = save_id == keep_id and not layout.is_lease(obj.key)
        if not ours and obj.key not in referenced:
            by_save.setdefault(save_id, ([], []))[0].append(obj)
    for upload, save_id in uploads:
        by_save.setdefault(save_id, ([], []))[1].append(upload)
    target = _Target(location, None if found is None else found.etag, left_alone=foreign)
    for save_id, (objects, save_uploads) in by_save.items():
        cutoff = now - older_than
        in_parts: int | None = None
        if save_id not in live:
            in_parts = await _idle(store, location.bucket, objects, save_uploads, cutoff)
        if in_parts is not None:
            target.objects += objects
            target.uploads += save_uploads
            target.upload_bytes += in_parts
        else:
            target.young += [obj.key for obj in objects]
            target.young_uploads += save_uploads
            reason = (
                f"save {save_id} is running: its lease is live (--break-leases if its writer "
                "is known dead)"
                if save_id in live
                else f"save {save_id} wrote within --older-than ({older_than})"
            )
            target.why.update({key: reason for key in [obj.key for obj in objects]})
            target.why.update({upload.key: reason for upload in save_uploads})
    return target


async def _idle(
    store: ObjectStore,
    bucket: str,
    objects: list[StoredObject],
    uploads: list[Upload],
    cutoff: datetime,
) -> int | None:
    """The bytes in the parts of one save's uploads if it has written nothing since ``cutoff``:
    neither an object, nor an upload or a part of one (a large upload can start long before its
    last part arrives); None if it has."""
    written = [obj.modified for obj in objects] + [upload.initiated for upload in uploads]
    if not all(listing.is_old(when, cutoff) for when in written):
        return None
    parts = await listing.run_all(lambda u: store.list_parts(bucket, u), uploads, store)
    if not all(listing.is_old(part.modified, cutoff) for listed in parts for part in listed):
        return None
    return sum(part.size for listed in parts for part in listed)


def _preview(bucket: str, targets: list[_Target]) -> Removal:
    records = [t.location.metadata_key for t in targets if t.record_size is not None]
    in_parts = sum(t.upload_bytes for t in targets)
    return Removal(
        bucket,
        tuple(records + [obj.key for t in targets for obj in t.objects]),
        tuple(upload for t in targets for upload in t.uploads),
        sum((t.record_size or 0) + sum(obj.size for obj in t.objects) for t in targets) + in_parts,
        in_parts,
        tuple(key for t in targets for key in t.kept),
        tuple(key for t in targets for key in t.left_alone),
    )


async def _spare(store: ObjectStore, targets: list[_Target], *, writers: bool = True) -> None:
    """Take out of the targets' objects those that a committed record of their run references
    (besides the records being removed), and those of saves whose lease is live now (without
    ``writers``, gc breaking them, only pins count: `references.protected`)."""
    removing = {t.location.metadata_key for t in targets if t.record_size is not None}
    holding = [t for t in targets if t.objects]
    found = await protected(
        store, [t.location for t in holding], ignoring=removing, writers=writers
    )
    for target in holding:
        used = found.used[run_of(target.location)]
        if used.unknown:
            log.warning(
                "%s: data kept: what %s references is unknown", target.location.url, used.unknown[0]
            )
        kept = {obj.key for obj in target.objects if found.keeps(target.location, obj.key)}
        if kept:
            target.objects = [obj for obj in target.objects if obj.key not in kept]
            target.kept += sorted(kept)
            held = "a committed checkpoint of the run references it, or a pin holds it"
            target.why.update(dict.fromkeys(kept, held))


async def _unchanged(store: ObjectStore, target: _Target) -> bool:
    head = await store.head(target.location.bucket, target.location.metadata_key)
    return (None if head is None else head.etag) == target.etag


async def _remove(
    store: ObjectStore,
    location: Location,
    targets: list[_Target],
    progress: Progress | None,
    *,
    guarded: bool,
    writers: bool = True,
) -> tuple[Removal, list[_Target]]:
    """Every ``.metadata`` first, then data objects, then uploads. Returns what was removed and
    (when ``guarded``) the targets skipped because their ``.metadata`` changed since planning."""
    dropped: list[_Target] = []
    if guarded:
        same = await listing.run_all(lambda t: _unchanged(store, t), targets, store)
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
    await _delete(store, plan.bucket, records, advance, f"cannot remove {location.url}")
    await _spare(store, targets, writers=writers)  # now that the records are gone
    if guarded:
        # Once more, just before the data goes: a save whose lease lapsed may have committed
        # since planning (its objects are then its record's, which a target without a record
        # to delete does not know).
        collecting = [t for t in targets if t.record_size is None]
        same = await listing.run_all(lambda t: _unchanged(store, t), collecting, store)
        late = [t for t, ok in zip(collecting, same, strict=True) if not ok]
        dropped += late
        targets = [t for t in targets if t not in late]
    plan = _preview(location.bucket, targets)
    total = len(plan.deleted) + len(plan.aborted)
    doing = f"deleting unreferenced data objects under {location.url} failed"
    if records:
        doing = (
            f"{len(records)} checkpoint(s) at {location.url} no longer load (.metadata deleted), "
            "but not all of their data objects could be deleted (run rm or gc again)"
        )
    await _delete(store, plan.bucket, list(plan.deleted[len(records) :]), advance, doing)
    doing = f"{location.url}: objects deleted, but a multipart upload could not be aborted"
    aborted = await listing.run_all(
        lambda u: _abort(store, plan.bucket, u, advance, doing), plan.aborted, store
    )
    done_uploads = tuple(u for u, ok in zip(plan.aborted, aborted, strict=True) if ok)
    removal = dataclasses.replace(plan, aborted=done_uploads)
    return removal, dropped


async def _delete(
    store: ObjectStore, bucket: str, keys: list[str], advance: Callable[[int], None], doing: str
) -> None:
    try:
        await store.delete(bucket, keys, deleted=advance)
    except StorageError as e:
        raise _refused(e, doing) from e


async def _abort(
    store: ObjectStore, bucket: str, upload: Upload, advance: Callable[[int], None], doing: str
) -> bool:
    """Abort one upload; False if it was already gone."""
    try:
        aborted = await store.abort(bucket, upload)
    except StorageError as e:
        raise _refused(e, f"{doing} (s3://{bucket}/{upload.key})") from e
    advance(1)
    return aborted


def _refused(error: StorageError, doing: str) -> StorageError:
    """The same error, saying how far the removal got. DeleteObjects reports a refused key in its
    reply, which `ObjectStore.delete` raises as a plain StorageError: type it AccessDenied."""
    message = f"{doing}: {error.message}"
    if error.code != "AccessDenied" or isinstance(error, AccessDenied):
        return error.reworded(message)
    return error.retyped(AccessDenied, message)
