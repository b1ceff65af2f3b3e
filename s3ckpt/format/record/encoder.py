""":func:`encode`, and the checks by which it refuses to commit a record that cannot be loaded.

It takes what DCP hands a writer (``Metadata`` and torch types), so it imports torch: only a
save needs it, and `s3ckpt.format.record` imports it when it is first asked for."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from operator import add, gt, mul, ne
from typing import Any, TypeVar, cast

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from ...errors import MetadataError
from ..frames import FrameTable
from ..jsoncheck import Invalid, all_counts, fail, is_count, joined, show
from . import entrytable, table
from .entrytable import Fields, Spec
from .model import (
    FORMAT,
    FORMAT_VERSION,
    TUPLE_TAG,
    Locator,
    check_locator,
    gc_paused,
    is_digest,
    is_valid_key,
)
from .tiling import check_chunk, check_extent, check_tiling_columns
from .torchmeta import DTYPE_NAMES, LAYOUT_NAMES, MEMORY_FORMAT_NAMES

T = TypeVar("T")

_MAX_DEPTH = 64  # planner_data / extra nesting; deeper is almost surely a reference cycle.


def encode(
    metadata: Metadata,
    locators: Mapping[MetadataIndex, Locator],
    *,
    save_id: str,
    created: float,
    objects: Mapping[str, int],
    frames: Mapping[str, FrameTable],
    extra: Mapping[str, Any] | None = None,
    digests: Mapping[MetadataIndex, str] | None = None,
) -> bytes:
    """Serialize a commit record; raises MetadataError rather than commit one that cannot load.

    ``locators`` must hold exactly one entry per tensor chunk and bytes item of ``metadata``;
    ``metadata.storage_data`` is ignored (the locators are the storage data). ``digests`` are
    the chunks' xxh3-128 digests (incremental saves), recorded for the next save to match.
    """
    try:
        with gc_paused():
            for key, size in objects.items():
                if key not in frames or frames[key].size != size:
                    fail(f"objects[{key!r}]: no frame table of {show(size)} stored bytes")
            if set(frames) - set(objects):
                fail("frames: a frame table for an object not in objects")
            # Locators point into raw (uncompressed) bytes; `objects` records stored sizes.
            raw_sizes = {key: table.raw_size for key, table in frames.items()}
            record = _encode_record(
                metadata, locators, save_id, created, raw_sizes, extra, digests or {}
            )
            record["objects"] = dict(objects)
            record["frames"] = {key: frame.to_json() for key, frame in frames.items()}
            text = json.dumps(
                record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            )
            return text.encode("utf-8")
    except Invalid as exc:
        raise MetadataError(f"cannot encode checkpoint metadata: {exc}", url=None) from None
    except UnicodeEncodeError as exc:  # a lone surrogate in some name
        raise MetadataError(f"cannot encode checkpoint metadata: {exc}", url=None) from None


def _encode_record(
    metadata: Metadata,
    locators: Mapping[MetadataIndex, Locator],
    save_id: str,
    created: float,
    objects: Mapping[str, int],
    extra: Mapping[str, Any] | None,
    digests: Mapping[MetadataIndex, str],
) -> dict[str, Any]:
    if not isinstance(metadata, Metadata):
        fail(f"metadata: expected a DCP Metadata, got {type(metadata).__name__}")
    if not isinstance(save_id, str):
        fail(f"save_id: expected a str, got {show(save_id)}")
    if (
        not isinstance(created, (int, float))
        or isinstance(created, bool)
        or not math.isfinite(created)
    ):
        fail(f"created: expected a finite unix time, got {show(created)}")
    if metadata.version is not None and not isinstance(metadata.version, str):
        fail(f"metadata.version: expected a str or None, got {show(metadata.version)}")
    if not isinstance(metadata.state_dict_metadata, Mapping):
        fail("metadata.state_dict_metadata: expected a dict")

    object_sizes: dict[str, int] = {}
    for key, size in objects.items():
        if not is_valid_key(key):
            fail(f"objects: {show(key)} is not a relative object key")
        if not is_count(size):
            fail(f"objects[{key!r}]: expected a size in bytes, got {show(size)}")
        object_sizes[key] = size

    names = sorted(object_sizes)
    columns = _Columns({key: i for i, key in enumerate(names)}, object_sizes)
    found = _by_item(locators)
    chunk_digests = _by_item(digests)

    items = metadata.state_dict_metadata
    unnamed = next((fqn for fqn in items if not isinstance(fqn, str)), None)
    if unnamed is not None:
        fail(f"state_dict[{unnamed!r}]: fqn must be a str")
    specs: list[Spec] = []
    for fqn in sorted(items):  # the tables' rows are in the order of the names
        item, where = items[fqn], f"state_dict[{fqn!r}]"
        if isinstance(item, TensorStorageMetadata):
            fields, count = _encode_tensor(
                item, found.get(fqn, {}), columns, chunk_digests.get(fqn, {}), where
            )
            specs.append((fqn, fields, count))
        elif isinstance(item, BytesStorageMetadata):
            columns.add(_locate(found.get(fqn, {}), None, where, object_sizes), None)
            specs.append((fqn, None, 1))
        else:
            fail(f"{where}: unsupported storage metadata {type(item).__name__}")

    if len(columns.keys) != len(locators):
        unused = _unused(items, locators)
        shown = ", ".join(f"({i.fqn!r}, {show(i.offset)})" for i in unused[:3])
        fail(f"{len(unused)} locator(s) match no item in the metadata, e.g. {shown}")
    idle = set(range(len(names))) - set(columns.keys)
    if idle:
        fail(f"objects: {names[min(idle)]!r} holds none of the state dict's items")

    paths = entrytable.path_codes(metadata.planner_data, [fqn for fqn, _, _ in specs])
    record = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "save_id": save_id,
        "created": float(created),
        "dcp_version": metadata.version,
        "objects": object_sizes,
        "extra": _to_json(dict(extra or {}), "extra", tag_tuples=False, depth=0),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
        "entries": entrytable.pack(specs, paths or {}),
        "items": columns.pack(),
    }
    if paths is None:  # not the paths of DCP's default planners: JSON
        planner_data = metadata.planner_data
        record["planner_data"] = _to_json(planner_data, "planner_data", tag_tuples=True, depth=0)
    return record


_Offsets = tuple[int, ...] | None  # a chunk's offsets; None for a bytes item


def _by_item(mapping: Mapping[MetadataIndex, T]) -> dict[str, dict[_Offsets, T]]:
    """``mapping`` by fqn, then by offsets: a chunk is found by a tuple's hash, where a
    `MetadataIndex` built per chunk costs more than the rest of its encode."""
    grouped: dict[str, dict[_Offsets, T]] = {}
    for index, value in mapping.items():
        offset = index.offset
        grouped.setdefault(index.fqn, {})[None if offset is None else tuple(offset)] = value
    return grouped


def _unused(items: Mapping[str, Any], locators: Mapping[MetadataIndex, Locator]) -> list[Any]:
    """The locators no item of ``items`` has: the error path only."""
    used: set[tuple[str, _Offsets]] = set()
    for fqn, item in items.items():
        if isinstance(item, TensorStorageMetadata):
            used.update((fqn, tuple(chunk.offsets)) for chunk in item.chunks)
        else:
            used.add((fqn, None))
    return [
        i for i in locators if (i.fqn, None if i.offset is None else tuple(i.offset)) not in used
    ]


def _locate(
    found: Mapping[_Offsets, Locator], offsets: _Offsets, where: str, objects: Mapping[str, int]
) -> Locator:
    locator = found.get(offsets)
    if locator is None:
        fail(f"{where}: no locator for this item (every chunk and bytes item needs one)")
    if not isinstance(locator, Locator):
        fail(f"{where}: expected a Locator, got {type(locator).__name__}")
    check_locator(locator, objects, where)
    return locator


class _Columns:
    """The item table's columns, a row per item as `_encode_record` visits them."""

    def __init__(self, index: dict[str, int], objects: Mapping[str, int]) -> None:
        self.index = index
        self.objects = objects
        self.keys: list[int] = []
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.chunk_offsets: list[int] = []
        self.chunk_sizes: list[int] = []
        self.digests: list[str | None] = []

    def add(self, locator: Locator, digest: str | None) -> None:
        self.keys.append(self.index[locator.key])
        self.offsets.append(locator.offset)
        self.lengths.append(locator.length)
        self.digests.append(digest)

    def add_rows(self, locators: list[Locator], digests: list[str | None]) -> None:
        self.keys.extend(self.index[locator.key] for locator in locators)
        self.offsets.extend(locator.offset for locator in locators)
        self.lengths.extend(locator.length for locator in locators)
        self.digests.extend(digests)

    def pack(self) -> dict[str, Any]:
        return table.pack(
            self.keys,
            self.offsets,
            self.lengths,
            self.chunk_offsets,
            self.chunk_sizes,
            self.digests,
        )


