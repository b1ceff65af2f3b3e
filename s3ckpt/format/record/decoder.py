""":func:`check_record_size` and :func:`decode`: a record read from the bucket is checked field by
field, and as a whole, before anything in it is used."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ...errors import MetadataError
from ..frames import FrameTable
from ..jsoncheck import (
    Invalid,
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
from ..layout import is_reference
from .model import (
    DTYPE_SIZES,
    FORMAT,
    FORMAT_VERSION,
    LAYOUTS,
    MEMORY_FORMATS,
    TUPLE_TAG,
    BytesEntry,
    Checkpoint,
    Chunk,
    Entry,
    Locator,
    StorageInfo,
    TensorEntry,
    check_locator,
    gc_paused,
    is_digest,
    is_valid_key,
)
from .tiling import Box, check_chunk, check_extent, check_tiling

_DTYPE_NAMES = {name: name for name in DTYPE_SIZES}
_LAYOUTS = {name: name for name in LAYOUTS}
_MEMORY_FORMATS = {name: name for name in MEMORY_FORMATS}


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
    """Parse and validate a commit record; any defect is a MetadataError naming ``url`` and why.

    The result is the format's own model: no torch is imported until a load asks for DCP's
    ``Metadata`` (`Checkpoint.metadata`)."""
    try:
        with gc_paused():
            return _decode_record(data, url)
    except Invalid as exc:
        raise MetadataError(f"{url}: {exc}", url=url) from None
    except RecursionError:
        raise MetadataError(f"{url}: commit record is nested too deeply", url=url) from None


def _decode_record(data: bytes, url: str) -> Checkpoint:
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
        if not is_valid_key(key):
            fail(f"objects: {show(key)} is not a relative object key")
        if version < 2 and is_reference(key):
            fail(f"objects: {key!r} references another checkpoint, which version 1 cannot")
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
    state_dict: dict[str, Entry] = {}
    entries = as_dict(get_field(record, "state_dict", ""), "state_dict")
    for fqn in list(entries):
        where = f"state_dict[{fqn!r}]"
        entry = as_dict(entries.pop(fqn), where)  # its tree freed once decoded: a lower peak
        kind = get_field(entry, "type", where)
        if kind == "bytes":
            state_dict[fqn] = BytesEntry(_decode_locator(entry, raw_sizes, where))
        elif kind == "tensor":
            state_dict[fqn] = _decode_tensor(entry, raw_sizes, where)
        else:
            fail(f"{where}.type: expected 'tensor' or 'bytes', got {show(kind)}")

    return Checkpoint(
        save_id=save_id,
        created=float(created),
        objects=objects,
        extra=extra,
        frames=frames,
        entries=state_dict,
        planner_data=planner_data,
        storage_meta=storage_meta,
        dcp_version=dcp_version,
        url=url,
    )


def _decode_tensor(entry: dict[str, Any], objects: Mapping[str, int], where: str) -> TensorEntry:
    dtype: str = lookup(_DTYPE_NAMES, get_field(entry, "dtype", where), where, "dtype")
    layout: str = lookup(_LAYOUTS, get_field(entry, "layout", where), where, "layout")
    memory_format: str = lookup(
        _MEMORY_FORMATS, get_field(entry, "memory_format", where), where, "memory_format"
    )
    requires_grad = as_bool(get_field(entry, "requires_grad", where), where, "requires_grad")
    pin_memory = as_bool(get_field(entry, "pin_memory", where), where, "pin_memory")
    size = as_counts(get_field(entry, "size", where), where, "size")
    itemsize = DTYPE_SIZES[dtype]
    chunks: list[Chunk] = []
    boxes: list[Box] = []
    starts: set[tuple[int, ...]] = set()
    volume = 0
    for position, chunk in enumerate(as_list(get_field(entry, "chunks", where), where, "chunks")):
        at = f"{where}.chunks[{position}]"
        chunk = as_dict(chunk, at)
        offsets = as_counts(get_field(chunk, "offsets", at), at, "offsets")
        sizes = as_counts(get_field(chunk, "sizes", at), at, "sizes")
        check_chunk(offsets, sizes, size, at)
        start = tuple(offsets)
        if start in starts:
            fail(f"{at}: two chunks start at offsets {offsets}")
        starts.add(start)
        locator = _decode_locator(chunk, objects, at)
        count = check_extent(locator.length, sizes, itemsize, dtype, at)
        if count:
            boxes.append((position, offsets, sizes))
        volume += count
        digest = chunk.get("xxh3")
        if digest is not None and not is_digest(digest):
            fail(f"{at}.xxh3: expected 32 hex digits, got {show(digest)}")
        chunks.append(Chunk(offsets, sizes, locator, digest))
    check_tiling(size, volume, boxes, where)
    return TensorEntry(dtype, size, layout, memory_format, requires_grad, pin_memory, chunks)


def _decode_locator(entry: dict[str, Any], objects: Mapping[str, int], where: str) -> Locator:
    raw = as_dict(get_field(entry, "locator", where), where, "locator")
    if "key" not in raw or "offset" not in raw or "length" not in raw:
        fail(f"{where}.locator: expected key, offset and length, got {show(raw)}")
    locator = Locator(raw["key"], raw["offset"], raw["length"])
    if type(locator.offset) is not int or type(locator.length) is not int:  # bool, float, str
        as_count(locator.offset, joined(where, "locator"), "offset")
        as_count(locator.length, joined(where, "locator"), "length")
    check_locator(locator, objects, where, "locator")
    return locator


def _decode_storage_meta(value: Any) -> StorageInfo | None:
    if value is None:
        return None
    raw = as_dict(value, "storage_meta")
    modules = as_list(get_field(raw, "modules", "storage_meta"), "storage_meta", "modules")
    return StorageInfo(
        checkpoint_id=opt_str(
            get_field(raw, "checkpoint_id", "storage_meta"), "storage_meta.checkpoint_id"
        ),
        save_id=opt_str(get_field(raw, "save_id", "storage_meta"), "storage_meta.save_id"),
        load_id=opt_str(get_field(raw, "load_id", "storage_meta"), "storage_meta.load_id"),
        modules=[as_str(module, f"storage_meta.modules[{i}]") for i, module in enumerate(modules)],
    )


def _from_json(value: Any, where: str) -> Any:
    """Undo ``encoder._to_json`` with ``tag_tuples``: tagged objects become tuples again."""
    if isinstance(value, list):
        return [_from_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if list(value) == [TUPLE_TAG]:
            items = as_list(value[TUPLE_TAG], where, TUPLE_TAG)
            return tuple(_from_json(v, f"{where}[{i}]") for i, v in enumerate(items))
        return {k: _from_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    return value
