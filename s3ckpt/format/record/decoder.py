""":func:`check_record_size` and :func:`decode`: a record read from the bucket is checked field by
field, and as a whole, before anything in it is used."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
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
    show,
)
from ..jsonstream import Reader
from ..layout import is_reference
from . import table
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

# The most text one value inside the state dict, the frame tables or planner_data may take
# (a chunk with its offsets, sizes and digest; a path): s3ckpt writes at most a few hundred.
_SMALL_VALUE = 64 * 1024
# The most text extra, storage_meta or any other top-level field may take, free-form (s3ckpt
# writes some 200 bytes each), and so at most 30 times that in memory.
_FREE_FORM = 1024 * 1024
_FIELDS = ("format", "version", "save_id", "created", "dcp_version", "extra", "storage_meta")
_MISSING = object()
_LAST_VERSION = re.compile(r'"version"\s*:\s*(\d+)\s*}\s*$')
MEMORY_BOUND = 10  # what decoding a record holds, at most, in multiples of its size (`decode`)
MAX_SIZE = 256 << 20  # `S3Config.max_record_size`'s default

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


def decode(data: bytes, *, url: str, max_size: int = MAX_SIZE) -> Checkpoint:
    """Parse and validate a commit record; any defect is a MetadataError naming ``url`` and why.

    The result is the format's own model: no torch is imported until a load asks for DCP's
    ``Metadata`` (`Checkpoint.metadata`).

    Memory: at most `MEMORY_BOUND` times the record's size, and at most 30 MiB more for its
    free-form ``extra`` and ``storage_meta`` (`_FREE_FORM` of text each), whatever it holds;
    s3ckpt's own records take 3-4 times. ``json.loads`` of the whole record held up to 30 times
    its text for valid, dense JSON (``[0]``: 4 bytes of text, 100 of objects), so the record is
    read a value at a time (`jsonstream.Reader`): the state dict entry by entry (and a large
    entry chunk by chunk), every other value from a slice of at most `_SMALL_VALUE` bytes, each
    turned into the model as it is read; ``planner_data`` is checked and kept as its text until
    it is asked for. The densest valid content measured (one-element chunks; objects
    holding one byte each) takes under 8 times its text.

    A version-3 record's item table (`table`) is compressed: its inflated size, which the state
    dict's entries fix, must be at most ``max_size`` (``S3Config.max_record_size``, the bound
    on the record's own size), checked before any of it is inflated; the bound above is then of
    the record's size plus that inflated size."""
    try:
        with gc_paused():
            return _decode_record(data, url, max_size)
    except Invalid as exc:
        raise MetadataError(f"{url}: {exc}", url=url) from None
    except RecursionError:
        raise MetadataError(f"{url}: commit record is nested too deeply", url=url) from None


def decode_planner_data(text: str) -> Any:
    """``planner_data`` from its text in a record that `decode` accepted."""
    with gc_paused():
        return _read_planner_data(Reader(text, "planner_data"), keep=True)