def _encode_tensor(
    item: TensorStorageMetadata,
    found: Mapping[_Offsets, Locator],
    columns: _Columns,
    digests: Mapping[_Offsets, str],
    where: str,
) -> tuple[Fields, int]:
    """The entry's fields and its number of chunks; its rows go into ``columns``."""
    props = item.properties
    dtype = DTYPE_NAMES.get(props.dtype)
    if dtype is None:
        fail(f"{where}: dtype {props.dtype} is not supported")
    layout = LAYOUT_NAMES.get(props.layout)
    if layout is None:
        fail(f"{where}: layout {props.layout} is not supported")
    memory_format = MEMORY_FORMAT_NAMES.get(props.memory_format)
    if memory_format is None:
        fail(f"{where}: memory format {props.memory_format} is not supported")
    size = _encode_counts(item.size, where, "size")
    rows = _whole_row(item, size, found, columns.objects, digests) or _rows_at_once(
        item, size, found, columns.objects, digests
    )
    if rows is None:  # something is wrong: find and name it, chunk by chunk
        rows = _rows_one_by_one(item, size, found, columns.objects, digests, where)
    chunk_offsets, chunk_sizes, counts, locators, chunk_digests = rows
    check_tiling_columns(size, chunk_offsets, chunk_sizes, counts, where)
    columns.add_rows(locators, chunk_digests)
    for column in chunk_offsets:  # dimension by dimension, chunk by chunk
        columns.chunk_offsets.extend(column)
    for column in chunk_sizes:
        columns.chunk_sizes.extend(column)
    fields = (
        dtype,
        size,
        layout,
        memory_format,
        bool(props.requires_grad),
        bool(props.pin_memory),
    )
    return fields, len(counts)


