"""The item table of a record of version 3 or 4: every item's locator, and every chunk's
offsets, sizes and digest, as columns of integers (`columns`). No torch.

Inline JSON cost 126 bytes and 9.5 us of decoding per chunk; columns of little-endian int64s,
deflated, cost a few bytes (a sharded tensor's sizes and lengths repeat from chunk to chunk,
its offsets step evenly, and the high bytes are zeros), and decoding is C loops over arrays
rather than a Python object per field. No delta coding: it would halve a table that is small
already, and undoing it costs a Python int per value.

The record's ``"items"`` is ``{"rows": R, "dims": D, "digests": bool, "deflated": base64}``.
Rows are the items in the order of the state dict's names, sorted: a tensor's chunks (a row
each, in their order), a non-tensor value (one row). Inflated, the table is, in order: the
rows' object (its position among the record's object keys, sorted), offset and length; the
chunks' offsets, then their sizes (``D`` values each: tensor by tensor, dimension by
dimension, chunk by chunk), each of these five columns int64; then, if
``digests``, one byte per row (1: the row has one) and 16 bytes per row (its xxh3-128 digest;
zeros where it has none). ``R`` and ``D`` follow from the state dict, so the table's inflated
size is known, and checked against a limit, before any of it is inflated.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import add, eq, gt, mul, ne
from typing import Any, overload

from ..jsoncheck import Invalid, as_bool, as_count, as_dict, fail, get_field, show
from .columns import deflate, from_int64s, has_negative, inflate, to_int64s
from .model import Chunk, Locator
from .tiling import check_chunk, check_extent, check_tiling_columns

__all__ = ["ChunkList", "ItemTable", "pack", "unpack"]

_DIGEST = 16
_FIELDS = {"rows", "dims", "digests", "deflated"}
_ZEROS = bytes(_DIGEST)


@dataclass(frozen=True, slots=True)
class ItemTable:
    """The inflated table: ``keys`` index the record's object keys, sorted (`keys_of`)."""

    keys: array[int]
    offsets: array[int]
    lengths: array[int]
    chunk_offsets: array[int]
    chunk_sizes: array[int]
    flags: bytes  # empty when the record has no digests
    digests: bytes

    def digest(self, row: int) -> str | None:
        if not self.flags or not self.flags[row]:
            return None
        return self.digests[row * _DIGEST : (row + 1) * _DIGEST].hex()


def inflated_size(rows: int, dims: int, digests: bool) -> int:
    return 8 * (3 * rows + 2 * dims) + ((1 + _DIGEST) * rows if digests else 0)


def pack(
    keys: list[int],
    offsets: list[int],
    lengths: list[int],
    chunk_offsets: list[int],
    chunk_sizes: list[int],
    digests: list[str | None],
) -> dict[str, Any]:
    """The ``"items"`` of a record from its columns (values checked by the caller)."""
    parts = [to_int64s(c) for c in (keys, offsets, lengths, chunk_offsets, chunk_sizes)]
    has_digests = any(digest is not None for digest in digests)
    if has_digests:
        parts.append(bytes(digest is not None for digest in digests))
        parts.append(b"".join(_ZEROS if d is None else bytes.fromhex(d) for d in digests))
    return {
        "rows": len(keys),
        "dims": len(chunk_offsets),
        "digests": has_digests,
        "deflated": deflate(parts),
    }


def unpack(value: Any, rows: int, dims: int, limit: int) -> ItemTable:
    """The table of a record whose state dict has ``rows`` items and ``dims`` chunk dimensions,
    refused (`Invalid`) if it is not exactly that, or would inflate to more than ``limit``
    bytes: its size is checked before any of it is inflated, and inflating stops there."""
    table = as_dict(value, "items")
    if set(table) != _FIELDS:
        fail(f"items: expected the fields {sorted(_FIELDS)}, got {show(sorted(table))}")
    for name, expected in (("rows", rows), ("dims", dims)):
        found = as_count(get_field(table, name, "items"), "items", name)
        if found != expected:
            fail(f"items.{name}: {found}, but the state dict's entries make {expected}")
    has_digests = as_bool(table["digests"], "items", "digests")
    size = inflated_size(rows, dims, has_digests)
    if size > limit:
        fail(
            f"items: the table inflates to {size} bytes, over the {limit} bytes a reader accepts "
            "(S3Config.max_record_size)"
        )
    raw = inflate(table["deflated"], size, "items")
    cuts = list(accumulate((0, 8 * rows, 8 * rows, 8 * rows, 8 * dims, 8 * dims, rows)))
    if has_negative(raw[: cuts[5]]):
        fail("items: the table holds negative offsets, sizes, lengths or object numbers")
    columns = [from_int64s(raw[cuts[i] : cuts[i + 1]]) for i in range(5)]
    flags, digests = b"", b""
    if has_digests:
        flags, digests = bytes(raw[cuts[5] : cuts[6]]), bytes(raw[cuts[6] :])
        if flags.strip(b"\x00\x01"):
            fail("items: a digest flag is neither 0 nor 1")
    keys, offsets, lengths, chunk_offsets, chunk_sizes = columns
    return ItemTable(keys, offsets, lengths, chunk_offsets, chunk_sizes, flags, digests)


