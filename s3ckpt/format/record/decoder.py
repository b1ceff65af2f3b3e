""":func:`check_record_size` and :func:`decode`: a record read from the bucket is checked field by
field, and as a whole, before anything in it is used."""

from __future__ import annotations

import re
from typing import Any

from ...errors import MetadataError
from ..frames import FrameTable
from ..jsoncheck import (
    Invalid,
    as_count,
    as_dict,
    as_list,
    as_str,
    fail,
    get_field,
    is_count,
    opt_str,
    show,
)
from ..jsonstream import Reader
from ..layout import is_reference
from . import entrytable
from .entries import (
    SMALL_VALUE,
    Pending,
    build_entries,
    check_inline_locators,
    read_state_dict,
    resolve_inline,
    resolve_table,
)
from .entrytable import Path
from .model import (
    FORMAT,
    FORMAT_VERSION,
    TUPLE_TAG,
    Checkpoint,
    Entry,
    StorageInfo,
    gc_paused,
    is_valid_key,
)

# The most text extra, storage_meta or any other top-level field may take, free-form (s3ckpt
# writes some 200 bytes each), and so at most 30 times that in memory.
_FREE_FORM = 1024 * 1024
_FIELDS = ("format", "version", "save_id", "created", "dcp_version", "extra", "storage_meta")
_MISSING = object()
_LAST_VERSION = re.compile(r'"version"\s*:\s*(\d+)\s*}\s*$')
MEMORY_BOUND = 10  # what decoding a record holds, at most, in multiples of its size (`decode`)
MAX_SIZE = 256 << 20  # `S3Config.max_record_size`'s default


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
    entry chunk by chunk), every other value from a slice of at most `SMALL_VALUE` bytes, each
    turned into the model as it is read; ``planner_data`` is checked and kept as its text until
    it is asked for. The densest valid content measured (one-element chunks; objects
    holding one byte each) takes under 8 times its text.

    The item table of versions 3 and 4 (`table`) and the entry table of version 4
    (`entrytable`) are compressed: each one's inflated size, which its counts fix (for the item
    table, the state dict's entries), must be at most ``max_size`` (``S3Config.max_record_size``,
    the bound on the record's own size), checked before any of it is inflated; the bound above
    is then of the record's size plus those inflated sizes (40 bytes a chunk of one dimension,
    56 of two; 72 bytes an entry, plus its name, sizes and path). The densest tables measured,
    300,000 one-element chunks in shuffled order (a tuple each in the checks) and 300,000
    scalars with a path each, took under 6 times that. Version 4's paths are decoded with the
    entries (a tuple each); ``planner_data`` of another shape is kept as its text, as before."""
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
        as_dict(reader.value("", SMALL_VALUE), "commit record")
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
    if version < 4:
        if "entries" in record:
            fail(f"entries: an entry table in a record of version {version}")
        state_dict: dict[str, Entry | Pending] = get_field(record, "state_dict", "")
    elif "state_dict" in record:
        fail("state_dict: a version 4 record keeps its entries in its entry table")
    if version < 3:
        if "items" in record:
            fail("items: an item table in a record of version 1 or 2")
        entries = resolve_inline(state_dict, named)
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
    planner: str | dict[str, Path] | None = record.get("planner_data")

    if version < 3:
        check_inline_locators(entries, frames)
    else:
        names = sorted(objects)
        raw_sizes = [frames[key].raw_size for key in names]
        items = get_field(record, "items", "")
        if version < 4:
            entries = resolve_table(state_dict, items, names, raw_sizes, max_size)
        else:
            table = entrytable.unpack(get_field(record, "entries", ""), max_size)
            entries = build_entries(table.specs, items, names, raw_sizes, max_size)
            if planner is None:  # DCP's paths, kept in the entry table
                planner = table.paths
            elif table.paths:
                fail("entries: paths beside planner_data (a record keeps one or the other)")
    if planner is None:
        planner = get_field(record, "planner_data", "")  # fails: missing

    return Checkpoint(
        save_id=save_id,
        created=float(created),
        objects=objects,
        extra=extra,
        frames=frames,
        entries=entries,
        planner_source=planner,
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
            record[name] = read_state_dict(reader, named)
        elif name == "objects":
            record[name] = _read_objects(reader)
        elif name == "frames":
            record[name] = _read_frames(reader)
        elif name in ("items", "entries"):
            record[name] = (
                reader.value(name, SMALL_VALUE)
                if reader.peek() != "{"
                else {
                    key: reader.value(f"items.{key}", SMALL_VALUE) for key in reader.members(name)
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
        return reader.value("objects", SMALL_VALUE)
    objects: dict[str, Any] = {}
    for key in reader.members("objects", into=objects):
        objects[key] = reader.value(f"objects[{key!r}]", SMALL_VALUE)
    return objects


def _read_frames(reader: Reader) -> Any:
    """``frames``, each table checked and kept packed as it is read (`FrameTable.parse_json`)
    until the objects' sizes are known; a long table's base64 needs no slice of its own."""
    if reader.peek() != "{":
        return reader.value("frames", SMALL_VALUE)
    tables: dict[str, tuple[int, bytes, int | None]] = {}
    for key in reader.members("frames", into=tables):
        where = f"frames[{key!r}]"
        table = (
            reader.value(where, SMALL_VALUE)
            if reader.peek() != "{"
            else {
                name: reader.value(f"{where}[{name!r}]", SMALL_VALUE)
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
        value = _from_json(reader.value(where, SMALL_VALUE), where)
        if keep:
            kept[key] = value
    return kept


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
