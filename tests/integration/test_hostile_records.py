"""Hostile and inconsistent commit records: a record that decodes never loads wrong data, and no
claim in a record makes a load allocate more than the store really holds.

Each server test saves a real checkpoint, then tampers with its ``.metadata`` (or a data object)
through the backdoor client, as a writer of the bucket could. The tests without a server check
the whole-record rules of `decode` (and that `encode` refuses the same records).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import re
import resource
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from s3ckpt import S3Config, S3Reader, S3Writer
from s3ckpt.engine.store import get_store
from s3ckpt.errors import ConfigError, MetadataError, StorageError
from s3ckpt.format.frames import RAW, ZSTD, FrameTable
from s3ckpt.format.record import Locator, decode, encode, tiling
from s3ckpt.tools import catalog
from s3ckpt.tools.verify import verify
from tests.helpers import raised

URL = "s3://bucket/ck/.metadata"
GiB = 1 << 30
# Far below the claims (3 GiB and up), far above what reading a tiny checkpoint costs.
_MAX_GROWTH_MB = 200


# ------------------------------------------------------------------------------- with a server


def save(s3: Any, bucket: str) -> dict[str, Any]:
    """A checkpoint in one object: ``w`` (16x4 float32), ``d`` (10 float64), ``step`` (bytes)."""
    generator = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(16, 4, generator=generator),
        "d": torch.randn(10, dtype=torch.float64, generator=generator),
        "step": 7,
    }
    writer = S3Writer(bucket, "ck", config=s3.config(), objects_per_rank=1)
    dcp.save(state, storage_writer=writer)
    return state


def record(s3: Any, bucket: str) -> dict[str, Any]:
    body = s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read()
    loaded: dict[str, Any] = json.loads(body)
    return loaded


def tamper(s3: Any, bucket: str, change: Callable[[dict[str, Any]], None]) -> None:
    edited = record(s3, bucket)
    change(edited)
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=json.dumps(edited).encode())


def load(s3: Any, bucket: str, **config: Any) -> dict[str, Any]:
    loaded = {"w": torch.zeros(16, 4), "d": torch.zeros(10, dtype=torch.float64), "step": 0}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=s3.config(**config)))
    return loaded


def refused(s3: Any, bucket: str, **config: Any) -> MetadataError:
    """The record's MetadataError, as `S3Reader.read_metadata` raises it; ``dcp.load`` fails
    with its text too (torch 2.13 re-raises a failed metadata read as AssertionError)."""
    reader = S3Reader(bucket, "ck", config=s3.config(**config))
    error = raised(reader.read_metadata)
    assert isinstance(error, MetadataError), repr(error)
    assert str(error) in str(raised(lambda: load(s3, bucket, **config)))
    return error


def chunk_of(edited: dict[str, Any], fqn: str) -> dict[str, Any]:
    chunk: dict[str, Any] = edited["state_dict"][fqn]["chunks"][0]
    return chunk


def the_object(edited: dict[str, Any]) -> str:
    (key,) = edited["objects"]
    return str(key)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def test_a_locator_that_is_not_its_chunks_bytes_is_refused(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    tamper(s3, bucket, lambda r: chunk_of(r, "w")["locator"].update(length=240))
    error = refused(s3, bucket)
    assert "state_dict['w'].chunks[0].locator: 240 bytes" in str(error)
    assert "take 256" in str(error) and f"s3://{bucket}/ck/.metadata" in str(error)


def test_float64_bytes_are_never_read_as_float32(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    tamper(s3, bucket, lambda r: r["state_dict"]["d"].update(dtype="float32"))
    error = refused(s3, bucket)
    assert "state_dict['d'].chunks[0].locator: 80 bytes" in str(error)
    assert "torch.float32" in str(error)


def _gap(edited: dict[str, Any]) -> None:
    chunk = chunk_of(edited, "w")
    chunk["sizes"] = [12, 4]
    chunk["locator"]["length"] = 12 * 4 * 4


def _two_chunks(
    first_rows: int, second_at: int, second_rows: int
) -> Callable[[dict[str, Any]], None]:
    """``w`` as rows ``[0, first_rows)`` and ``[second_at, second_at + second_rows)``."""

    def change(edited: dict[str, Any]) -> None:
        entry = edited["state_dict"]["w"]
        locator = entry["chunks"][0]["locator"]
        entry["chunks"] = [
            {
                "offsets": [at, 0],
                "sizes": [rows, 4],
                "locator": {**locator, "offset": locator["offset"] + start, "length": rows * 16},
            }
            for at, rows, start in (
                (0, first_rows, 0),
                (second_at, second_rows, 256 - 16 * second_rows),
            )
        ]

    return change


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (_gap, "its chunks hold 48 elements, the tensor 64: they leave a gap"),
        (_two_chunks(16, 8, 8), "its chunks hold 96 elements, the tensor 64: they overlap"),
        # As many elements as the tensor, so only the layout shows rows 4-8 twice, 12-16 never.
        (_two_chunks(8, 4, 8), "chunks 0 and 1 overlap"),
    ],
    ids=["gap", "overlap", "overlap-and-gap"],
)
def test_chunks_must_tile_their_tensor(
    s3: Any, bucket: str, change: Callable[[dict[str, Any]], None], cause: str
) -> None:
    save(s3, bucket)
    tamper(s3, bucket, change)
    error = refused(s3, bucket)
    assert f"state_dict['w']: {cause}" in str(error)


def test_a_chunk_reaching_past_its_objects_end_is_refused(s3: Any, bucket: str) -> None:
    save(s3, bucket)

    def near_the_end(edited: dict[str, Any]) -> None:
        end = edited["objects"][the_object(edited)]
        chunk_of(edited, "w")["locator"].update(offset=end - 16, length=16)

    tamper(s3, bucket, near_the_end)
    error = refused(s3, bucket)
    assert "state_dict['w'].chunks[0].locator: 16 bytes" in str(error)


@pytest.mark.parametrize("cut", ["half", "all"])
def test_an_object_shorter_than_its_record_fails_at_once(s3: Any, bucket: str, cut: str) -> None:
    """The record is intact, the stored object is not: every read of it fails on its first
    answer (the server clips the range, or refuses it), without retries."""
    state = save(s3, bucket)
    key = f"ck/{the_object(record(s3, bucket))}"
    data = s3.client.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.client.put_object(
        Bucket=bucket, Key=key, Body=data[: len(data) // 2] if cut == "half" else b""
    )

    config = s3.config()
    retries = get_store(config).stats.retries
    for call in (lambda: load(s3, bucket), lambda: verify(f"s3://{bucket}/ck", config=config)):
        error = raised(call)
        assert isinstance(error, StorageError) and error.code == "SizeMismatch", repr(error)
        assert key in str(error) and f"the {len(data)} the commit recorded" in str(error)
    assert get_store(config).stats.retries == retries

    s3.client.put_object(Bucket=bucket, Key=key, Body=data)
    assert torch.equal(load(s3, bucket)["w"], state["w"])


def _table(stored: int, codec: int) -> str:
    """A frame table of one frame (with a CRC no read will get to check)."""
    return base64.b64encode(struct.pack("<IIB", stored, 0, codec)).decode()


def _claim(fqn: str, claim: int) -> Callable[[dict[str, Any]], None]:
    """``fqn`` (bytes or the tensor ``w``) claims ``claim`` bytes, and the record an object that
    large: consistent in itself, while the object stored is a few hundred bytes."""

    def change(edited: dict[str, Any]) -> None:
        key = the_object(edited)
        entry = edited["state_dict"][fqn]
        if fqn == "w":
            entry["size"] = [claim // 16, 4]
            entry["chunks"][0]["sizes"] = [claim // 16, 4]
            entry = entry["chunks"][0]
        entry["locator"] = {"key": key, "offset": 0, "length": claim}
        if claim < 1 << 32:  # one raw frame of that size
            frame = _table(claim, RAW)
            edited["frames"][key] = {"frame_size": claim, "table": frame}
            edited["objects"][key] = claim
        else:  # more than a raw frame can say: one compressed frame, as large as the object
            frame = _table(edited["objects"][key], ZSTD)
            edited["frames"][key] = {"frame_size": claim, "raw_size": claim, "table": frame}

    return change


@pytest.mark.parametrize("claim", [3 * GiB, 2**62], ids=["3GiB", "2**62"])
@pytest.mark.parametrize("fqn", ["step", "w"])
def test_huge_claims_fail_before_anything_is_allocated(
    s3: Any, bucket: str, fqn: str, claim: int
) -> None:
    save(s3, bucket)
    tamper(s3, bucket, _claim(fqn, claim))
    before = peak_rss_mb()
    # The bytes value is loaded into a given state dict; the tensor, whose size DCP checks against
    # its destination, through read_state (export), which allocates what the record says.
    call = (
        (lambda: load(s3, bucket))
        if fqn == "step"
        else (lambda: catalog.read_state(f"s3://{bucket}/ck", s3.config()))
    )
    error = raised(call)
    assert peak_rss_mb() - before < _MAX_GROWTH_MB
    if claim < 1 << 32:
        assert isinstance(error, StorageError) and error.code == "SizeMismatch", repr(error)
        assert f"the {claim} the commit recorded" in str(error)
    else:  # no frame table of a tiny record can say that much
        assert "frames[" in str(error) and "a frame holds at most" in str(error)
        assert str(refused(s3, bucket)) in str(error)


def test_a_record_over_the_cap_is_refused_before_it_is_downloaded(s3: Any, bucket: str) -> None:
    save(s3, bucket)
    size = len(s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read())
    config = s3.config(max_record_size=size - 1)
    received = get_store(config).stats.bytes_received
    for error in (
        refused(s3, bucket, max_record_size=size - 1),
        raised(lambda: catalog.describe(f"s3://{bucket}/ck", config)),  # the tools' own GET
    ):
        assert isinstance(error, MetadataError), repr(error)
        assert f"s3://{bucket}/ck/.metadata" in str(error)
        assert f"{size} bytes, over the {size - 1}" in str(error)
        assert f"S3Config(max_record_size={size})" in str(error)
    assert get_store(config).stats.bytes_received - received < size
    assert load(s3, bucket, max_record_size=size)["step"] == 7


# -------------------------------------------------------------------------- without a server


def _tensor(
    size: list[int], chunks: list[tuple[list[int], list[int]]], dtype: torch.dtype = torch.float32
) -> tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int]]:
    """One tensor of ``chunks`` (offsets, sizes), packed back to back in object ``o``."""
    entries, locators, end = [], {}, 0
    for offsets, sizes in chunks:
        length = dtype.itemsize * int(torch.Size(sizes).numel())
        entries.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        locators[MetadataIndex("t", offsets)] = Locator("o", end, length)
        end += length
    props = TensorProperties(dtype=dtype)
    tensor = TensorStorageMetadata(props, torch.Size(size), entries)
    return Metadata({"t": tensor}), locators, {"o": end}


def _record(layout: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int]]) -> bytes:
    meta, locators, objects = layout
    frames = {key: FrameTable.raw(4096, [0] * -(-n // 4096), n) for key, n in objects.items()}
    return encode(meta, locators, save_id="s", created=1.0, objects=objects, frames=frames)


def _unchecked(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> bytes:
    """The record of chunks that `encode` refuses, as a hostile writer would write it."""
    _, locators, objects = _tensor(size, chunks)
    edited = json.loads(_record(_tensor(size, [([0] * len(size), size)])))
    edited["state_dict"]["t"]["chunks"] = [
        {"offsets": offsets, "sizes": sizes, "locator": dataclasses.asdict(locator)}
        for (offsets, sizes), locator in zip(chunks, locators.values(), strict=True)
    ]
    edited["objects"] = objects
    edited["frames"] = {"o": FrameTable.raw(4096, [0], objects["o"]).to_json()}
    return json.dumps(edited).encode()


def _rows(cuts: list[int], columns: int = 3) -> list[tuple[list[int], list[int]]]:
    return [([a, 0], [b - a, columns]) for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize(
    ("size", "chunks"),
    [
        ([], [([], [])]),  # a scalar
        ([0, 7], [([0, 0], [0, 7])]),  # no elements
        ([5], [([0], [2]), ([2], [2]), ([4], [1]), ([5], [0])]),  # uneven shards, one empty
        ([4, 6], [([r, c], [2, 3]) for r in (0, 2) for c in (0, 3)]),  # a 2x2 mesh
        ([2, 4], [([0, 0], [1, 2]), ([0, 2], [1, 2]), ([1, 0], [1, 1]), ([1, 1], [1, 3])]),
        ([100_000, 3], _rows(list(range(100_001)))),  # 100k row shards
    ],
    ids=["scalar", "empty", "uneven", "mesh", "bricks", "100k-chunks"],
)
def test_every_exact_tiling_round_trips(
    size: list[int], chunks: list[tuple[list[int], list[int]]]
) -> None:
    layout = _tensor(size, chunks)
    assert decode(_record(layout), url=URL).locators == layout[1]


def test_packed_dtypes_count_packed_elements() -> None:
    dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if dtype is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    layout = _tensor([4, 2], [([0, 0], [4, 2])], dtype)
    assert layout[1][MetadataIndex("t", [0, 0])].length == 8  # two values a byte
    assert decode(_record(layout), url=URL).locators == layout[1]


@pytest.mark.parametrize(
    ("chunks", "cause"),
    [
        (_rows([0, 2, 3]), "its chunks hold 9 elements, the tensor 12: they leave a gap"),
        ([*_rows([0, 2, 4]), ([1, 0], [1, 3])], "its chunks hold 15 elements, the tensor 12"),
        # 12 elements, but row 1 twice and row 3 never.
        ([([0, 0], [2, 3]), ([1, 0], [2, 3])], "chunks 0 and 1 overlap"),
    ],
    ids=["gap", "overlap", "equal-volume-overlap"],
)
def test_encode_and_decode_refuse_chunks_that_do_not_tile(
    chunks: list[tuple[list[int], list[int]]], cause: str
) -> None:
    with pytest.raises(MetadataError, match=re.escape(f"state_dict['t']: {cause}")):
        _record(_tensor([4, 3], chunks))
    with pytest.raises(MetadataError, match=re.escape(f"{URL}: state_dict['t']: {cause}")):
        decode(_unchecked([4, 3], chunks), url=URL)


def test_a_layout_too_irregular_to_check_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bricks: exact, but no grid; the sweep's comparisons are bounded, whatever the record."""
    layout = _tensor(
        [2, 4], [([0, 0], [1, 2]), ([0, 2], [1, 2]), ([1, 0], [1, 1]), ([1, 1], [1, 3])]
    )
    data = _record(layout)
    monkeypatch.setattr(tiling, "_MAX_COMPARISONS", 2)
    with pytest.raises(MetadataError, match="4 chunks in a layout too irregular to check"):
        decode(data, url=URL)


@pytest.mark.parametrize(
    ("frame_size", "raw_size", "cause"),
    [
        (4096, 100, "do not fit its codec"),
        (4 << 20, 4 << 20, "do not fit its codec"),  # 100 stored bytes: zstd makes 3.2 MB at most
        (2**40, 2**40, "a frame holds at most"),
    ],
    ids=["compressed-not-smaller", "more-than-zstd-holds", "frame-too-large"],
)
def test_frame_tables_must_fit_their_objects(frame_size: int, raw_size: int, cause: str) -> None:
    table = {"frame_size": frame_size, "raw_size": raw_size, "table": _table(100, ZSTD)}
    with pytest.raises(ValueError, match=cause):
        FrameTable.from_json(table, 100)


def test_frame_lookups_past_the_table_are_value_errors() -> None:
    table = FrameTable.raw(4096, [0, 0, 0], 10_000)
    assert table.frames(8192, 12_288) == range(2, 3)
    for start, end in ((8192, 12_289), (20_000, 20_001), (5, 4)):
        with pytest.raises(ValueError, match="not inside the 3 frames"):
            table.covering(start, end)


def test_max_record_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_record_size"):
        S3Config(max_record_size=0)
