"""The entry table of a version-4 record: each entry of the state dict (its name, kind, dtype,
size, layout, memory format, flags and number of chunks) and, where DCP's planner saved one,
its path in the nested state dict, as columns. No torch.

Version 3 kept each entry as a JSON object of some 150 bytes, and decoding one took 25-35 us (a
dict, a dozen field checks, name lookups): loading 20,000 small tensors spent more time on the
record than DCP spends loading them from memory. Here an entry is a row of integers, read by C
loops, and its name a slice of one UTF-8 text. DCP's default planners map each name to its path
(``planner_data``), and the name is the path's parts joined by dots, so a path is stored as the
lengths of its parts within the name (``"optim.state.0.step"``: 5, 5, 1 and 4 characters, the
third a list index), not as some 40 bytes of JSON per entry. Other ``planner_data`` stays JSON,
as in version 3.

The record's ``"entries"`` is ``{"count": N, "dims": D, "parts": P, "text": T, "dtypes": [...],
"layouts": [...], "memory_formats": [...], "deflated": base64}``; the three lists give the names
that the dtype, layout and memory-format columns number. Inflated (`columns`, as the item
table), the table is, in order: nine int64 columns of N values, one row per entry in the order
of the names (each name's length in UTF-8 bytes; its kind, 0 a non-tensor value and 1 a tensor;
dtype, layout and memory format; flags, 1 requires_grad and 2 pin_memory; dimensions; chunks,
the tensor's rows in the item table; path, 0 for none, else 1 + its number of parts), every
column but the first and the last 0 for a non-tensor value; then the tensors' sizes (D values,
tensor by tensor); then the paths' parts (P values, entry by entry: twice the part's length in
characters, plus 1 for a list index); then the names' UTF-8 text (T bytes), sorted, each name
once. N, D, P and T give the inflated size, which is checked against a limit before any of it
is inflated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, count, islice
from operator import ge, not_
from typing import Any

from ..jsoncheck import as_count, as_dict, as_list, fail, get_field, show
from .columns import deflate, from_int64s, has_negative, inflate, to_int64s
from .model import DTYPE_SIZES, LAYOUTS, MEMORY_FORMATS

__all__ = ["EntryTable", "Fields", "Path", "Spec", "pack", "path_codes", "unpack"]

Path = tuple[str | int, ...]
# A tensor entry's fields but its chunks: dtype, size, layout, memory format, requires_grad and
# pin_memory.
Fields = tuple[str, list[int], str, str, bool, bool]
# An entry: its name, a tensor's fields (None for a non-tensor value), and its rows in the item
# table (a tensor's chunks; 1 for a non-tensor value).
Spec = tuple[str, Fields | None, int]

_COLUMNS = 9
_REQUIRES_GRAD, _PIN_MEMORY = 1, 2
_FIELDS = {"count", "dims", "parts", "text", "dtypes", "layouts", "memory_formats", "deflated"}
_NAMES = {"dtypes": DTYPE_SIZES, "layouts": LAYOUTS, "memory_formats": MEMORY_FORMATS}
# The columns that only a tensor may set, for messages.
_TENSOR_COLUMNS = ("dtype", "layout", "memory format", "flag", "dimension", "chunk count")


@dataclass(frozen=True, slots=True)
class EntryTable:
    """The decoded table: every entry, and the paths that stand for ``planner_data``."""

    specs: list[Spec]
    paths: dict[str, Path]


def inflated_size(entries: int, dims: int, parts: int, text: int) -> int:
    return 8 * (_COLUMNS * entries + dims + parts) + text


def pack(specs: Sequence[Spec], paths: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The ``"entries"`` of a record from its entries, sorted by name, and the codes of their
    paths (`path_codes`); values checked by the caller."""
    tables: dict[str, dict[str, int]] = {name: {} for name in _NAMES}
    encoded = [name.encode("utf-8") for name, _, _ in specs]
    rows: list[tuple[int, ...]] = []  # kind, dtype, layout, memory format, flags, ndim, chunks
    sizes: list[int] = []
    for _, fields, chunk_count in specs:
        if fields is None:  # a non-tensor value: zeros
            rows.append((0,) * 7)
            continue
        dtype, size, layout, memory_format, requires_grad, pin_memory = fields
        flags = _REQUIRES_GRAD * requires_grad + _PIN_MEMORY * pin_memory
        numbers = (
            _number(tables["dtypes"], dtype),
            _number(tables["layouts"], layout),
            _number(tables["memory_formats"], memory_format),
        )
        rows.append((1, *numbers, flags, len(size), chunk_count))
        sizes.extend(size)
    codes = [paths.get(name) for name, _, _ in specs]
    parts = [part for c in codes if c is not None for part in c]
    columns = [
        [len(name) for name in encoded],
        *(list(zip(*rows, strict=True)) or [()] * 7),
        [0 if c is None else 1 + len(c) for c in codes],
    ]
    text = b"".join(encoded)
    return {
        "count": len(specs),
        "dims": len(sizes),
        "parts": len(parts),
        "text": len(text),
        **{name: list(table) for name, table in tables.items()},
        "deflated": deflate([*map(to_int64s, columns), to_int64s(sizes), to_int64s(parts), text]),
    }


