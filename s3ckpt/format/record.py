"""The commit record ``.metadata``: DCP's ``Metadata`` plus where every item's bytes are, as JSON.

It is JSON, never pickle, because loading a checkpoint from a bucket you do not fully trust must not
run code. Writing this one object is what commits a checkpoint, so :func:`encode` refuses anything
inconsistent (a chunk without a locator, a locator outside its object) rather than commit a record
that cannot be loaded, and :func:`decode` checks every field so a truncated, garbled or hostile file
ends in one clear :class:`~s3ckpt.errors.MetadataError` instead of a ``KeyError`` deep inside DCP.
Both also check the record as a whole, since one that is legal field by field can still load wrong
data with every checksum passing: a chunk's locator holds exactly its elements' bytes, the chunks of
a tensor cover it exactly once, and every frame table fits its object.

Layout (the file is compact UTF-8 with sorted keys; spaced out here for reading)::

    {"format": "s3ckpt", "version": 1, "save_id": "...", "created": 1700000000.5,
     "dcp_version": "1.0.0", "objects": {"data/0.bin": 4096}, "extra": {...},
     "storage_meta": {"checkpoint_id": ..., "save_id": ..., "load_id": ..., "modules": []},
     "planner_data": {"model.w": {"__tuple__": ["model", "w"]}, ...},
     "state_dict": {
        "model.w": {"type": "tensor", "dtype": "bfloat16", "size": [4, 3], "layout": "strided",
                    "memory_format": "contiguous_format", "requires_grad": false,
                    "pin_memory": false,
                    "chunks": [{"offsets": [0, 0], "sizes": [4, 3],
                                "locator": {"key": "data/0.bin", "offset": 0, "length": 24}}]},
        "step": {"type": "bytes", "locator": {"key": "data/0.bin", "offset": 24, "length": 11}}}}

``planner_data`` is plain JSON except that a Python tuple is written as ``{"__tuple__": [...]}``,
so the default planners' ``{fqn: ("a", 0, "b")}`` paths come back as tuples, exactly.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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

from ..errors import MetadataError
from .frames import FrameTable
from .jsoncheck import (
    Invalid,
    all_counts,
    as_bool,
    as_count,
    as_counts,
    as_dict,
    as_list,
    as_str,
    fail,
    get_field,
    is_count,
    joined,
    lookup,
    opt_str,
    reject_constant,
    show,
    unique_pairs,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Checkpoint",
    "Locator",
    "check_record_size",
    "decode",
    "encode",
]

FORMAT = "s3ckpt"
FORMAT_VERSION = 1

_TUPLE_TAG = "__tuple__"
_MAX_DEPTH = 64  # planner_data / extra nesting; deeper is almost surely a reference cycle.

_T = TypeVar("_T")


def _by_name(names: tuple[str, ...], kind: type[_T]) -> dict[str, _T]:
    """Look up fixed names on ``torch``; names this torch lacks are skipped (float8 and friends)."""
    table: dict[str, _T] = {}
    for name in names:
        value = getattr(torch, name, None)
        if isinstance(value, kind):
            table[name] = value
    return table


# Decoding maps names through these tables only: a name from the file is never looked up on torch.
_DTYPES: dict[str, torch.dtype] = _by_name(
    (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex128",
        "complex64",
        "complex32",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    ),
    torch.dtype,
)
_LAYOUTS: dict[str, torch.layout] = _by_name(
    ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged"),
    torch.layout,
)
# The three formats DCP's own (pickle) metadata can carry.
_MEMORY_FORMATS: dict[str, torch.memory_format] = _by_name(
    ("contiguous_format", "channels_last", "preserve_format"), torch.memory_format
)
_DTYPE_NAMES = {value: name for name, value in _DTYPES.items()}
_LAYOUT_NAMES = {value: name for name, value in _LAYOUTS.items()}
_MEMORY_FORMAT_NAMES = {value: name for name, value in _MEMORY_FORMATS.items()}


@dataclass(frozen=True, slots=True)
class Locator:
    """Where one item's bytes are: object key (relative to the checkpoint prefix), offset, length.

    Kept next to each chunk / bytes entry in the record so the reader needs no other index.
    """

    key: str
    offset: int
    length: int


@dataclass(frozen=True)
class Checkpoint:
    """A decoded commit record.

    ``metadata.storage_data`` is ``locators`` too, which is what DCP hands back to the storage
    reader; ``objects`` lists every data object (key relative to the prefix -> size in bytes)
    and ``frames`` how each is framed and checksummed.
    """

    metadata: Metadata
    locators: dict[MetadataIndex, Locator]
    save_id: str
    created: float
    objects: dict[str, int]
    extra: dict[str, Any]
    frames: dict[str, FrameTable]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """A record for a large model is millions of small acyclic objects; letting the cyclic
    collector rescan them while they are built doubles the time of encode and decode."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _is_valid_key(key: Any) -> bool:
    """Relative object keys only: the reader joins them to the prefix, so no escaping it."""
    return (
        isinstance(key, str)
        and "\x00" not in key
        and all(part not in ("", ".", "..") for part in key.split("/"))
    )


