"""Hostile and inconsistent commit records: a record that decodes never loads wrong data, and no
claim in a record makes a load allocate more than the store really holds.

Each test saves a real checkpoint, then tampers with its ``.metadata`` (or a data object)
through the backdoor client, as a writer of the bucket could. The whole-record rules of `decode`
without a server: tests/unit/format/test_record_validation.py.
"""

from __future__ import annotations

import base64
import json
import random
import resource
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard

from s3ckpt import S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.crc32c import checksum
from s3ckpt.engine.store import get_store
from s3ckpt.errors import MetadataError, StorageError
from s3ckpt.format.frames import RAW, ZSTD
from s3ckpt.format.record import entrytable
from s3ckpt.format.record import table as item_table
from s3ckpt.format.record.decoder import MEMORY_BOUND
from s3ckpt.tools import catalog
from s3ckpt.tools.verify import verify
from tests.helpers import peak_growth, raised
from tests.recordshapes import Columns, Entries, edit_entries, edit_table, inline

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

GiB = 1 << 30
# Far below the claims (3 GiB and up), far above what reading a tiny checkpoint costs.
_MAX_GROWTH_MB = 200


def save(s3: Any, bucket: str) -> dict[str, Any]:
    """A checkpoint in one object: ``w`` (16x4 float32), ``d`` (10 float64), ``step`` (bytes)."""
    generator = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(16, 4, generator=generator),
        "d": torch.randn(10, dtype=torch.float64, generator=generator),
        "step": 7,
    }
    writer = S3Writer(bucket, "ck", config=s3.config(), options=WriteOptions(objects_per_rank=1))
    dcp.save(state, storage_writer=writer)
    return state


def record(s3: Any, bucket: str, *, shape: str = "inline") -> dict[str, Any]:
    """The saved record, as written (``"table"``, version 4) or in the inline shape of versions
    1 and 2 (`recordshapes.inline`), which most tests here edit: old records are checked too."""
    body = s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read()
    loaded: dict[str, Any] = json.loads(body if shape == "table" else inline(body))
    return loaded


def tamper(
    s3: Any, bucket: str, change: Callable[[dict[str, Any]], None], *, shape: str = "inline"
) -> None:
    edited = record(s3, bucket, shape=shape)
    change(edited)
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=json.dumps(edited).encode())


# The rows of the saved record's item table: its items in the order of their names.
_ROWS = {"d": 0, "step": 1, "w": 2}


def in_table(change: Callable[[Columns], None]) -> Callable[[dict[str, Any]], None]:
    return lambda edited: edit_table(edited, change)


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


def _set(column: str, row: int, value: int) -> Callable[[Columns], None]:
    return lambda table: table[column].__setitem__(row, value)


def test_the_item_table_is_checked_as_inline_locators_were(s3: Any, bucket: str) -> None:
    """Versions 3 and 4: a locator of other than its chunk's bytes, one past its object's end,
    one in an object the record does not list, and chunks that leave a gap are refused, naming
    the item; a record from before (inline) is refused alike (the tests above)."""
    save(s3, bucket)
    original = s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read()
    w, objects = _ROWS["w"], record(s3, bucket, shape="table")["objects"]
    (size,) = objects.values()

    def tamper_table(change: Callable[[dict[str, Any]], None]) -> None:
        s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=original)
        tamper(s3, bucket, change, shape="table")

    cases: list[tuple[Callable[[Columns], None], str]] = [
        (_set("lengths", w, 240), "state_dict['w'].chunks[0].locator: 240 bytes"),
        (_set("offsets", w, size - 16), "state_dict['w'].chunks[0].locator: bytes"),
        (_set("keys", _ROWS["step"], 1), "state_dict['step'].locator: object 1 is not listed"),
        (_set("chunk_sizes", 0, 11), "state_dict['d'].chunks[0]: offsets [0] + sizes [11]"),
        (_set("chunk_sizes", 1, 12), "state_dict['w'].chunks[0].locator: 256 bytes"),
    ]
    for change, cause in cases:
        tamper_table(in_table(change))
        error = refused(s3, bucket)
        assert cause in str(error) and f"s3://{bucket}/ck/.metadata" in str(error)

    def gap(table: Columns) -> None:
        table["chunk_sizes"][1] = 12
        table["lengths"][w] = 12 * 4 * 4

    tamper_table(in_table(gap))
    cause = "state_dict['w']: its chunks hold 48 elements, the tensor 64: they leave a gap"
    assert cause in str(refused(s3, bucket))
    tamper_table(lambda r: edit_entries(r, lambda entries: entries["d"].update(dtype="float32")))
    assert "state_dict['d'].chunks[0].locator: 80 bytes" in str(refused(s3, bucket))


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


