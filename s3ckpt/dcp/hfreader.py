"""`SafetensorsReader`: DCP's StorageReader over a Hugging Face safetensors directory on S3.

``read_metadata`` (every rank) finds ``model.safetensors.index.json`` or ``model.safetensors``,
HEADs each file and reads its header (one ranged GET of its first 64 KiB, a second if the
header is longer), and describes every tensor as one chunk of its stored dtype. DCP's planner
then asks each rank for the rectangles its destination holds (a DTensor shard: part of the
chunk), and ``read_data`` fetches just their byte ranges with concurrent ranged GETs, coalesced
as `S3Reader` coalesces them; bytes land straight in the destination when they can
(`dcp.targets`). safetensors files carry no checksums: what the store serves is what is loaded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..config import MiB, S3Config
from ..engine import bridge
from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore
from ..errors import CheckpointNotFound, MetadataError
from ..format import safetensors as st
from ..format.layout import Location
from ..format.readplan import Target, plan_fetches
from .adapter import AtLocation, to_torch_future
from .exchange import Pieces
from .fetching import run_all
from .targets import Finish, StoredChunk, collect, tensor_targets

__all__ = ["SafetensorsReader", "read_headers", "torch_dtype"]

_FIRST_READ = 64 * 1024  # most headers fit: one GET per file


class SafetensorsReader(AtLocation, StorageReader):
    """Load the safetensors files at ``s3://bucket/prefix`` (``model.safetensors``, or the files
    that ``model.safetensors.index.json`` names) into any state dict, DTensor/FSDP-sharded
    included: ``dcp.load(model.state_dict(), storage_reader=SafetensorsReader(bucket, prefix))``.

    Tensors load as stored: a destination of another dtype is a MetadataError naming the tensor.
    Args as for `S3Reader`: ``checkpoint_id`` moves the prefix; ranges closer than ``max_gap``
    are fetched with one GET.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        config: S3Config | None = None,
        max_gap: int = 1 * MiB,
    ) -> None:
        StorageReader.__init__(self)
        AtLocation.__init__(self, bucket, prefix, config)
        self.max_gap = max_gap
        self._chunks: dict[MetadataIndex, StoredChunk] = {}

    def reset(self, checkpoint_id: str | Any = None) -> None:
        self._move(checkpoint_id)
        self._chunks = {}

    def check(self) -> None:
        """Raise the typed error (`CheckpointNotFound`, `MetadataError`, `AccessDenied`, ...)
        unless the prefix holds readable safetensors files; ``dcp.load`` would wrap it."""
        self.read_metadata()

    def read_metadata(self) -> Metadata:
        headers = bridge.run(read_headers(self._store, self.location))
        state: dict[str, Any] = {}
        chunks: dict[MetadataIndex, StoredChunk] = {}
        for key, header in headers.items():
            url = f"s3://{self.location.bucket}/{key}"
            for info in header.tensors:
                dtype, origin = torch_dtype(info.dtype, url, info.name), (0,) * len(info.shape)
                state[info.name] = TensorStorageMetadata(
                    TensorProperties(dtype=dtype),
                    torch.Size(info.shape),
                    [ChunkStorageMetadata(torch.Size(origin), torch.Size(info.shape))],
                )
                chunk = StoredChunk(key, header.data_start + info.start, info.shape, dtype)
                chunks[MetadataIndex(info.name, origin)] = chunk
        self._chunks = chunks
        return Metadata(state_dict_metadata=state, storage_data=chunks)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, **kwargs: Any
    ) -> None:
        chunks = metadata.storage_data
        if not isinstance(chunks, dict) or not all(
            isinstance(v, StoredChunk) for v in chunks.values()
        ):
            raise MetadataError(
                f"{self.checkpoint_id}: the metadata does not come from a SafetensorsReader",
                url=self.checkpoint_id,
            )
        self._chunks = chunks

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        targets, done = collect(plan.items, lambda n, item: self._targets(n, item, planner))
        pieces = Pieces(targets, done)
        fetches = plan_fetches(
            pieces.fetch_targets, max_gap=self.max_gap, max_size=self.config.part_size, align={}
        )

        async def read() -> None:
            pieces.planned(fetches)
            await run_all(self._store, self.location.bucket, fetches, {}, pieces.fetched)
            await pieces.placed()

        return to_torch_future(bridge.submit(read()))

    def _targets(
        self, number: int, item: ReadItem, planner: LoadPlanner
    ) -> tuple[list[Target], Finish]:
        fqn = item.dest_index.fqn
        if item.type != LoadItemType.TENSOR or item.storage_index not in self._chunks:
            raise MetadataError(
                f"{self.checkpoint_id}: {fqn} is not a tensor of these safetensors files",
                url=self.checkpoint_id,
            )
        chunk = self._chunks[item.storage_index]
        url = f"s3://{self.location.bucket}/{chunk.key}"
        return tensor_targets(
            number,
            item,
            planner,
            chunk,
            self.config.part_size,
            self.checkpoint_id,
            url,
            exact_dtype=True,
        )


