"""The item table (versions 3 and 4) and the entry table (version 4): random records round-trip
exactly (and load alike in the shapes of versions 1 to 3), and tables that a hostile writer
could make are refused.

No hypothesis here: seeded generators draw the shapes, dtypes, chunkings (grids, shuffled or
in order, with empty chunks), bytes items, digests and references to a sibling's objects, so a
failure names its seed.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import pickle
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from s3ckpt.errors import MetadataError
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.jsoncheck import Invalid
from s3ckpt.format.record import Chunk, Locator, TensorEntry, decode, encode, entrytable
from s3ckpt.format.record import table as table_module
from s3ckpt.format.record.table import ChunkList, check_tensor, is_whole, pack, unpack
from s3ckpt.format.record.torchmeta import DTYPES
from tests.recordshapes import (
    Columns,
    Entries,
    columns,
    edit_entries,
    edit_entry_columns,
    edit_table,
    entries,
    entry_columns,
    inline,
    older,
)

URL = "s3://bucket/run/step-2/.metadata"
SIBLING = "../step-1/data-0123456789abcdef01234567"
SEEDS = range(40)


@dataclass
class Drawn:
    metadata: Metadata
    locators: dict[MetadataIndex, Locator]
    digests: dict[MetadataIndex, str]
    objects: dict[str, int]
    chunks: dict[str, list[Chunk]]  # what each tensor's chunks must decode to

    def encode(self) -> bytes:
        frames = {k: FrameTable.raw(4096, [7] * -(-n // 4096), n) for k, n in self.objects.items()}
        return encode(
            self.metadata,
            self.locators,
            save_id="s",
            created=1.7e9,
            objects=self.objects,
            frames=frames,
            digests=self.digests,
        )


def _cuts(rng: random.Random, extent: int) -> list[tuple[int, int]]:
    """A dimension cut into consecutive (start, length) pieces; an empty one now and then."""
    points = sorted(rng.sample(range(1, extent), rng.randint(0, min(3, max(extent - 1, 0)))))
    edges = [0, *points, extent] if extent else [0, 0]
    pieces = [(a, b - a) for a, b in itertools.pairwise(edges)]
    if extent and rng.random() < 0.1:
        pieces.append((extent, 0))  # an empty chunk at the end
    return pieces


def draw(seed: int) -> Drawn:
    rng = random.Random(seed)
    incremental = rng.random() < 0.5
    names = [f"data-abc/{i:05d}-000" for i in range(rng.randint(1, 4))]
    if incremental:
        names += [f"{SIBLING}/{i:05d}-000" for i in range(rng.randint(1, 2))]
    ends = dict.fromkeys(names, 0)
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    locators: dict[MetadataIndex, Locator] = {}
    digests: dict[MetadataIndex, str] = {}
    chunks: dict[str, list[Chunk]] = {}

    def place(length: int) -> Locator:
        key = rng.choice(names)
        ends[key] += rng.choice((0, 0, 3, 64))  # gaps, as alignment leaves them
        locator = Locator(key, ends[key], length)
        ends[key] += length
        return locator

    paths: dict[str, tuple[str | int, ...]] = {}
    for n in range(rng.randint(1, 10)):
        path = _path(rng, n)
        fqn = ".".join(map(str, path))
        if rng.random() < 0.8:
            paths[fqn] = path
        if rng.random() < 0.25:
            state[fqn] = BytesStorageMetadata()
            locators[MetadataIndex(fqn)] = place(rng.randint(0, 40))
            continue
        _, dtype = rng.choice(sorted(DTYPES.items()))
        size = [rng.randint(0, 7) for _ in range(rng.randint(0, 4))]
        grid: list[list[tuple[int, int]]] = [[]]
        for extent in size:
            grid = [[*cell, piece] for cell in grid for piece in _cuts(rng, extent)]
        if rng.random() < 0.5:
            rng.shuffle(grid)
        stored: list[Chunk] = []
        for cell in grid:
            offsets, sizes = tuple(c[0] for c in cell), tuple(c[1] for c in cell)
            numel = 1
            for s in sizes:
                numel *= s
            index = MetadataIndex(fqn, offsets)
            locators[index] = place(numel * dtype.itemsize)
            digest = None
            if incremental and rng.random() < 0.8:
                digest = digests[index] = f"{rng.getrandbits(128):032x}"
            stored.append(Chunk(offsets, sizes, locators[index], digest))
        chunks[fqn] = stored
        props = TensorProperties(dtype=dtype, requires_grad=rng.random() < 0.5)
        state[fqn] = TensorStorageMetadata(
            props,
            torch.Size(size),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in stored],
        )
    used = {locator.key for locator in locators.values()}
    objects = {key: end + rng.choice((0, 5)) for key, end in ends.items() if key in used}
    planner_data: Any = paths
    if rng.random() < 0.2:  # not DCP's default planner's: kept as JSON
        planner_data = rng.choice([None, {"custom": [1, (2, "x")]}, {**paths, "gone": ("gone",)}])
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data)
    return Drawn(metadata, locators, digests, objects, chunks)


def _path(rng: random.Random, n: int) -> tuple[str | int, ...]:
    """A path of keys and list indices, as DCP flattens a nested state dict: dots and other
    scripts inside keys too, and keys that look like list indices."""
    keys = ["m", "optim", "é", "a.b", "", "0", "07", "state", "名"]
    parts: list[str | int] = [rng.choice(keys) for _ in range(rng.randint(0, 3))]
    parts += [rng.randrange(12) for _ in range(rng.randint(0, 1))]
    rng.shuffle(parts)
    return (*parts, f"{rng.choice('abcxyz')}{n}")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_records_round_trip(seed: int) -> None:
    drawn = draw(seed)
    data = drawn.encode()
    checkpoint = decode(data, url=URL)
    assert checkpoint.version == 4 and checkpoint.record_size == len(data)
    assert checkpoint.objects == drawn.objects
    for fqn, expected in drawn.chunks.items():
        entry = checkpoint.entries[fqn]
        assert isinstance(entry, TensorEntry)
        assert list(entry.chunks) == expected, seed
        assert entry.chunks == expected
        # One chunk by position is read straight from the columns, apart from the iteration.
        assert [entry.chunks[i] for i in range(len(expected))] == expected, seed
        assert entry.chunks[-1] == expected[-1]
    assert checkpoint.locators == drawn.locators
    assert checkpoint.metadata.state_dict_metadata == drawn.metadata.state_dict_metadata
    assert checkpoint.planner_data == drawn.metadata.planner_data
    assert isinstance(checkpoint.planner_source, str) == ("planner_data" in json.loads(data))
    assert list(checkpoint.entries) == sorted(drawn.metadata.state_dict_metadata)
    # The same record as s3ckpt wrote it before version 4, and before version 3, loads to the
    # same checkpoint.
    three = decode(older(data), url=URL)
    assert three.version == 3 and three.entries == checkpoint.entries
    assert three.planner_data == checkpoint.planner_data
    old = decode(inline(data), url=URL)
    assert old.version == (2 if drawn.digests or checkpoint.referenced_saves else 1)
    assert old.entries == checkpoint.entries and old.locators == checkpoint.locators
    assert encode_again(checkpoint, drawn) == data  # deterministic


def encode_again(checkpoint: Any, drawn: Drawn) -> bytes:
    """The decoded record encoded again, from DCP's types as a load hands them on."""
    again = Drawn(
        checkpoint.metadata, checkpoint.locators, drawn.digests, checkpoint.objects, drawn.chunks
    )
    return again.encode()