def _check_locator(
    locator: Locator, objects: Mapping[str, int], where: str, name: str = ""
) -> None:
    """``objects`` holds only validated keys, so being listed there proves the key is sane."""
    size = objects.get(locator.key) if isinstance(locator.key, str) else None
    if size is None:
        if not _is_valid_key(locator.key):
            fail(f"{joined(where, name)}: key {show(locator.key)} is not a relative object key")
        fail(f"{joined(where, name)}: object {locator.key!r} is not listed in objects")
    if not is_count(locator.offset) or not is_count(locator.length):
        fail(f"{joined(where, name)}: offset and length must be non-negative ints, got {locator!r}")
    end = locator.offset + locator.length
    if end > size:
        fail(
            f"{joined(where, name)}: bytes {locator.offset}..{end} lie outside "
            f"object {locator.key!r} of {size} bytes"
        )


# --------------------------------------------------------------------------------------- encode


def encode(
    metadata: Metadata,
    locators: Mapping[MetadataIndex, Locator],
    *,
    save_id: str,
    created: float,
    objects: Mapping[str, int],
    frames: Mapping[str, FrameTable],
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """Serialize a commit record; raises MetadataError rather than commit one that cannot load.

    ``locators`` must hold exactly one entry per tensor chunk and bytes item of ``metadata``;
    ``metadata.storage_data`` is ignored (the locators are the storage data).
    """
    try:
        with _gc_paused():
            for key, size in objects.items():
                if key not in frames or frames[key].size != size:
                    fail(f"objects[{key!r}]: no frame table of {show(size)} stored bytes")
            if set(frames) - set(objects):
                fail("frames: a frame table for an object not in objects")
            # Locators point into raw (uncompressed) bytes; `objects` records stored sizes.
            raw_sizes = {key: table.raw_size for key, table in frames.items()}
            record = _encode_record(metadata, locators, save_id, created, raw_sizes, extra)
            record["objects"] = dict(objects)
            record["frames"] = {key: table.to_json() for key, table in frames.items()}
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
        if not _is_valid_key(key):
            fail(f"objects: {show(key)} is not a relative object key")
        if not is_count(size):
            fail(f"objects[{key!r}]: expected a size in bytes, got {show(size)}")
        object_sizes[key] = size

    used: set[MetadataIndex] = set()

    def locate(index: MetadataIndex, where: str) -> dict[str, Any]:
        locator = locators.get(index)
        if locator is None:
            fail(f"{where}: no locator for this item (every chunk and bytes item needs one)")
        if not isinstance(locator, Locator):
            fail(f"{where}: expected a Locator, got {type(locator).__name__}")
        _check_locator(locator, object_sizes, where)
        used.add(index)
        return {"key": locator.key, "offset": locator.offset, "length": locator.length}

    state_dict: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        where = f"state_dict[{fqn!r}]"
        if not isinstance(fqn, str):
            fail(f"{where}: fqn must be a str")
        if isinstance(item, TensorStorageMetadata):
            state_dict[fqn] = _encode_tensor(fqn, item, locate, where)
        elif isinstance(item, BytesStorageMetadata):
            state_dict[fqn] = {"type": "bytes", "locator": locate(MetadataIndex(fqn), where)}
        else:
            fail(f"{where}: unsupported storage metadata {type(item).__name__}")

    unused = [index for index in locators if index not in used]
    if unused:
        shown = ", ".join(f"({i.fqn!r}, {show(i.offset)})" for i in unused[:3])
        fail(f"{len(unused)} locator(s) match no item in the metadata, e.g. {shown}")

    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "save_id": save_id,
        "created": float(created),
        "dcp_version": metadata.version,
        "objects": object_sizes,
        "extra": _to_json(dict(extra or {}), "extra", tag_tuples=False, depth=0),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
        "planner_data": _to_json(metadata.planner_data, "planner_data", tag_tuples=True, depth=0),
        "state_dict": state_dict,
    }


