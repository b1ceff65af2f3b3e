"""Commit records in the shapes of earlier format versions, and the item table of version 3
opened for editing: what tests craft hostile or old records from.

`inline` writes a version-3 record as s3ckpt wrote it before version 3 (locators, chunks and
digests inline; version 2 if it has digests or references, else 1), so every check of the old
shape stays tested and old records keep loading. `edit_table` hands a test the table's columns
as lists to change, and packs them again, as a hostile writer would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from s3ckpt.format.layout import is_reference
from s3ckpt.format.record import decode
from s3ckpt.format.record import table as item_table
from s3ckpt.format.record.model import BytesEntry

Columns = dict[str, list[Any]]
_COLUMNS = ("keys", "offsets", "lengths", "chunk_offsets", "chunk_sizes")


def inline(data: bytes) -> bytes:
    """``data`` (a version-3 record) in the inline shape of versions 1 and 2."""
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
    """The item table of ``record`` (a version-3 record's JSON) as lists; ``digests`` holds
    32 hex digits or None per row."""
    rows, dims = record["items"]["rows"], record["items"]["dims"]
    table = item_table.unpack(record["items"], rows, dims, 1 << 40)
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


def _locator(locator: Any) -> dict[str, Any]:
    return {"key": locator.key, "offset": locator.offset, "length": locator.length}


def _dumps(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
