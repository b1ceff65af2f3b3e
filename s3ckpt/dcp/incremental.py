"""Incremental saves: the base a save references, and the pins that keep its objects meanwhile.

A save with ``incremental=True`` hashes every staged tensor chunk (`format.digests`) and, where
the chunk of the same tensor at the same offsets in the run's previous committed checkpoint (its
*base*) has the same digest, sizes, dtype and compression, records a reference to those bytes
instead of uploading them. The base is the committed sibling (same parent prefix) with the
highest step below this save's (`layout.step_of`); a checkpoint whose name has no step has no
base and is saved in full. References always name the object that holds the bytes
(`layout.reference`), and the record lists the referenced objects with their frame tables, so a
plain `S3Reader` loads it alone and ``verify`` checks those bytes too.

References never dangle. Removals delete a data object only when no committed record of the run
references it and no live lease covers it (`references.protected`: the records read first, the
leases listed after, within `layout.PIN_GRACE`), looking again after deleting the records they
remove. A save pins every save directory it may reference (`Pins`) *before* it confirms that
its base is still committed, HEADs each referenced object before its commit, and leaves the
pins to expire `layout.LEASE_TTL` after the commit. A removal whose leases listing came before
the pins read the base's record already deleted, so the save sees it gone and references nothing
of it; one whose listing came later sees the pins, or (after they expire) read the records
after the commit, the new record among them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from functools import cached_property

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from ..engine.contract import ObjectStore
from ..errors import MetadataError, S3CkptError
from ..format import layout
from ..format.frames import FrameTable
from ..format.layout import Location, referenced_save
from ..format.record import Checkpoint, Chunk, Locator, TensorEntry, decode
from ..format.record.torchmeta import DTYPE_NAMES
from .commit import ReadLease
from .prefix import read_record
from .references import siblings

__all__ = ["Base", "Candidate", "find_base"]

log = logging.getLogger(__name__)

# Siblings tried, highest step first, before a save gives up looking for a readable base.
_TRIES = 8

Candidate = tuple[str, Locator]
"""A base chunk an item may reference: its digest and where its bytes are, relative to the
new checkpoint."""


class Pins:
    """Read leases on every save directory that a committed record's objects are in (its own
    and those it references), refreshed on the bridge loop while held; ``owner``, the save
    that pins them (`ReadLease`)."""

    def __init__(
        self,
        store: ObjectStore,
        location: Location,
        checkpoint: Checkpoint,
        owner: str | None = None,
    ) -> None:
        parent, dirs = location.parent, {(location, checkpoint.save_id)}
        for sibling, save_id in checkpoint.referenced_saves:
            dirs.add((Location(parent.bucket, parent.key(sibling)), save_id))
        order = sorted(dirs, key=lambda d: (d[0].prefix, d[1]))
        self.leases = [ReadLease(store, where, save_id, owner) for where, save_id in order]
        self._stack = contextlib.AsyncExitStack()

    async def hold(self) -> None:
        for lease in self.leases:
            await self._stack.enter_async_context(lease.held())

    async def release(self) -> None:
        """Stop refreshing the pins and delete them."""
        await self._stack.aclose()
        for lease in self.leases:
            await lease.release()

    async def leave(self) -> None:
        """Stop refreshing the pins, refreshed once more, and leave them to expire
        `layout.LEASE_TTL` from now: what a save does once its record protects what it
        references, for removals that read the run's records before the commit."""
        await self._stack.aclose()
        for lease in self.leases:
            try:
                await lease.write()
            except S3CkptError as e:
                log.warning("s3://%s/%s: pin not refreshed: %s", lease.bucket, lease.key, e)


