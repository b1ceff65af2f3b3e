"""The commit protocol: a running save's lease, and the one PUT of ``.metadata`` that commits it.

One rule governs every delete s3ckpt issues: data is deleted only when it is certain that no
committed record references it. Once the commit PUT has been sent, that is never certain from the
save's side: a balancer in front of the store may answer 503 to a PUT it forwarded, which the
store applies seconds later, and an answer may be lost after the PUT was applied. So a failed
commit never deletes data, whatever the error: its objects are left for ``s3ckpt gc``, which
judges them by the records that did land, and its lease is left to expire rather than deleted, so
that even ``gc --older-than 0`` spares them for `layout.LEASE_TTL`. The outcome is resolved by
reading the record back: the save's own record means it committed; another save's record in place
of a conditional PUT, or a refusal (4xx, 501), means it failed; anything else raises
`CommitOutcomeUnknown`.

While a save runs, each rank holds its lease (`layout.lease_key`) from the start of its upload,
and the coordinator from the start of the commit: a small object rewritten every quarter of
`layout.LEASE_TTL`, which gc, prune and rm respect. Before the PUT the coordinator checks that
every object it is about to reference, uploaded or in an earlier checkpoint, is stored with the
size it expects (listings of each save directory, one per 900 objects, all concurrently): a
commit does not reference an object that a removal has already deleted. After the PUT it lists
them again: a removal that took the save for dead while the commit was in flight (its lease
refreshes stalled past the TTL) may have deleted some, and a committed record must mean loadable
data, so then the record is withdrawn and the save fails. That a removal does not delete a
referenced object afterwards is the records' and the pins' business (`s3ckpt.dcp.references`,
`s3ckpt.dcp.incremental`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterable, Mapping

from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore, RetryPolicy
from ..errors import (
    CheckpointExists,
    CommitOutcomeUnknown,
    IncompleteCheckpoint,
    MetadataError,
    PreconditionFailed,
    S3CkptError,
    StorageError,
)
from ..format import layout
from ..format.layout import Location
from ..format.record import decode
from .prefix import read_record
from .references import protected

__all__ = ["Lease", "ReadLease", "commit", "delete_quietly", "may_have_applied"]

log = logging.getLogger(__name__)

# Answers that say the server did not act: a refusal (4xx), "not implemented". Not 503: a
# balancer answers it for requests it may have forwarded.
_NOT_APPLIED_STATUS = {501}
# Failures before a request was sent. Not EndpointConnectionError: aiobotocore raises it for a
# connection reset after the request went out, too.
_NOT_SENT_CODES = {"ConnectTimeoutError", "SSLError"}


def may_have_applied(error: StorageError) -> bool:
    """Whether the server may have carried out the request although the client saw ``error``."""
    if error.status is not None:
        return not (400 <= error.status < 500 or error.status in _NOT_APPLIED_STATUS)
    return error.code not in _NOT_SENT_CODES


class Lease:
    """A save's announcement that it runs, rewritten while `held` so that removals spare it."""

    def __init__(self, store: ObjectStore, location: Location, save_id: str) -> None:
        self.store = store
        self.bucket = location.bucket
        self.key = location.key(layout.lease_key(save_id))
        owner = {"save_id": save_id, "host": socket.gethostname(), "pid": os.getpid()}
        self._body = json.dumps(owner | {"ttl": layout.LEASE_TTL}).encode()

    async def write(self) -> None:
        """Write (or refresh) the lease once: live for `layout.LEASE_TTL` from now."""
        await self.store.put(self.bucket, self.key, self._body)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        await self.write()
        refresher = asyncio.ensure_future(self._refresh())
        try:
            yield
        finally:
            refresher.cancel()
            await asyncio.gather(refresher, return_exceptions=True)

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(layout.LEASE_TTL / 4)
            try:
                await self.write()
            except S3CkptError as e:
                log.warning("s3://%s/%s: lease not refreshed: %s", self.bucket, self.key, e)

    async def release(self) -> None:
        await delete_quietly(self.store, self.bucket, [self.key], "the lease of a saved checkpoint")


class ReadLease(Lease):
    """A lease on a committed save by someone who needs its objects to stay: a reader loading
    it, or an incremental save referencing it. ``data-<save_id>/<token>/.lease`` is a key that
    removals read as that save's lease (`layout.save_of`, `layout.is_lease`), so they spare its
    objects while it is live. Each holder has its own token, so none releases another's: a
    reader's is random, an incremental save's is its own save id (``owner``), so that removals
    which see that save's record committed know the pin is no longer needed
    (`layout.pin_owner`)."""

    def __init__(
        self, store: ObjectStore, location: Location, save_id: str, owner: str | None = None
    ) -> None:
        super().__init__(store, location, save_id)
        token = owner or secrets.token_hex(8)
        self.key = location.key(f"data-{save_id}/{token}/{layout.LEASE_NAME}")


