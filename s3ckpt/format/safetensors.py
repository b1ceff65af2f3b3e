"""The safetensors file format and Hugging Face's sharded layout of it. Pure: bytes in, bytes out.

A file is an 8-byte little-endian header length N, N bytes of JSON (padded with spaces so that
the data starts 8-byte aligned), then the tensors' raw little-endian C-order bytes. The header
maps each name to ``dtype``, ``shape`` and ``data_offsets`` (relative to the data), and may hold
``__metadata__`` (strings only). `decode` refuses what the ``safetensors`` library refuses: a
header over 100 MB or past the end of the file, unknown dtypes, offsets that disagree with the
shape, and tensors that overlap, leave gaps or do not cover the data exactly; a sharded
directory's ``model.safetensors.index.json`` maps names to files (`decode_index`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MetadataError

__all__ = [
    "DTYPES",
    "HEADER_LIMIT",
    "INDEX",
    "PREFIX",
    "SINGLE",
    "Header",
    "TensorInfo",
    "decode",
    "decode_index",
    "encode_index",
    "header_length",
    "layout",
    "nbytes",
    "plan_shards",
    "shard_name",
]

PREFIX = 8  # the header length's bytes
HEADER_LIMIT = 100_000_000  # the safetensors library's own limit
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_META = "__metadata__"

# safetensors dtype -> (torch's attribute name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "C64": ("complex64", 8),
    "F64": ("float64", 8),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a file; ``start`` and ``end`` are relative to the data (after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A file's header: its tensors in data order, its metadata, and where the data starts."""

    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str]
    data_start: int

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    def encode(self) -> bytes:
        """The header's bytes: length, JSON, padding (``data_start`` of them)."""
        body: dict[str, Any] = {_META: dict(self.metadata)} if self.metadata else {}
        for t in self.tensors:
            body[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [t.start, t.end],
            }
        return _framed(json.dumps(body, separators=(",", ":")).encode())


def _framed(text: bytes) -> bytes:
    padded = text + b" " * (-len(text) % PREFIX)
    return struct.pack("<Q", len(padded)) + padded


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * DTYPES[dtype][1]


def layout(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]
) -> Header:
    """The header for ``(name, dtype, shape)`` tensors: ordered as the safetensors library
    orders them (widest dtype first, then by name), so that every tensor's data is aligned to
    its element size."""
    ordered = sorted(tensors, key=lambda t: (-DTYPES[t[1]][1], t[0]))
    infos, at = [], 0
    for name, dtype, shape in ordered:
        size = nbytes(dtype, shape)
        infos.append(TensorInfo(name, dtype, tuple(shape), at, at + size))
        at += size
    draft = Header(tuple(infos), dict(metadata), 0)
    return Header(draft.tensors, draft.metadata, len(draft.encode()))


def header_length(prefix: bytes, file_size: int, url: str) -> int:
    """The JSON's length from a file's first 8 bytes; refused if it cannot be a header."""
    if len(prefix) < PREFIX or file_size < PREFIX:
        raise MetadataError(f"{url}: {file_size} bytes, too short for a safetensors file", url=url)
    (length,) = struct.unpack("<Q", prefix[:PREFIX])
    if length > HEADER_LIMIT:
        raise MetadataError(
            f"{url}: header length {length} is over the limit of {HEADER_LIMIT} bytes", url=url
        )
    if PREFIX + length > file_size:
        raise MetadataError(
            f"{url}: header length {length} runs past the end of the file ({file_size} bytes)",
            url=url,
        )
    return int(length)


def decode(text: bytes, file_size: int, url: str) -> Header:
    """The header whose JSON is ``text`` (the bytes after the length), in a file of
    ``file_size`` bytes; MetadataError naming the file and the tensor if it is not sound."""
    data_size = file_size - PREFIX - len(text)
    raw = _json(text, url)
    metadata = raw.pop(_META, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise MetadataError(f"{url}: {_META} must map strings to strings", url=url)
    infos = sorted(
        (_tensor(name, entry, url) for name, entry in raw.items()), key=lambda t: (t.start, t.end)
    )
    at = 0
    for info in infos:
        if info.start != at:
            what = "overlaps the tensor before it" if info.start < at else "leaves a gap before it"
            raise MetadataError(
                f"{url}: tensor {info.name!r} at data offsets {info.start}-{info.end} {what}",
                url=url,
            )
        at = info.end
    if at != data_size:
        raise MetadataError(
            f"{url}: the tensors cover {at} bytes of data, the file holds {data_size}", url=url
        )
    return Header(tuple(infos), metadata, PREFIX + len(text))


def _json(text: bytes, url: str) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found = dict(pairs)
        if len(found) != len(pairs):
            raise ValueError("a name appears twice")
        return found

    try:
        if not text.lstrip().startswith(b"{"):
            raise ValueError("it is not a JSON object")
        value = json.loads(text.decode(), object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise MetadataError(f"{url}: the header is not valid JSON: {e}", url=url) from None
    assert isinstance(value, dict)
    return value


def _tensor(name: str, entry: Any, url: str) -> TensorInfo:
    def refuse(why: str) -> MetadataError:
        return MetadataError(f"{url}: tensor {name!r}: {why}", url=url)

    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise refuse("expected exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise refuse(f"unknown dtype {dtype!r}")
    if not _naturals(shape):
        raise refuse(f"shape {shape!r} is not a list of sizes")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise refuse(f"data_offsets {offsets!r} is not a byte range [start, end]")
    if offsets[1] - offsets[0] != nbytes(dtype, shape):
        raise refuse(
            f"{dtype} of shape {tuple(shape)} is {nbytes(dtype, shape)} bytes, its data_offsets "
            f"{offsets} hold {offsets[1] - offsets[0]}"
        )
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def shard_name(number: int, count: int) -> str:
    """Hugging Face's name for file ``number`` (from 1) of ``count``."""
    return SINGLE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names (in order) grouped into files of at most ``max_shard_size`` bytes of data, as
    ``save_pretrained`` groups them: a new file when the next tensor would overflow this one (a
    tensor larger than the limit gets a file of its own)."""
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    shards: list[list[str]] = [[]]
    held = 0
    for name, size in sizes:
        if shards[-1] and held + size > max_shard_size:
            shards.append([])
            held = 0
        shards[-1].append(name)
        held += size
    return shards


def encode_index(weight_map: Mapping[str, str], total_size: int) -> bytes:
    body = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(body, indent=2).encode() + b"\n"


def decode_index(text: bytes, url: str) -> dict[str, str]:
    """The ``weight_map`` of an index: tensor name -> file name (a plain name, no path)."""
    weights = _json(text, url).get("weight_map")
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _plain(v) for k, v in weights.items()
    ):
        raise MetadataError(f"{url}: weight_map must map names to file names", url=url)
    return weights


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..")