@dataclass
class Base:
    """The committed checkpoint a save references, pinned while the save runs; ``oldest``, if
    set, is the lowest step whose objects the save may reference (see `find_base`)."""

    location: Location
    checkpoint: Checkpoint
    pins: Pins
    oldest: int | None = None

    @property
    def frames(self) -> dict[str, FrameTable]:
        """The base's objects, keyed as the new checkpoint references them."""
        name = self.location.name
        return {layout.reference(name, k): t for k, t in self.checkpoint.frames.items()}

    def candidates(
        self, items: list[WriteItem], compression: str | None
    ) -> dict[MetadataIndex, Candidate]:
        """For each of a rank's tensor items, the base chunk it may reference."""
        if self.checkpoint.extra.get("compression", "") != compression:
            return {}  # stored another way (or by a writer that did not say how)
        name, chunks, out = self.location.name, self._chunks, {}
        for item in items:
            data = item.tensor_data
            if data is None:
                continue
            found = chunks.get((item.index.fqn, tuple(data.chunk.offsets)))
            if found is None or found[0] != DTYPE_NAMES.get(data.properties.dtype):
                continue
            chunk = found[1]
            if chunk.sizes == tuple(data.chunk.sizes) and chunk.digest and self._near(chunk):
                key = layout.reference(name, chunk.locator.key)
                out[item.index] = (
                    chunk.digest,
                    Locator(key, chunk.locator.offset, chunk.locator.length),
                )
        return out

    def _near(self, chunk: Chunk) -> bool:
        """Whether the checkpoint holding the chunk's bytes is recent enough to reference."""
        if self.oldest is None:
            return True
        holder = referenced_save(chunk.locator.key)
        step = layout.step_of(self.location.name if holder is None else holder[0])
        return step is not None and step >= self.oldest

    @cached_property
    def _chunks(self) -> dict[tuple[str, tuple[int, ...]], tuple[str, Chunk]]:
        """The base's tensor chunks by name and offsets, with their dtype: each rank's plan
        looks its items up here (a model sharded over many ranks has many chunks per tensor)."""
        return {
            (fqn, chunk.offsets): (entry.dtype, chunk)
            for fqn, entry in self.checkpoint.entries.items()
            if isinstance(entry, TensorEntry)
            for chunk in entry.chunks
        }


async def find_base(
    store: ObjectStore, location: Location, save_id: str, full_every: int | None = None
) -> Base | None:
    """The run's previous committed checkpoint, pinned by the save ``save_id``; None if there
    is none to reference.

    With ``full_every``, steps fall in windows of that many (``step // full_every``): a save
    references only checkpoints of its own window, so the window's first save is full and one
    lost or damaged object can spoil at most one window's checkpoints."""
    # A checkpoint named data-... would hide among its parent's save directories (`siblings`).
    step = None if layout.is_save_dir(location.name) else layout.step_of(location.prefix)
    if not location.prefix or step is None:
        log.info("%s: no step in the name, so no previous checkpoint: saved in full", location.url)
        return None
    oldest = None if full_every is None else step - step % full_every
    older = [
        (found, sibling)
        for sibling in await siblings(store, location)
        if (found := layout.step_of(sibling.prefix)) is not None
        and found < step
        and (oldest is None or found >= oldest)
    ]
    if oldest is not None and not older:
        log.info("%s: the first save since step %d: saved in full", location.url, oldest)
    for _, sibling in sorted(older, key=lambda s: s[0], reverse=True)[:_TRIES]:
        try:
            record = await read_record(store, sibling)
            checkpoint = (
                None
                if record is None
                else decode(
                    record[0],
                    url=sibling.metadata_url,
                    max_size=store.config.max_record_size,
                )
            )
        except MetadataError as e:
            log.warning("%s: not a base, its record cannot be read: %s", sibling.url, e)
            continue
        if record is None or checkpoint is None:
            continue
        pins = Pins(store, sibling, checkpoint, owner=save_id)
        try:
            await pins.hold()
            head = await store.head(sibling.bucket, sibling.metadata_key)
        except BaseException:
            await pins.release()
            raise
        if head is not None and head.etag == record[1]:
            return Base(sibling, checkpoint, pins, oldest)
        # Removed or replaced before the pins landed: its objects may be going.
        await pins.release()
        log.info("%s changed while a save pinned it; trying an older base", sibling.url)
    return None
