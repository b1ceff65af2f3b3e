"""Between the format's model and DCP's types: the tables of torch objects by name, and the
``Metadata`` a load hands DCP, built from a decoded `Checkpoint`. The one module of the record
that imports torch, and only loads and saves import it."""

from __future__ import annotations

from typing import TypeVar

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
    Checkpoint,
    Locator,
    TensorEntry,
    gc_paused,
)
from .table import ChunkList

_T = TypeVar("_T")


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


def to_dcp(checkpoint: Checkpoint) -> tuple[Metadata, dict[MetadataIndex, Locator]]:
    """DCP's ``Metadata`` of a decoded record, and its locators by DCP's index (also its
    ``storage_data``). The record is valid already; only a name this torch lacks (a dtype newer
    than it) can fail, as a MetadataError naming the record."""
    with gc_paused():  # millions of acyclic objects, as in `decode`
        return _to_dcp(checkpoint)


def _to_dcp(checkpoint: Checkpoint) -> tuple[Metadata, dict[MetadataIndex, Locator]]:
    locators: dict[MetadataIndex, Locator] = {}
    state_dict: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, entry in checkpoint.entries.items():
        if isinstance(entry, TensorEntry):
            state_dict[fqn] = _tensor(fqn, entry, locators, checkpoint.url)
        else:
            locators[MetadataIndex(fqn)] = entry.locator
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
    metadata = Metadata(
        state_dict_metadata=state_dict,
        planner_data=checkpoint.planner_data,
        storage_data=locators,
        storage_meta=storage_meta,
        version=checkpoint.dcp_version,
    )
    return metadata, locators


def _tensor(
    fqn: str, entry: TensorEntry, locators: dict[MetadataIndex, Locator], url: str
) -> TensorStorageMetadata:
    properties = TensorProperties(
        dtype=_lookup(DTYPES, entry.dtype, fqn, "dtype", url),
        layout=_lookup(LAYOUT_TYPES, entry.layout, fqn, "layout", url),
        requires_grad=entry.requires_grad,
        memory_format=_lookup(MEMORY_FORMAT_TYPES, entry.memory_format, fqn, "memory_format", url),
        pin_memory=entry.pin_memory,
    )
    chunks: list[ChunkStorageMetadata] = []
    stored = entry.chunks
    rows = (
        stored.located()
        if isinstance(stored, ChunkList)
        else ((chunk.offsets, chunk.sizes, chunk.locator) for chunk in stored)
    )
    for position, (offsets, sizes, locator) in enumerate(rows):
        start = torch.Size(offsets)
        locators[MetadataIndex(fqn, start, position)] = locator
        chunks.append(ChunkStorageMetadata(offsets=start, sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=properties, size=torch.Size(entry.size), chunks=chunks)


def _lookup(table: dict[str, _T], name: str, fqn: str, field: str, url: str) -> _T:
    found = table.get(name)
    if found is None:
        raise MetadataError(
            f"{url}: state_dict[{fqn!r}].{field}: {name!r} is not in this torch "
            f"({torch.__version__}); load it with a newer torch",
            url=url,
        )
    return found
