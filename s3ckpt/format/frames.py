"""Frames: the unit in which stored bytes are checked and compressed. No I/O.

An object's raw bytes are cut into frames of ``frame_size`` bytes (the last may be shorter). Each
frame is stored raw or compressed on its own (zstd, optionally after a byte-plane shuffle that
groups bytes of equal significance of 2-, 4- or 8-byte elements), so a ranged or resharded read
fetches and decodes only the frames it needs. The commit record holds each frame's stored length,
codec and the CRC32C of its stored bytes, so any read, however partial, can be checked. A frame
table is small (9 bytes a frame: about 2 KiB per GiB with 4 MiB frames) and travels as base64.

Decoding trusts the record, not the frame: a frame decodes into the memory waiting for its raw
bytes, never more than the record says it holds (`decode_into`).
"""

from __future__ import annotations

import base64
import itertools
import struct
import sys
import threading
import warnings
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..crc32c import Checksums

if TYPE_CHECKING:
    # At run time torch is imported where a shuffle needs it: the tools read frames without it.
    import torch

__all__ = [
    "RAW",
    "ZSTD",
    "FrameTable",
    "decode",
    "decode_into",
    "encode",
    "shuffle",
]

RAW = 0  # stored as it is
ZSTD = 1  # zstd; with a shuffle, the element size is in the high nibble (0x21, 0x41, 0x81)
_CODECS = {RAW, ZSTD, 0x21, 0x41, 0x81}
_ENTRY = struct.Struct("<IIB")  # stored length, CRC32C, codec
_MAX_FRAME = 2**32 - 1  # the most bytes an entry's stored length can say
_CHUNK = 1 << 20  # decoded bytes held outside the destination, per frame being streamed
_local = threading.local()


def encode(raw: memoryview, level: int, itemsize: int | None) -> tuple[bytes | memoryview, int]:
    """One frame's stored bytes and codec: zstd (after a shuffle by ``itemsize`` when given),
    or the raw bytes when compression does not make them smaller."""
    if itemsize in (2, 4, 8) and len(raw) and len(raw) % itemsize == 0:
        planes = shuffle(raw, itemsize, out=_scratch(len(raw)))
        stored: bytes = _compressor(level, planes=True).compress(planes)
        codec = itemsize << 4 | ZSTD
    else:
        stored, codec = _compressor(level, planes=False).compress(raw), ZSTD
    return (raw, RAW) if len(stored) >= len(raw) else (stored, codec)


def decode(stored: bytes | memoryview, codec: int, raw_size: int) -> memoryview:
    """A frame's raw bytes, in a new buffer of ``raw_size`` bytes (see `decode_into`)."""
    out = memoryview(bytearray(raw_size))
    decode_into(stored, codec, raw_size, [(0, out)])
    return out


def decode_into(
    stored: bytes | memoryview, codec: int, raw_size: int, parts: Sequence[tuple[int, memoryview]]
) -> None:
    """Decode a frame into the memory that wants its bytes: ``(offset, view)`` receives raw bytes
    ``[offset, offset + len(view))`` of the frame; bytes that no view wants are dropped.

    ``raw_size`` is the record's size for the frame and the hard limit: the frame's zstd header
    must declare that size (or none), and a frame that decodes to more or fewer bytes raises
    ValueError, as do bytes that do not decode at all. Nothing is allocated by the header's claim.
    Memory: a frame that one view wants whole is decoded straight into it (zstd's single pass).
    Any other (a shuffled frame, or one shared by several views) streams through this thread's
    `_CHUNK` buffer and a zstd window of at most the frame's raw size (and 128 MiB, zstd's
    default limit), freed once the frame is done.
    """
    if codec == RAW:
        if len(stored) != raw_size:
            raise ValueError(f"frame has {len(stored)} bytes, expected {raw_size}")
        _place(memoryview(stored), 0, parts)
        return
    import zstandard

    itemsize = codec >> 4
    if itemsize and raw_size % itemsize:
        raise ValueError(f"{raw_size} bytes are not a whole number of {itemsize}-byte elements")
    try:
        declared = zstandard.frame_content_size(stored)  # -1: the header does not say
        if declared not in (raw_size, -1):
            raise ValueError(f"frame header declares {declared} bytes, expected {raw_size}")
        if declared == raw_size and not itemsize and _whole(parts, raw_size):
            # The single pass: zstd decodes a whole frame into a large enough output at once.
            reader = _decompressor().stream_reader(stored, read_across_frames=True)
            decoded = _fill(reader, parts[0][1])
        else:
            # A fresh context: the window a streamed frame makes zstd allocate goes with it.
            reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
            decoded = _stream(reader, raw_size, itemsize, parts)
        if decoded == raw_size and reader.read(1):
            decoded += 1
    except zstandard.ZstdError as e:
        raise ValueError(f"frame does not decompress: {e}") from None
    if decoded > raw_size:
        raise ValueError(f"frame decodes to more than the {raw_size} bytes expected")
    if decoded < raw_size:
        raise ValueError(f"frame decodes to {decoded} bytes, {raw_size} expected")