# A tensor's rows: offsets and sizes by dimension (``offsets[d][i]``), each chunk's element
# count, locator and digest.
_Rows = tuple[list[Sequence[int]], list[Sequence[int]], list[int], list[Locator], list[str | None]]


def _whole_row(
    item: TensorStorageMetadata,
    size: list[int],
    found: Mapping[_Offsets, Locator],
    objects: Mapping[str, int],
    digests: Mapping[_Offsets, str],
) -> _Rows | None:
    """The one row of an unsharded tensor (a chunk of all of it), its checks made directly;
    None for any other tensor, or if a check fails. `_rows_at_once`, made for many chunks,
    cost a small tensor 15 us."""
    if len(item.chunks) != 1:
        return None
    chunk = item.chunks[0]
    offsets, sizes = tuple(chunk.offsets), list(chunk.sizes)
    if sizes != size or any(offsets) or not all_counts([*offsets, *sizes]):
        return None
    locator = found.get(offsets)
    if type(locator) is not Locator or type(locator.key) is not str:
        return None
    start, length, numel = locator.offset, locator.length, math.prod(size)
    if not all_counts([start, length]) or length != numel * item.properties.dtype.itemsize:
        return None
    if start + length > objects.get(locator.key, -1):
        return None
    digest = digests.get(offsets)
    if digest is not None and not is_digest(digest):
        return None
    return [[0] for _ in size], [[extent] for extent in size], [numel], [locator], [digest]


def _rows_at_once(
    item: TensorStorageMetadata,
    size: list[int],
    found: Mapping[_Offsets, Locator],
    objects: Mapping[str, int],
    digests: Mapping[_Offsets, str],
) -> _Rows | None:
    """The rows, every check made a column at a time (C loops); None if any fails, for
    `_rows_one_by_one` to name the chunk. Half the encode's time was per-chunk checks."""
    chunks = item.chunks
    try:
        offsets = [tuple(chunk.offsets) for chunk in chunks]
        sizes = [tuple(chunk.sizes) for chunk in chunks]
        dims = len(size)
        if {len(o) for o in offsets} | {len(s) for s in sizes} != {dims}:
            return None
        if not all_counts(list(chain.from_iterable(offsets + sizes))):
            return None
        by_dim_offsets: list[Sequence[int]] = list(zip(*offsets, strict=True)) if dims else []
        by_dim_sizes: list[Sequence[int]] = list(zip(*sizes, strict=True)) if dims else []
        for extent, column, spans in zip(size, by_dim_offsets, by_dim_sizes, strict=True):
            if max(map(add, column, spans)) > extent:
                return None
        if len(set(offsets)) != len(offsets):
            return None
        maybe = list(map(found.get, offsets))
        if not all(type(locator) is Locator for locator in maybe):
            return None
        locators = cast(list[Locator], maybe)
        keys = [locator.key for locator in locators]
        starts = [locator.offset for locator in locators]
        lengths = [locator.length for locator in locators]
        if not all(type(key) is str for key in keys) or not all_counts(starts + lengths):
            return None
        if any(map(gt, map(add, starts, lengths), map(objects.__getitem__, keys))):
            return None
        counts = list(map(math.prod, sizes))
        if any(map(ne, lengths, map(mul, counts, repeat(item.properties.dtype.itemsize)))):
            return None
    except (KeyError, TypeError):  # a key not among the objects; offsets that are not ints
        return None
    chunk_digests: list[str | None] = (
        list(map(digests.get, offsets)) if digests else [None] * len(offsets)
    )
    if digests and not all(d is None or is_digest(d) for d in chunk_digests):
        return None
    return by_dim_offsets, by_dim_sizes, counts, locators, chunk_digests


