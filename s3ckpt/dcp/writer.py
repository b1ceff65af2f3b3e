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
   commits; with it, the old checkpoint's objects are deleted after the commit. A commit that
   certainly failed deletes the save's objects; one whose outcome is unknown deletes nothing.

Every rank holds the save's lease while it uploads, and the coordinator while it commits, so
that gc, prune and rm leave a running save alone.

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
from collections.abc import AsyncIterator
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import S3Config, WriteOptions
from ..engine import bridge
from ..engine.bridge import gather_or_cancel
from ..errors import CheckpointExists, S3CkptError
from ..format import layout
from ..format.frames import FrameTable
from ..format.packing import Packed, assign_objects, element_size
from ..format.record import Locator, encode
from ..format.tensorbytes import as_flat_bytes
from .adapter import AtLocation, to_torch_future
from .commit import Lease, commit, delete_quietly
from .staging import StagingBuffers

__all__ = ["S3Writer"]


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    save_id: str
    rank: int
    spread: int


class S3Writer(AtLocation, StorageWriter):
    """Save a DCP checkpoint to ``s3://bucket/prefix``.

    Args:
        bucket: bucket name, or a whole ``s3://bucket/prefix`` URL.
        prefix: key prefix of the checkpoint (a "directory"); ``checkpoint_id`` overrides it.
        config: connection settings; default `S3Config()` reads the standard AWS sources.
        overwrite: replace a committed checkpoint at the prefix instead of failing.
        options: how the bytes are laid out: objects per rank, frame size, compression,
            key spreading (`WriteOptions`; the defaults suit most stores).
        async_staging: stage in a background thread; ``dcp.async_save`` then returns an
            ``AsyncSaveResponse`` whose ``staging_completion`` must finish before the state
            dict's tensors are modified (e.g. before the next ``optimizer.step()``).
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        config: S3Config | None = None,
        options: WriteOptions | None = None,
        overwrite: bool = False,
        async_staging: bool = False,
    ) -> None:
        StorageWriter.__init__(self)
        AtLocation.__init__(self, bucket, prefix, config)
        self.options = options or WriteOptions()
        self.overwrite = overwrite
        self.async_staging = async_staging
        self.is_coordinator = False
        self._save_id: str | None = None
        self._staging = StagingBuffers()
        self._stager_thread: ThreadPoolExecutor | None = None
        self._reset_in: threading.Thread | None = None  # a save that began with `reset`

    def __getstate__(self) -> dict[str, Any]:
        # PROCESS mode pickles the writer on every save: never ship buffers, threads or locks.
        state = AtLocation.__getstate__(self)
        state["_staging"] = None
        state["_stager_thread"] = None
        state["_reset_in"] = None
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

    def synchronize_staging(self) -> None:
        """Staging is complete when `stage` returns (or its future resolves)."""

    def close(self) -> None:
        """Release the staging buffers (pinned memory included) and the staging thread."""
        self._staging.wait_for_previous_save()
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
        if is_coordinator:
            bridge.run(self._check_destination())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._save_id = layout.new_save_id()
        options = self.options
        # The world size is known only now, when the save starts.
        objects = len(plans) * options.objects_per_rank
        spread = layout.spread_digits(objects) if options.spread_keys else 0
        return [
            dataclasses.replace(plan, storage_data=_RankPlan(self._save_id, rank, spread))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan: _RankPlan = plan.storage_data
        sizes = [_planned_size(item) for item in plan.items]
        owner = assign_objects(sizes, self.options.objects_per_rank, self.config.part_size)
        objects: dict[int, list[tuple[WriteItem, torch.Tensor | bytes]]] = {}
        for item, obj in zip(plan.items, owner, strict=True):
            data = planner.resolve_data(item)
            value = data.getvalue() if isinstance(data, io.BytesIO) else as_flat_bytes(data)
            objects.setdefault(obj, []).append((item, value))
        element = {
            item.index: element_size(item.tensor_data.properties.dtype)
            for item in plan.items
            if item.tensor_data is not None
        }

        results: list[WriteResult] = []
        uploads: dict[str, Packed] = {}
        nonce = secrets.token_hex(3)
        for obj, members in sorted(objects.items()):
            relative = layout.data_key(
                rank_plan.save_id, rank_plan.rank, obj, rank_plan.spread, nonce
            )
            packed = Packed(
                [value for _, value in members],
                [element.get(item.index) for item, _ in members],
                self.options.frame_size,
            )
            uploads[relative] = packed
            for (item, _), start, length in zip(
                members, packed.starts, packed.lengths, strict=True
            ):
                stored = _Stored(Locator(relative, start, length))
                results.append(WriteResult(item.index, length, stored))
        upload = self._upload(uploads, results, rank_plan.save_id)
        return to_torch_future(bridge.submit(upload))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        locators: dict[MetadataIndex, Locator] = {}
        frames: dict[str, FrameTable] = {}
        for rank_results in results:
            for result in rank_results:
                stored: _Stored = result.storage_data
                locators[result.index] = stored.locator
                if stored.frames is not None:
                    frames[stored.locator.key] = stored.frames
        if self._save_id is None:
            raise S3CkptError(f"finish() for {self.checkpoint_id} without a planned save")
        record = encode(
            metadata,
            locators,
            save_id=self._save_id,
            created=time.time(),
            objects={key: table.size for key, table in frames.items()},
            frames=frames,
            extra=self._recorded(len(results)),
        )
        objects = {self.location.key(key): table.size for key, table in frames.items()}
        bridge.run(self._commit(record, objects, self._save_id))

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
        if self.overwrite:
            return
        if await store.head(location.bucket, location.metadata_key) is not None:
            raise CheckpointExists(
                f"{self.checkpoint_id} already holds a committed checkpoint; "
                "pass overwrite=True to replace it",
                url=self.checkpoint_id,
            )

    async def _commit(self, record: bytes, objects: dict[str, int], save_id: str) -> None:
        lease = Lease(self._store, self.location, save_id)
        try:
            async with lease.held():
                await commit(
                    self._store,
                    self.location,
                    record,
                    objects,
                    save_id=save_id,
                    overwrite=self.overwrite,
                )
        finally:
            await lease.release()

    async def _upload(
        self, uploads: dict[str, Packed], results: list[WriteResult], save_id: str
    ) -> list[WriteResult]:
        """Upload the objects under the save's lease, checksumming their frames; the results
        carry the frame tables."""
        lease = Lease(self._store, self.location, save_id)
        try:
            async with lease.held():
                return await self._upload_all(uploads, results)
        except BaseException:
            await lease.release()  # this save can no longer commit
            raise

    async def _upload_all(
        self, uploads: dict[str, Packed], results: list[WriteResult]
    ) -> list[WriteResult]:
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

        try:
            await gather_or_cancel(one(relative, p) for relative, p in uploads.items())
        except BaseException:
            # Every key, not only finished ones: a cancelled PUT or Complete may still land.
            keys = [self.location.key(relative) for relative in uploads]
            await delete_quietly(store, bucket, keys, f"{self.checkpoint_id}: a failed save")
            raise
        # The coordinator learns each object's frame table from its first item's result.
        for result in results:
            stored: _Stored = result.storage_data
            stored.frames = tables.pop(stored.locator.key, None)
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


@dataclass
class _Stored:
    """A WriteResult's storage data: where the item is, and (once per object) its frames."""

    locator: Locator
    frames: FrameTable | None = None


def _planned_size(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    dtype = item.tensor_data.properties.dtype
    return math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize
