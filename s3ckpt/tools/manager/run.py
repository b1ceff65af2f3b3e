"""A run's checkpoints on the store: which steps are committed, and retention's deletes.

A run is a prefix whose children are ``step-<digits>`` checkpoints. Listing its committed steps
costs one LIST request per 1000 children plus one HEAD of ``.metadata`` per child. Retention
deletes through `s3ckpt.tools.removal`, so a save whose lease is live keeps its objects whatever
the policy says; before that, a victim with any live lease (a save, or a reader's `ReadLease`)
is left for a later pass, and a victim whose objects a lease still spared is swept again later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from ...config import S3Config
from ...dcp.prefix import saves
from ...engine import bridge
from ...engine.contract import ObjectStore
from ...engine.store import get_store
from ...errors import CheckpointNotFound
from ...format.layout import Location
from .. import removal, scan
from ..retention import Retention, step_in, step_name
from .collective import Agreement

__all__ = ["Run", "children", "committed", "in_use", "prune"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """Where a run is, how to reach it, and how its ranks load together."""

    location: Location
    config: S3Config
    group: dist.ProcessGroup | None
    agreement: Agreement

    @property
    def store(self) -> ObjectStore:
        return get_store(self.config)

    def at(self, step: int) -> Location:
        """Where the manager saves ``step``."""
        return Location(self.location.bucket, self.location.key(step_name(step)))


async def children(store: ObjectStore, run: Location) -> dict[int, Location]:
    """The run's ``step-<digits>`` child prefixes by step, committed or not (one LIST per 1000).
    Of two names for one step (``step-100``, ``step-000000100``) the manager's wins."""
    listing = await store.list_objects(run.bucket, run.listing_prefix, delimiter=True)
    start, found = len(run.listing_prefix), {}
    for prefix in sorted(listing.prefixes):
        name = prefix[start:].rstrip("/")
        step = step_in(name)
        if step is not None and (step not in found or name == step_name(step)):
            found[step] = Location(run.bucket, run.key(name))
    return found


async def committed(store: ObjectStore, run: Location) -> dict[int, Location]:
    """The run's steps that hold a ``.metadata`` (readable or not), by step."""
    found = await children(store, run)
    heads = await scan.run_all(
        lambda at: store.head(at.bucket, at.metadata_key), found.values(), store
    )
    return {
        step: at for (step, at), head in zip(found.items(), heads, strict=True) if head is not None
    }


async def in_use(store: ObjectStore, location: Location) -> bool:
    """Whether any save at ``location`` holds a live lease: it is being written, or read."""
    data, now = await saves(store, location)
    return bool(scan.live_saves(data, now))


async def _holds_objects(store: ObjectStore, location: Location) -> bool:
    return bool((await store.list_objects(location.bucket, location.listing_prefix)).objects)


def _delete(location: Location, config: S3Config) -> bool:
    """`removal.delete`: ``.metadata``, then the objects of every save without a live lease."""
    try:
        removal.delete(location.url, config)
    except CheckpointNotFound:
        return False  # gone already, or only a running save's objects are there
    return True


def prune(
    run: Run,
    retention: Retention,
    leftovers: dict[int, Location],
    damaged: frozenset[int] = frozenset(),
) -> list[int]:
    """Apply ``retention`` to the committed steps once; returns the steps deleted.

    ``damaged`` steps (restore could not load them) are left out of the policy: counted as
    kept, a damaged newest step would make the last loadable checkpoints its victims.
    ``leftovers`` (updated) holds the deleted steps whose objects a live lease spared: each pass
    deletes them again, until nothing is left or the step is committed anew.
    """
    store = run.store
    found = bridge.run(committed(store, run.location))
    for step, location in sorted(leftovers.items()):
        if step not in found:  # (committed again: retention judges it like any other step)
            _delete(location, run.config)
            if bridge.run(_holds_objects(store, location)):
                continue
        del leftovers[step]
    deleted = []
    for step in retention.victims([s for s in found if s not in damaged]):
        location = found[step]
        if bridge.run(in_use(store, location)):
            log.info("%s: kept until a later save: it is being read or written", location.url)
            continue
        if _delete(location, run.config):
            deleted.append(step)
        if bridge.run(_holds_objects(store, location)):
            leftovers[step] = location
    if deleted:
        log.info("%s: retention deleted step(s) %s", run.location.url, deleted)
    return deleted