def _zeros(size: int) -> bytes:
    """One zstd frame of ``size`` zero bytes, compressed a piece at a time: about 32 KB a GiB,
    within the 32768:1 that zstd can reach and `FrameTable.from_json` allows."""
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=size)
    piece = bytes(16 * MiB)
    stored = [
        compressor.compress(piece[: min(len(piece), size - at)])
        for at in range(0, size, len(piece))
    ]
    return b"".join(stored) + compressor.flush()


def _plant_zeros(s3: Any, bucket: str, sizes: list[int], declared: int | None = None) -> None:
    """The record of ``ck`` with float32 tensors ``w0``, ``w1``, ... of ``sizes`` bytes instead
    of its own, each a zstd frame of zeros in an object of its own: consistent, and tiny. With
    ``declared``, each frame's header says that many bytes instead."""
    edited = record(s3, bucket)
    folder = the_object(edited).rpartition("/")[0]
    edited.update(objects={}, frames={}, state_dict={}, planner_data={})
    for i, size in enumerate(sizes):
        key, stored = f"{folder}/zeros-{i}", _zeros(declared or size)
        s3.client.put_object(Bucket=bucket, Key=f"ck/{key}", Body=stored)
        table = base64.b64encode(struct.pack("<IIB", len(stored), checksum(stored), ZSTD))
        edited["objects"][key] = len(stored)
        edited["frames"][key] = {"frame_size": size, "raw_size": size, "table": table.decode()}
        locator = {"key": key, "offset": 0, "length": size}
        edited["state_dict"][f"w{i}"] = {
            "type": "tensor",
            "dtype": "float32",
            "size": [size // 4],
            "layout": "strided",
            "memory_format": "contiguous_format",
            "requires_grad": False,
            "pin_memory": False,
            "chunks": [{"offsets": [0], "sizes": [size // 4], "locator": locator}],
        }
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=json.dumps(edited).encode())


_LOAD = """
import torch.distributed.checkpoint as dcp
dcp.load(state, storage_reader=S3Reader({bucket!r}, "ck", config=config))
"""
_STATE = """
import torch
from s3ckpt import S3Reader
state = {{f"w{{i}}": torch.zeros(size // 4) for i, size in enumerate({sizes})}}
"""


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
def test_a_frame_decodes_straight_into_its_tensor(s3: Any, bucket: str) -> None:
    """A 256 MiB tensor stored as one 8 KB frame loads with a few MiB beside its destination;
    decoded into a buffer of its own first, it cost its whole size again (a 98 KB frame of
    3.2 GB: 6.4 GiB)."""
    save(s3, bucket)
    _plant_zeros(s3, bucket, [256 * MiB])
    sizes = [256 * MiB]
    peak = peak_growth(s3.config(), _LOAD.format(bucket=bucket), _STATE.format(sizes=sizes))
    assert peak.error is None
    assert peak.growth < 64 * MiB, peak


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
def test_a_frame_header_that_claims_more_than_the_record_allocates_nothing(
    s3: Any, bucket: str
) -> None:
    """The record says 1 MiB, the frame's header 512 MiB: a typed error naming the frame, and
    no allocation of what the header claims (there was: 512 MiB, then the error)."""
    save(s3, bucket)
    _plant_zeros(s3, bucket, [1 * MiB], declared=512 * MiB)
    sizes = [1 * MiB]
    peak = peak_growth(s3.config(), _LOAD.format(bucket=bucket), _STATE.format(sizes=sizes))
    assert peak.error is not None and peak.error.startswith("StorageError: "), peak
    assert f"s3://{bucket}/ck/" in peak.error and "/zeros-0 frame 0 (stored bytes 0-" in peak.error
    assert "frame header declares 536870912 bytes, expected 1048576" in peak.error
    assert peak.growth < 64 * MiB, peak


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
def test_export_holds_a_batch_of_tensors_not_the_state(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    """Four 256 MiB tensors, 32 KB stored, exported with 32 MiB of tensors at a time: the peak
    stays under one tensor (it was all four and a decoded frame: 1.25 GiB)."""
    save(s3, bucket)
    _plant_zeros(s3, bucket, [256 * MiB] * 4)
    out = tmp_path / "out.pt"
    argv = ["--part-size", "8", "--max-concurrency", "4", "export", f"s3://{bucket}/ck", str(out)]
    code = f"""
os.environ["AWS_ACCESS_KEY_ID"] = config.access_key_id
os.environ["AWS_SECRET_ACCESS_KEY"] = config.secret_access_key
assert main(["--endpoint-url", config.endpoint_url, *{argv}]) == 0
"""
    setup = "import os\nfrom s3ckpt.cli import main\nfrom s3ckpt.tools import catalog, export"
    peak = peak_growth(s3.config(), code, setup)  # (export imports torch and DCP)
    assert peak.error is None
    assert peak.growth < 256 * MiB, peak
    loaded = torch.load(out, mmap=True, weights_only=True)
    assert sorted(loaded) == ["w0", "w1", "w2", "w3"] and loaded["w3"].shape == (64 * MiB,)


_CLI = """
os.environ["AWS_ACCESS_KEY_ID"] = config.access_key_id
os.environ["AWS_SECRET_ACCESS_KEY"] = config.secret_access_key
exits = main(["--endpoint-url", config.endpoint_url, *{argv}])
assert exits == {exits}, exits
"""
_CLI_SETUP = "import os\nfrom s3ckpt.cli import main"


def _decoded_in_a_child(s3: Any, bucket: str, body: bytes, command: str, exits: int) -> int:
    """The peak RSS growth of ``s3ckpt COMMAND s3://bucket/ck`` over the record ``body``."""
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=body)
    argv = [command, f"s3://{bucket}/ck"]
    peak = peak_growth(s3.config(), _CLI.format(argv=argv, exits=exits), _CLI_SETUP)
    assert peak.error is None, peak
    return peak.growth


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
@pytest.mark.parametrize("command", ["info", "ls"])
def test_a_dense_record_costs_a_bounded_multiple_of_its_size(
    s3: Any, bucket: str, command: str
) -> None:
    """40 MiB of valid JSON in planner_data, three bytes a list (``[[],[],...]``): refused,
    at a few times its size (it cost 2 GiB, 50 times, in ``json.loads`` and a copy)."""
    save(s3, bucket)
    edited = record(s3, bucket)
    edited["planner_data"]["x"] = [[]] * (40 * MiB // 3)
    body = json.dumps(edited, separators=(",", ":")).encode()
    growth = _decoded_in_a_child(s3, bucket, body, command, exits=1 if command == "info" else 0)
    assert growth < MEMORY_BOUND * len(body), growth


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
def test_a_valid_record_of_the_densest_kind_costs_under_its_bound(s3: Any, bucket: str) -> None:
    """A tensor of 300,000 one-element chunks (16 MiB of record, s3ckpt's tiniest chunk, the
    costliest valid content found): ``info`` reads it within `MEMORY_BOUND` times its size
    (it took 13 times, the whole JSON tree and the model beside it)."""
    save(s3, bucket)
    edited = record(s3, bucket)
    key = the_object(edited)
    count = 300_000
    edited["state_dict"] = {
        "t": {
            **edited["state_dict"]["w"],
            "size": [count],
            "chunks": [
                {
                    "offsets": [i],
                    "sizes": [1],
                    "locator": {"key": key, "offset": 4 * (i % 64), "length": 4},
                }
                for i in range(count)
            ],
        }
    }
    body = json.dumps(edited, separators=(",", ":")).encode()
    growth = _decoded_in_a_child(s3, bucket, body, "info", exits=0)
    assert growth < MEMORY_BOUND * len(body), (growth, len(body))


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
def test_a_dense_item_table_costs_under_its_bound(s3: Any, bucket: str) -> None:
    """Versions 3 and 4: 300,000 one-element chunks, in shuffled order (so the general checks run,
    a tuple per chunk, not the whole-array proof of an ordered sharding) and at scattered
    offsets: ``info`` reads the record within `MEMORY_BOUND` times its size plus its table's
    inflated size."""
    save(s3, bucket)
    edited = record(s3, bucket, shape="table")
    count, key = 300_000, the_object(edited)

    def one_tensor(entries: Entries) -> None:
        w = entries.pop("w")
        entries.clear()
        entries["t"] = {**w, "size": [count], "chunks": count}

    edit_entries(edited, one_tensor)
    edited["objects"] = {key: edited["objects"][key]}
    order = list(range(count))
    random.Random(3).shuffle(order)
    edited["items"] = item_table.pack(
        [0] * count, [4 * (i % 64) for i in order], [4] * count, order, [1] * count, [None] * count
    )
    body = json.dumps(edited, separators=(",", ":")).encode()
    inflated = item_table.inflated_size(count, count, False)
    growth = _decoded_in_a_child(s3, bucket, body, "info", exits=0)
    assert growth < MEMORY_BOUND * (len(body) + inflated), (growth, len(body), inflated)


@pytest.mark.stores("seaweedfs")  # measured in a child process: a real server
def test_a_dense_entry_table_costs_under_its_bound(s3: Any, bucket: str) -> None:
    """Version 4: 300,000 scalars with the shortest names a path of a key and a list index can
    make (``"0.0"``, ``"0.1"``, ...): ``ls`` reads the record within `MEMORY_BOUND` times its
    size plus its tables' inflated size (``info`` lists every entry: its output grows too)."""
    save(s3, bucket)
    edited = record(s3, bucket, shape="table")
    count, key = 300_000, the_object(edited)
    names = sorted(f"{i // 10:x}.{i % 10}" for i in range(count))
    paths: dict[str, tuple[str | int, ...]] = {}
    for name in names:
        head, _, index = name.partition(".")
        paths[name] = (head, int(index))

    def scalars(entries: Entries) -> None:
        w = entries.pop("w")
        entries.clear()
        entries.update({name: {**w, "size": [], "chunks": 1} for name in names})

    edit_entries(edited, scalars, paths=paths)
    edited["objects"] = {key: edited["objects"][key]}
    edited["items"] = item_table.pack(
        [0] * count, [4 * (i % 64) for i in range(count)], [4] * count, [], [], [None] * count
    )
    body = json.dumps(edited, separators=(",", ":")).encode()
    table = edited["entries"]
    inflated = item_table.inflated_size(count, 0, False) + entrytable.inflated_size(
        count, table["dims"], table["parts"], table["text"]
    )
    growth = _decoded_in_a_child(s3, bucket, body, "ls", exits=0)
    assert growth < MEMORY_BOUND * (len(body) + inflated), (growth, len(body), inflated)


@pytest.mark.parametrize("bomb", ["counts", "stream"])
def test_an_item_table_cannot_inflate_past_what_its_counts_make(
    s3: Any, bucket: str, bomb: str
) -> None:
    """A table whose entries claim a billion chunks is refused before anything is inflated
    (its size is over ``max_record_size``); one whose deflated stream holds 1 GiB of zeros
    behind a record of a few chunks is cut at what the counts make: neither allocates more."""
    save(s3, bucket)
    edited = record(s3, bucket, shape="table")
    if bomb == "counts":
        edit_entries(edited, lambda entries: entries["w"].update(size=[10**9, 4], chunks=10**9))
        edited["items"].update(rows=10**9 + 2, dims=1 + 2 * 10**9)  # as the entries say
        cause = "over the 268435456 bytes a reader accepts (S3Config.max_record_size)"
    else:
        inflater = zlib.compressobj(9)
        zeros = bytes(16 * MiB)
        stream = b"".join(inflater.compress(zeros) for _ in range(64)) + inflater.flush()
        edited["items"]["deflated"] = base64.b64encode(stream).decode()
        cause = "inflates to other than the"
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=json.dumps(edited).encode())
    before = peak_rss_mb()
    error = refused(s3, bucket)
    assert peak_rss_mb() - before < _MAX_GROWTH_MB
    assert "items" in str(error) and cause in str(error), str(error)
