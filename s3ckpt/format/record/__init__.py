"""The commit record ``.metadata``: DCP's ``Metadata`` plus where every item's bytes are, as JSON.

It is JSON, never pickle, because loading a checkpoint from a bucket you do not fully trust must not
run code. Writing this one object is what commits a checkpoint, so :func:`encode` refuses anything
inconsistent (a chunk without a locator, a locator outside its object) rather than commit a record
that cannot be loaded, and :func:`decode` checks every field so a truncated, garbled or hostile file
ends in one clear :class:`~s3ckpt.errors.MetadataError` instead of a ``KeyError`` deep inside DCP.
Both also check the record as a whole, since one that is legal field by field can still load wrong
data with every checksum passing: a chunk's locator holds exactly its elements' bytes, the chunks of
a tensor cover it exactly once, and every frame table fits its object.

:func:`decode` returns the format's own model (`model`: plain dataclasses, no torch), which is all
that listing, describing, verifying and removing need; DCP's ``Metadata`` is built from it when a
load asks (`Checkpoint.metadata`, `torchmeta`). :func:`encode` takes DCP's types, so it and torch
are imported only when it is first used (PEP 562).

Layout (the file is compact UTF-8 with sorted keys; spaced out here for reading)::

    {"format": "s3ckpt", "version": 4, "save_id": "...", "created": 1700000000.5,
     "dcp_version": "1.0.0", "objects": {"data/0.bin": 4096}, "extra": {...},
     "storage_meta": {"checkpoint_id": ..., "save_id": ..., "load_id": ..., "modules": []},
     "entries": {"count": 2, "dims": 2, "parts": 3, "text": 11, "dtypes": ["bfloat16"],
                 "layouts": ["strided"], "memory_formats": ["contiguous_format"],
                 "deflated": "eJxjYGBgYGBgYGBgYAA..."},
     "items": {"rows": 2, "dims": 2, "digests": false, "deflated": "eJxjYGBgYGBgYGBgYAA..."}}

``entries`` (`entrytable`) holds the state dict's entries in the order of their names: each
name, whether it is a tensor or another value, a tensor's dtype, size, layout, memory format,
``requires_grad`` and ``pin_memory`` and number of chunks, and the entry's path in the nested
state dict that DCP's default planners keep in ``planner_data`` (``"model.w"``: ``("model",
"w")``), stored as the lengths of the name's parts. ``items`` (`table`) holds, for every item in
the same order, where its bytes are (object, offset, length) and, for a tensor's chunks, their
offsets, sizes and digests. Both are integer columns, deflated, so that an entry or a chunk
costs a few bytes instead of a JSON object of some 150 and 126, and decoding is C loops over
arrays. ``planner_data`` that is not DCP's default paths is kept as JSON, in a field of that
name, as version 3 kept all of it: plain JSON except that a Python tuple is written as
``{"__tuple__": [...]}``, so that tuples come back as tuples, exactly.

Incremental saves need two things. A chunk may carry the xxh3-128 digest of its bytes, which
the next save compares. And a key in ``objects``, ``frames`` and the locators may reference a
sibling checkpoint's data object, ``../<sibling>/data-<save_id>/<name>`` (`layout.reference`),
listed with its size and frame table like the record's own objects, so that the record loads
alone. Earlier versions are read as they were written: version 3 kept each entry as a JSON
object in ``"state_dict"`` (``"model.w": {"type": "tensor", "dtype": "bfloat16", "size": [4,
3], "layout": "strided", "memory_format": "contiguous_format", "requires_grad": false,
"pin_memory": false, "chunks": 1}``, ``"step": {"type": "bytes"}``) and all of
``planner_data`` as JSON; version 1 kept each chunk inline too (``"chunks": [{"offsets": [0,
0], "sizes": [4, 3], "locator": {"key": "data/0.bin", "offset": 0, "length": 24}}]``, a bytes
entry its ``"locator"``), and version 2 added digests (``"xxh3"``: 32 hex digits) and
references to that shape. An s3ckpt older than a record's version refuses it as "written by a
newer s3ckpt" (and so never removes a checkpoint whose objects later ones may reference).

``extra`` is free-form; `S3Writer` records there what the tools show and the rest of the record
does not say: ``world_size``, ``compression`` (``"zstd"`` or null), ``compression_level`` and
``shuffle`` (null when uncompressed), ``s3ckpt_version`` and ``torch_version``. Records written
before these were recorded lack them; readers must treat each as optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .decoder import check_record_size, decode
from .model import (
    FORMAT,
    FORMAT_VERSION,
    BytesEntry,
    Checkpoint,
    Chunk,
    Locator,
    StorageInfo,
    TensorEntry,
)

if TYPE_CHECKING:
    from .encoder import encode
    from .torchmeta import Locators

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "BytesEntry",
    "Checkpoint",
    "Chunk",
    "Locator",
    "Locators",
    "StorageInfo",
    "TensorEntry",
    "check_record_size",
    "decode",
    "encode",
]


def __getattr__(name: str) -> Any:
    """`encode` and `Locators` (and with them torch) are imported when first asked for."""
    if name not in ("encode", "Locators"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import encoder, torchmeta

    found = encoder.encode if name == "encode" else torchmeta.Locators
    globals()[name] = found
    return found