def _encode_tensor(
    fqn: str,
    item: TensorStorageMetadata,
    locate: Callable[[MetadataIndex, str], dict[str, Any]],
    where: str,
) -> dict[str, Any]:
    props = item.properties
    dtype = _DTYPE_NAMES.get(props.dtype)
    if dtype is None:
        fail(f"{where}: dtype {props.dtype} is not supported")
    layout = _LAYOUT_NAMES.get(props.layout)
    if layout is None:
        fail(f"{where}: layout {props.layout} is not supported")
    memory_format = _MEMORY_FORMAT_NAMES.get(props.memory_format)
    if memory_format is None:
        fail(f"{where}: memory format {props.memory_format} is not supported")
    size = _encode_counts(item.size, where, "size")
    chunks: list[dict[str, Any]] = []
    seen: set[tuple[int, ...]] = set()
    boxes: list[_Box] = []
    volume = 0
    for position, chunk in enumerate(item.chunks):
        at = f"{where}.chunks[{position}]"
        offsets = _encode_counts(chunk.offsets, at, "offsets")
        sizes = _encode_counts(chunk.sizes, at, "sizes")
        _check_chunk(offsets, sizes, size, at)
        if tuple(offsets) in seen:
            fail(f"{at}: two chunks start at offsets {offsets}")
        seen.add(tuple(offsets))
        locator = locate(MetadataIndex(fqn, offsets), at)
        count = _check_extent(locator["length"], sizes, props.dtype, at)
        if count:
            boxes.append((position, offsets, sizes))
        volume += count
        chunks.append({"offsets": offsets, "sizes": sizes, "locator": locator})
    _check_tiling(size, volume, boxes, where)
    return {
        "type": "tensor",
        "dtype": dtype,
        "size": size,
        "layout": layout,
        "memory_format": memory_format,
        "requires_grad": bool(props.requires_grad),
        "pin_memory": bool(props.pin_memory),
        "chunks": chunks,
    }


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


def _check_chunk(offsets: list[int], sizes: list[int], size: list[int], where: str) -> None:
    if len(offsets) != len(size) or len(sizes) != len(size):
        fail(f"{where}: offsets {offsets} and sizes {sizes} do not match tensor size {size}")
    if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
        fail(f"{where}: offsets {offsets} + sizes {sizes} exceed tensor size {size}")


# A chunk as the tiling check sees it: its position in the record, offsets and sizes.
_Box = tuple[int, list[int], list[int]]
# Comparisons the overlap sweep may make: a second of Python (measured), for a layout that no
# DTensor sharding makes.
_MAX_COMPARISONS = 1 << 20


def _check_extent(length: int, sizes: list[int], dtype: torch.dtype, where: str) -> int:
    """A chunk's element count, once its locator is found to hold exactly its bytes.

    The reader sizes every read from the sizes and the dtype; a locator of another length would
    have it read a neighbour's bytes, or another dtype's, with every checksum passing. Packed
    dtypes (``float4_e2m1fn_x2``) count packed elements, as ``itemsize`` and the writer do.
    """
    count = math.prod(sizes)
    if length != count * dtype.itemsize:
        fail(
            f"{where}.locator: {length} bytes, but {count} {dtype} elements (sizes {sizes}) "
            f"take {count * dtype.itemsize}"
        )
    return count


