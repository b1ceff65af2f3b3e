"""The record's own model: decoded without torch, with DCP's ``Metadata`` built only on demand,
and the tables of names that stand in for torch's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
from s3ckpt.format.record import BytesEntry, Locator, TensorEntry, decode, encode, torchmeta
from s3ckpt.format.record.model import DTYPE_SIZES, LAYOUTS, MEMORY_FORMATS

URL = "s3://bucket/run/step-3/.metadata"


def _record() -> bytes:
    """A bfloat16 tensor in two row chunks, a float64 scalar and a non-tensor value."""
    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16),
        torch.Size([4, 3]),
        [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
        ],
    )
    scalar = TensorStorageMetadata(
        TensorProperties(dtype=torch.float64),
        torch.Size([]),
        [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
    )
    metadata = Metadata({"w": w, "s": scalar, "step": BytesStorageMetadata()}, version="1.0.0")
    locators = {
        MetadataIndex("w", [0, 0]): Locator("o", 0, 12),
        MetadataIndex("w", [2, 0]): Locator("o", 12, 12),
        MetadataIndex("s", []): Locator("o", 24, 8),
        MetadataIndex("step"): Locator("o", 32, 5),
    }
    frames = {"o": FrameTable.raw(4096, [0], 37)}
    return encode(
        metadata,
        locators,
        save_id="abc",
        created=1.5,
        objects={"o": 37},
        frames=frames,
        extra={"world_size": 2},
    )


def test_names_stand_for_torch_objects_of_these_sizes() -> None:
    for name, size in DTYPE_SIZES.items():
        dtype = getattr(torch, name, None)
        if dtype is not None:
            assert dtype.itemsize == size, name
            assert torchmeta.DTYPES[name] is dtype
    assert set(torchmeta.LAYOUT_TYPES) <= set(LAYOUTS)
    assert set(torchmeta.MEMORY_FORMAT_TYPES) == set(MEMORY_FORMATS)
    assert torchmeta.DTYPES["float32"] is torch.float32


def test_decode_gives_the_formats_own_model() -> None:
    checkpoint = decode(_record(), url=URL)
    w, s, step = (checkpoint.entries[name] for name in ("w", "s", "step"))
    assert isinstance(w, TensorEntry) and isinstance(s, TensorEntry)
    assert (w.dtype, w.size, w.layout, w.nbytes) == ("bfloat16", [4, 3], "strided", 24)
    assert [(c.offsets, c.sizes, c.locator) for c in w.chunks] == [
        ((0, 0), (2, 3), Locator("o", 0, 12)),
        ((2, 0), (2, 3), Locator("o", 12, 12)),
    ]
    assert (s.size, s.nbytes) == ([], 8)
    assert step == BytesEntry(Locator("o", 32, 5))
    assert (checkpoint.tensors, checkpoint.logical_bytes, checkpoint.stored_bytes) == (2, 37, 37)
    assert (checkpoint.save_id, checkpoint.extra, checkpoint.dcp_version) == (
        "abc",
        {"world_size": 2},
        "1.0.0",
    )


def test_dcp_metadata_is_built_once_from_the_model() -> None:
    checkpoint = decode(_record(), url=URL)
    metadata = checkpoint.metadata
    assert metadata is checkpoint.metadata and metadata.storage_data is checkpoint.locators
    w = metadata.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata)
    assert w.properties.dtype is torch.bfloat16 and w.size == torch.Size([4, 3])
    assert [index.index for index in checkpoint.locators if index.fqn == "w"] == [0, 1]
    assert checkpoint.locators[MetadataIndex("step")] == Locator("o", 32, 5)
    assert isinstance(metadata.state_dict_metadata["step"], BytesStorageMetadata)


def test_a_dtype_this_torch_lacks_fails_when_dcp_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(torchmeta.DTYPES, "bfloat16")
    checkpoint = decode(_record(), url=URL)  # listing and describing still work
    assert checkpoint.tensors == 2
    with pytest.raises(
        MetadataError, match=r"state_dict\['w'\]\.dtype: 'bfloat16' is not in this torch"
    ) as caught:
        checkpoint.metadata  # noqa: B018
    assert URL in str(caught.value) and caught.value.url == URL


def test_reading_a_record_imports_no_torch(tmp_path: Path) -> None:
    (tmp_path / "record").write_bytes(_record())
    script = (
        "import json, sys\n"
        "from s3ckpt.format.record import decode\n"
        f"ckpt = decode(open({str(tmp_path / 'record')!r}, 'rb').read(), url='u')\n"
        "print(json.dumps([ckpt.tensors, ckpt.logical_bytes, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout) == [2, 37, False]