def _decode_record(data: bytes, url: str, max_size: int) -> Checkpoint:
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
    reader = Reader(text, "commit record")
    if reader.peek() != "{":
        as_dict(reader.value("", _SMALL_VALUE), "commit record")
    record: dict[str, Any] = {}
    try:
        named = _read_members(reader, record)
        reader.end()
    except Invalid:
        _check_format(record.get("format", FORMAT), record.get("version", _last_version(text)))
        raise
    version = _check_format(record.get("format"), record.get("version", _MISSING))
    del reader, text  # what was read is all that is needed now

    save_id = as_str(get_field(record, "save_id", ""), "save_id")
    created = get_field(record, "created", "")
    if (
        not isinstance(created, (int, float))
        or isinstance(created, bool)
        or not 0 <= created < 1e11
    ):
        fail(f"created: expected a unix time, got {show(created)}")
    dcp_version = opt_str(get_field(record, "dcp_version", ""), "dcp_version")

    objects: dict[str, int] = as_dict(get_field(record, "objects", ""), "objects")
    for key, size in objects.items():
        if not is_valid_key(key):
            fail(f"objects: {show(key)} is not a relative object key")
        if version < 2 and is_reference(key):
            fail(f"objects: {key!r} references another checkpoint, which version 1 cannot")
        as_count(size, f"objects[{key!r}]")
    state_dict: dict[str, Entry | _Pending] = get_field(record, "state_dict", "")
    if version < 3:
        if "items" in record:
            fail("items: an item table in a record of version 1 or 2")
        entries = _resolve_inline(state_dict, named)
        # s3ckpt lists the objects its items are in, no others: a record listing more costs a
        # frame table each, however little text it takes to list one.
        unnamed = next((key for key in objects if key not in named), None)
        if unnamed is not None:
            fail(f"objects: {unnamed!r} holds none of the state dict's items")

    frames: dict[str, FrameTable] = {}
    tables = as_dict(get_field(record, "frames", ""), "frames")
    del record["frames"]  # each table's JSON is freed as it is decoded
    if set(tables) != set(objects):
        fail("frames: expected one frame table per object")
    for key in objects:  # keyed by the objects' own strings; each table's JSON freed as it goes
        table = tables.pop(key)
        try:
            frames[key] = FrameTable.from_parsed(table, objects[key])
        except ValueError as e:
            fail(f"frames[{key!r}]: {e}")

    extra = as_dict(get_field(record, "extra", ""), "extra")
    storage_meta = _decode_storage_meta(get_field(record, "storage_meta", ""))
    planner_data = get_field(record, "planner_data", "")

    if version < 3:
        _check_locators(entries, frames)
    else:
        names = sorted(objects)
        raw_sizes = [frames[key].raw_size for key in names]
        items = get_field(record, "items", "")
        entries = _resolve_table(state_dict, items, names, raw_sizes, max_size)

    return Checkpoint(
        save_id=save_id,
        created=float(created),
        objects=objects,
        extra=extra,
        frames=frames,
        entries=entries,
        planner_source=planner_data,
        storage_meta=storage_meta,
        dcp_version=dcp_version,
        url=url,
        record_size=len(data),
        version=version,
    )


def _read_members(reader: Reader, record: dict[str, Any]) -> dict[str, str]:
    """The record's top-level members into ``record``: the small ones as they are, the frame
    tables and objects as JSON, the state dict decoded, ``planner_data`` as its text; and the
    object keys that its locators name."""
    named: dict[str, str] = {}  # the keys the locators name, each once: they share it
    for name in reader.members(""):
        start = reader.pos
        if name == "state_dict":
            record[name] = _read_state_dict(reader, named)
        elif name == "objects":
            record[name] = _read_objects(reader)
        elif name == "frames":
            record[name] = _read_frames(reader)
        elif name == "items":
            record[name] = (
                reader.value(name, _SMALL_VALUE)
                if reader.peek() != "{"
                else {
                    key: reader.value(f"items.{key}", _SMALL_VALUE) for key in reader.members(name)
                }
            )
        elif name == "planner_data":
            _read_planner_data(reader, keep=False)
            record[name] = reader.text[start : reader.pos]
        else:  # the small fields, extra, storage_meta, and what a later writer adds
            value = reader.value(name, _FREE_FORM)
            if name in _FIELDS:
                record[name] = value
    return named


def _check_format(fmt: Any, version: Any) -> int:
    """The record's version, once what decides whether the rest is worth checking is checked:
    a record of another format, or of a newer s3ckpt (which may be shaped otherwise), says so
    before anything else is refused."""
    if fmt != FORMAT:
        fail(f"not an s3ckpt commit record (format is {show(fmt)}, expected {FORMAT!r})")
    if version is _MISSING:
        fail("commit record: missing field 'version'")
    if not is_count(version) or version < 1:
        fail(f"version: expected a positive int, got {show(version)}")
    if version > FORMAT_VERSION:
        fail(
            f"written by a newer s3ckpt (format version {version}; this s3ckpt reads up to "
            f"{FORMAT_VERSION}); upgrade s3ckpt"
        )
    return int(version)


def _last_version(text: str) -> Any:
    """The version of a record that could not be read to its end, where s3ckpt writes it:
    last (keys are sorted). Else 1: nothing says the record is newer."""
    match = _LAST_VERSION.search(text, max(0, len(text) - 100))
    return int(match.group(1)) if match else 1


