"""The state dict's entries of a record: read one at a time (`read_state_dict`), and resolved
with their items, inline as versions 1 and 2 keep them (`resolve_inline`) or from the item
table of version 3 (`resolve_table`); version 4 keeps them in its entry table (`entrytable`), and
`build_entries` joins them with the item table, as for version 3. Every chunk is checked as
`decoder.decode` promises."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..frames import FrameTable
from ..jsoncheck import (
    as_bool,
    as_count,
    as_counts,
    as_dict,
    as_list,
    fail,
    get_field,
    joined,
    lookup,
    show,
)
from ..jsonstream import Reader
from . import table
from .entrytable import Fields, Spec
from .model import (
    DTYPE_SIZES,
    LAYOUTS,
    MEMORY_FORMATS,
    BytesEntry,
    Chunk,
    Entry,
    Locator,
    TensorEntry,
    check_locator,
    is_digest,
)
from .tiling import Box, check_chunk, check_extent, check_tiling

# The most text one value inside the state dict, the frame tables or planner_data may take
# (a chunk with its offsets, sizes and digest; a path): s3ckpt writes at most a few hundred.
SMALL_VALUE = 64 * 1024

_DTYPE_NAMES = {name: name for name in DTYPE_SIZES}
_LAYOUTS = {name: name for name in LAYOUTS}
_MEMORY_FORMATS = {name: name for name in MEMORY_FORMATS}


def read_state_dict(reader: Reader, keys: dict[str, str]) -> dict[str, Entry | Pending]:
    """The state dict, decoded entry by entry as it is read: a small entry (most are) in one
    scan, a larger one (many chunks) member by member and chunk by chunk. An entry of the
    version-3 shape (its items in the table) waits for the table (`_resolve_table`)."""
    entries: dict[str, Entry | Pending] = {}
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
                    chunks = reader.value(joined(where, name), SMALL_VALUE)
                    if type(chunks) is not int:
                        as_list(chunks, where, "chunks")  # fails: neither a list nor a count
                else:
                    fields[name] = reader.value(joined(where, name), SMALL_VALUE)
        if isinstance(chunks, list):
            entries[fqn] = _decode_entry(fields, chunks, where, keys)
        elif chunks is not None or (fields.get("type") == "bytes" and "locator" not in fields):
            entries[fqn] = Pending(fields, chunks, where)
        else:
            entries[fqn] = _decode_entry(fields, None, where, keys)
    return entries


@dataclass(frozen=True, slots=True)
class Pending:
    """An entry of the version-3 shape: its fields and (a tensor's) count of chunks."""

    fields: dict[str, Any]
    chunks: Any
    where: str


def resolve_inline(
    state_dict: dict[str, Entry | Pending], keys: dict[str, str]
) -> dict[str, Entry]:
    """The entries of a version 1 or 2 record, which keeps its items inline: one of the
    version-3 shape is refused as the older reader refused it."""
    for fqn, entry in state_dict.items():
        if isinstance(entry, Pending):
            if entry.chunks is not None:  # a count, which only version 3 has
                as_list(entry.chunks, entry.where, "chunks")  # fails
            state_dict[fqn] = _decode_entry(entry.fields, None, entry.where, keys)
    return state_dict  # type: ignore[return-value]


def resolve_table(
    state_dict: dict[str, Entry | Pending],
    items: Any,
    names: list[str],
    raw_sizes: list[int],
    max_size: int,
) -> dict[str, Entry]:
    """The entries of a version-3 record from their fields and its item table, checked."""
    specs: list[Spec] = []
    for fqn, entry in state_dict.items():
        if not isinstance(entry, Pending):
            fail(
                f"state_dict[{fqn!r}]: its locators are inline, but a version 3 record keeps "
                "them in its item table"
            )
        kind = get_field(entry.fields, "type", entry.where)
        if kind == "bytes":
            specs.append((fqn, None, 1))
        elif kind == "tensor":
            if entry.chunks is None:
                get_field(entry.fields, "chunks", entry.where)  # fails: missing
            count = as_count(entry.chunks, entry.where, "chunks")
            specs.append((fqn, _tensor_fields(entry.fields, entry.where), count))
        else:
            fail(f"{entry.where}.type: expected 'tensor' or 'bytes', got {show(kind)}")
    return build_entries(specs, items, names, raw_sizes, max_size)


def build_entries(
    specs: list[Spec], items: Any, names: list[str], raw_sizes: list[int], max_size: int
) -> dict[str, Entry]:
    """The entries of a record of version 3 or later from its entries (``specs``, in the order
    of their names) and its item table, checked: the table holds exactly their rows, each in
    one of the objects (``names``, sorted, of ``raw_sizes`` raw bytes), and a tensor's chunks
    tile it."""
    rows = dims = 0
    for _, fields, count in specs:
        rows += count
        if fields is not None:
            dims += count * len(fields[1])
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
            itemsize = DTYPE_SIZES[dtype]
            if count != 1 or not table.is_whole(columns, row, col, size, itemsize):
                where = f"state_dict[{fqn!r}]"
                table.check_tensor(columns, row, col, count, size, itemsize, dtype, where)
            chunks = table.ChunkList(columns, names, row, col, count, len(size))
            entries[fqn] = TensorEntry(
                dtype, size, layout, memory_format, requires_grad, pin_memory, chunks
            )
            col += count * len(size)
        row += count
    return entries


def _row_name(specs: list[Spec], row: int) -> str:
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
        _chunk(reader.value(f"{at}[{i}]", SMALL_VALUE), f"{at}[{i}]", keys)
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


def _tensor_fields(entry: dict[str, Any], where: str) -> Fields:
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


def check_inline_locators(state_dict: dict[str, Entry], frames: Mapping[str, FrameTable]) -> None:
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