async def commit(
    store: ObjectStore,
    location: Location,
    record: bytes,
    objects: Mapping[str, int],
    *,
    save_id: str,
    overwrite: bool,
    references: Mapping[str, int] | None = None,
) -> None:
    """Commit ``record``, which references the uploaded ``objects`` (key -> stored size) and
    ``references``, objects of earlier checkpoints (confirmed like the others, never deleted),
    holding the save's lease meanwhile.

    With ``overwrite`` the checkpoint it replaces loses its data objects once the commit is
    certain (but those other records of the run reference). Raises `CommitOutcomeUnknown` when
    it cannot be known whether the record landed.
    """
    lease = Lease(store, location, save_id)
    everything = {**objects, **(references or {})}
    async with lease.held():
        try:
            await _check(store, location, record, everything)
        except S3CkptError:  # before the PUT: no record can reference the save's objects
            await delete_quietly(store, location.bucket, objects, f"{location.url}: a failed save")
            await lease.release()
            raise
        previous, stale = await _previous(store, location) if overwrite else (None, set())
        refused = await _put_record(store, location, record, save_id=save_id, overwrite=overwrite)
        if refused is not None:
            raise refused
        wrong = await _changed(store, location.bucket, everything)
        if wrong:
            await _withdraw(store, location, record, previous)
            raise _incomplete(location, wrong, len(everything), "withdrawn after the commit", _LEFT)
    await lease.release()
    stale -= set(objects)
    if stale:
        try:
            kept = await protected(store, [location])
            stale = {key for key in stale if not kept.keeps(location, key)}
            await store.delete(location.bucket, sorted(stale))
        except S3CkptError as e:
            log.warning("%s: committed; old data objects not deleted: %s", location.url, e)


_LEFT = "are left for `s3ckpt gc`"
_LISTED = 900  # keys per listing: a page (1000) also holds the strays among them (leases, pins)


async def _check(
    store: ObjectStore, location: Location, record: bytes, objects: Mapping[str, int]
) -> None:
    """Refuse a commit readers would refuse, or one over objects that are not all there."""
    limit = store.config.max_record_size
    if len(record) > limit:
        raise MetadataError(
            f"{location.metadata_url}: not committed: the record is {len(record)} bytes, over "
            f"S3Config.max_record_size ({limit}); raise it for the writer and every reader",
            url=location.metadata_url,
        )
    wrong = await _changed(store, location.bucket, objects)
    if wrong:
        raise _incomplete(location, wrong, len(objects), "not committed", "were deleted")


async def _changed(
    store: ObjectStore, bucket: str, objects: Mapping[str, int]
) -> list[tuple[str, int, int | None]]:
    """``(key, size, stored size or None)`` of each object not stored with its size: listings
    of each save directory the keys are in (`layout.save_dir`), one per `_LISTED` keys, each
    starting after the previous one's last key, all concurrently: as many round trips in a
    row for 1,000 ranks as for one."""
    by_dir: dict[str, list[str]] = {}
    for key in objects:
        by_dir.setdefault(layout.save_dir(key), []).append(key)
    ranges: list[tuple[str, str | None, str]] = []
    for directory, keys in sorted(by_dir.items()):
        keys.sort()  # the listing's order: code points are UTF-8's byte order
        for i in range(0, len(keys), _LISTED):
            last = keys[min(i + _LISTED, len(keys)) - 1]
            ranges.append((directory, keys[i - 1] if i else None, last))

    async def listed(directory: str, after: str | None, last: str) -> dict[str, int]:
        async with store.slot():
            listing = await store.list_objects(bucket, directory, start_after=after, end=last)
        return {obj.key: obj.size for obj in listing.objects}

    stored: dict[str, int] = {}
    for sizes in await gather_or_cancel(listed(*r) for r in ranges):
        stored.update(sizes)
    return [(k, size, stored.get(k)) for k, size in objects.items() if stored.get(k) != size]


def _incomplete(
    location: Location, wrong: list[tuple[str, int, int | None]], count: int, what: str, then: str
) -> IncompleteCheckpoint:
    key, size, got = wrong[0]
    state = "is missing" if got is None else f"holds {got} bytes, not {size}"
    return IncompleteCheckpoint(
        f"{location.url}: {what}: {len(wrong)} of {count} data objects (uploaded or referenced) "
        f"changed (s3://{location.bucket}/{key} {state}: deleted by a removal while the save "
        f"ran? its lease may have lapsed); the save's objects {then}",
        url=location.url,
    )