def _read_objects(reader: Reader) -> Any:
    """``objects``, member by member (a value that is not an object is refused by the caller)."""
    if reader.peek() != "{":
        return reader.value("objects", _SMALL_VALUE)
    objects: dict[str, Any] = {}
    for key in reader.members("objects", into=objects):
        objects[key] = reader.value(f"objects[{key!r}]", _SMALL_VALUE)
    return objects


def _read_frames(reader: Reader) -> Any:
    """``frames``, each table checked and kept packed as it is read (`FrameTable.parse_json`)
    until the objects' sizes are known; a long table's base64 needs no slice of its own."""
    if reader.peek() != "{":
        return reader.value("frames", _SMALL_VALUE)
    tables: dict[str, tuple[int, bytes, int | None]] = {}
    for key in reader.members("frames", into=tables):
        where = f"frames[{key!r}]"
        table = (
            reader.value(where, _SMALL_VALUE)
            if reader.peek() != "{"
            else {
                name: reader.value(f"{where}[{name!r}]", _SMALL_VALUE)
                for name in reader.members(where)
            }
        )
        try:
            tables[key] = FrameTable.parse_json(table)
        except ValueError as e:
            fail(f"{where}: {e}")
    return tables


def _read_planner_data(reader: Reader, *, keep: bool) -> Any:
    """``planner_data``, each member checked (a tagged tuple must hold a list) as it is read;
    kept only if ``keep`` (`decode` keeps its text, which `decode_planner_data` reads again
    when it is asked for). One that is not an object (not DCP's) must be small."""
    if reader.peek() != "{":
        return _from_json(reader.value("planner_data", _FREE_FORM), "planner_data")
    kept: dict[str, Any] = {}
    for key in reader.members("planner_data"):
        where = f"planner_data[{key!r}]"
        value = _from_json(reader.value(where, _SMALL_VALUE), where)
        if keep:
            kept[key] = value
    return kept


def _read_state_dict(reader: Reader, keys: dict[str, str]) -> dict[str, Entry | _Pending]:
    """The state dict, decoded entry by entry as it is read: a small entry (most are) in one
    scan, a larger one (many chunks) member by member and chunk by chunk. An entry of the
    version-3 shape (its items in the table) waits for the table (`_resolve_table`)."""
    entries: dict[str, Entry | _Pending] = {}
    for fqn in reader.members("state_dict", into=entries):
        where = f"state_dict[{fqn!r}]"
        small = reader.small()
        chunks: list[Chunk] | int | None = None
        if small is not None:
            fields = as_dict(small, where)
            listed = fields.pop("chunks", None)
            if type(listed) is int:
                chunks = listed
            elif listed is not None:
                at = joined(where, "chunks")
                chunks = [_chunk(c, f"{at}[{i}]", keys) for i, c in enumerate(as_list(listed, at))]
        else:
            fields = {}
            for name in reader.members(where):
                if name == "chunks" and reader.peek() == "[":
                    chunks = _read_chunks(reader, where, keys)
                elif name == "chunks":
                    chunks = reader.value(joined(where, name), _SMALL_VALUE)
                    if type(chunks) is not int:
                        as_list(chunks, where, "chunks")  # fails: neither a list nor a count
                else:
                    fields[name] = reader.value(joined(where, name), _SMALL_VALUE)
        if isinstance(chunks, list):
            entries[fqn] = _decode_entry(fields, chunks, where, keys)
        elif chunks is not None or (fields.get("type") == "bytes" and "locator" not in fields):
            entries[fqn] = _Pending(fields, chunks, where)
        else:
            entries[fqn] = _decode_entry(fields, None, where, keys)
    return entries


# A tensor entry's fields but its chunks: dtype, size, layout, memory format, requires_grad
# and pin_memory.
_Fields = tuple[str, list[int], str, str, bool, bool]


@dataclass(frozen=True, slots=True)
class _Pending:
    """An entry of the version-3 shape: its fields and (a tensor's) count of chunks."""

    fields: dict[str, Any]
    chunks: Any
    where: str


