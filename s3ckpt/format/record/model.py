"""What encoding and decoding share: the format's name and version, the tables of torch names,
the :class:`Locator` and :class:`Checkpoint` types, and the key and locator checks."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..frames import FrameTable
from ..jsoncheck import fail, is_count, joined, show

FORMAT = "s3ckpt"
FORMAT_VERSION = 1

TUPLE_TAG = "__tuple__"

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
DTYPES: dict[str, torch.dtype] = _by_name(
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
LAYOUTS: dict[str, torch.layout] = _by_name(
    ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged"),
    torch.layout,
)
# The three formats DCP's own (pickle) metadata can carry.
MEMORY_FORMATS: dict[str, torch.memory_format] = _by_name(
    ("contiguous_format", "channels_last", "preserve_format"), torch.memory_format
)
DTYPE_NAMES = {value: name for name, value in DTYPES.items()}
LAYOUT_NAMES = {value: name for name, value in LAYOUTS.items()}
MEMORY_FORMAT_NAMES = {value: name for name, value in MEMORY_FORMATS.items()}


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
def gc_paused() -> Iterator[None]:
    """A record for a large model is millions of small acyclic objects; letting the cyclic
    collector rescan them while they are built doubles the time of encode and decode."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def is_valid_key(key: Any) -> bool:
    """Relative object keys only: the reader joins them to the prefix, so no escaping it."""
    return (
        isinstance(key, str)
        and "\x00" not in key
        and all(part not in ("", ".", "..") for part in key.split("/"))
    )


def check_locator(locator: Locator, objects: Mapping[str, int], where: str, name: str = "") -> None:
    """``objects`` holds only validated keys, so being listed there proves the key is sane."""
    size = objects.get(locator.key) if isinstance(locator.key, str) else None
    if size is None:
        if not is_valid_key(locator.key):
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