def test_chunk_lists_behave_as_lists() -> None:
    drawn = next(d for d in map(draw, SEEDS) if any(len(c) > 3 for c in drawn_chunks(d)))
    checkpoint = decode(drawn.encode(), url=URL)
    fqn, expected = next((f, c) for f, c in drawn.chunks.items() if len(c) > 3)
    entry = checkpoint.entries[fqn]
    assert isinstance(entry, TensorEntry) and isinstance(entry.chunks, ChunkList)
    chunks = entry.chunks
    assert len(chunks) == len(expected)
    assert chunks[0] == expected[0] and chunks[-1] == expected[-1]
    assert chunks[1:3] == expected[1:3]
    with pytest.raises(IndexError):
        chunks[len(expected)]
    assert chunks != expected[:-1] and chunks != "not chunks"
    assert pickle.loads(pickle.dumps(entry)) == entry
    assert repr(chunks).startswith("ChunkList([Chunk(")


def drawn_chunks(drawn: Drawn) -> list[list[Chunk]]:
    return list(drawn.chunks.values())


# ----------------------------------------------------------------------------- hostile tables


def _tensor_rows(record: dict[str, Any]) -> list[int]:
    rows, at = [], 0
    state_dict = entries(record)
    for fqn in sorted(state_dict):
        entry = state_dict[fqn]
        count = entry["chunks"] if entry["type"] == "tensor" else 1
        if entry["type"] == "tensor":
            rows += range(at, at + count)
        at += count
    return rows