def _check_tiling(size: list[int], volume: int, boxes: list[_Box], where: str) -> None:
    """The chunks of a tensor must cover it exactly once.

    DCP fills a destination from whichever chunks intersect it, so a gap loads as elements never
    written and an overlap as elements from either chunk. ``boxes`` are the non-empty chunks,
    which lie inside the tensor (`_check_chunk`) and start at distinct offsets; ``volume`` is
    their element count. Equal volumes and no overlap make an exact tiling: one chunk needs no
    more, the chunks of any DTensor sharding form a grid (linear in chunks), and any other
    layout is swept for overlaps, within `_MAX_COMPARISONS`.
    """
    numel = math.prod(size)
    if volume != numel:
        how = "leave a gap" if volume < numel else "overlap"
        fail(f"{where}: its chunks hold {volume} elements, the tensor {numel}: they {how}")
    if len(boxes) > 1 and not _is_grid(size, boxes):
        _check_disjoint(boxes, where)


def _is_grid(size: list[int], boxes: list[_Box]) -> bool:
    """Whether, in every dimension, the chunks' extents partition the tensor's.

    Each chunk is then one cell of that grid, and distinct offsets make distinct cells, which
    cannot overlap.
    """
    for dim, extent in enumerate(size):
        at = 0
        for start, length in sorted({(offsets[dim], sizes[dim]) for _, offsets, sizes in boxes}):
            if start != at:
                return False
            at += length
        if at != extent:
            return False
    return True


def _check_disjoint(boxes: list[_Box], where: str) -> None:
    """No two chunks overlap: a sweep along the dimension where most chunks start apart compares
    each chunk with those still open where it starts; a layout needing too many is refused."""
    dim = max(range(len(boxes[0][1])), key=lambda d: len({b[1][d] for b in boxes}))
    budget = _MAX_COMPARISONS
    open_boxes: list[_Box] = []
    for box in sorted(boxes, key=lambda b: b[1][dim]):
        position, offsets, sizes = box
        open_boxes = [b for b in open_boxes if b[1][dim] + b[2][dim] > offsets[dim]]
        budget -= len(open_boxes) + 1
        if budget < 0:
            fail(f"{where}: {len(boxes)} chunks in a layout too irregular to check for overlaps")
        for other, other_offsets, other_sizes in open_boxes:
            if all(
                a < b + m and b < a + n
                for a, n, b, m in zip(offsets, sizes, other_offsets, other_sizes, strict=True)
            ):
                fail(f"{where}: chunks {other} and {position} overlap")
        open_boxes.append(box)


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
        return {_TUPLE_TAG: items} if tag_tuples and isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                fail(f"{where}: key {show(key)} is not a str (JSON keys must be)")
            out[key] = _to_json(item, f"{where}[{key!r}]", tag_tuples=tag_tuples, depth=depth + 1)
        if tag_tuples and list(out) == [_TUPLE_TAG]:
            fail(f"{where}: a dict with the single key {_TUPLE_TAG!r} would read back as a tuple")
        return out
    fail(f"{where}: {type(value).__name__} value {show(value)} cannot be stored in JSON")


# --------------------------------------------------------------------------------------- decode


def check_record_size(size: int, limit: int, url: str) -> None:
    """Refuse a record of ``size`` bytes over ``limit`` (``S3Config.max_record_size``) before it
    is downloaded: decoding holds several times a record's size, so a huge one, hostile or not,
    would cost that much memory on every rank that loads it."""
    if size > limit:
        raise MetadataError(
            f"{url}: the commit record is {size} bytes, over the {limit} bytes a reader accepts "
            f"(S3Config.max_record_size); if the checkpoint is trusted, read it with "
            f"S3Config(max_record_size={size}) or more",
            url=url,
        )


