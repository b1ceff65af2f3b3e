"""The safetensors codec against the ``safetensors`` library: what one writes the other reads, and
hostile headers are refused by both."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import safetensors.torch
import torch

from s3ckpt.errors import MetadataError
from s3ckpt.format import safetensors as st

NAMES = {getattr(torch, name): dtype for dtype, (name, _) in st.DTYPES.items()}


def _state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(3, 4),
        "ids": torch.arange(5, dtype=torch.int64),
        "scale": torch.tensor(2.5).bfloat16(),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(7).half(),
    }


def _file(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    header = st.layout([(k, NAMES[v.dtype], tuple(v.shape)) for k, v in state.items()], metadata)
    data = [state[t.name].contiguous().reshape(-1).view(torch.uint8) for t in header.tensors]
    return header.encode() + b"".join(bytes(d.numpy()) for d in data)


def _decode(data: bytes) -> st.Header:
    length = st.header_length(data[: st.PREFIX], len(data), "s3://b/f")
    return st.decode(data[st.PREFIX : st.PREFIX + length], len(data), "s3://b/f")


def test_what_the_codec_writes_the_library_reads() -> None:
    state = _state()
    data = _file(state, {"format": "pt"})
    back = safetensors.torch.load(data)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    header = _decode(data)
    assert header.data_start % 8 == 0 and header.metadata == {"format": "pt"}
    for info in header.tensors:  # widest dtype first: every tensor aligned to its element size
        assert (header.data_start + info.start) % st.DTYPES[info.dtype][1] == 0


def test_what_the_library_writes_the_codec_reads() -> None:
    state = _state()
    data = safetensors.torch.save(state, metadata={"format": "pt"})
    header = _decode(data)
    assert header.metadata == {"format": "pt"}
    assert {t.name: (t.dtype, t.shape) for t in header.tensors} == {
        k: (NAMES[v.dtype], tuple(v.shape)) for k, v in state.items()
    }
    for info in header.tensors:
        raw = data[header.data_start + info.start : header.data_start + info.end]
        assert raw == bytes(state[info.name].contiguous().reshape(-1).view(torch.uint8).numpy())


def _with_header(body: Any, data: bytes = b"\0" * 16, length: int | None = None) -> bytes:
    text = body if isinstance(body, bytes) else json.dumps(body).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _entry(dtype: str, shape: list[int], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


HOSTILE = {
    "huge header length": (_with_header({}, length=2**62), "over the limit"),
    "header past the end": (_with_header({}, length=100), "past the end"),
    "offsets outside the file": (
        _with_header({"a": _entry("F32", [8], 0, 32)}),
        "cover 32 bytes of data, the file holds 16",
    ),
    "overlapping tensors": (
        _with_header({"a": _entry("F32", [3], 0, 12), "b": _entry("F32", [2], 8, 16)}),
        "overlaps",
    ),
    "a gap": (
        _with_header({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [1], 12, 16)}),
        "gap",
    ),
    "shape against offsets": (
        _with_header({"a": _entry("F32", [3], 0, 16)}),
        r"of shape \(3,\) is 12 bytes",
    ),
    "unknown dtype": (_with_header({"a": _entry("F128", [1], 0, 16)}), "unknown dtype"),
    "negative offset": (_with_header({"a": _entry("U8", [16], -1, 15)}), "not a byte range"),
    "a name twice": (
        _with_header(
            b'{"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},'
            b'"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}'
        ),
        "appears twice",
    ),
    "not json": (_with_header(b"[not json"), "not valid JSON"),
    "metadata not strings": (
        _with_header({"__metadata__": {"k": 1}, "a": _entry("U8", [16], 0, 16)}),
        "strings to strings",
    ),
}

# The library keeps the last of two equal names; which bytes a name means must not depend on that.
STRICTER = {"a name twice"}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_headers_are_refused_like_the_library_refuses_them(case: str) -> None:
    data, why = HOSTILE[case]
    with pytest.raises(MetadataError, match=why) as raised:
        _decode(data)
    assert "s3://b/f" in str(raised.value)
    if case in STRICTER:
        return
    with pytest.raises(Exception):  # noqa: B017  # the library's own error types
        safetensors.torch.load(data)


def test_a_sound_hand_made_header_decodes() -> None:
    data = _with_header({"a": _entry("F32", [2], 0, 8), "b": _entry("I32", [2], 8, 16)})
    header = _decode(data)
    assert [(t.name, t.start, t.end) for t in header.tensors] == [("a", 0, 8), ("b", 8, 16)]
    assert set(safetensors.torch.load(data)) == {"a", "b"}


def test_shards_follow_save_pretrained() -> None:
    sizes = [("a", 40), ("b", 50), ("c", 200), ("d", 10), ("e", 95)]
    assert st.plan_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert st.plan_shards(sizes, 10**9) == [["a", "b", "c", "d", "e"]]
    assert st.shard_name(1, 1) == "model.safetensors"
    assert st.shard_name(2, 3) == "model-00002-of-00003.safetensors"


def test_an_index_round_trips_and_refuses_paths() -> None:
    text = st.encode_index({"b": "model-00002-of-00002.safetensors", "a": "x"}, 123)
    body = json.loads(text)
    assert body["metadata"] == {"total_size": 123} and list(body["weight_map"]) == ["a", "b"]
    assert st.decode_index(text, "u") == body["weight_map"]
    with pytest.raises(MetadataError, match="weight_map"):
        st.decode_index(json.dumps({"weight_map": {"a": "../x"}}).encode(), "u")
