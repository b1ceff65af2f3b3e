"""The whole-record rules of `decode` on hostile records, and that `encode` refuses the same
records: chunks must tile their tensor exactly, and irregular layouts stay cheap to check. On
bytes and in-memory records, no server (the tampering of real saved checkpoints:
tests/integration/test_hostile_records.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from s3ckpt.errors import MetadataError
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.record import Locator, decode, encode, tiling
from tests.recordshapes import inline

URL = "s3://bucket/ck/.metadata"


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
    edited = json.loads(inline(_record(_tensor(size, [([0] * len(size), size)]))))
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
