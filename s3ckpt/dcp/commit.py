"""The commit protocol: a running save's lease, and the one PUT of ``.metadata`` that commits it.

One rule governs every delete s3ckpt issues: data is deleted only when it is certain that no
committed record references it. A commit PUT whose answers were all lost (a reset or a timeout
after the request was sent) may have been applied, so a failed commit is resolved by reading the
record back: the save's own record means it committed; another save's record in place of a
conditional PUT means it lost; a server that refused every attempt outright (a 4xx, 501 or 503
answer) means nothing landed. In every other case nothing is deleted and the save raises
`CommitOutcomeUnknown`; its objects are left for ``s3ckpt gc``, which keeps whatever a record
that did land references.

While a save runs, each rank holds its lease (`layout.lease_key`) from the start of its upload,
and the coordinator from the start of the commit: a small object rewritten every quarter of
`layout.LEASE_TTL`, which gc, prune and rm respect. Before the PUT the coordinator checks that
every object it is about to reference, uploaded or in an earlier checkpoint, is stored with the
size it expects (one HEAD each): a commit does not reference an object that a removal has
already deleted. That a removal does not delete one afterwards is the pins' business
(`s3ckpt.dcp.incremental`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterable, Mapping

from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore
from ..engine.retry import RetryPolicy
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

# Answers that say the server did not act: a refusal (4xx), "not implemented", "slow down".
_NOT_APPLIED_STATUS = {501, 503}
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
    objects while it is live. Each holder has its own token, so none releases another's."""

    def __init__(self, store: ObjectStore, location: Location, save_id: str) -> None:
        super().__init__(store, location, save_id)
        token = secrets.token_hex(8)
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
    ``references``, objects of earlier checkpoints (confirmed like the others, never deleted).

    With ``overwrite`` the checkpoint it replaces loses its data objects once the commit is
    certain (but those other records of the run reference). Raises `CommitOutcomeUnknown` when
    it cannot be known whether the record landed.
    """
    limit = store.config.max_record_size
    if len(record) > limit:  # readers with this config would refuse it: never commit that
        await delete_quietly(store, location.bucket, objects, f"{location.url}: a failed save")
        raise MetadataError(
            f"{location.metadata_url}: not committed: the record is {len(record)} bytes, over "
            f"S3Config.max_record_size ({limit}); raise it for the writer and every reader",
            url=location.metadata_url,
        )
    await _confirm(store, location, objects, references or {})
    previous = await _previous_objects(store, location) if overwrite else set()
    refused = await _put_record(store, location, record, save_id=save_id, overwrite=overwrite)
    if refused is not None:
        await delete_quietly(store, location.bucket, objects, f"{location.url}: a failed save")
        raise refused
    stale = previous - set(objects)
    if stale:
        try:
            kept = await protected(store, [location])
            stale = {key for key in stale if not kept.keeps(location, key)}
            await store.delete(location.bucket, sorted(stale))
        except S3CkptError as e:
            log.warning("%s: committed; old data objects not deleted: %s", location.url, e)


async def _confirm(
    store: ObjectStore,
    location: Location,
    objects: Mapping[str, int],
    references: Mapping[str, int],
) -> None:
    """Every object is stored with its uploaded size, or the save's objects go and it raises."""
    bucket = location.bucket
    uploaded, objects = objects, {**objects, **references}

    async def stored_size(key: str) -> int | None:
        async with store.slot():
            head = await store.head(bucket, key)
        return None if head is None else head.size

    sizes = await gather_or_cancel(stored_size(key) for key in objects)
    found = zip(objects.items(), sizes, strict=True)
    wrong = [(key, size, got) for (key, size), got in found if got != size]
    if not wrong:
        return
    await delete_quietly(store, bucket, uploaded, f"{location.url}: a save that cannot commit")
    key, size, got = wrong[0]
    state = "is missing" if got is None else f"holds {got} bytes, not {size}"
    raise IncompleteCheckpoint(
        f"{location.url}: not committed: {len(wrong)} of {len(objects)} data objects (uploaded "
        f"or referenced) changed (s3://{bucket}/{key} {state}: deleted by a removal while "
        "the save ran?); "
        "the save's objects were deleted",
        url=location.url,
    )


async def _put_record(
    store: ObjectStore, location: Location, record: bytes, *, save_id: str, overwrite: bool
) -> S3CkptError | None:
    """PUT the record: None once it certainly landed, the error when it certainly did not.

    A first attempt that may have been applied is checked by reading the record back at once:
    retried, a PUT whose answers are lost would be resent for the whole retry window.
    """
    bucket, key = location.bucket, location.metadata_key
    once = dataclasses.replace(store.retry, max_attempts=1)
    doubts: list[StorageError] = []

    def failed(error: StorageError) -> None:
        if may_have_applied(error):
            doubts.append(error)

    async def put(retry: RetryPolicy | None) -> None:
        await store.put(
            bucket, key, record, if_none_match=not overwrite, retry=retry, on_failure=failed
        )

    try:
        await put(once)
        return None
    except StorageError as e:
        error = e
    if doubts or isinstance(error, PreconditionFailed):
        with contextlib.suppress(S3CkptError):  # resolved below, with retries
            if await _read_back(store, location, once) == record:
                _log_read_back(location, error)
                return None
    if store.retry.should_retry(error, 1, 0.0):
        try:
            await put(None)
            return None
        except StorageError as e:
            error = e
    how = (
        f"No data was deleted. `s3ckpt info {location.url}` shows save id {save_id} if this "
        "save committed; otherwise `s3ckpt gc` removes its objects (it keeps whatever a "
        "committed record references)."
    )
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
            f"{location.url}: another save committed first; this save's data was deleted",
            url=location.url,
        )
    if not doubts:
        return error
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


async def _previous_objects(store: ObjectStore, location: Location) -> set[str]:
    """Data keys of the committed checkpoint being replaced (to delete after the commit)."""
    try:
        raw = await _read_back(store, location)
        previous = None if raw is None else decode(raw, url=location.metadata_url)
    except S3CkptError as e:
        log.warning("%s: replacing a record whose objects cannot be listed: %s", location.url, e)
        return set()
    if previous is None:
        return set()
    return {location.key(key) for key in previous.objects if not layout.is_reference(key)}


async def delete_quietly(store: ObjectStore, bucket: str, keys: Iterable[str], what: str) -> None:
    """Delete objects that certainly no record references; a failure is logged (gc finds them)."""
    keys = list(keys)
    if not keys:
        return
    try:
        await asyncio.shield(store.delete(bucket, keys))
    except Exception as e:
        log.warning("could not delete %d objects of %s: %s", len(keys), what, e)
