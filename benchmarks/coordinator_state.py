"""A synthetic save as the coordinator sees it: DCP's metadata and every rank's write results,
shaped as `S3Writer.write_data` returns them, for any number of ranks and chunks without
running the ranks (shared by `bench_coordinator` and `bench_scale`).

The layout is FSDP's: every FQN is sharded along dim 0 over all ranks, so each rank holds one
chunk of each, and packs its chunks into ``objects_per_rank`` objects, as the writer does.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from s3ckpt.dcp.results import RankResults
from s3ckpt.format import layout
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.record import Locator

__all__ = ["Synthetic", "local_plans", "synthetic"]

_ROWS, _COLS = 16, 64  # each chunk: 16 x 64 fp32 = 4 KiB
_FRAME = 4 * 1024 * 1024


@dataclass
class Synthetic:
    """One save: its id, DCP's metadata, each rank's results, and the objects (key -> size)."""

    save_id: str
    metadata: Metadata
    results: list[RankResults]
    objects: dict[str, int]

    @property
    def chunks(self) -> int:
        return sum(len(rank) for rank in self.results)


def _names(chunks_per_rank: int) -> list[str]:
    return [f"model.layers.{i // 8}.block.p{i % 8}.weight" for i in range(chunks_per_rank)]


def local_plans(ranks: int, chunks_per_rank: int) -> list[SavePlan]:
    """Every rank's local save plan of the same layout, as DCP's default planner makes them."""
    names = _names(chunks_per_rank)
    properties = TensorProperties(dtype=torch.float32)
    size = torch.Size([_ROWS * ranks, _COLS])
    plans = []
    for rank in range(ranks):
        offsets = torch.Size([rank * _ROWS, 0])
        chunk = ChunkStorageMetadata(offsets, torch.Size([_ROWS, _COLS]))
        items = [
            WriteItem(
                MetadataIndex(name, offsets),
                WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk, properties, size),
            )
            for name in names
        ]
        plans.append(SavePlan(items, planner_data={name: (name,) for name in names}))
    return plans


def synthetic(ranks: int, chunks_per_rank: int, objects_per_rank: int = 4) -> Synthetic:
    """A save of ``chunks_per_rank`` FQNs, each sharded over ``ranks`` ranks (names of ~40
    characters, like a model's)."""
    save_id = layout.new_save_id()
    names = _names(chunks_per_rank)
    properties = TensorProperties(dtype=torch.float32)
    size = torch.Size([_ROWS * ranks, _COLS])
    chunk_bytes = _ROWS * _COLS * 4
    state = {
        name: TensorStorageMetadata(
            properties,
            size,
            [
                ChunkStorageMetadata(torch.Size([r * _ROWS, 0]), torch.Size([_ROWS, _COLS]))
                for r in range(ranks)
            ],
        )
        for name in names
    }
    metadata = Metadata(dict(state), planner_data={name: (name,) for name in names})
    results: list[RankResults] = []
    objects: dict[str, int] = {}
    per_object = -(-chunks_per_rank // objects_per_rank)
    for rank in range(ranks):
        nonce = secrets.token_hex(3)
        rank_results = RankResults()
        for obj in range(-(-chunks_per_rank // per_object)):
            key = layout.data_key(save_id, rank, obj, 0, nonce)
            members = names[obj * per_object : (obj + 1) * per_object]
            object_bytes = chunk_bytes * len(members)
            frames = -(-object_bytes // _FRAME)
            table = FrameTable.raw(_FRAME, [rank + obj + f for f in range(frames)], object_bytes)
            objects[key] = table.size
            rank_results.frames[key] = table
            for i, name in enumerate(members):
                index = MetadataIndex(name, torch.Size([rank * _ROWS, 0]))
                rank_results.add(index, Locator(key, i * chunk_bytes, chunk_bytes))
        results.append(rank_results)
    return Synthetic(save_id, metadata, results, objects)
