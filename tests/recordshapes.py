"""Commit records in the shapes of earlier format versions, and the tables of versions 3 and 4
opened for editing: what tests craft hostile or old records from.

`older` writes a record as s3ckpt wrote it before version 4 (version 3: each entry a JSON object
in ``state_dict``, ``planner_data`` JSON), and `inline` as it did before version 3 (locators,
chunks and digests inline; version 2 if it has digests or references, else 1), so every check of
the old shapes stays tested and old records keep loading. `edit_table` hands a test the item
table's columns as lists to change, and `edit_entries` the entry table as version 3's
``state_dict`` of JSON objects; both pack their tables again, as a hostile writer would.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

from s3ckpt.format.layout import is_reference
from s3ckpt.format.record import columns as record_columns
from s3ckpt.format.record import decode, entrytable
from s3ckpt.format.record import table as item_table
from s3ckpt.format.record.model import TUPLE_TAG, BytesEntry

Columns = dict[str, list[Any]]
Entries = dict[str, dict[str, Any]]
_COLUMNS = ("keys", "offsets", "lengths", "chunk_offsets", "chunk_sizes")
_LIMIT = 1 << 40


def older(data: bytes) -> bytes:
    """``data`` (a version-4 record) in the shape of version 3."""
    record = json.loads(data)
    if record["version"] < 4:
        return bytes(data)
    entries, paths = _entries(record)
    del record["entries"]
    record["state_dict"] = entries
    if "planner_data" not in record:
        record["planner_data"] = {name: {TUPLE_TAG: list(path)} for name, path in paths.items()}
    record["version"] = 3
    return _dumps(record)


def inline(data: bytes) -> bytes:
    """``data`` (a record of version 3 or 4) in the inline shape of versions 1 and 2."""
    data = older(data)
    record = json.loads(data)
    checkpoint = decode(data, url="s3://b/p/.metadata")
    incremental = any(is_reference(key) for key in checkpoint.objects)
    for fqn, entry in checkpoint.entries.items():
        out = record["state_dict"][fqn]
        if isinstance(entry, BytesEntry):
            out["locator"] = _locator(entry.locator)
            continue
        chunks = []
        for chunk in entry.chunks:
            inlined = {
                "offsets": list(chunk.offsets),
                "sizes": list(chunk.sizes),
                "locator": _locator(chunk.locator),
            }
            if chunk.digest is not None:
                inlined["xxh3"] = chunk.digest
                incremental = True
            chunks.append(inlined)
        out["chunks"] = chunks
    del record["items"]
    record["version"] = 2 if incremental else 1
    return _dumps(record)


def columns(record: dict[str, Any]) -> Columns:
    """The item table of ``record`` (the JSON of a record of version 3 or 4) as lists;
    ``digests`` holds 32 hex digits or None per row."""
    rows, dims = record["items"]["rows"], record["items"]["dims"]
    table = item_table.unpack(record["items"], rows, dims, _LIMIT)
    out: Columns = {name: list(getattr(table, name)) for name in _COLUMNS}
    out["digests"] = [table.digest(row) for row in range(rows)]
    return out


def edit_table(record: dict[str, Any], change: Callable[[Columns], None]) -> None:
    """Change the columns of ``record``'s item table in place, packed again (its counts from
    the columns changed, so that they still match them)."""
    edited = columns(record)
    change(edited)
    record["items"] = item_table.pack(
        edited["keys"],
        edited["offsets"],
        edited["lengths"],
        edited["chunk_offsets"],
        edited["chunk_sizes"],
        edited["digests"],
    )


def entries(record: dict[str, Any]) -> Entries:
    """The entries of ``record`` (a version-4 record's JSON) as version 3 wrote them: a JSON
    object each, ``{"type": "tensor", "dtype": ..., "chunks": count}`` or ``{"type":
    "bytes"}``."""
    return _entries(record)[0]


def edit_entries(
    record: dict[str, Any],
    change: Callable[[Entries], None],
    paths: dict[str, entrytable.Path] | None = None,
) -> None:
    """Change ``record``'s entries (a version-4 record's JSON) as `entries` shows them, and
    pack its entry table again, with the paths of the entries still there, or ``paths``; names
    may be any order (the table sorts them)."""
    edited, kept = _entries(record)
    paths = kept if paths is None else paths
    change(edited)
    specs: list[entrytable.Spec] = []
    for name in sorted(edited):
        entry = edited[name]
        if entry["type"] == "bytes":
            specs.append((name, None, 1))
            continue
        fields = [entry[f] for f in ("dtype", "size", "layout", "memory_format")]
        flags = (entry["requires_grad"], entry["pin_memory"])
        specs.append((name, (*fields, *flags), entry["chunks"]))  # type: ignore[arg-type]
    kept = {name: path for name, path in paths.items() if name in edited}
    codes = entrytable.path_codes(kept, sorted(edited)) or {}
    record["entries"] = entrytable.pack(specs, codes)


# The entry table's columns as `entry_columns` names them, in the table's order.
ENTRY_COLUMNS = (
    "lengths",
    "kinds",
    "dtypes",
    "layouts",
    "memory_formats",
    "flags",
    "ndims",
    "chunks",
    "paths",
    "sizes",
    "parts",
)


def entry_columns(record: dict[str, Any]) -> Columns:
    """The entry table of ``record`` (a version-4 record's JSON) as it is stored: its int64
    columns as lists (`ENTRY_COLUMNS`) and ``"text"``, the names' UTF-8 bytes in one list."""
    table = record["entries"]
    n, dims, parts = table["count"], table["dims"], table["parts"]
    size = entrytable.inflated_size(n, dims, parts, table["text"])
    raw = record_columns.inflate(table["deflated"], size, "entries")
    lengths = [n] * 9 + [dims, parts]
    cuts = [0, *itertools.accumulate(8 * length for length in lengths)]
    out: Columns = {
        name: list(record_columns.from_int64s(raw[a:b]))
        for name, a, b in zip(ENTRY_COLUMNS, cuts[:-1], cuts[1:], strict=True)
    }
    out["text"] = [bytes(raw[cuts[-1] :])]
    return out


def edit_entry_columns(record: dict[str, Any], change: Callable[[Columns], None]) -> None:
    """Change the columns of ``record``'s entry table in place, packed again unchecked, with
    the counts the changed columns make."""
    edited = entry_columns(record)
    change(edited)
    (text,) = edited["text"]
    record["entries"].update(
        count=len(edited["lengths"]),
        dims=len(edited["sizes"]),
        parts=len(edited["parts"]),
        text=len(text),
        deflated=record_columns.deflate(
            [*(record_columns.to_int64s(edited[name]) for name in ENTRY_COLUMNS), text]
        ),
    )


def _entries(record: dict[str, Any]) -> tuple[Entries, dict[str, entrytable.Path]]:
    table = entrytable.unpack(record["entries"], _LIMIT)
    out: Entries = {}
    for name, fields, count in table.specs:
        if fields is None:
            out[name] = {"type": "bytes"}
            continue
        dtype, size, layout, memory_format, requires_grad, pin_memory = fields
        out[name] = {
            "type": "tensor",
            "dtype": dtype,
            "size": size,
            "layout": layout,
            "memory_format": memory_format,
            "requires_grad": requires_grad,
            "pin_memory": pin_memory,
            "chunks": count,
        }
    return out, table.paths


def _locator(locator: Any) -> dict[str, Any]:
    return {"key": locator.key, "offset": locator.offset, "length": locator.length}


def _dumps(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