def _rows_one_by_one(
    item: TensorStorageMetadata,
    size: list[int],
    found: Mapping[_Offsets, Locator],
    objects: Mapping[str, int],
    digests: Mapping[_Offsets, str],
    where: str,
) -> _Rows:
    """The rows, each chunk checked in turn: slower, and names the first chunk at fault."""
    dtype, itemsize = DTYPE_NAMES[item.properties.dtype], item.properties.dtype.itemsize
    seen: set[tuple[int, ...]] = set()
    offsets_rows: list[list[int]] = []
    sizes_rows: list[list[int]] = []
    counts: list[int] = []
    locators: list[Locator] = []
    chunk_digests: list[str | None] = []
    for position, chunk in enumerate(item.chunks):
        at = f"{where}.chunks[{position}]"
        offsets = _encode_counts(chunk.offsets, at, "offsets")
        sizes = _encode_counts(chunk.sizes, at, "sizes")
        check_chunk(offsets, sizes, size, at)
        if tuple(offsets) in seen:
            fail(f"{at}: two chunks start at offsets {offsets}")
        seen.add(tuple(offsets))
        locator = _locate(found, tuple(offsets), at, objects)
        counts.append(check_extent(locator.length, sizes, itemsize, dtype, at))
        digest = digests.get(tuple(offsets))
        if digest is not None and not is_digest(digest):
            fail(f"{at}: digest {show(digest)} is not 32 hex digits")
        offsets_rows.append(offsets)
        sizes_rows.append(sizes)
        locators.append(locator)
        chunk_digests.append(digest)
    by_dim_offsets: list[Sequence[int]] = [list(c) for c in zip(*offsets_rows, strict=True)]
    by_dim_sizes: list[Sequence[int]] = [list(c) for c in zip(*sizes_rows, strict=True)]
    if not by_dim_offsets:
        by_dim_offsets = by_dim_sizes = [[] for _ in size]
    return by_dim_offsets, by_dim_sizes, counts, locators, chunk_digests


def _encode_counts(values: Any, where: str, name: str) -> list[int]:
    try:
        counts = list(values)
    except TypeError:
        fail(f"{joined(where, name)}: expected a sequence of ints, got {show(values)}")
    if all_counts(counts):
        return counts
    if not all(is_count(value) for value in counts):
        fail(f"{joined(where, name)}: expected non-negative ints, got {show(values)}")
    return [int(value) for value in counts]


def _encode_storage_meta(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    if not isinstance(meta, StorageMeta):
        fail(f"storage_meta: expected a StorageMeta, got {type(meta).__name__}")
    checkpoint_id = meta.checkpoint_id
    if checkpoint_id is not None:
        try:
            checkpoint_id = os.fsdecode(checkpoint_id)
        except TypeError:
            fail(f"storage_meta.checkpoint_id: expected a str or path, got {show(checkpoint_id)}")
    for name in ("save_id", "load_id"):
        value = getattr(meta, name)
        if value is not None and not isinstance(value, str):
            fail(f"storage_meta.{name}: expected a str or None, got {show(value)}")
    modules = list(meta.modules or [])
    if not all(isinstance(module, str) for module in modules):
        fail(f"storage_meta.modules: expected a list of str, got {show(meta.modules)}")
    return {
        "checkpoint_id": checkpoint_id,
        "save_id": meta.save_id,
        "load_id": meta.load_id,
        "modules": modules,
    }


def _to_json(value: Any, where: str, *, tag_tuples: bool, depth: int) -> Any:
    """Copy ``value`` as plain JSON data; tuples become tagged objects when ``tag_tuples``."""
    if depth > _MAX_DEPTH:
        fail(f"{where}: nested more than {_MAX_DEPTH} deep (a reference cycle?)")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(f"{where}: {value} cannot be stored in JSON")
        return float(value)
    if isinstance(value, (list, tuple)):
        items = [
            _to_json(v, f"{where}[{i}]", tag_tuples=tag_tuples, depth=depth + 1)
            for i, v in enumerate(value)
        ]
        return {TUPLE_TAG: items} if tag_tuples and isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                fail(f"{where}: key {show(key)} is not a str (JSON keys must be)")
            out[key] = _to_json(item, f"{where}[{key!r}]", tag_tuples=tag_tuples, depth=depth + 1)
        if tag_tuples and list(out) == [TUPLE_TAG]:
            fail(f"{where}: a dict with the single key {TUPLE_TAG!r} would read back as a tuple")
        return out
    fail(f"{where}: {type(value).__name__} value {show(value)} cannot be stored in JSON")
