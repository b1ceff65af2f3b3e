"""Tests for the JSON commit record: exact round trips through DCP's planners, and loud failures.

The metadata comes from DCP's own planners (not hand-built) so the tests track what real saves
produce; the in-memory storage plugin at the end runs a whole ``dcp.save`` / ``dcp.load`` on it.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from s3ckpt.errors import MetadataError
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.record import FORMAT, FORMAT_VERSION, Checkpoint, Locator, TensorEntry, decode
from s3ckpt.format.record import encode as encode_record
from tests.recordshapes import columns, entries, inline, older

URL = "s3://bucket/run/step-10/.metadata"
FRAME = 4096


def encode(metadata: Any, locators: Any, *, objects: Any, **kwargs: Any) -> bytes:
    """`encode` with made-up frame tables: these tests are about the rest of the record."""
    frames = {
        key: FrameTable.raw(FRAME, [7] * -(-size // FRAME), size)
        for key, size in (objects.items() if isinstance(objects, dict) else [])
        if isinstance(size, int) and not isinstance(size, bool) and size >= 0
    }
    return encode_record(metadata, locators, objects=objects, frames=frames, **kwargs)


def _state_dict() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {
            "w": torch.randn(4, 3, dtype=torch.bfloat16),
            "c": torch.randn(2, dtype=torch.complex64),
            "mask": torch.tensor([True, False, True]),
            "u8": torch.arange(5, dtype=torch.uint8),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 7),
        },
        "layers": [torch.ones(2, 2), {"b": torch.full((3,), 2, dtype=torch.int64)}],
        "step": 12,
        "names": ["a", "b"],
    }


def _zeros_like(sd: Any) -> Any:
    """A fresh state dict of the same shape, so a load has something to fill."""
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeros_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _plan(sd: dict[str, Any]) -> Metadata:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=True)
    _, metadata = planner.create_global_plan([planner.create_local_plan()])
    return dataclasses.replace(
        metadata,
        version="1.0.0",
        storage_meta=StorageMeta(
            checkpoint_id="s3://bucket/run/step-10", save_id="save-1", modules=["model"]
        ),
    )


def _fake_locators(metadata: Metadata) -> tuple[dict[MetadataIndex, Locator], dict[str, int]]:
    """One locator per chunk / bytes item, spread over two objects like two ranks would."""
    locators: dict[MetadataIndex, Locator] = {}
    objects = {"data/0.bin": 0, "data/1.bin": 0}
    for n, (fqn, item) in enumerate(metadata.state_dict_metadata.items()):
        key = f"data/{n % 2}.bin"
        if isinstance(item, BytesStorageMetadata):
            indexes, lengths = [MetadataIndex(fqn)], [11]
        else:
            itemsize = item.properties.dtype.itemsize
            indexes = [MetadataIndex(fqn, c.offsets, i) for i, c in enumerate(item.chunks)]
            lengths = [c.sizes.numel() * itemsize for c in item.chunks]
        for index, length in zip(indexes, lengths, strict=True):
            locators[index] = Locator(key, objects[key], length)
            objects[key] += length
    return locators, objects


@pytest.fixture
def saved() -> tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes]:
    metadata = _plan(_state_dict())
    locators, objects = _fake_locators(metadata)
    data = encode(
        metadata,
        locators,
        save_id="save-1",
        created=1700000000.25,
        objects=objects,
        extra={"world_size": 2, "settings": {"part_size": 8 << 20, "tags": ("a", "b")}},
    )
    return metadata, locators, objects, data


def test_round_trip_is_exact(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    metadata, locators, objects, data = saved
    ckpt = decode(data, url=URL)

    assert isinstance(ckpt, Checkpoint)
    got = ckpt.metadata
    assert got.state_dict_metadata == metadata.state_dict_metadata
    assert list(got.state_dict_metadata) == sorted(metadata.state_dict_metadata)
    for fqn, item in got.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            want = metadata.state_dict_metadata[fqn]
            assert isinstance(want, TensorStorageMetadata)
            assert item.properties.dtype is want.properties.dtype
            assert type(item.size) is torch.Size
            assert all(type(c.offsets) is torch.Size for c in item.chunks)
            assert all(type(c.sizes) is torch.Size for c in item.chunks)
    assert got.state_dict_metadata["model.scalar"].size == torch.Size([])  # type: ignore[union-attr]
    assert got.state_dict_metadata["model.empty"].size == torch.Size([0, 7])  # type: ignore[union-attr]
    assert isinstance(got.state_dict_metadata["step"], BytesStorageMetadata)

    assert got.planner_data == metadata.planner_data
    assert got.planner_data["layers.1.b"] == ("layers", 1, "b")
    assert all(type(path) is tuple for path in got.planner_data.values())
    assert got.storage_meta == metadata.storage_meta
    assert got.version == "1.0.0"

    assert ckpt.locators == locators
    assert got.storage_data is ckpt.locators
    assert ckpt.objects == objects
    assert ckpt.save_id == "save-1"
    assert ckpt.created == 1700000000.25
    assert ckpt.extra == {"world_size": 2, "settings": {"part_size": 8 << 20, "tags": ["a", "b"]}}


def test_locator_index_hints_are_chunk_positions() -> None:
    chunks = [ChunkStorageMetadata(torch.Size([r * 2, 0]), torch.Size([2, 3])) for r in range(3)]
    metadata = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32), torch.Size([6, 3]), chunks
            )
        }
    )
    locators = {
        MetadataIndex("w", c.offsets): Locator("o", i * 24, 24) for i, c in enumerate(chunks)
    }
    ckpt = decode(encode(metadata, locators, save_id="s", created=0, objects={"o": 72}), url=URL)
    assert ckpt.locators == locators
    assert [index.index for index in ckpt.locators] == [0, 1, 2]
    assert ckpt.metadata.planner_data is None
    assert ckpt.metadata.storage_meta is None
    assert ckpt.extra == {}


@pytest.mark.parametrize(
    "dtype",
    [
        getattr(torch, name)
        for name in [
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
        ]
        if isinstance(getattr(torch, name, None), torch.dtype)
    ],
    ids=str,
)
def test_every_standard_dtype_round_trips(dtype: torch.dtype) -> None:
    props = TensorProperties(dtype=dtype, requires_grad=True, memory_format=torch.channels_last)
    chunk = ChunkStorageMetadata(torch.Size([0, 0, 0, 0]), torch.Size([1, 2, 2, 2]))
    metadata = Metadata({"t": TensorStorageMetadata(props, torch.Size([1, 2, 2, 2]), [chunk])})
    length = 8 * dtype.itemsize
    locators = {MetadataIndex("t", chunk.offsets): Locator("o", 0, length)}
    objects = {"o": length}
    ckpt = decode(encode(metadata, locators, save_id="s", created=1, objects=objects), url=URL)
    assert ckpt.metadata.state_dict_metadata == metadata.state_dict_metadata


def test_planner_data_keeps_lists_and_tuples_apart() -> None:
    planner_data = {
        "paths": {"a.0": ("a", 0), "b": ("b",)},
        "list": [1, (2, [3, (4.5, None)]), True, "x"],
        "empty": (),
        "nested": {"__tuple__": [1], "other": 2},  # two keys: an ordinary dict
    }
    metadata = Metadata({}, planner_data=planner_data)
    ckpt = decode(encode(metadata, {}, save_id="s", created=0, objects={}), url=URL)
    assert ckpt.metadata.planner_data == planner_data
    assert type(ckpt.metadata.planner_data["list"][1]) is tuple
    assert type(ckpt.metadata.planner_data["list"][1][1]) is list
    assert ckpt.metadata.planner_data["empty"] == ()


def test_encoding_is_deterministic(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    metadata, locators, objects, data = saved
    shuffled = dataclasses.replace(
        metadata,
        state_dict_metadata=dict(reversed(list(metadata.state_dict_metadata.items()))),
    )
    again = encode(
        shuffled,
        dict(reversed(list(locators.items()))),
        save_id="save-1",
        created=1700000000.25,
        objects=dict(reversed(list(objects.items()))),
        extra={"settings": {"tags": ["a", "b"], "part_size": 8 << 20}, "world_size": 2},
    )
    assert again == data


def test_encoded_record_is_plain_json_with_an_item_table(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    _, locators, objects, data = saved
    assert not data.startswith(b"\x80")  # pickle protocol 2+ marker
    assert b"\n" not in data  # compact

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    record = json.loads(data.decode("utf-8"), parse_constant=no_constants)
    assert record["format"] == FORMAT
    assert record["version"] == FORMAT_VERSION == 4
    assert set(record) == {
        "format",
        "version",
        "save_id",
        "created",
        "dcp_version",
        "objects",
        "frames",
        "extra",
        "storage_meta",
        "entries",
        "items",
    }
    state_dict = entries(record)
    w = state_dict["model.w"]
    assert w["type"] == "tensor"
    assert w["dtype"] == "bfloat16"
    assert w["size"] == [4, 3]
    assert w["memory_format"] == "contiguous_format"
    assert w["chunks"] == 1
    assert state_dict["step"] == {"type": "bytes"}
    # DCP's default planner_data, a path per entry, is kept as the lengths of the name's parts.
    assert decode(data, url=URL).planner_data["layers.1.b"] == ("layers", 1, "b")
    assert record["entries"]["count"] == len(state_dict) and "planner_data" not in record

    # A row per item, in the order of the names; keys index the sorted object keys.
    names = sorted(state_dict)
    rows = [fqn for fqn in names for _ in range(state_dict[fqn].get("chunks", 1))]
    table = columns(record)
    at = rows.index("model.w")
    loc = locators[MetadataIndex("model.w", [0, 0])]
    assert sorted(objects)[table["keys"][at]] == loc.key
    assert (table["offsets"][at], table["lengths"][at]) == (loc.offset, loc.length)
    assert len(table["keys"]) == len(locators) == record["items"]["rows"]
    assert table["digests"] == [None] * len(rows)

    def leaves(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                leaves(v)
        elif isinstance(value, list):
            for v in value:
                leaves(v)
        else:
            assert value is None or isinstance(value, (bool, int, float, str))

    leaves(record)


def test_records_of_versions_1_to_3_still_load(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    """The shapes that s3ckpt wrote before version 4 (version 3: entries as JSON objects,
    planner_data JSON) and before version 3 (inline) decode to the same checkpoint."""
    metadata, locators, _, data = saved
    three = decode(older(data), url=URL)
    assert three.version == 3 and three.entries == decode(data, url=URL).entries
    assert isinstance(three.planner_source, str)
    assert three.planner_data == metadata.planner_data == decode(data, url=URL).planner_data
    old = inline(data)
    record = json.loads(old)
    assert record["version"] == 1 and "items" not in record
    loc = locators[MetadataIndex("model.w", [0, 0])]
    assert record["state_dict"]["model.w"]["chunks"] == [
        {
            "offsets": [0, 0],
            "sizes": [4, 3],
            "locator": {"key": loc.key, "offset": loc.offset, "length": loc.length},
        }
    ]
    before, now = decode(old, url=URL), decode(data, url=URL)
    assert (before.version, now.version) == (1, 4)
    assert before.entries == now.entries
    assert before.locators == now.locators == locators
    assert before.metadata.state_dict_metadata == metadata.state_dict_metadata
    assert now.record_size == len(data) < len(old) == before.record_size


def test_default_load_planner_uses_decoded_metadata(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    data = saved[3]
    ckpt = decode(data, url=URL)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(
        state_dict=_zeros_like(_state_dict()), metadata=ckpt.metadata, is_coordinator=True
    )
    plan = planner.create_local_plan()
    for item in plan.items:
        assert item.storage_index in ckpt.locators
        assert ckpt.metadata.storage_data[item.storage_index] == ckpt.locators[item.storage_index]
    # DCP reads every item except empty tensors, which have nothing to read.
    unread = set(ckpt.locators) - {item.storage_index for item in plan.items}
    assert {index.fqn for index in unread} == {"model.empty"}

    # The empty-state-dict planner rebuilds the nesting from planner_data's tuple paths.
    empty: dict[str, Any] = {}
    rebuild = _EmptyStateDictLoadPlanner()  # type: ignore[no-untyped-call]
    rebuild.set_up_planner(state_dict=empty, metadata=ckpt.metadata, is_coordinator=True)
    assert rebuild.create_local_plan().items
    assert empty["layers"][1]["b"].shape == (3,)
    assert empty["model"]["w"].dtype == torch.bfloat16


# ----------------------------------------------------------------------------- decode failures


def _mutated(data: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    record = json.loads(data)
    change(record)
    return json.dumps(record).encode()


def _tensor(record: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = record["state_dict"]["model.w"]
    return entry


def _chunk(record: dict[str, Any]) -> dict[str, Any]:
    chunk: dict[str, Any] = _tensor(record)["chunks"][0]
    return chunk


MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "format": lambda r: r.update(format="torch-dcp"),
    "no-format": lambda r: r.pop("format"),
    "version-str": lambda r: r.update(version="1"),
    "version-bool": lambda r: r.update(version=True),
    "version-zero": lambda r: r.update(version=0),
    "no-save-id": lambda r: r.pop("save_id"),
    "save-id-int": lambda r: r.update(save_id=5),
    "created-str": lambda r: r.update(created="yesterday"),
    "created-huge": lambda r: r.update(created=1e400),
    "dcp-version-int": lambda r: r.update(dcp_version=1),
    "objects-list": lambda r: r.update(objects=["data/0.bin"]),
    "object-size-negative": lambda r: r["objects"].update({"data/0.bin": -1}),
    "object-key-escapes": lambda r: r["objects"].update({"../x": 1}),
    "extra-list": lambda r: r.update(extra=[]),
    "storage-meta-modules": lambda r: r["storage_meta"].update(modules="model"),
    "storage-meta-id": lambda r: r["storage_meta"].update(checkpoint_id=3),
    "planner-data-tag": lambda r: r["planner_data"].update({"x": {"__tuple__": 3}}),
    "state-dict-list": lambda r: r.update(state_dict=[]),
    "entry-type": lambda r: _tensor(r).update(type="sparse"),
    "entry-no-type": lambda r: _tensor(r).pop("type"),
    "dtype-unknown": lambda r: _tensor(r).update(dtype="float128"),
    "dtype-not-a-dtype": lambda r: _tensor(r).update(dtype="Tensor"),
    "dtype-dunder": lambda r: _tensor(r).update(dtype="__class__"),
    "dtype-list": lambda r: _tensor(r).update(dtype=["float32"]),
    "layout": lambda r: _tensor(r).update(layout="os"),
    "memory-format": lambda r: _tensor(r).update(memory_format=0),
    "requires-grad-int": lambda r: _tensor(r).update(requires_grad=0),
    "size-negative": lambda r: _tensor(r).update(size=[-4, 3]),
    "size-float": lambda r: _tensor(r).update(size=[4.0, 3]),
    "size-str": lambda r: _tensor(r).update(size="4,3"),
    "size-huge": lambda r: _tensor(r).update(size=[2**70, 3]),
    "chunks-dict": lambda r: _tensor(r).update(chunks={}),
    "chunk-rank": lambda r: _chunk(r).update(offsets=[0]),
    "chunk-outside": lambda r: _chunk(r).update(offsets=[1, 0]),
    "chunk-duplicate": lambda r: _tensor(r)["chunks"].append(_chunk(r)),
    "no-locator": lambda r: _chunk(r).pop("locator"),
    "locator-offset-negative": lambda r: _chunk(r)["locator"].update(offset=-1),
    "locator-length-bool": lambda r: _chunk(r)["locator"].update(length=True),
    "locator-past-end": lambda r: _chunk(r)["locator"].update(offset=10**9),
    "locator-unknown-object": lambda r: _chunk(r)["locator"].update(key="data/9.bin"),
    "locator-absolute-key": lambda r: _chunk(r)["locator"].update(key="/etc/passwd"),
    "bytes-no-locator": lambda r: r["state_dict"]["step"].pop("locator"),
}


# What only the inline shape (versions 1 and 2) has; `test_record_table` changes the table.
INLINE_ONLY = {name for name in MUTATIONS if "chunk" in name or "locator" in name}


@pytest.mark.parametrize("shape", ["table", "inline"])
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_decode_rejects_wrong_fields(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
    name: str,
    shape: str,
) -> None:
    """Version 3's entries (and its planner_data) and the inline shape's; version 4's entry
    table holds no JSON of its own to garble: `test_record_table` changes its columns."""
    if shape == "table" and name in INLINE_ONLY:
        pytest.skip("the inline shape's chunks and locators")
    data = _mutated(older(saved[3]) if shape == "table" else inline(saved[3]), MUTATIONS[name])
    with pytest.raises(MetadataError) as caught:
        decode(data, url=URL)
    assert URL in str(caught.value)
    assert caught.value.url == URL  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (lambda d: d[: len(d) // 2], "not valid JSON"),
        (lambda d: d[:-1], "not valid JSON"),
        (lambda d: b"", "not valid JSON"),
        (lambda d: b"\xff\xfe\x00garbage\x9c", "not UTF-8"),
        (lambda d: b"PK\x03\x04 this is a zip", "not valid JSON"),
        (lambda d: pickle.dumps({"format": "s3ckpt"}), "pickle"),
        (lambda d: b"[1, 2, 3]", "expected a JSON object"),
        (lambda d: b'{"format": "s3ckpt", "version": NaN}', "NaN"),
        (lambda d: b'{"format": "s3ckpt", "format": "s3ckpt"}', "twice"),
        (lambda d: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (lambda d: d.replace(b'"created":1700000000.25', b'"created":1e400'), "created"),
        (lambda d: _mutated(d, lambda r: r.update(version=FORMAT_VERSION + 1)), "newer s3ckpt"),
        (lambda d: _mutated(d, lambda r: r.pop("entries")), "missing field 'entries'"),
        (lambda d: _mutated(d, lambda r: r.update(format="x")), "not an s3ckpt commit record"),
    ],
    ids=[
        "truncated-half",
        "truncated-last-byte",
        "empty",
        "not-utf8",
        "garbage",
        "pickle",
        "not-an-object",
        "nan",
        "duplicate-key",
        "deep-nesting",
        "created-overflows",
        "version-newer",
        "missing-field",
        "wrong-format",
    ],
)
def test_decode_errors_name_url_and_cause(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
    make: Callable[[bytes], bytes],
    cause: str,
) -> None:
    with pytest.raises(MetadataError) as caught:
        decode(make(saved[3]), url=URL)
    message = str(caught.value)
    assert URL in message
    assert cause in message


def test_newer_version_says_upgrade(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    with pytest.raises(MetadataError, match="upgrade"):
        decode(_mutated(saved[3], lambda r: r.update(version=FORMAT_VERSION + 1)), url=URL)


def test_decode_ignores_unknown_top_level_fields(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    data = _mutated(saved[3], lambda r: r.update(comment="added by a later 1.x writer"))
    assert decode(data, url=URL).locators == saved[1]


def test_metadata_error_pickles(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    with pytest.raises(MetadataError) as caught:
        decode(saved[3][:10], url=URL)
    again = pickle.loads(pickle.dumps(caught.value))
    assert str(again) == str(caught.value)
    assert again.url == URL


def test_gc_state_is_restored(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    assert gc.isenabled()
    decode(saved[3], url=URL)
    with pytest.raises(MetadataError):
        decode(saved[3][:-1], url=URL)
    assert gc.isenabled()
    gc.disable()
    try:
        decode(saved[3], url=URL)
        assert not gc.isenabled()
    finally:
        gc.enable()


# ----------------------------------------------------------------------------- encode failures


def _encode_with(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes], **changes: Any
) -> bytes:
    metadata, locators, objects, _ = saved
    args: dict[str, Any] = {
        "metadata": metadata,
        "locators": locators,
        "save_id": "s",
        "created": 1.0,
        "objects": objects,
        "extra": None,
    }
    args.update(changes)
    return encode(
        args.pop("metadata"),
        args.pop("locators"),
        save_id=args["save_id"],
        created=args["created"],
        objects=args["objects"],
        extra=args["extra"],
    )


def test_encode_requires_a_locator_for_every_chunk(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    locators = dict(saved[1])
    del locators[MetadataIndex("model.c", [0])]
    with pytest.raises(MetadataError, match=r"model\.c.*no locator"):
        _encode_with(saved, locators=locators)
    locators = dict(saved[1])
    del locators[MetadataIndex("step")]
    with pytest.raises(MetadataError, match=r"'step'.*no locator"):
        _encode_with(saved, locators=locators)


def test_encode_rejects_stray_locators(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    locators = {**saved[1], MetadataIndex("ghost", [0]): Locator("data/0.bin", 0, 1)}
    with pytest.raises(MetadataError, match="ghost"):
        _encode_with(saved, locators=locators)


@pytest.mark.parametrize(
    ("locator", "cause"),
    [
        (Locator("data/7.bin", 0, 1), "not listed in objects"),
        (Locator("data/0.bin", 0, 10**9), "outside object"),
        (Locator("data/0.bin", -1, 1), "non-negative"),
        (Locator("../data/0.bin", 0, 1), "relative object key"),
        (Locator("data/0.bin", 0, 5), r"chunks\[0\]\.locator: 5 bytes, but 12 torch\.bfloat16"),
    ],
)
def test_encode_checks_locators_against_objects(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
    locator: Locator,
    cause: str,
) -> None:
    locators = {**saved[1], MetadataIndex("model.w", [0, 0]): locator}
    with pytest.raises(MetadataError, match=cause):
        _encode_with(saved, locators=locators)


@pytest.mark.parametrize(
    ("planner_data", "cause"),
    [
        ({"model.w": ("model", object())}, r"planner_data\['model\.w'\]\[1\]"),
        ({"x": {1: "a"}}, r"planner_data\['x'\]: key 1"),
        ({"x": float("nan")}, r"planner_data\['x'\]"),
        ({"x": {"__tuple__": [1]}}, "would read back as a tuple"),
        ({"x": b"raw"}, "bytes value"),
    ],
)
def test_encode_rejects_planner_data_that_is_not_json(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
    planner_data: Any,
    cause: str,
) -> None:
    metadata = dataclasses.replace(saved[0], planner_data=planner_data)
    with pytest.raises(MetadataError, match=cause):
        _encode_with(saved, metadata=metadata)


def test_encode_rejects_cycles_and_bad_extra(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(MetadataError, match="nested"):
        _encode_with(saved, extra={"loop": cycle})
    with pytest.raises(MetadataError, match=r"extra\['when'\]"):
        _encode_with(saved, extra={"when": object()})
    with pytest.raises(MetadataError, match="created"):
        _encode_with(saved, created=float("inf"))
    with pytest.raises(MetadataError, match="objects"):
        _encode_with(saved, objects={**saved[2], "data/0.bin": -5})


def test_encode_rejects_unsupported_dtype() -> None:
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
    props = TensorProperties(dtype=torch.qint8)
    metadata = Metadata({"q": TensorStorageMetadata(props, torch.Size([1]), [chunk])})
    locators = {MetadataIndex("q", [0]): Locator("o", 0, 1)}
    with pytest.raises(MetadataError, match=r"'q'.*dtype"):
        encode(metadata, locators, save_id="s", created=0, objects={"o": 1})


# ------------------------------------------------------------- a whole dcp.save / dcp.load


class _MemoryWriter(StorageWriter):
    """Writes every item into one in-memory object, tensors as their raw row-major bytes (what
    the record says a chunk's locator holds), and commits with :func:`encode`."""

    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        blob = io.BytesIO()
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                payload = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            else:
                assert item.type == WriteItemType.BYTE_IO and isinstance(data, io.BytesIO)
                payload = data.getvalue()
            locator = Locator("data/0.bin", blob.tell(), len(payload))
            blob.write(payload)
            results.append(WriteResult(item.index, len(payload), locator))
        self.store["data/0.bin"] = blob.getvalue()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        locators = {r.index: r.storage_data for rank in results for r in rank}
        objects = {key: len(value) for key, value in self.store.items()}
        self.store[".metadata"] = encode(
            metadata, locators, save_id="e2e", created=2.0, objects=objects
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class _MemoryReader(StorageReader):
    """Reads back what :class:`_MemoryWriter` wrote, trusting only :func:`decode`."""

    def __init__(self, store: dict[str, bytes]) -> None:
        self.store = store
        self.metadata = Metadata({})
        self.locators: dict[MetadataIndex, Locator] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return decode(self.store[".metadata"], url="mem://.metadata").metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **kw: Any) -> None:
        self.metadata = metadata
        self.locators = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            loc = self.locators[item.storage_index]
            payload = self.store[loc.key][loc.offset : loc.offset + loc.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(payload))
                continue
            entry = self.metadata.state_dict_metadata[item.storage_index.fqn]
            assert isinstance(entry, TensorStorageMetadata)
            chunk = next(c for c in entry.chunks if c.offsets == item.storage_index.offset)
            flat = torch.frombuffer(bytearray(payload), dtype=entry.properties.dtype)
            tensor = flat.reshape(chunk.sizes)
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def test_dcp_save_and_load_through_the_json_record() -> None:
    store: dict[str, bytes] = {}
    original = _state_dict()
    dcp_save(original, storage_writer=_MemoryWriter(store), no_dist=True)
    assert json.loads(store[".metadata"])["format"] == FORMAT

    target = _zeros_like(original)
    target["step"], target["names"] = 0, []
    dcp_load(target, storage_reader=_MemoryReader(store), no_dist=True)

    for name, want in original["model"].items():
        assert torch.equal(target["model"][name], want), name
        assert target["model"][name].dtype == want.dtype
    assert torch.equal(target["layers"][0], original["layers"][0])
    assert torch.equal(target["layers"][1]["b"], original["layers"][1]["b"])
    assert target["step"] == 12
    assert target["names"] == ["a", "b"]


SIBLING_SAVE = "0123456789abcdef01234567"


def _referencing(data: bytes, *, version: int) -> bytes:
    """The record with its first object moved to a sibling checkpoint's save."""

    def change(record: dict[str, Any]) -> None:
        old = sorted(record["objects"])[0]
        new = f"../step-1/data-{SIBLING_SAVE}/00000-000"
        record["objects"][new] = record["objects"].pop(old)
        record["frames"][new] = record["frames"].pop(old)
        for entry in record["state_dict"].values():
            for located in entry.get("chunks", [entry]):
                if located["locator"]["key"] == old:
                    located["locator"]["key"] = new
        record["version"] = version

    return _mutated(data, change)


def test_references_and_digests_round_trip(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    metadata, locators, objects, _ = saved
    digests = {index: f"{n:032x}" for n, index in enumerate(locators) if index.offset is not None}
    moved = {k: f"../step-1/data-{SIBLING_SAVE}/{n:05d}-000" for n, k in enumerate(objects)}
    data = encode(
        metadata,
        {i: Locator(moved[loc.key], loc.offset, loc.length) for i, loc in locators.items()},
        save_id="save-2",
        created=1700000000.5,
        objects={moved[k]: size for k, size in objects.items()},
        digests=digests,
    )
    assert json.loads(data)["version"] == 4
    old = inline(data)
    assert json.loads(old)["version"] == 2
    assert decode(old, url=URL).entries == decode(data, url=URL).entries
    ckpt = decode(data, url=URL)
    chunks = {
        (fqn, tuple(c.offsets)): c.digest
        for fqn, entry in ckpt.entries.items()
        if isinstance(entry, TensorEntry)
        for c in entry.chunks
    }
    assert {(i.fqn, tuple(i.offset or ())): d for i, d in digests.items()} == chunks
    assert ckpt.stored_bytes == 0 and ckpt.referenced_bytes == sum(
        c.locator.length
        for e in ckpt.entries.values()
        if isinstance(e, TensorEntry)
        for c in e.chunks
    )
    assert ckpt.metadata.state_dict_metadata == metadata.state_dict_metadata


def test_a_version_1_record_cannot_reference_and_digests_must_be_hex(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    old = inline(saved[3])
    assert decode(_referencing(old, version=2), url=URL).referenced_bytes > 0
    with pytest.raises(MetadataError, match="version 1 cannot"):
        decode(_referencing(old, version=1), url=URL)

    def bad_digest(record: dict[str, Any]) -> None:
        _tensor(record)["chunks"][0]["xxh3"] = "not-hex"

    with pytest.raises(MetadataError, match="32 hex digits"):
        decode(_mutated(old, bad_digest), url=URL)


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (lambda r: r["extra"].update(x=[{}] * 400_000), "extra: more than 1048576 bytes"),
        (lambda r: r["planner_data"].update(x=[[]] * 30_000), "planner_data['x']: more than"),
        (lambda r: _chunk(r).update(junk=[0] * 40_000), "chunks[0]: more than 65536 bytes"),
        (lambda r: r["objects"].update({"data/9.bin": 1}), "'data/9.bin' holds none of"),
    ],
    ids=["extra", "planner-data", "chunk", "unused-object"],
)
@pytest.mark.parametrize("shape", ["table", "inline"])
def test_decode_refuses_what_would_cost_more_than_its_share(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
    change: Callable[[dict[str, Any]], None],
    cause: str,
    shape: str,
) -> None:
    """A free-form field of more than 1 MiB, a value inside the state dict, the frame tables or
    planner_data of more than 64 KiB, an object that holds none of the items (each costs a
    frame table, however short its text): s3ckpt writes none of them."""

    def also_framed(record: dict[str, Any]) -> None:
        change(record)
        for key in record["objects"]:
            record["frames"].setdefault(key, {"frame_size": 4096, "table": "AQAAAAAAAAAA"})

    if shape == "table" and "chunks[0]" in cause:
        pytest.skip("the inline shape's chunks")
    data = older(saved[3]) if shape == "table" else inline(saved[3])
    with pytest.raises(MetadataError) as caught:
        decode(_mutated(data, also_framed), url=URL)
    assert cause in str(caught.value)


def test_a_newer_record_says_so_even_if_this_s3ckpt_cannot_read_it(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    """Version is the record's last member: a state dict shaped as a newer s3ckpt may shape it
    is refused as newer, not as garbled."""

    def newer(record: dict[str, Any]) -> None:
        record["entries"] = [record.pop("entries")]
        record["version"] = FORMAT_VERSION + 1

    with pytest.raises(MetadataError, match="newer s3ckpt"):
        decode(_mutated(saved[3], newer), url=URL)


def test_version_3_planner_data_is_read_when_it_is_asked_for(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    checkpoint = decode(older(saved[3]), url=URL)
    assert isinstance(checkpoint.planner_source, str)
    assert checkpoint.planner_data == saved[0].planner_data
    assert checkpoint.metadata.planner_data == saved[0].planner_data


def _two_rows(chunks: list[tuple[Any, Any, int]]) -> tuple[Metadata, dict[MetadataIndex, Locator]]:
    """A float32 [4, 3] tensor ``t`` of the given (offsets, sizes, locator length) chunks, each
    in its own 48-byte slot of ``d/0``."""
    metadata = Metadata(
        state_dict_metadata={
            "t": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([4, 3]),
                [ChunkStorageMetadata(offsets, sizes) for offsets, sizes, _ in chunks],
            )
        }
    )
    locators = {
        MetadataIndex("t", [0, 0] if i == 0 else [2, 0]): Locator("d/0", 48 * i, length)
        for i, (_, _, length) in enumerate(chunks)
    }
    return metadata, locators


@pytest.mark.parametrize(
    ("chunks", "cause"),
    [
        ([([0, 0], [2, 3], 24), ([2, 0], [2, 3], 24)], None),
        ([([0, 0], [2, 3], 24), ([2, 0], [3, 3], 36)], r"chunks\[1\]: .* exceed tensor size"),
        ([([0, 0], [2, 3], 24), ([2, 0], [2, 3], 20)], r"chunks\[1\]\.locator: 20 bytes"),
        ([([0, 0], [2, 3], 24), ([2, 0], [2], 24)], r"chunks\[1\]: .* do not match"),
        ([([0, 0], [2, 3], 24), ([2, 0], [2, True], 24)], r"chunks\[1\]\.sizes: expected"),
        ([([0, 0], [2, 3], 24), ([2, 0], [2, -3], 24)], r"chunks\[1\]\.sizes: expected"),
        ([([0, 0], [4, 3], 48), ([0, 0], [4, 3], 48)], r"chunks\[1\]: two chunks start"),
    ],
    ids=["valid", "beyond", "length", "dims", "bool", "negative", "twice"],
)
def test_encode_names_the_chunk_at_fault(
    chunks: list[tuple[Any, Any, int]], cause: str | None
) -> None:
    """The encode checks a tensor's chunks a column at a time, and chunk by chunk only once one
    fails: whichever check fails names the chunk, and a valid tensor passes both."""
    metadata, locators = _two_rows(chunks)
    if chunks[1][0] == chunks[0][0]:
        locators[MetadataIndex("t", [2, 0])] = Locator("d/0", 48, 48)  # a stray, never reached
    objects = {"d/0": 96}
    if cause is None:
        data = encode(metadata, locators, save_id="s", created=1.0, objects=objects)
        item = decode(data, url=URL).metadata.state_dict_metadata["t"]
        assert isinstance(item, TensorStorageMetadata)
        got = [(list(chunk.offsets), list(chunk.sizes)) for chunk in item.chunks]
        assert got == [(offsets, sizes) for offsets, sizes, _ in chunks]
        return
    with pytest.raises(MetadataError, match=cause):
        encode(metadata, locators, save_id="s", created=1.0, objects=objects)


def test_locators_are_found_with_or_without_the_position_hint(
    saved: tuple[Metadata, dict[MetadataIndex, Locator], dict[str, int], bytes],
) -> None:
    """The locators are looked up in the record, not copied into a dict: DCP's position hint
    finds a chunk at once, a missing or stale hint falls back to the offsets, and an index of
    no stored item is a KeyError as a dict's would be."""
    metadata, locators, _, data = saved
    found = decode(data, url=URL).locators
    assert dict(found) == locators and len(found) == len(locators)
    for index, locator in locators.items():
        assert found[MetadataIndex(index.fqn, index.offset)] == locator
        assert found[MetadataIndex(index.fqn, index.offset, 10**6)] == locator
        assert found.get(MetadataIndex(index.fqn, index.offset, 0)) == locator
    item = metadata.state_dict_metadata["model.w"]
    assert isinstance(item, TensorStorageMetadata)
    beyond = [size + 1 for size in item.size]
    for missing in (MetadataIndex("model.w", beyond), MetadataIndex("nothing"), "model.w"):
        assert missing not in found
        with pytest.raises(KeyError):
            found[missing]