def decode(data: bytes, *, url: str) -> Checkpoint:
    """Parse and validate a commit record; any defect is a MetadataError naming ``url`` and why."""
    try:
        with _gc_paused():
            return _decode_record(data)
    except Invalid as exc:
        raise MetadataError(f"{url}: {exc}", url=url) from None
    except RecursionError:
        raise MetadataError(f"{url}: commit record is nested too deeply", url=url) from None


def _decode_record(data: bytes) -> Checkpoint:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        fail(f"commit record must be bytes, got {type(data).__name__}")
    if bytes(data[:1]) == b"\x80":
        fail(
            "this is a pickle (e.g. torch's FileSystemWriter .metadata), not an s3ckpt commit "
            "record; s3ckpt never unpickles"
        )
    try:
        text = str(data, "utf-8")
    except UnicodeDecodeError as exc:
        fail(f"commit record is not UTF-8 text (garbled?): {exc}")
    try:
        root = json.loads(text, object_pairs_hook=unique_pairs, parse_constant=reject_constant)
    except json.JSONDecodeError as exc:
        fail(f"commit record is not valid JSON (truncated or garbled?): {exc}")
    del text  # the tree is all that is needed now: freed, the text adds nothing to the peak

    record = as_dict(root, "commit record")
    fmt = record.get("format")
    if fmt != FORMAT:
        fail(f"not an s3ckpt commit record (format is {show(fmt)}, expected {FORMAT!r})")
    version = get_field(record, "version", "commit record")
    if not is_count(version) or version < 1:
        fail(f"version: expected a positive int, got {show(version)}")
    if version > FORMAT_VERSION:
        fail(
            f"written by a newer s3ckpt (format version {version}; this s3ckpt reads up to "
            f"{FORMAT_VERSION}); upgrade s3ckpt"
        )

    save_id = as_str(get_field(record, "save_id", ""), "save_id")
    created = get_field(record, "created", "")
    if (
        not isinstance(created, (int, float))
        or isinstance(created, bool)
        or not 0 <= created < 1e11
    ):
        fail(f"created: expected a unix time, got {show(created)}")
    dcp_version = opt_str(get_field(record, "dcp_version", ""), "dcp_version")

    objects: dict[str, int] = {}
    for key, size in as_dict(get_field(record, "objects", ""), "objects").items():
        if not _is_valid_key(key):
            fail(f"objects: {show(key)} is not a relative object key")
        objects[key] = as_count(size, f"objects[{key!r}]")

    frames: dict[str, FrameTable] = {}
    tables = as_dict(get_field(record, "frames", ""), "frames")
    if set(tables) != set(objects):
        fail("frames: expected one frame table per object")
    for key, table in tables.items():
        try:
            frames[key] = FrameTable.from_json(table, objects[key])
        except ValueError as e:
            fail(f"frames[{key!r}]: {e}")

    extra = as_dict(get_field(record, "extra", ""), "extra")
    storage_meta = _decode_storage_meta(get_field(record, "storage_meta", ""))
    planner_data = _from_json(get_field(record, "planner_data", ""), "planner_data")

    raw_sizes = {key: table.raw_size for key, table in frames.items()}
    locators: dict[MetadataIndex, Locator] = {}
    state_dict: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    entries = as_dict(get_field(record, "state_dict", ""), "state_dict")
    for fqn in list(entries):
        where = f"state_dict[{fqn!r}]"
        entry = as_dict(entries.pop(fqn), where)  # its tree freed once decoded: a lower peak
        kind = get_field(entry, "type", where)
        if kind == "bytes":
            locators[MetadataIndex(fqn)] = _decode_locator(entry, raw_sizes, where)
            state_dict[fqn] = BytesStorageMetadata()
        elif kind == "tensor":
            state_dict[fqn] = _decode_tensor(fqn, entry, raw_sizes, locators, where)
        else:
            fail(f"{where}.type: expected 'tensor' or 'bytes', got {show(kind)}")

    metadata = Metadata(
        state_dict_metadata=state_dict,
        planner_data=planner_data,
        storage_data=locators,
        storage_meta=storage_meta,
        version=dcp_version,
    )
    return Checkpoint(
        metadata=metadata,
        locators=locators,
        save_id=save_id,
        created=float(created),
        objects=objects,
        extra=extra,
        frames=frames,
    )