async def _withdraw(
    store: ObjectStore, location: Location, record: bytes, previous: bytes | None
) -> None:
    """Take back the save's own record, just committed over missing objects (what loads from
    it would fail): the record it replaced goes back, whose objects the removal kept (they were
    referenced when it judged), else it is deleted. Another save's record in its place stays."""
    try:
        if await _read_back(store, location) != record:
            return
        if previous is None:
            await store.delete(location.bucket, [location.metadata_key])
        else:
            await store.put(location.bucket, location.metadata_key, previous)
    except S3CkptError as e:
        log.warning("%s: a record over missing objects could not be withdrawn: %s", location.url, e)


async def _put_record(
    store: ObjectStore, location: Location, record: bytes, *, save_id: str, overwrite: bool
) -> S3CkptError | None:
    """PUT the record: None once it certainly landed, the error when it certainly did not.

    A first attempt that may have been applied is checked by reading the record back at once:
    retried, a PUT whose answers are lost would be resent for the whole retry window.
    """
    bucket, key = location.bucket, location.metadata_key
    first = await store.try_put(bucket, key, record, if_none_match=not overwrite, once=True)
    if first.error is None:
        return None
    error = first.error
    doubts = [e for e in first.failures if may_have_applied(e)]
    if doubts or isinstance(error, PreconditionFailed):
        with contextlib.suppress(S3CkptError):  # resolved below, with retries
            if await _read_back(store, location, store.retry.once()) == record:
                _log_read_back(location, error)
                return None
    if first.retriable:
        again = await store.try_put(bucket, key, record, if_none_match=not overwrite, once=False)
        if again.error is None:
            return None
        error = again.error
        doubts += [e for e in again.failures if may_have_applied(e)]
    how = (
        f"No data was deleted. `s3ckpt info {location.url}` shows save id {save_id} if this "
        "save committed; otherwise `s3ckpt gc` removes its objects (it keeps whatever a "
        "committed record references)."
    )
    gone = "No data was deleted: `s3ckpt gc` removes the save's objects unless a record lands."
    try:
        landed = await _read_back(store, location)
    except S3CkptError as e:
        raise CommitOutcomeUnknown(
            f"{location.url}: the commit's outcome is unknown ({error}), and reading the "
            f"record back failed ({e}). {how}",
            url=location.url,
            save_id=save_id,
        ) from error
    if landed == record:
        _log_read_back(location, error)
        return None
    if isinstance(error, PreconditionFailed) and not overwrite:
        # A conditional PUT cannot land while another save's record is there.
        return CheckpointExists(
            f"{location.url}: another save committed first. {gone}", url=location.url
        )
    if not doubts:
        return error.reworded(f"{location.url}: not committed: {error.message}. {gone}")
    now = "no record" if landed is None else "another save's record"
    raise CommitOutcomeUnknown(
        f"{location.url}: the commit's outcome is unknown: {doubts[-1]}; the prefix holds "
        f"{now}, but the PUT may still be applied. {how}",
        url=location.url,
        save_id=save_id,
    ) from error


def _log_read_back(location: Location, error: StorageError) -> None:
    log.info("%s: committed (answer lost: %s; the record read back)", location.url, error)


async def _read_back(
    store: ObjectStore, location: Location, retry: RetryPolicy | None = None
) -> bytes | None:
    """The record at ``location`` (None: there is none), refused over the configured size."""
    found = await read_record(store, location, retry)
    return None if found is None else found[0]


async def _previous(store: ObjectStore, location: Location) -> tuple[bytes | None, set[str]]:
    """The record being replaced, and its data keys (to delete after the commit): only those
    it lists that are data objects by the writer's naming (`layout.data_key`), so a crafted
    record cannot make an overwrite delete another checkpoint's record or a file."""
    try:
        raw = await _read_back(store, location)
        previous = (
            None
            if raw is None
            else decode(raw, url=location.metadata_url, max_size=store.config.max_record_size)
        )
    except S3CkptError as e:
        log.warning("%s: replacing a record whose objects cannot be listed: %s", location.url, e)
        return None, set()
    if raw is None or previous is None:
        return None, set()
    return raw, {location.key(key) for key in previous.objects if layout.is_data_object(key)}


async def delete_quietly(store: ObjectStore, bucket: str, keys: Iterable[str], what: str) -> None:
    """Delete objects that certainly no record references; a failure is logged (gc finds them)."""
    keys = list(keys)
    if not keys:
        return
    try:
        await asyncio.shield(store.delete(bucket, keys))
    except Exception as e:
        log.warning("could not delete %d objects of %s: %s", len(keys), what, e)
