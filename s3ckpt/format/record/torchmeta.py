"""Between the format's model and DCP's types: the tables of torch objects by name, and the
``Metadata`` a load hands DCP, built from a decoded `Checkpoint`. The one module of the record
that imports torch, and only loads and saves import it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import MetadataError
from .model import (
    DTYPE_SIZES,
    LAYOUTS,
    MEMORY_FORMATS,
    BytesEntry,
    Checkpoint,
    Chunk,
    Entry,
    Locator,
    TensorEntry,
    gc_paused,
)
from .table import ChunkList

_T = TypeVar("_T")
_Row = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's offsets and sizes


def _by_name(names: tuple[str, ...], kind: type[_T]) -> dict[str, _T]:
    """Look up fixed names on ``torch``; names this torch lacks are skipped (float8 and friends)."""
    table: dict[str, _T] = {}
    for name in names:
        value = getattr(torch, name, None)
        if isinstance(value, kind):
            table[name] = value
    return table


DTYPES: dict[str, torch.dtype] = _by_name(tuple(DTYPE_SIZES), torch.dtype)
LAYOUT_TYPES: dict[str, torch.layout] = _by_name(LAYOUTS, torch.layout)
MEMORY_FORMAT_TYPES: dict[str, torch.memory_format] = _by_name(MEMORY_FORMATS, torch.memory_format)
DTYPE_NAMES = {value: name for name, value in DTYPES.items()}
LAYOUT_NAMES = {value: name for name, value in LAYOUT_TYPES.items()}
MEMORY_FORMAT_NAMES = {value: name for name, value in MEMORY_FORMAT_TYPES.items()}


def to_dcp(checkpoint: Checkpoint) -> tuple[Metadata, Locators]:
    """DCP's ``Metadata`` of a decoded record, and its locators by DCP's index (also its
    ``storage_data``). The record is valid already; only a name this torch lacks (a dtype newer
    than it) can fail, as a MetadataError naming the record."""
    with gc_paused():  # millions of acyclic objects, as in `decode`
        return _to_dcp(checkpoint)


class Locators(Mapping[MetadataIndex, Any]):
    """Each item's `Locator` by DCP's index, found in the record when asked for. A dict of them
    cost every rank of a load 2 us a chunk (a `MetadataIndex` and its hash), more than the rest
    of the ``Metadata``, while a rank reads a few of the chunks. The index's position hint
    (DCP's ``MetadataIndex.index``, the chunk's place in the tensor's list) finds a chunk at
    once; without it, the tensor's offsets are indexed on first use."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self._entries = entries
        self._positions: dict[str, dict[tuple[int, ...], int]] = {}

    def chunk(self, index: MetadataIndex) -> Chunk:
        """The stored chunk at ``index``; KeyError if the record has none there."""
        entry = self._entries.get(index.fqn)
        if not isinstance(entry, TensorEntry) or index.offset is None:
            raise KeyError(index)
        chunks, offsets, hint = entry.chunks, tuple(index.offset), index.index
        if hint is not None and 0 <= hint < len(chunks):
            chunk = chunks[hint]
            if chunk.offsets == offsets:
                return chunk
        positions = self._positions.get(index.fqn)
        if positions is None:
            positions = {chunk.offsets: i for i, chunk in enumerate(chunks)}
            self._positions[index.fqn] = positions
        position = positions.get(offsets)
        if position is None:
            raise KeyError(index)
        return chunks[position]

    def __getitem__(self, index: Any) -> Locator:
        if not isinstance(index, MetadataIndex):
            raise KeyError(index)
        entry = self._entries.get(index.fqn)
        if isinstance(entry, BytesEntry) and index.offset is None:
            return entry.locator
        return self.chunk(index).locator

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, entry in self._entries.items():
            if isinstance(entry, TensorEntry):
                for position, chunk in enumerate(entry.chunks):
                    yield MetadataIndex(fqn, chunk.offsets, position)
            else:
                yield MetadataIndex(fqn)

    def __len__(self) -> int:
        return sum(
            len(entry.chunks) if isinstance(entry, TensorEntry) else 1
            for entry in self._entries.values()
        )


def _to_dcp(checkpoint: Checkpoint) -> tuple[Metadata, Locators]:
    state_dict: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    shared, properties = _Chunks(), _Properties(checkpoint.url)
    for fqn, entry in checkpoint.entries.items():
        if isinstance(entry, TensorEntry):
            state_dict[fqn] = _tensor(fqn, entry, shared, properties)
        else:
            state_dict[fqn] = BytesStorageMetadata()
    meta = checkpoint.storage_meta
    storage_meta = None
    if meta is not None:
        storage_meta = StorageMeta(
            checkpoint_id=meta.checkpoint_id,
            save_id=meta.save_id,
            load_id=meta.load_id,
            modules=list(meta.modules),
        )
    locators = Locators(checkpoint.entries)
    metadata = Metadata(
        state_dict_metadata=state_dict,
        planner_data=checkpoint.planner_data,
        storage_data=locators,
        storage_meta=storage_meta,
        version=checkpoint.dcp_version,
    )
    return metadata, locators


class _Chunks:
    """DCP's chunk objects, one per distinct offsets and sizes, with one ``torch.Size`` per
    distinct shape and one list per distinct lone chunk (an unsharded tensor's): the tensors of
    a sharded state share their chunk geometry (FSDP: each shard of every layer alike), an
    unsharded tensor's one chunk has its size, and one dict lookup costs a third of making an
    object. Fewer objects also spare the collector: a load's `Metadata` of 20k small tensors
    was 106k objects for it to track, half of them sizes. DCP only reads them."""

    def __init__(self) -> None:
        self._sizes: dict[tuple[int, ...], torch.Size] = {}
        self._chunks: dict[_Row, ChunkStorageMetadata] = {}
        self._alone: dict[_Row, list[ChunkStorageMetadata]] = {}

    def size(self, values: tuple[int, ...]) -> torch.Size:
        found = self._sizes.get(values)
        if found is None:
            found = self._sizes[values] = torch.Size(values)
        return found

    def chunk(self, row: _Row) -> ChunkStorageMetadata:
        found = self._chunks.get(row)
        if found is None:
            offsets, sizes = row
            found = self._chunks[row] = ChunkStorageMetadata(self.size(offsets), self.size(sizes))
        return found

    def of(self, rows: list[_Row]) -> list[ChunkStorageMetadata]:
        """A tensor's chunk list; that of a lone chunk shared by the tensors it is alone in."""
        if len(rows) != 1:
            return [self.chunk(row) for row in rows]
        found = self._alone.get(rows[0])
        if found is None:
            found = self._alone[rows[0]] = [self.chunk(rows[0])]
        return found


class _Properties(dict[tuple[str, str, bool, str, bool], TensorProperties]):
    """DCP's tensor properties by the record's names, one object per distinct set, as
    `_Chunks` shares chunks: a state holds a few kinds of tensor, and DCP only reads them."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def of(self, fqn: str, entry: TensorEntry) -> TensorProperties:
        key = (
            entry.dtype,
            entry.layout,
            entry.requires_grad,
            entry.memory_format,
            entry.pin_memory,
        )
        found = self.get(key)
        if found is None:
            url = self.url
            found = self[key] = TensorProperties(
                dtype=_lookup(DTYPES, entry.dtype, fqn, "dtype", url),
                layout=_lookup(LAYOUT_TYPES, entry.layout, fqn, "layout", url),
                requires_grad=entry.requires_grad,
                memory_format=_lookup(
                    MEMORY_FORMAT_TYPES, entry.memory_format, fqn, "memory_format", url
                ),
                pin_memory=entry.pin_memory,
            )
        return found


def _tensor(
    fqn: str, entry: TensorEntry, shared: _Chunks, properties: _Properties
) -> TensorStorageMetadata:
    stored = entry.chunks
    rows = list(
        stored.geometry()
        if isinstance(stored, ChunkList)
        else ((chunk.offsets, chunk.sizes) for chunk in stored)
    )
    return TensorStorageMetadata(
        properties=properties.of(fqn, entry),
        size=shared.size(tuple(entry.size)),
        chunks=shared.of(rows),
    )


def _lookup(table: dict[str, _T], name: str, fqn: str, field: str, url: str) -> _T:
    found = table.get(name)
    if found is None:
        raise MetadataError(
            f"{url}: state_dict[{fqn!r}].{field}: {name!r} is not in this torch "
            f"({torch.__version__}); load it with a newer torch",
            url=url,
        )
    return found
