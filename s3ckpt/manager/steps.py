"""A run's checkpoints on the store: which steps are committed, and retention's deletes.

A run is a prefix whose children are ``step-<digits>`` checkpoints. Listing its committed steps
costs one LIST request per 1000 children plus one HEAD of ``.metadata`` per child; retention also
reads each record it has not seen before (`references.records`: a GET, then cached by ETag), to
judge only records it can read. It deletes through `s3ckpt.tools.removal`, so a save whose lease
is live keeps its objects whatever the policy says, and a victim whose objects a pin still holds
loses its record at once and the rest in a later pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from ..config import S3Config
from ..dcp.prefix import saves
from ..dcp.references import records
from ..engine import bridge
from ..engine.contract import ObjectStore
from ..engine.store import get_store
from ..errors import CheckpointNotFound
from ..format.layout import Location, step_in, step_name
from ..tools import listing, removal
from ..tools.retention import Retention
from .collective import Agreement

__all__ = ["Run", "children", "committed", "prune"]

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
    heads = await listing.run_all(
        lambda at: store.head(at.bucket, at.metadata_key), found.values(), store
    )
    return {
        step: at for (step, at), head in zip(found.items(), heads, strict=True) if head is not None
    }


async def _holds_objects(store: ObjectStore, location: Location) -> bool:
    """Whether objects of a save are left at ``location`` (files s3ckpt did not write do not
    count: no removal touches them)."""
    return bool((await saves(store, location)).objects)


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
    schedule: int | None = None,
) -> list[int]:
    """Apply ``retention`` (with ``schedule``: see `Retention`) to the run's committed steps
    once; returns the steps deleted.

    The policy sees only records that can be read, as ``s3ckpt prune``'s does: one that cannot
    (garbled, or written by a newer s3ckpt) is never deleted and counts for nothing, since what
    it references is unknown (an older s3ckpt must not delete a newer job's checkpoints) and,
    counted as the newest, it would make the loadable ones its victims. ``damaged`` steps
    (restore could not load them) are left out of the policy for that reason too.

    A victim's record goes at once, so the policy converges; objects that a pin still holds (a
    reader loading the checkpoint) stay. ``leftovers`` (updated) holds such steps: each pass
    deletes what is left of them again, until nothing is or the step is committed anew.
    """
    store = run.store
    found = bridge.run(children(store, run.location))
    read = bridge.run(records(store, list(found.values())))
    recorded = {step: r for step, r in zip(found, read, strict=True) if r is not None}
    for step, location in sorted(leftovers.items()):
        if step not in recorded:  # (committed again: retention judges it like any other step)
            _delete(location, run.config)
            if bridge.run(_holds_objects(store, location)):
                continue
        del leftovers[step]
    readable = {}
    for step, record in recorded.items():
        if record.unreadable is None:
            readable[step] = record
        else:
            why = record.unreadable
            log.warning("%s: kept, its record cannot be read: %s", record.location.url, why)
    steps = retention.victims((s for s in readable if s not in damaged), schedule)
    victims = [readable[s] for s in steps]
    gone = set(removal.remove(run.location.url, victims, run.config)) if victims else set()
    deleted = [step for step in steps if readable[step].location in gone]
    for step in deleted:
        if bridge.run(_holds_objects(store, readable[step].location)):
            leftovers[step] = readable[step].location
    if deleted:
        log.info("%s: retention deleted step(s) %s", run.location.url, deleted)
    return deleted