def torch_dtype(name: str, url: str, tensor: str) -> torch.dtype:
    """The torch dtype of safetensors dtype ``name``; MetadataError if this torch lacks it."""
    found = getattr(torch, st.DTYPES[name][0], None)
    if not isinstance(found, torch.dtype):
        raise MetadataError(f"{url}: tensor {tensor!r} is {name}, which this torch lacks", url=url)
    return found


async def read_headers(store: ObjectStore, location: Location) -> dict[str, st.Header]:
    """Each file's header by its key: the index's files (every name in the header of the file
    the index gives it, and only there), or ``model.safetensors``."""
    bucket = location.bucket
    index_key = location.key(st.INDEX)
    if await store.head(bucket, index_key) is not None:
        index_url = f"s3://{bucket}/{index_key}"
        weights = st.decode_index((await store.get(bucket, index_key)).data, index_url)
        files = sorted(set(weights.values()))
    elif await store.head(bucket, location.key(st.SINGLE)) is not None:
        weights, files = {}, [st.SINGLE]
    else:
        raise CheckpointNotFound(
            f"{location.url}: no {st.INDEX} and no {st.SINGLE} there", url=location.url
        )
    keys = [location.key(name) for name in files]
    headers = await gather_or_cancel(_header(store, bucket, key) for key in keys)
    found = dict(zip(keys, headers, strict=True))
    seen: dict[str, str] = {}
    for name, key in zip(files, keys, strict=True):
        for info in found[key].tensors:
            if (weights and weights.get(info.name) != name) or info.name in seen:
                raise MetadataError(
                    f"s3://{bucket}/{key}: tensor {info.name!r} is not where {st.INDEX} puts it "
                    f"({weights.get(info.name) or seen.get(info.name) or 'not in it'})",
                    url=location.url,
                )
            seen[info.name] = name
    missing = sorted(set(weights) - set(seen))
    if missing:
        raise MetadataError(
            f"{location.url}: {st.INDEX} names tensors that no file holds: {missing[:5]}",
            url=location.url,
        )
    return found


async def _header(store: ObjectStore, bucket: str, key: str) -> st.Header:
    url = f"s3://{bucket}/{key}"
    stored = await store.head(bucket, key)
    if stored is None:
        raise MetadataError(f"{url}: the file is missing", url=url)
    first = bytearray(min(stored.size, _FIRST_READ))
    await _read(store, bucket, key, 0, first)
    length = st.header_length(bytes(first[: st.PREFIX]), stored.size, url)
    text = bytearray(first[st.PREFIX : st.PREFIX + length])
    if len(text) < length:
        rest = bytearray(length - len(text))
        await _read(store, bucket, key, len(first), rest)
        text += rest
    return await asyncio.get_running_loop().run_in_executor(
        None, st.decode, bytes(text), stored.size, url
    )


async def _read(store: ObjectStore, bucket: str, key: str, start: int, into: bytearray) -> None:
    if into:
        async with store.slot():
            end = start + len(into)
            await store.read_range(bucket, key, start, end, [(start, memoryview(into))])