def _decode_tensor(
    fqn: str,
    entry: dict[str, Any],
    objects: Mapping[str, int],
    locators: dict[MetadataIndex, Locator],
    where: str,
) -> TensorStorageMetadata:
    properties = TensorProperties(
        dtype=lookup(_DTYPES, get_field(entry, "dtype", where), where, "dtype"),
        layout=lookup(_LAYOUTS, get_field(entry, "layout", where), where, "layout"),
        requires_grad=as_bool(get_field(entry, "requires_grad", where), where, "requires_grad"),
        memory_format=lookup(
            _MEMORY_FORMATS, get_field(entry, "memory_format", where), where, "memory_format"
        ),
        pin_memory=as_bool(get_field(entry, "pin_memory", where), where, "pin_memory"),
    )
    size = as_counts(get_field(entry, "size", where), where, "size")
    chunks: list[ChunkStorageMetadata] = []
    boxes: list[_Box] = []
    volume = 0
    for position, chunk in enumerate(as_list(get_field(entry, "chunks", where), where, "chunks")):
        at = f"{where}.chunks[{position}]"
        chunk = as_dict(chunk, at)
        offsets = as_counts(get_field(chunk, "offsets", at), at, "offsets")
        sizes = as_counts(get_field(chunk, "sizes", at), at, "sizes")
        _check_chunk(offsets, sizes, size, at)
        index = MetadataIndex(fqn, offsets, position)
        if index in locators:
            fail(f"{at}: two chunks start at offsets {offsets}")
        locator = locators[index] = _decode_locator(chunk, objects, at)
        count = _check_extent(locator.length, sizes, properties.dtype, at)
        if count:
            boxes.append((position, offsets, sizes))
        volume += count
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    _check_tiling(size, volume, boxes, where)
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


def _decode_locator(entry: dict[str, Any], objects: Mapping[str, int], where: str) -> Locator:
    raw = as_dict(get_field(entry, "locator", where), where, "locator")
    if "key" not in raw or "offset" not in raw or "length" not in raw:
        fail(f"{where}.locator: expected key, offset and length, got {show(raw)}")
    locator = Locator(raw["key"], raw["offset"], raw["length"])
    if type(locator.offset) is not int or type(locator.length) is not int:  # bool, float, str
        as_count(locator.offset, joined(where, "locator"), "offset")
        as_count(locator.length, joined(where, "locator"), "length")
    _check_locator(locator, objects, where, "locator")
    return locator


def _decode_storage_meta(value: Any) -> StorageMeta | None:
    if value is None:
        return None
    raw = as_dict(value, "storage_meta")
    modules = as_list(get_field(raw, "modules", "storage_meta"), "storage_meta", "modules")
    return StorageMeta(
        checkpoint_id=opt_str(
            get_field(raw, "checkpoint_id", "storage_meta"), "storage_meta.checkpoint_id"
        ),
        save_id=opt_str(get_field(raw, "save_id", "storage_meta"), "storage_meta.save_id"),
        load_id=opt_str(get_field(raw, "load_id", "storage_meta"), "storage_meta.load_id"),
        modules=[as_str(module, f"storage_meta.modules[{i}]") for i, module in enumerate(modules)],
    )


def _from_json(value: Any, where: str) -> Any:
    """Undo :func:`_to_json` with ``tag_tuples``: tagged objects become tuples again."""
    if isinstance(value, list):
        return [_from_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if list(value) == [_TUPLE_TAG]:
            items = as_list(value[_TUPLE_TAG], where, _TUPLE_TAG)
            return tuple(_from_json(v, f"{where}[{i}]") for i, v in enumerate(items))
        return {k: _from_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    return value