def _whole(parts: Sequence[tuple[int, memoryview]], raw_size: int) -> bool:
    return len(parts) == 1 and parts[0][0] == 0 and len(parts[0][1]) == raw_size


def _fill(reader: Any, view: memoryview) -> int:
    """Decode into ``view`` until it is full or the frame ends; the bytes decoded."""
    filled = 0
    while filled < len(view) and (count := reader.readinto(view[filled:])):
        filled += count
    return filled


def _stream(
    reader: Any, raw_size: int, itemsize: int, parts: Sequence[tuple[int, memoryview]]
) -> int:
    """Decode a chunk at a time and place each; the bytes decoded (stops past ``raw_size``)."""
    buffer, at = _chunk(), 0
    while at <= raw_size and (count := _fill(reader, buffer)):
        if at + count <= raw_size:
            if itemsize:
                _place_planes(buffer[:count], at, raw_size // itemsize, itemsize, parts)
            else:
                _place(buffer[:count], at, parts)
        at += count
    return at


def _place(data: memoryview, at: int, parts: Sequence[tuple[int, memoryview]]) -> None:
    """Raw bytes ``[at, at + len(data))`` of a frame into the parts that want them."""
    for start, view in parts:
        lo, hi = max(start, at), min(start + len(view), at + len(data))
        if lo < hi:
            view[lo - start : hi - start] = data[lo - at : hi - at]


def _place_planes(
    data: memoryview, at: int, count: int, itemsize: int, parts: Sequence[tuple[int, memoryview]]
) -> None:
    """Stored bytes ``[at, at + len(data))`` of a shuffled frame of ``count`` elements into the
    parts: stored byte ``plane * count + i`` is byte ``plane`` of element ``i``, raw byte
    ``i * itemsize + plane``. One strided copy per plane and part."""
    source, done = _bytes_of(data), 0
    while done < len(data):
        plane, first = divmod(at + done, count)
        run = min(count - first, len(data) - done)
        for start, view in parts:
            # The elements whose byte ``plane`` lies in the part's raw bytes.
            lo = max(first, -(-(start - plane) // itemsize))
            hi = min(first + run, -(-(start + len(view) - plane) // itemsize))
            if lo < hi:
                into = lo * itemsize + plane - start
                target = _bytes_of(view)[into : into + (hi - lo - 1) * itemsize + 1 : itemsize]
                target.copy_(source[done + lo - first : done + hi - first])
        done += run


# One strided copy per byte plane: torch's copy of a transposed (n, itemsize) byte matrix walks
# it a byte at a time (0.35-0.48 GB/s in bench_compression's codec stages); a plane at a time
# ran at 0.9-1.8 GB/s there.
def shuffle(raw: bytes | memoryview, itemsize: int, out: memoryview | None = None) -> memoryview:
    """The byte planes of ``raw``'s elements, least significant first."""
    import torch

    out = memoryview(bytearray(len(raw))) if out is None else out
    elements = _bytes_of(raw).view(-1, itemsize)
    planes = torch.frombuffer(out, dtype=torch.uint8).view(itemsize, -1)
    for plane in range(itemsize):
        planes[plane].copy_(elements[:, plane])
    return out


def _chunk() -> memoryview:
    """This thread's `_CHUNK` buffer for streamed frames: bounded, so kept."""
    buffer = getattr(_local, "chunk", None)
    if buffer is None:
        buffer = _local.chunk = memoryview(bytearray(_CHUNK))
    return buffer


def _scratch(size: int) -> memoryview:
    """This thread's reusable buffer: a fresh one per frame costs a zero-fill or page faults."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or len(buffer) < size:
        buffer = _local.scratch = bytearray(size)
    return memoryview(buffer)[:size]


def _bytes_of(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``data`` without a copy, writable where ``data`` is."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


def _compressor(level: int, *, planes: bool) -> Any:
    """zstd at ``level``; for byte planes at level 1, with a 4096-entry match table instead of
    16384: planes of float mantissas hold few real matches, and the smaller table finds fewer
    false ones, so it is faster and compresses weights better (compare bench_compression's
    "zstd_compress_shuffled" stage, zstd's own table, with the s3ckpt row's speed and ratio)."""
    import zstandard

    cache = _local.__dict__.setdefault("compressors", {})
    if (level, planes) not in cache:
        if planes and level == 1:
            params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=12)
            cache[level, planes] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level, planes] = zstandard.ZstdCompressor(level=level)
    return cache[level, planes]


def _decompressor() -> Any:
    import zstandard

    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


@dataclass(frozen=True, slots=True)
class FrameTable:
    """How one object is framed: raw size, and each stored frame's size, codec and checksum.

    Kept packed (4 + 4 + 1 bytes a frame, and 8 for its offset), not as Python ints (about 100
    bytes a frame): a table of millions of frames is what a hostile record would amplify."""

    frame_size: int
    sizes: Sequence[int]
    crcs: Sequence[int]
    codecs: Sequence[int]
    raw_size: int
    starts: Sequence[int] = field(init=False, repr=False, compare=False)
    """Stored offset of each frame, and the object's stored size at the end."""

    def __post_init__(self) -> None:
        sizes, crcs = _packed("I", self.sizes), _packed("I", self.crcs)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "crcs", crcs)
        object.__setattr__(self, "codecs", bytes(self.codecs))
        object.__setattr__(self, "starts", array("Q", itertools.accumulate(sizes, initial=0)))

    @classmethod
    def raw(cls, frame_size: int, crcs: Iterable[int], size: int) -> FrameTable:
        """The table of an object stored without compression."""
        crcs = tuple(crcs)
        sizes = (min(frame_size, size - i * frame_size) for i in range(len(crcs)))
        return cls(frame_size, array("I", sizes), crcs, bytes(len(crcs)), size)

    @property
    def size(self) -> int:
        return self.starts[-1]

    @property
    def checksums(self) -> Checksums:
        """The stored frames as checksummed ranges, for reads that verify them."""
        return Checksums(self.starts, self.crcs)

    def raw_length(self, frame: int) -> int:
        return min(self.frame_size, self.raw_size - frame * self.frame_size)

    def frames(self, start: int, end: int) -> range:
        """The frames holding raw bytes ``[start, end)``.

        Raises ValueError for a range that reaches past the last frame: clipped, it would read
        fewer bytes than its destinations wait for.
        """
        first = start // self.frame_size
        last = max(first, (end - 1) // self.frame_size)
        if not 0 <= start <= end or last >= len(self.sizes):
            raise ValueError(
                f"bytes {start}..{end} are not inside the {len(self.sizes)} frames of "
                f"{self.frame_size} bytes of this object"
            )
        return range(first, last + 1)

    def covering(self, start: int, end: int) -> tuple[int, int]:
        """The stored byte range of the frames that hold raw bytes ``[start, end)``."""
        frames = self.frames(start, end)
        return self.starts[frames.start], self.starts[min(frames.stop, len(self.sizes))]

    @property
    def compressed(self) -> bool:
        return any(codec != RAW for codec in self.codecs)

    def to_json(self) -> dict[str, Any]:
        entries = zip(self.sizes, self.crcs, self.codecs, strict=True)
        packed = b"".join(_ENTRY.pack(*entry) for entry in entries)
        table = {"frame_size": self.frame_size, "table": base64.b64encode(packed).decode()}
        return table if self.raw_size == self.size else {**table, "raw_size": self.raw_size}

    @classmethod
    def from_json(cls, value: Any, size: int) -> FrameTable:
        """Parse and check a table; raises ValueError saying what is wrong."""
        return cls.from_parsed(cls.parse_json(value), size)

    @staticmethod
    def parse_json(value: Any) -> tuple[int, bytes, int | None]:
        """A table's frame size, packed entries and raw size (if it says), checked so far as
        they can be without the object's size; raises ValueError saying what is wrong."""
        if not isinstance(value, dict) or not {"frame_size", "table"} <= set(value) <= {
            "frame_size",
            "table",
            "raw_size",
        }:
            raise ValueError("a frame table has 'frame_size', 'table' and maybe 'raw_size'")
        frame_size, table, raw_size = value["frame_size"], value["table"], value.get("raw_size")
        for name, number in (("frame_size", frame_size), ("raw_size", raw_size)):
            if number is not None and (
                not isinstance(number, int) or isinstance(number, bool) or number < 0
            ):
                raise ValueError(f"{name} must be a non-negative integer, got {number!r}")
        if frame_size == 0:
            raise ValueError("frame_size must be positive")
        if not isinstance(table, str):
            raise ValueError("table must be a base64 string")
        try:
            packed = base64.b64decode(table, validate=True)
        except ValueError as e:
            raise ValueError(f"table is not base64: {e}") from None
        if len(packed) % _ENTRY.size:
            raise ValueError(f"table has {len(packed)} bytes, not a multiple of {_ENTRY.size}")
        return frame_size, packed, raw_size

    @classmethod
    def from_parsed(cls, parsed: tuple[int, bytes, int | None], size: int) -> FrameTable:
        """The table of an object of ``size`` stored bytes from what `parse_json` returned."""
        frame_size, packed, raw_size = parsed
        raw_size = size if raw_size is None else raw_size
        if min(frame_size, raw_size) > _MAX_FRAME:
            # A raw size beyond what an entry's 32 bits say of a stored one: no writer makes it.
            raise ValueError(f"frame_size {frame_size}: a frame holds at most {_MAX_FRAME} bytes")
        # The entries' fields apart, a byte at a time (C speed): no tuple per entry.
        sizes, crcs = bytearray(len(packed) // 9 * 4), bytearray(len(packed) // 9 * 4)
        for byte in range(4):
            sizes[byte::4] = packed[byte::9]
            crcs[byte::4] = packed[4 + byte :: 9]
        codecs = packed[8::9]
        parsed_table = cls(frame_size, _from_le(sizes), _from_le(crcs), codecs, raw_size)
        if parsed_table.size != size:
            raise ValueError(f"frames add up to {parsed_table.size} bytes, the object has {size}")
        if len(codecs) != -(-raw_size // frame_size):
            raise ValueError(f"{len(codecs)} frames cannot hold {raw_size} raw bytes")
        if not set(codecs) <= _CODECS:
            raise ValueError("unknown frame codec (written by a newer s3ckpt?)")
        for i, (stored, codec) in enumerate(zip(parsed_table.sizes, codecs, strict=True)):
            # `encode` stores a frame raw unless compressing makes it smaller; zstd holds at most
            # 128 KiB in a block of 4 bytes, and a frame that claims more raw bytes would have a
            # reader allocate more than any stored frame can deliver.
            raw = parsed_table.raw_length(i)
            if stored == 0 or (stored != raw if codec == RAW else not stored < raw <= stored << 15):
                raise ValueError(f"frame {i}: {stored} stored bytes do not fit its codec")
        return parsed_table


def _packed(code: str, values: Sequence[int]) -> array[int]:
    return values if isinstance(values, array) and values.typecode == code else array(code, values)


def _from_le(data: bytearray) -> array[int]:
    """Little-endian 32-bit unsigned ints, as an array (of "I": 4 bytes wherever CPython runs)."""
    values = array("I")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values