def is_whole(table: ItemTable, row: int, col: int, size: list[int], itemsize: int) -> bool:
    """Whether the tensor's one chunk, at row ``row`` and chunk values ``col`` on, is the whole
    tensor, as an unsharded tensor is stored: what every check of `check_tensor` accepts, in
    three comparisons. False is no verdict."""
    ndim = len(size)
    return (
        table.lengths[row] == math.prod(size) * itemsize
        and table.chunk_sizes[col : col + ndim].tolist() == size
        and not any(table.chunk_offsets[col : col + ndim])
    )


def check_tensor(
    table: ItemTable,
    row: int,
    col: int,
    count: int,
    size: list[int],
    itemsize: int,
    dtype: str,
    where: str,
) -> None:
    """The checks `entries._decode_tensor` makes of inline chunks, on the table's columns:
    rows ``row`` on and chunk values ``col`` on are this tensor's ``count`` chunks."""
    ndim = len(size)
    offsets = [table.chunk_offsets[col + d * count : col + (d + 1) * count] for d in range(ndim)]
    sizes = [table.chunk_sizes[col + d * count : col + (d + 1) * count] for d in range(ndim)]
    lengths = table.lengths[row : row + count]
    if _is_sharded_once(size, offsets, sizes, lengths, itemsize):
        return
    chunks = ChunkTable(offsets, sizes, count)
    for d in range(ndim):
        if count and max(map(add, offsets[d], sizes[d])) > size[d]:
            chunks.first(lambda o, s, _l: check_chunk(o, s, size, ""), lengths, where)
    counts = list(sizes[0]) if ndim else [1] * count
    for d in range(1, ndim):
        counts = list(map(mul, counts, sizes[d]))
    if any(map(ne, lengths, map(mul, counts, repeat(itemsize)))):
        chunks.first(lambda _o, s, n: check_extent(n, s, itemsize, dtype, ""), lengths, where)
    starts = len(set(zip(*offsets, strict=False))) if ndim else min(count, 1)
    if starts != count:
        seen: set[tuple[int, ...]] = set()
        for position, start in enumerate(
            zip(*offsets, strict=False) if ndim else repeat((), count)
        ):
            if start in seen:
                fail(f"{where}.chunks[{position}]: two chunks start at offsets {list(start)}")
            seen.add(start)
    check_tiling_columns(size, offsets, sizes, counts, where)


def _is_sharded_once(
    size: list[int],
    offsets: list[array[int]],
    sizes: list[array[int]],
    lengths: array[int],
    itemsize: int,
) -> bool:
    """Whether the chunks cut the tensor along one dimension only, in order, each holding the
    bytes of its elements, as FSDP's and DTensor's ``Shard(d)`` do: a layout that passes every
    check of `check_tensor`, proved by comparing whole arrays (memcmp) and a few C loops, not
    by a tuple per chunk. False is no verdict: the full checks then run."""
    count = len(lengths)
    if count < 2:
        return False
    cut = -1
    factor = itemsize
    for dim, extent in enumerate(size):
        if offsets[dim] == array("q", [0]) * count and sizes[dim] == array("q", [extent]) * count:
            factor *= extent
        elif cut < 0:
            cut = dim
        else:
            return False
    if cut < 0 or factor == 0:
        return False
    starts, steps = offsets[cut], sizes[cut]
    try:
        ends = array("q", map(add, starts, steps))
        return (
            starts[0] == 0
            and ends[-1] == size[cut]
            and starts[1:] == ends[:-1]
            and 0 not in steps
            and lengths == array("q", map(mul, steps, repeat(factor)))
        )
    except OverflowError:  # past int64: the full checks say what is wrong
        return False


@dataclass(frozen=True, slots=True)
class ChunkTable:
    """One tensor's chunk columns, for the message of the first chunk that fails a check."""

    offsets: list[array[int]]
    sizes: list[array[int]]
    count: int

    def first(self, check: Any, lengths: array[int], where: str) -> None:
        rows = zip(self._tuples(self.offsets), self._tuples(self.sizes), lengths, strict=False)
        for position, (offsets, sizes, length) in enumerate(rows):
            try:
                check(offsets, sizes, length)
            except Invalid as e:
                fail(f"{where}.chunks[{position}]{e}")

    def _tuples(self, columns: list[array[int]]) -> Iterator[tuple[int, ...]]:
        return zip(*columns, strict=False) if columns else repeat((), self.count)


