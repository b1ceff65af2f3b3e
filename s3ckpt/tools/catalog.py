"""Find, inspect, read and clean up checkpoints under a prefix: what the ``s3ckpt`` command does.

Listing and ``latest`` search every depth below the URL (`tree`: one LIST request per 1000 keys
under it); the removals (``delete``, ``prune``, ``gc``) live in `removal`, go one level deep and
are importable from here. The functions are synchronous; the I/O runs on the `bridge` loop
through the process's `ObjectStore`. Only `read_state` and `export` import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import S3Config
from ..dcp.prefix import State, read_prefix
from ..engine import bridge
from ..engine.contract import ObjectStore, Upload
from ..engine.store import get_store
from ..errors import AccessDenied, BucketNotFound, IncompleteCheckpoint, StorageError
from ..format.layout import Location
from ..format.record import Checkpoint
from . import listing, search
from .listing import CheckpointInfo, Progress
from .removal import GcReport, Removal, delete, gc, prune

if TYPE_CHECKING:
    from .export import Exported

__all__ = [
    "CheckpointInfo",
    "GcReport",
    "Progress",
    "Removal",
    "Upload",
    "delete",
    "describe",
    "export",
    "gc",
    "highest",
    "latest",
    "list_checkpoints",
    "make_bucket",
    "prune",
    "read_state",
]


def list_checkpoints(url: str, config: S3Config | None = None) -> list[CheckpointInfo]:
    """Checkpoints at ``url`` and at every depth below it, committed or not, in tree order (by
    path; ``step-2`` before ``step-10``). Incomplete ones count the parts of their uploads."""
    found = bridge.run(search.survey_all(get_store(config), listing.location_of(url)))
    return [f.info for f in found]


def latest(url: str, config: S3Config | None = None) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step at any depth (then the newest), or None."""
    found = bridge.run(search.latest(get_store(config), listing.location_of(url)))
    return None if found is None else found.info


def highest(url: str, config: S3Config | None = None) -> list[CheckpointInfo]:
    """Every committed checkpoint with the highest step at any depth, newest first (`latest`
    is the first): more than one when runs under ``url`` tie."""
    found = bridge.run(search.highest(get_store(config), listing.location_of(url)))
    return [f.info for f in found]


def describe(url: str, config: S3Config | None = None) -> tuple[CheckpointInfo, Checkpoint]:
    """The committed checkpoint at ``url`` and its record; else CheckpointNotFound or
    IncompleteCheckpoint (saying what the incomplete one holds, uploaded parts included)."""
    return bridge.run(_describe(get_store(config), listing.location_of(url)))


def read_state(
    url: str,
    config: S3Config | None = None,
    *,
    progress: Progress | None = None,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """The whole state dict of the committed checkpoint at ``url``, nested as it was saved, with
    CPU tensors rebuilt from the metadata: no model is needed to compare checkpoints. It is all
    in memory at once (`export` writes one to a file without that). ``progress(done, total)``
    counts tensor bytes as they arrive. ``trust_pickles`` is `S3Reader`'s: without it a
    non-tensor value that could run code when unpickled raises `UnsafeCheckpoint`."""
    _check_readable(url, config)
    from .export import read_state as load  # torch and DCP: only this needs them

    return load(url, config, progress=progress, trust_pickles=trust_pickles)


def export(
    url: str,
    path: Path,
    config: S3Config | None = None,
    *,
    progress: Progress | None = None,
    trust_pickles: bool = False,
) -> Exported:
    """Write the committed checkpoint at ``url`` to ``path`` as one ``torch.save`` file, nested
    as it was saved, holding a bounded batch of tensors in memory at a time (see
    `state.export`); ``progress`` and ``trust_pickles`` as for `read_state`."""
    _check_readable(url, config)
    from .export import export as write  # torch and DCP: only this needs them

    return write(url, path, config, progress=progress, trust_pickles=trust_pickles)


def _check_readable(url: str, config: S3Config | None) -> None:
    """The typed error, which DCP would turn into an AssertionError: building DCP's metadata is
    part of it (a dtype this torch lacks)."""
    _, checkpoint = describe(url, config)
    _ = checkpoint.metadata


async def _describe(store: ObjectStore, location: Location) -> tuple[CheckpointInfo, Checkpoint]:
    at = await read_prefix(store, location)
    if at.state is State.INCOMPLETE:
        pending = (await listing.uploads(store, location)).get(location.prefix, [])
        info = (await listing.incomplete(store, location, list(at.data), pending)).info
        of_save = f" of save {info.save_id}" if info.save_id else ""
        raise IncompleteCheckpoint(
            f"{location.url} is incomplete: no .metadata, but {info.num_objects} data object(s) "
            f"({info.stored_bytes} bytes) and {info.uploads} multipart upload(s) "
            f"({info.upload_bytes} bytes in parts so far){of_save} — a save failed, was "
            "killed, or is running (`s3ckpt gc` removes what it left once it is old)",
            url=location.url,
        )
    checkpoint = at.require()
    return listing.found(at).info, checkpoint


def make_bucket(bucket: str, config: S3Config | None = None) -> bool:
    """Create ``bucket`` (``s3ckpt mb``); False if it exists already and these credentials may
    use it. Raises AccessDenied for a bucket that is someone else's or denied to us."""
    return bridge.run(_make_bucket(get_store(config), bucket))


async def _make_bucket(store: ObjectStore, bucket: str) -> bool:
    """Create ``bucket``; False if it was there already and ours.

    A one-key listing decides first, not `ObjectStore.check_bucket`, which lets AccessDenied
    pass (prefix-scoped credentials): a bucket we may not list is someone else's or denied to
    us, and must not be reported as ready to save to.
    """
    try:
        await store.list_objects(bucket, "", limit=1)
        return False
    except BucketNotFound:
        pass
    except AccessDenied as e:
        advice = "it belongs to someone else, or these credentials or a policy do not allow it"
        raise e.retyped(AccessDenied, f"cannot use bucket s3://{bucket} ({advice}): {e}") from e
    try:
        await store.create_bucket(bucket)
    except StorageError as e:
        if e.code == "BucketAlreadyOwnedByYou":  # a racing mb, or a listing not yet consistent
            return False
        if e.code == "BucketAlreadyExists":
            taken = f"bucket s3://{bucket} belongs to someone else (names are global): {e}"
            raise e.retyped(StorageError, taken) from e
        raise
    return True