def _hostile(seed: int) -> tuple[str, Callable[[dict[str, Any]], None]]:
    """One change that no valid record has, drawn with ``seed``."""
    rng = random.Random(seed)

    def length(record: dict[str, Any]) -> None:
        row = rng.choice(_tensor_rows(record))
        edit_table(record, lambda t: t["lengths"].__setitem__(row, t["lengths"][row] + 1))

    def key(record: dict[str, Any]) -> None:
        row = rng.randrange(record["items"]["rows"])
        edit_table(record, lambda t: t["keys"].__setitem__(row, len(record["objects"])))

    def past_end(record: dict[str, Any]) -> None:
        row = rng.randrange(record["items"]["rows"])
        size = sorted(record["objects"].items())[columns(record)["keys"][row]][1]
        edit_table(record, lambda t: t["offsets"].__setitem__(row, size + 1))

    def outside(record: dict[str, Any]) -> None:
        if not record["items"]["dims"]:  # scalars only
            length(record)
            return
        spot = rng.randrange(record["items"]["dims"])
        edit_table(record, lambda t: t["chunk_offsets"].__setitem__(spot, 10**6))

    def negative(record: dict[str, Any]) -> None:
        name = rng.choice(["keys", "offsets", "lengths"])
        edit_table(record, lambda t: t[name].__setitem__(0, -1))

    def truncated(record: dict[str, Any]) -> None:
        deflated = base64.b64decode(record["items"]["deflated"])
        cut = deflated[: rng.randrange(len(deflated))]
        record["items"]["deflated"] = base64.b64encode(cut).decode()

    def garbled(record: dict[str, Any]) -> None:
        raw = zlib.decompress(base64.b64decode(record["items"]["deflated"]))
        spare = zlib.compress(raw + b"\0" * rng.choice((1, 8)))
        record["items"]["deflated"] = base64.b64encode(spare).decode()

    def miscounted(record: dict[str, Any]) -> None:
        name = rng.choice(["rows", "dims"])
        record["items"][name] += rng.choice((-1, 1)) if record["items"][name] else 1

    def shuffled(record: dict[str, Any]) -> None:
        """Two tensors' entries swap their chunk counts (the table stays): rows misassigned."""
        state = entries(record)
        tensors = [name for name, e in state.items() if e["type"] == "tensor"]
        counts = [state[name]["chunks"] for name in tensors]
        if len(set(counts)) < 2:
            miscounted(record)
            return
        a, b = rng.sample(range(len(tensors)), 2)
        while counts[a] == counts[b]:
            a, b = rng.sample(range(len(tensors)), 2)

        def swap(edited: Entries) -> None:
            edited[tensors[a]]["chunks"], edited[tensors[b]]["chunks"] = counts[b], counts[a]

        edit_entries(record, swap)

    changes = [length, key, past_end, outside, negative, truncated, garbled, miscounted, shuffled]
    change = changes[seed % len(changes)]
    return change.__name__, change


def _valid_with_tensors(seed: int) -> Drawn:
    for n in range(100):
        drawn = draw(seed * 100 + n)
        if drawn.chunks and any(drawn.chunks.values()) and sum(map(len, drawn.chunks.values())):
            return drawn
    raise AssertionError("no record with a chunk drawn")


@pytest.mark.parametrize("seed", range(90))
def test_hostile_tables_are_refused(seed: int) -> None:
    record = json.loads(_valid_with_tensors(seed).encode())
    name, change = _hostile(seed)
    change(record)
    with pytest.raises(MetadataError) as caught:
        decode(json.dumps(record).encode(), url=URL)
    assert URL in str(caught.value), name


def _version_2_with_items(record: dict[str, Any]) -> None:
    """``record`` in version 3's shape, then called version 2."""
    three = json.loads(older(json.dumps(record).encode()))
    record.clear()
    record.update(three, version=2)


def _saved() -> dict[str, Any]:
    record: dict[str, Any] = json.loads(_valid_with_tensors(7).encode())
    return record


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda r: r.pop("items"), "missing field 'items'"),
        (lambda r: r["items"].update(extra=1), "items: expected the fields"),
        (lambda r: r["items"].update(deflated="not base64!"), "items.deflated: not base64"),
        (
            lambda r: r["items"].update(deflated=base64.b64encode(b"garbage").decode()),
            "items.deflated: does not inflate",
        ),
        (lambda r: r["items"].update(rows=True), "items.rows: expected a non-negative int"),
        (lambda r: r["items"].update(digests=1), "items.digests: expected true or false"),
        (_version_2_with_items, "an item table in a record of version 1 or 2"),
        (lambda r: r.update(items=[]), "items: expected a JSON object"),
        (
            lambda r: (
                edit_table(r, lambda t: t["digests"].__setitem__(0, "ab" * 16))
                or r["items"].update(
                    deflated=_flag(r["items"]["deflated"], r["items"]["rows"], r["items"]["dims"])
                )
            ),
            "a digest flag is neither 0 nor 1",
        ),
    ],
    ids=[
        "no-items",
        "unknown-field",
        "not-base64",
        "not-deflate",
        "rows-bool",
        "digests-int",
        "items-in-version-2",
        "items-list",
        "digest-flag",
    ],
)
def test_the_table_itself_is_checked(change: Callable[[dict[str, Any]], None], cause: str) -> None:
    record = _saved()
    change(record)
    with pytest.raises(MetadataError, match=cause):
        decode(json.dumps(record).encode(), url=URL)


def _flag(deflated: str, rows: int, dims: int) -> str:
    """The table with its first digest flag 2."""
    raw = bytearray(zlib.decompress(base64.b64decode(deflated)))
    raw[8 * (3 * rows + 2 * dims)] = 2
    return base64.b64encode(zlib.compress(bytes(raw))).decode()


def test_a_version_3_record_keeps_no_item_inline() -> None:
    record = json.loads(older(json.dumps(_saved()).encode()))
    inline_record = json.loads(inline(json.dumps(record).encode()))
    fqn = next(f for f, e in record["state_dict"].items() if e["type"] == "tensor")
    record["state_dict"][fqn] = inline_record["state_dict"][fqn]
    with pytest.raises(MetadataError, match="inline, but a version 3 record keeps them"):
        decode(json.dumps(record).encode(), url=URL)


def test_the_inflated_size_is_bounded_by_max_size() -> None:
    data = draw(3).encode()
    record = json.loads(data)
    rows, dims = record["items"]["rows"], record["items"]["dims"]
    size = 8 * (3 * rows + 2 * dims) + (17 * rows if record["items"]["digests"] else 0)
    assert decode(data, url=URL, max_size=size).entries
    with pytest.raises(MetadataError, match=f"inflates to {size} bytes, over the {size - 1}"):
        decode(data, url=URL, max_size=size - 1)


def test_unused_columns_edit_round_trip() -> None:
    """`recordshapes.edit_table` with no change packs the same table: the hostile tests above
    change only what they say."""
    record = _saved()
    before: Columns = columns(record)
    edit_table(record, lambda table: None)
    assert columns(record) == before


@pytest.mark.parametrize("seed", range(200))
def test_the_whole_array_proof_agrees_with_the_full_checks(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layouts near a ``Shard(d)`` one (cut along one dimension, in order), then perturbed by
    one value or a swap: the fast proof accepts exactly what the full checks accept."""
    rng = random.Random(seed)
    size = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
    cut = rng.randrange(len(size))
    pieces = _cuts(rng, size[cut])
    offsets = [[0] * len(pieces) for _ in size]
    sizes = [[extent] * len(pieces) for extent in size]
    offsets[cut], sizes[cut] = [p[0] for p in pieces], [p[1] for p in pieces]
    per_row = 4
    for s in (s for d, s in enumerate(size) if d != cut):
        per_row *= s
    lengths = [per_row * p[1] for p in pieces]
    column = rng.choice(["offsets", "sizes", "lengths", "swap", "none"])
    at = rng.randrange(len(pieces))
    if column == "lengths":
        lengths[at] += rng.choice((-1, 1, per_row))
    elif column == "swap" and len(pieces) > 1:
        other = (at + 1) % len(pieces)
        for values in [*offsets, *sizes, lengths]:
            values[at], values[other] = values[other], values[at]
    elif column in ("offsets", "sizes"):
        values = (offsets if column == "offsets" else sizes)[rng.randrange(len(size))]
        values[at] = max(0, values[at] + rng.choice((-1, 1)))
    flat = [v for values in offsets for v in values], [v for values in sizes for v in values]
    packed = pack(list(range(len(pieces))), [0] * len(pieces), lengths, *flat, [None] * len(pieces))
    items = unpack(packed, len(pieces), len(flat[0]), 1 << 30)

    def verdict() -> str | None:
        try:
            check_tensor(items, 0, 0, len(pieces), size, 4, "float32", "t")
        except Invalid as e:
            return str(e)
        return None

    fast = verdict()
    monkeypatch.setattr(table_module, "_is_sharded_once", lambda *_: False)
    assert (fast is None) == (verdict() is None), (seed, column, fast)


@pytest.mark.parametrize("seed", range(100))
def test_a_whole_chunk_is_proved_only_where_the_full_checks_agree(seed: int) -> None:
    """`is_whole`, the three comparisons that stand for every check of an unsharded tensor,
    accepts a chunk only if `check_tensor` does: the chunk's offsets, sizes and length, each
    perturbed now and then."""
    rng = random.Random(seed)
    size = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
    offsets, sizes = [0] * len(size), list(size)
    length = 4 * math.prod(size)
    if size and rng.random() < 0.3:
        offsets[rng.randrange(len(size))] = rng.choice((1, 2))
    if size and rng.random() < 0.3:
        dim = rng.randrange(len(size))
        sizes[dim] = max(0, sizes[dim] + rng.choice((-1, 1)))
    if rng.random() < 0.3:
        length = max(0, length + rng.choice((-4, 4)))
    items = unpack(pack([0], [0], [length], offsets, sizes, [None]), 1, len(size), 1 << 30)
    try:
        check_tensor(items, 0, 0, 1, size, 4, "float32", "t")
        valid = True
    except Invalid:
        valid = False
    assert not is_whole(items, 0, 0, size, 4) or valid, seed
    exact = offsets == [0] * len(size) and sizes == size and length == 4 * math.prod(size)
    assert is_whole(items, 0, 0, size, 4) == exact


# ----------------------------------------------------------------------------- the entry table

_PATHS: dict[str, tuple[str | int, ...]] = {"a.0.w": ("a", 0, "w"), "b": ("b",), "c": ("c",)}


def _known() -> dict[str, Any]:
    """The JSON of a record of a float32 [2, 3] ``a.0.w`` (path ``("a", 0, "w")``), a value
    ``b`` and a float64 [4] ``c`` that requires grad."""
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
        "a.0.w": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([2, 3]),
            [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))],
        ),
        "b": BytesStorageMetadata(),
        "c": TensorStorageMetadata(
            TensorProperties(dtype=torch.float64, requires_grad=True),
            torch.Size([4]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
        ),
    }
    locators = {
        MetadataIndex("a.0.w", [0, 0]): Locator("d/0", 0, 24),
        MetadataIndex("b"): Locator("d/0", 24, 5),
        MetadataIndex("c", [0]): Locator("d/0", 32, 32),
    }
    data = encode(
        Metadata(state, planner_data=dict(_PATHS)),
        locators,
        save_id="s",
        created=1.0,
        objects={"d/0": 64},
        frames={"d/0": FrameTable.raw(4096, [7], 64)},
    )
    record: dict[str, Any] = json.loads(data)
    return record


def test_the_entry_table_holds_what_its_docstring_says() -> None:
    record = _known()
    stored = entry_columns(record)
    assert stored["lengths"] == [5, 1, 1] and stored["text"] == [b"a.0.wbc"]
    assert stored["kinds"] == [1, 0, 1] and stored["flags"] == [0, 0, 1]
    assert stored["dtypes"] == [0, 0, 1] and record["entries"]["dtypes"] == ["float32", "float64"]
    assert stored["ndims"] == [2, 0, 1] and stored["sizes"] == [2, 3, 4]
    assert stored["chunks"] == [1, 0, 1]
    # Paths: "a" (2 x 1 character), the list index 0 (2 x 1 + 1), "w"; "b"; "c".
    assert stored["paths"] == [4, 2, 2] and stored["parts"] == [2, 3, 2, 2, 2]
    assert "planner_data" not in record
    checkpoint = decode(json.dumps(record).encode(), url=URL)
    assert checkpoint.planner_data == _PATHS and list(checkpoint.entries) == ["a.0.w", "b", "c"]
    again = json.loads(json.dumps(record))
    edit_entry_columns(again, lambda columns: None)
    assert again == record  # the editor changes only what a test changes


def _set(column: str, row: int, value: int) -> Callable[[Columns], None]:
    return lambda columns: columns[column].__setitem__(row, value)


def _text(text: bytes) -> Callable[[Columns], None]:
    """The names' text replaced, their lengths kept."""
    return lambda columns: columns.__setitem__("text", [text])


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (_set("kinds", 1, 2), "a kind is 2, expected 0 (bytes) or 1 (tensor)"),
        (_set("ndims", 1, 1), "state_dict['b']: a non-tensor value with a dimension"),
        (_set("dtypes", 1, 1), "state_dict['b']: a non-tensor value with a dtype"),
        (_set("dtypes", 2, 5), "state_dict['c']: dtype 5 is not listed (of 2)"),
        (_set("layouts", 0, 1), "state_dict['a.0.w']: layout 1 is not listed (of 1)"),
        (_set("memory_formats", 2, 3), "state_dict['c']: memory format 3 is not listed"),
        (_set("flags", 0, 4), "flags 4, expected at most 3"),
        (_set("lengths", 0, -1), "the table holds a negative number"),
        (_set("sizes", 0, -2), "the table holds a negative number"),
        (_text(b"a.0.wcb"), "names must be sorted and unique, got 'c' before 'b'"),
        (_text(b"a.0.wbb"), "names must be sorted and unique, got 'b' before 'b'"),
        (_text(b"a.0.w\xffc"), "a name is not UTF-8 text"),
        (_set("lengths", 0, 6), "the names' lengths add up to 8, the text is 7"),
        (_set("ndims", 0, 1), "entries.dims: 3, but the entries' dimensions add up to 2"),
        (_set("paths", 1, 0), "entries.parts: 5, but the entries' paths have 4 parts"),
        (_set("parts", 0, 4), "state_dict['a.0.w']: its path's parts ([4, 3, 2]) do not make"),
        (_set("parts", 2, 4), "state_dict['a.0.w']: its path's parts ([2, 3, 4]) do not make"),
        (_set("parts", 1, 1), "state_dict['a.0.w']: its path's parts ([2, 1, 2]) do not make"),
        (_set("parts", 0, 3), "state_dict['a.0.w']: its path holds 'a' as a list index"),
        (_text(b"a.00.wbc"), "the names' lengths add up to 7, the text is 8"),
        (_set("sizes", 0, 3), "state_dict['a.0.w']: its chunks hold 6 elements, the tensor 9"),
        (_set("chunks", 0, 2), "items.rows: 3, but the state dict's entries make 4"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_hostile_entry_columns_are_refused(change: Callable[[Columns], None], cause: str) -> None:
    record = _known()
    edit_entry_columns(record, change)
    with pytest.raises(MetadataError) as caught:
        decode(json.dumps(record).encode(), url=URL)
    assert cause in str(caught.value) and URL in str(caught.value)


def test_a_list_index_is_a_canonical_number() -> None:
    """``a.00.w`` cut as ``a``, the list index ``00``, ``w`` is refused: 0 would not make the
    name again; ``a.00.w`` with ``00`` a key is a path like any other."""
    record = _known()

    def rename(columns: Columns) -> None:
        columns["text"], columns["lengths"][0], columns["parts"][1] = [b"a.00.wbc"], 6, 5

    edit_entry_columns(record, rename)
    with pytest.raises(MetadataError, match="its path holds '00' as a list index"):
        decode(json.dumps(record).encode(), url=URL)

    def as_key(columns: Columns) -> None:
        columns["parts"][1] = 4

    edit_entry_columns(record, as_key)
    assert decode(json.dumps(record).encode(), url=URL).planner_data["a.00.w"] == ("a", "00", "w")


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda r: r["entries"].update(dtypes=["float128", "float64"]), "dtypes[0]: unsupported"),
        (lambda r: r["entries"].update(dtypes=[["float32"], "float64"]), "dtypes[0]: unsupported"),
        (lambda r: r["entries"].update(layouts="strided"), "entries.layouts: expected a JSON list"),
        (lambda r: r["entries"].update(dtypes=["float32"] * 2), "a name appears twice"),
        (lambda r: r["entries"].update(extra=1), "entries: expected the fields"),
        (lambda r: r["entries"].pop("parts"), "entries: expected the fields"),
        (lambda r: r["entries"].update(count=True), "entries.count: expected a non-negative int"),
        (lambda r: r["entries"].update(deflated="not base64!"), "entries.deflated: not base64"),
        (lambda r: r["entries"].update(text=8), "entries.deflated: inflates to other than"),
        (lambda r: r["entries"].update(count=10**9), "entries: the table inflates to"),
        (lambda r: r.update(entries=[]), "entries: expected a JSON object"),
        (lambda r: r.pop("entries"), "missing field 'entries'"),
        (lambda r: r.update(version=3), "entries: an entry table in a record of version 3"),
        (lambda r: r.update(state_dict={}), "keeps its entries in its entry table"),
        (lambda r: r.update(planner_data={}), "paths beside planner_data"),
    ],
    ids=[
        "unknown-dtype",
        "dtype-list",
        "layouts-str",
        "dtype-twice",
        "extra-field",
        "missing-field",
        "count-bool",
        "not-base64",
        "miscounted",
        "huge-count",
        "entries-list",
        "no-entries",
        "entries-in-version-3",
        "state-dict-in-version-4",
        "planner-data-beside-paths",
    ],
)
def test_the_entry_table_itself_is_checked(
    change: Callable[[dict[str, Any]], None], cause: str
) -> None:
    record = _known()
    change(record)
    with pytest.raises(MetadataError) as caught:
        decode(json.dumps(record).encode(), url=URL)
    assert cause in str(caught.value) and URL in str(caught.value)


def test_the_entry_table_is_bounded_by_max_size() -> None:
    data = json.dumps(_known()).encode()
    table = json.loads(data)["entries"]
    size = entrytable.inflated_size(table["count"], table["dims"], table["parts"], table["text"])
    assert size == 8 * (9 * 3 + 3 + 5) + 7
    assert decode(data, url=URL, max_size=size).entries
    with pytest.raises(MetadataError, match=f"entries: the table inflates to {size} bytes"):
        decode(data, url=URL, max_size=size - 1)


def test_planner_data_of_another_shape_stays_json() -> None:
    """What DCP's default planners do not write (a list, an int key's path, a path that does not
    make its name, a path for no entry) is kept as JSON, and read back alike."""
    drawn = draw(0)
    names = list(drawn.metadata.state_dict_metadata)
    for planner_data in (
        [1, 2],
        {names[0]: [names[0]]},
        {names[0]: ("elsewhere",)},
        {names[0]: (True,)},
        {names[0]: (-1,)},
        {"nowhere": ("nowhere",)},
    ):
        drawn.metadata.planner_data = planner_data
        record = json.loads(drawn.encode())
        assert "planner_data" in record and not any(entry_columns(record)["paths"])
        assert decode(drawn.encode(), url=URL).planner_data == planner_data