def check_locators(table: ItemTable, names: list[str], raw_sizes: list[int], where: Any) -> None:
    """Every row names one of the objects (``names``, sorted, of ``raw_sizes`` raw bytes) and
    lies inside its raw bytes, and every object holds a row; ``where(row)`` names a row's
    item, for the message."""
    keys, offsets, lengths = table.keys, table.offsets, table.lengths
    if keys and max(keys) >= len(names):
        row = next(i for i, key in enumerate(keys) if key >= len(names))
        fail(f"{where(row)}.locator: object {keys[row]} is not listed (of {len(names)})")
    ends = map(add, offsets, lengths)
    if any(map(gt, ends, map(raw_sizes.__getitem__, keys))):
        for row, (key, offset, length) in enumerate(zip(keys, offsets, lengths, strict=True)):
            if offset + length > raw_sizes[key]:
                fail(
                    f"{where(row)}.locator: bytes {offset}..{offset + length} lie outside "
                    f"object {names[key]!r} of {raw_sizes[key]} bytes"
                )
    if len(set(keys)) != len(names):
        unnamed = min(set(range(len(names))) - set(keys))
        fail(f"objects: {names[unnamed]!r} holds none of the state dict's items")


class ChunkList(Sequence[Chunk]):
    """A tensor's chunks in a version-3 record, made from the table as they are asked for:
    decoding makes no object per chunk, and what a tool never looks at costs no memory."""

    __slots__ = ("_col", "_count", "_names", "_ndim", "_row", "_table")

    def __init__(
        self, table: ItemTable, names: list[str], row: int, col: int, count: int, ndim: int
    ) -> None:
        self._table, self._names = table, names
        self._row, self._col, self._count, self._ndim = row, col, count, ndim

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Chunk: ...
    @overload
    def __getitem__(self, index: slice) -> list[Chunk]: ...
    def __getitem__(self, index: int | slice) -> Chunk | list[Chunk]:
        if isinstance(index, slice):
            return list(self)[index]
        position = range(self._count)[index]  # IndexError as a list raises it
        # One chunk read straight from the columns: a load looks up each chunk it reads here,
        # where slicing every column (`_fields`) cost more than the rest of the lookup.
        table, count, at, row = self._table, self._count, self._col + position, self._row + position
        end = at + self._ndim * count  # the chunk's values, ``count`` apart: an extended slice
        return Chunk(
            tuple(table.chunk_offsets[at:end:count]),
            tuple(table.chunk_sizes[at:end:count]),
            Locator(self._names[table.keys[row]], table.offsets[row], table.lengths[row]),
            table.digest(row) if table.flags else None,
        )

    def __iter__(self) -> Iterator[Chunk]:
        return self._chunks(0, self._count)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._count and all(map(eq, self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkList({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)

    def geometry(self) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each chunk's offsets and sizes, without a `Chunk` or `Locator` (what DCP's types
        need)."""
        if self._count == 1:  # an unsharded tensor's: its values side by side in the columns
            at, table = self._col, self._table
            end = at + self._ndim
            return iter(((tuple(table.chunk_offsets[at:end]), tuple(table.chunk_sizes[at:end])),))
        offsets, sizes, _, _ = self._fields(0, self._count)
        return zip(offsets, sizes, strict=False)

    def _chunks(self, start: int, stop: int) -> Iterator[Chunk]:
        return map(Chunk, *self._fields(start, stop))

    def _fields(self, start: int, stop: int) -> tuple[Iterator[Any], ...]:
        """Chunks ``start`` to ``stop``: iterators of their offsets, sizes, locators, digests."""
        table, count, row = self._table, self._count, self._row + start
        n = stop - start

        def columns(values: array[int]) -> Iterator[tuple[int, ...]]:
            at = self._col + start
            if not self._ndim:
                return repeat((), n)
            return zip(
                *(values[at + d * count : at + d * count + n] for d in range(self._ndim)),
                strict=False,
            )

        locators = map(
            Locator,
            map(self._names.__getitem__, table.keys[row : row + n]),
            table.offsets[row : row + n],
            table.lengths[row : row + n],
        )
        digests = map(table.digest, range(row, row + n)) if table.flags else repeat(None, n)
        return columns(table.chunk_offsets), columns(table.chunk_sizes), locators, digests