def _number(table: dict[str, int], name: str) -> int:
    """``name``'s number in ``table``, the next one if it is new."""
    return table.setdefault(name, len(table))


def path_codes(planner_data: Any, names: Sequence[str]) -> dict[str, list[int]] | None:
    """``planner_data`` as the codes of `pack`'s paths, if it has the shape DCP's default
    planners give it: a dict of some of ``names``, each to a tuple of str keys and int list
    indices whose parts, joined by dots, make the name. None for anything else, which the
    record keeps as JSON."""
    if type(planner_data) is not dict or not planner_data.keys() <= set(names):
        return None
    codes: dict[str, list[int]] = {}
    for name, path in planner_data.items():
        if type(path) is not tuple:
            return None
        parts: list[int] = []
        for part in path:
            if type(part) is str:
                parts.append(2 * len(part))
            elif type(part) is int and part >= 0:
                parts.append(2 * len(str(part)) + 1)
            else:
                return None
        if ".".join(map(str, path)) != name:
            return None
        codes[name] = parts
    return codes


def unpack(value: Any, limit: int) -> EntryTable:
    """The table of a record, refused (`Invalid`) if it is not self-consistent or would
    inflate to more than ``limit`` bytes (checked before any of it is inflated). How its
    entries' chunks fit the item table is the caller's to check."""
    table = as_dict(value, "entries")
    if set(table) != _FIELDS:
        fail(f"entries: expected the fields {sorted(_FIELDS)}, got {show(sorted(table))}")
    n, dims, parts, text = (
        as_count(get_field(table, name, "entries"), "entries", name)
        for name in ("count", "dims", "parts", "text")
    )
    dtypes, layouts, formats = (_names(table, name) for name in _NAMES)
    size = inflated_size(n, dims, parts, text)
    if size > limit:
        fail(
            f"entries: the table inflates to {size} bytes, over the {limit} bytes a reader "
            "accepts (S3Config.max_record_size)"
        )
    raw = inflate(table["deflated"], size, "entries")
    ints = size - text
    if has_negative(raw[:ints]):
        fail("entries: the table holds a negative number")
    columns = [from_int64s(raw[8 * n * i : 8 * n * (i + 1)]) for i in range(_COLUMNS)]
    lengths, kinds, dtype_of, layout_of, format_of, flags, ndims, chunks, path_of = columns
    cut = 8 * _COLUMNS * n
    sizes, codes = from_int64s(raw[cut : cut + 8 * dims]), from_int64s(raw[cut + 8 * dims : ints])
    names = _read_names(bytes(raw[ints:]), lengths)
    del raw

    if not set(kinds) <= {0, 1}:
        fail(f"entries: a kind is {max(kinds)}, expected 0 (bytes) or 1 (tensor)")
    others = list(map(not_, kinds))
    for column, what in zip(columns[2:8], _TENSOR_COLUMNS, strict=True):
        if any(compress(column, others)):
            row = next(i for i, v in enumerate(column) if v and not kinds[i])
            fail(f"state_dict[{names[row]!r}]: a non-tensor value with a {what}")
    for column, known, what in (
        (dtype_of, dtypes, "dtype"),
        (layout_of, layouts, "layout"),
        (format_of, formats, "memory format"),
    ):
        _check_index(column, kinds, len(known), names, what)
    if flags and max(flags) > _REQUIRES_GRAD + _PIN_MEMORY:
        fail(f"entries: flags {max(flags)}, expected at most 3 (requires_grad and pin_memory)")
    if sum(ndims) != dims:
        fail(f"entries.dims: {dims}, but the entries' dimensions add up to {sum(ndims)}")
    listed = sum(path_of) - (n - path_of.count(0))
    if listed != parts:
        fail(f"entries.parts: {parts}, but the entries' paths have {listed} parts")

    specs: list[Spec] = []
    at = 0
    for name, kind, dtype, layout, memory_format, flag, ndim, chunk_count in zip(
        names, kinds, dtype_of, layout_of, format_of, flags, ndims, chunks, strict=True
    ):
        if not kind:
            specs.append((name, None, 1))
            continue
        fields = (
            dtypes[dtype],
            sizes[at : at + ndim].tolist(),
            layouts[layout],
            formats[memory_format],
            bool(flag & _REQUIRES_GRAD),
            bool(flag & _PIN_MEMORY),
        )
        specs.append((name, fields, chunk_count))
        at += ndim
    return EntryTable(specs, _paths(names, path_of, codes))


