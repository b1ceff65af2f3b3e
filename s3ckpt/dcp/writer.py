"""`S3Writer`: DCP's StorageWriter for S3-compatible object stores.

How DCP drives it (torch 2.13; see ``torch/distributed/checkpoint/storage.py``):

1. every rank: ``storage_meta()``, ``set_up_storage_writer`` — the coordinator checks the prefix
   for a committed checkpoint here, so a refused save fails before any upload;
2. every rank: ``prepare_local_plan``; coordinator: ``prepare_global_plan``, which draws the save's
   id and tells each rank its number;
3. every rank: ``write_data`` packs its items into a few objects balanced by size and uploads them
   concurrently; if anything fails it aborts its multipart uploads and deletes what it wrote;
4. coordinator, only when every rank succeeded: ``finish`` checks that every object is stored,
   then writes ``.metadata`` with one PUT — the commit (`s3ckpt.dcp.commit`). Without ``overwrite``
   the PUT is conditional (``If-None-Match: *``) so that of two concurrent saves at most one
   commits; with it, the old checkpoint's objects are deleted after the commit. Once the PUT is
   sent, a failed commit deletes nothing, whatever the answer (its record may still land): gc
   removes its objects if none does. After the PUT the objects are listed again, so a save whose
   objects a removal deleted meanwhile fails instead of committing a record that cannot load.

Every rank holds the save's lease while it uploads, and the coordinator while it commits, so
that gc, prune and rm leave a running save alone.

With ``incremental=True`` the coordinator finds the run's previous committed checkpoint and pins it
in ``prepare_global_plan``; each rank hashes its items beside its upload in ``write_data`` and
references the unchanged ones instead of uploading them (`s3ckpt.dcp.incremental`).

Data objects of a multi-rank save whose other ranks failed are not referenced by any
``.metadata`` and are left for garbage collection.

The writer is also DCP's stager (``dcp.async_save`` uses it when no ``async_stager`` is given): it
copies the state into CPU buffers kept across saves (see `s3ckpt.dcp.staging`). One save runs at a
time per writer: a new save on it first waits until the previous one has finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import itertools
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import S3Config, WriteOptions
from ..engine import bridge
from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore
from ..errors import CheckpointExists, ConfigError, IncompleteCheckpoint, S3CkptError
from ..format import layout
from ..format.digests import digest
from ..format.frames import FrameTable
from ..format.packing import Packed, assign_objects, element_size
from ..format.record import Locator, encode
from ..format.record.model import gc_paused
from ..format.tensorbytes import as_flat_bytes
from .adapter import AtLocation, to_torch_future
from .commit import Lease, commit, delete_quietly
from .incremental import Base, Candidate, find_base
from .results import RankResults
from .staging import StagingBuffers

__all__ = ["S3Writer"]


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    save_id: str
    rank: int
    spread: int
    incremental: bool = False
    candidates: dict[MetadataIndex, Candidate] = dataclasses.field(default_factory=dict)


class S3Writer(AtLocation, StorageWriter):
    """Save a DCP checkpoint to ``s3://bucket/prefix``.

    Args:
        bucket: bucket name, or a whole ``s3://bucket/prefix`` URL.
        prefix: key prefix of the checkpoint (a "directory"); ``checkpoint_id`` overrides it.
        config: connection settings; default `S3Config()` reads the standard AWS sources.
        overwrite: replace a committed checkpoint at the prefix instead of failing; or a
            function of the checkpoint id, asked once as each save begins, for a writer reused
            across checkpoints that may replace only some (a `CheckpointManager`'s: the steps
            its restore found damaged).
        options: how the bytes are laid out: objects per rank, frame size, compression,
            key spreading (`WriteOptions`; the defaults suit most stores).
        async_staging: stage in a background thread; ``dcp.async_save`` then returns an
            ``AsyncSaveResponse`` whose ``staging_completion`` must finish before the state
            dict's tensors are modified (e.g. before the next ``optimizer.step()``).
        incremental: reference the tensor chunks that are unchanged since the run's previous
            committed checkpoint (the sibling prefix with the highest step below this one's)
            instead of uploading them again; any `S3Reader` loads the result.
        full_every: with ``incremental``, reference only checkpoints of the same window of
            this many steps, so the first save of each window is full: one lost or damaged
            object then spoils at most one window's checkpoints, not the whole run's.
        store: the `ObjectStore` to use instead of the one ``config`` resolves to (a wrapper,
            or a `MemoryStore`); it works only in the process that made it.

    Construction does the one-time work of a first save that needs neither the state nor a
    request: it resolves the configuration (the AWS config files), starts the I/O thread and
    makes the S3 client with its HTTP session (~0.3 s of CPU), so that a job's first checkpoint
    does not take that from training. Make the writer before training starts, and keep it.
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        config: S3Config | None = None,
        options: WriteOptions | None = None,
        overwrite: bool | Callable[[str], bool] = False,
        async_staging: bool = False,
        incremental: bool = False,
        full_every: int | None = None,
        store: ObjectStore | None = None,
    ) -> None:
        if full_every is not None and (not incremental or full_every < 1):
            raise ConfigError(f"full_every needs incremental=True and >= 1, got {full_every}")
        StorageWriter.__init__(self)
        AtLocation.__init__(self, bucket, prefix, config, store)
        self.options = options or WriteOptions()
        self.overwrite = overwrite
        self.async_staging = async_staging
        self.incremental, self.full_every = incremental, full_every
        self.is_coordinator = False
        self._replacing = False  # what ``overwrite`` said for the save in progress
        self._save_id: str | None = None
        self._base: Base | None = None  # the coordinator's, while an incremental save runs
        self._staging = StagingBuffers()
        self._stager_thread: ThreadPoolExecutor | None = None
        self._reset_in: threading.Thread | None = None  # a save that began with `reset`
        bridge.run(self._store.prepare())

    def __getstate__(self) -> dict[str, Any]:
        # PROCESS mode pickles the writer on every save: never ship buffers, threads or locks.
        state = AtLocation.__getstate__(self)
        state["_staging"] = None
        state["_stager_thread"] = None
        state["_reset_in"] = None
        state["_base"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._staging = StagingBuffers()

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(
        self, state_dict: dict[str, Any]
    ) -> dict[str, Any] | ConcurrentFuture[dict[str, Any]]:
        """Copy the state into this writer's CPU staging buffers (DCP's AsyncStager protocol)."""
        if not self.async_staging:
            return self._staging.stage(state_dict)
        if self._stager_thread is None:
            self._stager_thread = ThreadPoolExecutor(1, thread_name_prefix="s3ckpt-stage")
        return self._stager_thread.submit(self._staging.stage, state_dict)

    def prepare_staging(self, state_dict: dict[str, Any]) -> None:
        """Allocate and touch the staging buffers for a state like ``state_dict`` now (its
        ``Stateful`` values as DCP will ask them), so that the first ``async_save`` of such a
        state stalls for its copy alone, not for the first touch of fresh memory (see
        `dcp.staging`). Call it before training; `CheckpointManager.restore` does."""
        self._staging.prepare(
            {key: v.state_dict() if isinstance(v, Stateful) else v for key, v in state_dict.items()}
        )

    def synchronize_staging(self) -> None:
        """Staging is complete when `stage` returns (or its future resolves)."""

    def close(self) -> None:
        """Release the staging buffers (pinned memory included) and the staging thread."""
        self._staging.wait_for_previous_save()
        self._release_base()
        self._staging.release()
        if self._stager_thread is not None:
            self._stager_thread.shutdown(wait=True)
            self._stager_thread = None

    def reset(self, checkpoint_id: str | Any = None) -> None:
        # A save begins here when DCP has a checkpoint id for it (else in `storage_meta`): it
        # waits for the writer before moving it, so a second save cannot move the first.
        self._staging.save_started()
        self._reset_in = threading.current_thread()
        self._move(checkpoint_id)
        self._save_id = None

    def storage_meta(self) -> StorageMeta:
        if self._reset_in is not threading.current_thread():
            self._staging.save_started()
        self._reset_in = None
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if is_coordinator:  # the one rank that commits
            overwrite = self.overwrite
            self._replacing = overwrite(self.checkpoint_id) if callable(overwrite) else overwrite
            bridge.run(self._check_destination())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._save_id = layout.new_save_id()
        options = self.options
        # The world size is known only now, when the save starts.
        objects = len(plans) * options.objects_per_rank
        spread = layout.spread_digits(objects) if options.spread_keys else 0
        self._release_base()
        if self.incremental:
            # A save that fails before `finish` leaves its pins until the next save's plan
            # (the release above) or `close` (or the process's end: then they expire).
            found = find_base(self._store, self.location, self._save_id, self.full_every)
            self._base = bridge.run(found)
        base, compression = self._base, options.compression
        return [
            dataclasses.replace(
                plan,
                storage_data=_RankPlan(
                    self._save_id,
                    rank,
                    spread,
                    self.incremental,
                    {} if base is None else base.candidates(plan.items, compression),
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan: _RankPlan = plan.storage_data
        _claim(rank_plan, self.checkpoint_id)
        members: _Members = []
        for item in plan.items:
            data = planner.resolve_data(item)
            value = data.getvalue() if isinstance(data, io.BytesIO) else as_flat_bytes(data)
            members.append((item, value))
        sizes = [_planned_size(item) for item, _ in members]
        owner = assign_objects(sizes, self.options.objects_per_rank, self.config.part_size)
        objects: dict[int, _Members] = {}
        for member, obj in zip(members, owner, strict=True):
            objects.setdefault(obj, []).append(member)
        place = _Placing(rank_plan, secrets.token_hex(3), self.options.frame_size)
        if rank_plan.incremental:
            source = self._changed(objects, place)
        else:
            source = _each(place.packed(obj, found, {}) for obj, found in sorted(objects.items()))
        upload = self._upload(source, place.results, rank_plan.save_id)
        return cast(Future[list[WriteResult]], to_torch_future(bridge.submit(upload)))

    async def _changed(
        self, objects: dict[int, _Members], place: _Placing
    ) -> AsyncIterator[tuple[str, Packed]]:
        """Each object's items hashed in a worker thread, one object after the other, so that
        the next object hashes while the previous ones upload; the items that changed go up
        in the object, the others are referenced."""
        loop, candidates = asyncio.get_running_loop(), place.rank_plan.candidates
        for obj, members in sorted(objects.items()):
            digests = await loop.run_in_executor(None, _hash_all, members)
            changed: _Members = []
            for item, value in members:
                candidate = candidates.get(item.index)
                if candidate is not None and digests.get(item.index) == candidate[0]:
                    place.results.add(item.index, candidate[1], candidate[0])
                else:
                    changed.append((item, value))
            if changed:
                yield place.packed(obj, changed, digests)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Each rank's results are the `RankResults` its `write_data` returned.
        ranks = cast(list[RankResults], results)
        try:
            self._finish(metadata, ranks)
        finally:
            # Left to expire, not deleted: the record may have landed even when the commit
            # raised (see `incremental`).
            base, self._base = self._base, None
            if base is not None:
                bridge.run(base.pins.leave())

    def _finish(self, metadata: Metadata, results: list[RankResults]) -> None:
        locators: dict[MetadataIndex, Locator] = {}
        frames: dict[str, FrameTable] = {}
        digests: dict[MetadataIndex, str] = {}
        referenced: set[str] = set()
        with gc_paused():  # millions of acyclic objects: rescanning them would double the time
            for rank_results in results:
                frames.update(rank_results.frames)
                referenced.update(key for key in rank_results.keys if layout.is_reference(key))
                for fqn, offset, key, start, length, hashed in rank_results.located():
                    index = MetadataIndex(fqn, offset)
                    locators[index] = Locator(key, start, length)
                    if hashed is not None:
                        digests[index] = hashed
        if self._save_id is None:
            raise S3CkptError(f"finish() for {self.checkpoint_id} without a planned save")
        pinned = {} if self._base is None else self._base.frames
        stray = sorted(referenced - pinned.keys())
        if stray:
            # Only the base's objects are pinned: DCP's plan caching can hand a rank an
            # earlier save's references.
            raise IncompleteCheckpoint(
                f"{self.checkpoint_id}: not committed: a rank referenced {stray[0]!r}, which the "
                "base checkpoint of this save does not hold (a save plan cached from an earlier "
                "save?); save again without plan caching",
                url=self.checkpoint_id,
            )
        tables = frames | {key: pinned[key] for key in referenced}
        record = encode(
            metadata,
            locators,
            save_id=self._save_id,
            created=time.time(),
            objects={key: table.size for key, table in tables.items()},
            frames=tables,
            extra=self._recorded(len(results)),
            digests=digests,
        )
        absolute = self.location.key
        objects = {absolute(relative): table.size for relative, table in frames.items()}
        references = {absolute(relative): pinned[relative].size for relative in referenced}
        committing = commit(
            self._store,
            self.location,
            record,
            objects,
            save_id=self._save_id,
            overwrite=self._replacing,
            references=references,
        )
        bridge.run(committing)

    def _release_base(self) -> None:
        """Drop the pins of a save that did not commit."""
        base, self._base = self._base, None
        if base is not None:
            bridge.run(base.pins.release())

    def _recorded(self, world_size: int) -> dict[str, Any]:
        """The record's ``extra``: what `s3ckpt info` shows and the rest of the record does not
        say (see `s3ckpt.format.record`)."""
        from importlib import metadata

        try:
            version: str | None = metadata.version("s3ckpt")
        except metadata.PackageNotFoundError:  # run from a source tree, not installed
            version = None
        compressed = self.options.compression is not None
        return {
            "world_size": world_size,
            "compression": self.options.compression,
            "compression_level": self.options.compression_level if compressed else None,
            "shuffle": self.options.shuffle if compressed else None,
            "s3ckpt_version": version,
            "torch_version": str(torch.__version__),
        }

    async def _check_destination(self) -> None:
        """Fail before any upload if the bucket is missing or a commit would be refused."""
        store, location = self._store, self.location
        await store.check_bucket(location.bucket)
        if self._replacing:
            return
        if await store.head(location.bucket, location.metadata_key) is not None:
            raise CheckpointExists(
                f"{self.checkpoint_id} already holds a committed checkpoint; "
                "pass overwrite=True to replace it",
                url=self.checkpoint_id,
            )

    async def _upload(
        self,
        uploads: AsyncIterator[tuple[str, Packed]],
        results: RankResults,
        save_id: str,
    ) -> RankResults:
        """Upload the objects under the save's lease as ``uploads`` yields them (``results`` is
        complete once it is exhausted), checksumming their frames; the results carry the frame
        tables."""
        lease = Lease(self._store, self.location, save_id)
        try:
            async with lease.held():
                return await self._upload_all(uploads, results)
        except BaseException:
            await lease.release()  # this save can no longer commit
            raise

    async def _upload_all(
        self, uploads: AsyncIterator[tuple[str, Packed]], results: RankResults
    ) -> RankResults:
        store, bucket, loop = self._store, self.location.bucket, asyncio.get_running_loop()
        tables: dict[str, FrameTable] = {}

        frame_size = self.options.frame_size

        async def one(relative: str, packed: Packed) -> None:
            key = self.location.key(relative)
            if self.options.compression is None:
                # Beside the upload: each frame's checksum is computed once, for the record and
                # for the wire checksums of the parts, by whichever needs it first.
                checksums = loop.run_in_executor(None, packed.frame_table)
                await store.upload(bucket, key, packed)
                tables[relative] = await checksums
                return
            entries: list[tuple[int, int, int]] = []
            await store.upload_stream(bucket, key, self._encoded(packed, entries))
            sizes, crcs, codecs = (tuple(entry[i] for entry in entries) for i in range(3))
            tables[relative] = FrameTable(frame_size, sizes, crcs, codecs, packed.size)

        started: list[asyncio.Future[None]] = []
        keys: list[str] = []
        try:
            async for relative, packed in uploads:
                keys.append(self.location.key(relative))
                started.append(asyncio.ensure_future(one(relative, packed)))
            await gather_or_cancel(started)
        except BaseException:
            for task in started:
                task.cancel()
            await asyncio.gather(*started, return_exceptions=True)
            # Every key, not only finished ones: a cancelled PUT or Complete may still land.
            await delete_quietly(store, bucket, keys, f"{self.checkpoint_id}: a failed save")
            raise
        results.frames = tables
        return results

    async def _encoded(
        self, packed: Packed, entries: list[tuple[int, int, int]]
    ) -> AsyncIterator[bytes | memoryview]:
        """The object's frames, compressed in worker threads a few at a time, in order; each
        frame's (stored size, CRC32C, codec) is appended to ``entries``."""
        loop = asyncio.get_running_loop()
        window: deque[asyncio.Future[tuple[bytes | memoryview, int, int]]] = deque()
        depth = max(2, os.cpu_count() or 2)
        options = self.options
        frames = range(-(-packed.size // options.frame_size))
        for number in itertools.chain(frames, [None] * depth):
            if number is not None:
                window.append(
                    loop.run_in_executor(
                        None,
                        packed.encode_frame,
                        number,
                        options.compression_level,
                        options.shuffle,
                    )
                )
            if window and (len(window) >= depth or number is None):
                stored, codec, crc = await window.popleft()
                entries.append((len(stored), crc, codec))
                yield stored


_claimed: set[tuple[str, int]] = set()  # (save id, rank) of every write_data in this process
_claimed_lock = threading.Lock()


def _claim(rank_plan: _RankPlan, url: str) -> None:
    """Refuse a plan whose save this rank has already written: one a planner cached from an
    earlier save (DCP's ``enable_plan_caching`` without `CachingSavePlanner`), which would
    write into that save's directory, perhaps a committed checkpoint's."""
    with _claimed_lock:
        if (rank_plan.save_id, rank_plan.rank) in _claimed:
            raise ConfigError(
                f"{url}: not saved: rank {rank_plan.rank}'s save plan is that of the earlier "
                f"save {rank_plan.save_id} (DCP's plan caching reuses the storage data of the "
                "save that cached it); use s3ckpt.dcp.planning.CachingSavePlanner, or a planner "
                "without enable_plan_caching"
            )
        _claimed.add((rank_plan.save_id, rank_plan.rank))


_Members = list[tuple[WriteItem, torch.Tensor | bytes]]


@dataclass
class _Placing:
    """How one rank's objects are named and laid out, and the results of its items so far."""

    rank_plan: _RankPlan
    nonce: str
    frame_size: int
    results: RankResults = dataclasses.field(default_factory=RankResults)

    def packed(
        self, obj: int, members: _Members, digests: dict[MetadataIndex, str]
    ) -> tuple[str, Packed]:
        """Object ``obj`` holding ``members``, and (in ``results``) where each item is in it."""
        plan = self.rank_plan
        relative = layout.data_key(plan.save_id, plan.rank, obj, plan.spread, self.nonce)
        elements = [
            None if item.tensor_data is None else element_size(item.tensor_data.properties.dtype)
            for item, _ in members
        ]
        packed = Packed([value for _, value in members], elements, self.frame_size)
        for (item, _), start, length in zip(members, packed.starts, packed.lengths, strict=True):
            self.results.add(item.index, Locator(relative, start, length), digests.get(item.index))
        return relative, packed


async def _each(uploads: Iterable[tuple[str, Packed]]) -> AsyncIterator[tuple[str, Packed]]:
    for upload in uploads:
        yield upload


def _hash_all(members: _Members) -> dict[MetadataIndex, str]:
    """The tensor items' digests (worker thread: xxh3 releases the GIL)."""
    return {item.index: digest(value) for item, value in members if item.tensor_data is not None}


def _planned_size(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    dtype = item.tensor_data.properties.dtype
    return math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize
