"""Version 3's item table: random records round-trip exactly (and load alike in the inline shape
of versions 1 and 2), and tables that a hostile writer could make are refused.

No hypothesis here: seeded generators draw the shapes, dtypes, chunkings (grids, shuffled or
in order, with empty chunks), bytes items, digests and references to a sibling's objects, so a
failure names its seed.
"""

from __future__ import annotations

import base64
import itertools
import json
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
from s3ckpt.format.record import Chunk, Locator, TensorEntry, decode, encode
from s3ckpt.format.record import table as table_module
from s3ckpt.format.record.table import ChunkList, check_tensor, pack, unpack
from s3ckpt.format.record.torchmeta import DTYPES
from tests.recordshapes import Columns, columns, edit_table, inline

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

    for n in range(rng.randint(1, 10)):
        fqn = f"m.{rng.choice('abcxyz')}{n}"
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
    metadata = Metadata(state_dict_metadata=state, planner_data={})
    return Drawn(metadata, locators, digests, objects, chunks)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_records_round_trip(seed: int) -> None:
    drawn = draw(seed)
    data = drawn.encode()
    checkpoint = decode(data, url=URL)
    assert checkpoint.version == 3 and checkpoint.record_size == len(data)
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
    assert list(checkpoint.entries) == sorted(drawn.metadata.state_dict_metadata)
    # The same record as s3ckpt wrote it before version 3 loads to the same checkpoint.
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
    for fqn in sorted(record["state_dict"]):
        entry = record["state_dict"][fqn]
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
        tensors = [e for e in record["state_dict"].values() if e["type"] == "tensor"]
        counts = [e["chunks"] for e in tensors]
        if len(set(counts)) < 2:
            miscounted(record)
            return
        a, b = rng.sample([i for i, _ in enumerate(tensors)], 2)
        while counts[a] == counts[b]:
            a, b = rng.sample(range(len(tensors)), 2)
        tensors[a]["chunks"], tensors[b]["chunks"] = counts[b], counts[a]

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
        (lambda r: r.update(version=2), "an item table in a record of version 1 or 2"),
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
    record = _saved()
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