def _resolve_inline(
    state_dict: dict[str, Entry | _Pending], keys: dict[str, str]
) -> dict[str, Entry]:
    """The entries of a version 1 or 2 record, which keeps its items inline: one of the
    version-3 shape is refused as the older reader refused it."""
    for fqn, entry in state_dict.items():
        if isinstance(entry, _Pending):
            if entry.chunks is not None:  # a count, which only version 3 has
                as_list(entry.chunks, entry.where, "chunks")  # fails
            state_dict[fqn] = _decode_entry(entry.fields, None, entry.where, keys)
    return state_dict  # type: ignore[return-value]


def _resolve_table(
    state_dict: dict[str, Entry | _Pending],
    items: Any,
    names: list[str],
    raw_sizes: list[int],
    max_size: int,
) -> dict[str, Entry]:
    """The entries of a version-3 record from their fields and its item table, checked."""
    specs: list[tuple[str, _Fields | None, int]] = []
    rows = dims = 0
    for fqn, entry in state_dict.items():
        if not isinstance(entry, _Pending):
            fail(
                f"state_dict[{fqn!r}]: its locators are inline, but a version 3 record keeps "
                "them in its item table"
            )
        kind = get_field(entry.fields, "type", entry.where)
        if kind == "bytes":
            specs.append((fqn, None, 1))
            rows += 1
        elif kind == "tensor":
            if entry.chunks is None:
                get_field(entry.fields, "chunks", entry.where)  # fails: missing
            count = as_count(entry.chunks, entry.where, "chunks")
            fields = _tensor_fields(entry.fields, entry.where)
            specs.append((fqn, fields, count))
            rows += count
            dims += count * len(fields[1])
        else:
            fail(f"{entry.where}.type: expected 'tensor' or 'bytes', got {show(kind)}")
    columns = table.unpack(items, rows, dims, max_size)
    table.check_locators(columns, names, raw_sizes, lambda row: _row_name(specs, row))
    entries: dict[str, Entry] = {}
    row = col = 0
    for fqn, tensor, count in specs:
        if tensor is None:
            key = names[columns.keys[row]]
            entries[fqn] = BytesEntry(Locator(key, columns.offsets[row], columns.lengths[row]))
        else:
            dtype, size, layout, memory_format, requires_grad, pin_memory = tensor
            where = f"state_dict[{fqn!r}]"
            table.check_tensor(columns, row, col, count, size, DTYPE_SIZES[dtype], dtype, where)
            chunks = table.ChunkList(columns, names, row, col, count, len(size))
            entries[fqn] = TensorEntry(
                dtype, size, layout, memory_format, requires_grad, pin_memory, chunks
            )
            col += count * len(size)
        row += count
    return entries


def _row_name(specs: list[tuple[str, _Fields | None, int]], row: int) -> str:
    """The item of a row of the table, for a message."""
    for fqn, fields, count in specs:
        if row < count:
            return f"state_dict[{fqn!r}]" + ("" if fields is None else f".chunks[{row}]")
        row -= count
    return "items"


def _decode_entry(
    fields: dict[str, Any], chunks: list[Chunk] | None, where: str, keys: dict[str, str]
) -> Entry:
    kind = get_field(fields, "type", where)
    if kind == "bytes":
        return BytesEntry(_decode_locator(fields, where, keys))
    if kind == "tensor":
        if chunks is None:
            get_field(fields, "chunks", where)  # fails: missing
        return _decode_tensor(fields, chunks or [], where)
    fail(f"{where}.type: expected 'tensor' or 'bytes', got {show(kind)}")


def _read_chunks(reader: Reader, where: str, keys: dict[str, str]) -> list[Chunk]:
    """A tensor's chunks, read one at a time."""
    at = joined(where, "chunks")
    return [
        _chunk(reader.value(f"{at}[{i}]", _SMALL_VALUE), f"{at}[{i}]", keys)
        for i in reader.items(at)
    ]