def _names(table: dict[str, Any], field: str) -> list[str]:
    """One of the lists of names the columns number: each a name s3ckpt knows, once."""
    known = _NAMES[field]
    names = as_list(table[field], "entries", field)
    for position, name in enumerate(names):
        if not isinstance(name, str) or name not in known:
            fail(f"entries.{field}[{position}]: unsupported value {show(name)}")
    if len(set(names)) != len(names):
        fail(f"entries.{field}: a name appears twice in {show(names)}")
    return names


def _check_index(
    column: Sequence[int], kinds: Sequence[int], known: int, names: list[str], what: str
) -> None:
    if max(compress(column, kinds), default=-1) >= known:
        row = next(i for i, v in enumerate(column) if kinds[i] and v >= known)
        fail(f"state_dict[{names[row]!r}]: {what} {column[row]} is not listed (of {known})")


def _read_names(text: bytes, lengths: Sequence[int]) -> list[str]:
    """The names, cut from their UTF-8 text by their lengths in bytes, sorted and unique."""
    if sum(lengths) != len(text):
        fail(f"entries: the names' lengths add up to {sum(lengths)}, the text is {len(text)}")
    ends = list(accumulate(lengths))
    starts = [0, *ends[:-1]]
    if text.isascii():  # byte offsets are character offsets: one decode
        whole = text.decode("ascii")
        names = list(map(whole.__getitem__, map(slice, starts, ends)))
    else:
        try:
            names = [text[a:b].decode("utf-8") for a, b in zip(starts, ends, strict=True)]
        except UnicodeDecodeError as e:
            fail(f"entries: a name is not UTF-8 text: {e}")
    unsorted = next(compress(count(1), map(ge, names, islice(names, 1, None))), None)
    if unsorted is not None:
        first, then = names[unsorted - 1], names[unsorted]
        fail(f"entries: names must be sorted and unique, got {show(first)} before {show(then)}")
    return names


def _paths(names: list[str], path_of: Sequence[int], codes: Sequence[int]) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    at = 0
    for name, parts in compress(zip(names, path_of, strict=True), path_of):
        parts -= 1
        if parts == 1 and codes[at] == 2 * len(name):  # a key of the state dict's top level
            paths[name] = (name,)
        else:
            paths[name] = _cut(name, codes[at : at + parts])
        at += parts
    return paths


def _cut(name: str, codes: Sequence[int]) -> Path:
    """The path whose parts, of the lengths ``codes`` give, joined by dots make ``name``."""
    pieces: list[str] = []
    start = indices = 0
    for code in codes:
        end = start + (code >> 1)
        pieces.append(name[start:end])
        start = end + 1
        indices |= code & 1
    # Consecutive slices a character apart, as long as the name: the dots, exactly.
    if (codes and start != len(name) + 1) or ".".join(pieces) != name:
        fail(f"state_dict[{name!r}]: its path's parts ({show(list(codes))}) do not make its name")
    if not indices:
        return tuple(pieces)
    path: list[str | int] = list(pieces)
    for position, code in enumerate(codes):
        if code & 1:
            part = pieces[position]
            if not (part.isascii() and part.isdigit() and (part == "0" or part[0] != "0")):
                fail(f"state_dict[{name!r}]: its path holds {part!r} as a list index")
            path[position] = int(part)
    return tuple(path)
