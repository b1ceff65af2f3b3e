"""The format's own model of a commit record: plain dataclasses and the tables of torch names,
shared by encoding and decoding, with the key and locator checks. No torch.

Listing, describing, verifying and removing checkpoints read records through this model alone,
so the tools never import torch (seconds of start-up); DCP's ``Metadata`` is built from it only
when a load asks for it (`Checkpoint.metadata`, in `torchmeta`).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..frames import FrameTable
from ..jsoncheck import fail, is_count, joined, show
from ..layout import is_reference, referenced_save

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from .torchmeta import Locators

FORMAT = "s3ckpt"
# Version 2 added references to siblings' objects and chunk digests (incremental saves); version 3
# moved every locator, chunk and digest into one compressed table (`table`), version 4 every
# entry and DCP's paths into another (`entrytable`). All are read.
FORMAT_VERSION = 4

TUPLE_TAG = "__tuple__"

# The dtypes a record may name, with their element size in bytes (torch's ``itemsize``; packed
# dtypes count packed elements). Decoding maps names through these tables only: a name from the
# file is never looked up on torch (`tests/unit/format/test_record_model.py` checks the sizes).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
LAYOUTS = (
    "strided",
    "sparse_coo",
    "sparse_csr",
    "sparse_csc",
    "sparse_bsr",
    "sparse_bsc",
    "jagged",
)
# The three formats DCP's own (pickle) metadata can carry.
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")


@dataclass(frozen=True, slots=True)
class Locator:
    """Where one item's bytes are: object key (relative to the checkpoint prefix), offset, length.

    Kept next to each chunk / bytes entry in the record so the reader needs no other index.
    """

    key: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor: where it starts in the tensor, its sizes, its bytes, and
    (from incremental saves) the xxh3-128 digest of those bytes, 32 hex digits."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    locator: Locator
    digest: str | None = None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor as the record describes it; names are keys of the tables above. ``chunks`` is
    a list, or (version 3) a `table.ChunkList` that makes each chunk when it is asked for."""

    dtype: str
    size: list[int]
    layout: str
    memory_format: str
    requires_grad: bool
    pin_memory: bool
    chunks: Sequence[Chunk]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class BytesEntry:
    """A non-tensor value (DCP stores it as a pickle)."""

    locator: Locator


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """DCP's ``StorageMeta``, as plain data."""

    checkpoint_id: str | None
    save_id: str | None
    load_id: str | None
    modules: list[str]


Entry = TensorEntry | BytesEntry


@dataclass(frozen=True)
class Checkpoint:
    """A decoded commit record.

    ``objects`` lists every data object (key relative to the prefix -> size in bytes as stored)
    and ``frames`` how each is framed and checksummed; ``entries`` are the state dict's items.
    ``metadata`` (DCP's ``Metadata``, whose ``storage_data`` is ``locators``) is built, and torch
    imported, on first use: only loads need it.
    """

    save_id: str
    created: float
    objects: dict[str, int]
    extra: dict[str, Any]
    frames: dict[str, FrameTable]
    entries: dict[str, Entry]
    # planner_data's JSON text, read when it is first asked for, or (version 4) DCP's paths
    planner_source: str | dict[str, tuple[str | int, ...]]
    storage_meta: StorageInfo | None
    dcp_version: str | None
    url: str  # of the record, for errors raised when DCP's types are built
    record_size: int = 0  # the record's bytes, as stored
    version: int = FORMAT_VERSION  # the record's format version

    @cached_property
    def planner_data(self) -> Any:
        """DCP's ``planner_data`` (tuples tagged in the JSON are tuples again)."""
        if isinstance(self.planner_source, dict):
            return self.planner_source
        from .decoder import decode_planner_data

        return decode_planner_data(self.planner_source)

    @property
    def metadata(self) -> Metadata:
        return self._dcp[0]

    @property
    def locators(self) -> Locators:
        return self._dcp[1]

    @cached_property
    def _dcp(self) -> tuple[Metadata, Locators]:
        from .torchmeta import to_dcp

        return to_dcp(self)

    @property
    def tensors(self) -> int:
        return sum(isinstance(entry, TensorEntry) for entry in self.entries.values())

    @property
    def logical_bytes(self) -> int:
        """The state's own bytes: every tensor's elements and every non-tensor value."""
        return sum(
            entry.nbytes if isinstance(entry, TensorEntry) else entry.locator.length
            for entry in self.entries.values()
        )

    @property
    def stored_bytes(self) -> int:
        """The bytes of this checkpoint's own data objects as stored (compressed, if they are);
        objects referenced from earlier checkpoints are not counted."""
        return sum(size for key, size in self.objects.items() if not is_reference(key))

    @property
    def referenced_saves(self) -> set[tuple[str, str]]:
        """``(sibling, save_id)`` of every earlier save whose objects this checkpoint uses."""
        return {found for key in self.objects if (found := referenced_save(key)) is not None}

    @property
    def referenced_bytes(self) -> int:
        """The state's bytes that this checkpoint references in earlier ones instead of storing."""
        return sum(
            chunk.locator.length
            for entry in self.entries.values()
            if isinstance(entry, TensorEntry)
            for chunk in entry.chunks
            if is_reference(chunk.locator.key)
        )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """A record for a large model is millions of small acyclic objects; letting the cyclic
    collector rescan them while they are built doubles the time of encode and decode."""
    resume = pause_collector()
    try:
        yield
    finally:
        resume()


def pause_collector() -> Callable[..., None]:
    """Pause the cyclic collector until the call returned is made (with any arguments: it
    serves as a future's done callback), which turns it on again if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()

    def resume(*_: object) -> None:
        if was_enabled:
            gc.enable()

    return resume


def is_valid_key(key: Any) -> bool:
    """Relative object keys only: the reader joins them to the prefix, so no escaping it, except
    to a sibling checkpoint's data object (`layout.reference`), one level up and no further."""
    if not isinstance(key, str) or "\x00" in key:
        return False
    if is_reference(key):
        if referenced_save(key) is None:
            return False
        key = key[3:]
    return all(part not in ("", ".", "..") for part in key.split("/"))


def is_digest(value: Any) -> bool:
    """An xxh3-128 digest as records write it: 32 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 32 and all(c in _HEX for c in value)


_HEX = frozenset("0123456789abcdef")


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