def _chunk(value: Any, at: str, keys: dict[str, str]) -> Chunk:
    """A chunk checked on its own; how the chunks fit their tensor is `_decode_tensor`'s (the
    tensor's size and dtype may come after them)."""
    chunk = as_dict(value, at)
    offsets = tuple(as_counts(get_field(chunk, "offsets", at), at, "offsets"))
    sizes = tuple(as_counts(get_field(chunk, "sizes", at), at, "sizes"))
    digest = chunk.get("xxh3")
    if digest is not None and not is_digest(digest):
        fail(f"{at}.xxh3: expected 32 hex digits, got {show(digest)}")
    return Chunk(offsets, sizes, _decode_locator(chunk, at, keys), digest)


def _decode_tensor(entry: dict[str, Any], chunks: list[Chunk], where: str) -> TensorEntry:
    dtype, size, layout, memory_format, requires_grad, pin_memory = _tensor_fields(entry, where)
    itemsize = DTYPE_SIZES[dtype]
    boxes: list[Box] = []
    starts: set[tuple[int, ...]] = set()
    volume = 0
    for position, chunk in enumerate(chunks):
        at = f"{where}.chunks[{position}]"
        check_chunk(chunk.offsets, chunk.sizes, size, at)
        if chunk.offsets in starts:
            fail(f"{at}: two chunks start at offsets {list(chunk.offsets)}")
        starts.add(chunk.offsets)
        count = check_extent(chunk.locator.length, chunk.sizes, itemsize, dtype, at)
        if count:
            boxes.append((position, chunk.offsets, chunk.sizes))
        volume += count
    check_tiling(size, volume, boxes, where)
    return TensorEntry(dtype, size, layout, memory_format, requires_grad, pin_memory, chunks)


def _tensor_fields(
    entry: dict[str, Any], where: str
) -> tuple[str, list[int], str, str, bool, bool]:
    """A tensor entry's fields but its chunks: dtype, size, layout, memory format,
    requires_grad and pin_memory."""
    dtype: str = lookup(_DTYPE_NAMES, get_field(entry, "dtype", where), where, "dtype")
    layout: str = lookup(_LAYOUTS, get_field(entry, "layout", where), where, "layout")
    memory_format: str = lookup(
        _MEMORY_FORMATS, get_field(entry, "memory_format", where), where, "memory_format"
    )
    requires_grad = as_bool(get_field(entry, "requires_grad", where), where, "requires_grad")
    pin_memory = as_bool(get_field(entry, "pin_memory", where), where, "pin_memory")
    size = as_counts(get_field(entry, "size", where), where, "size")
    return dtype, size, layout, memory_format, requires_grad, pin_memory


def _decode_locator(entry: dict[str, Any], where: str, keys: dict[str, str]) -> Locator:
    """A locator's fields; whether its object exists and holds its bytes is `_check_locators`'
    (the objects may come after the state dict)."""
    raw = as_dict(get_field(entry, "locator", where), where, "locator")
    if "key" not in raw or "offset" not in raw or "length" not in raw:
        fail(f"{where}.locator: expected key, offset and length, got {show(raw)}")
    key, offset, length = raw["key"], raw["offset"], raw["length"]
    if type(offset) is not int or type(length) is not int:  # bool, float, str
        as_count(offset, joined(where, "locator"), "offset")
        as_count(length, joined(where, "locator"), "length")
    return Locator(keys.setdefault(key, key) if isinstance(key, str) else key, offset, length)


def _check_locators(state_dict: dict[str, Entry], frames: Mapping[str, FrameTable]) -> None:
    """Every locator names a listed object and lies inside its raw bytes (spelt out by
    `check_locator` only for one that does not: saying where each one is would double the time
    of a decode)."""
    for fqn, entry in state_dict.items():
        bytes_entry = isinstance(entry, BytesEntry)
        locators = (
            [entry.locator] if isinstance(entry, BytesEntry) else [c.locator for c in entry.chunks]
        )
        for position, locator in enumerate(locators):
            table = frames.get(locator.key) if isinstance(locator.key, str) else None
            if table is None or not 0 <= locator.offset <= table.raw_size - locator.length:
                where = f"state_dict[{fqn!r}]" + ("" if bytes_entry else f".chunks[{position}]")
                raw_sizes = {key: table.raw_size for key, table in frames.items()}
                check_locator(locator, raw_sizes, where, "locator")


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
