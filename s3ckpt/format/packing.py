"""How a rank's items are packed: which object holds each (`assign_objects`), and how one
object's bytes are laid out (`Packed`). No I/O.

Items are stored back to back, each starting at a multiple of 8 bytes (zeros in between), so that
a frame cut from a tensor's bytes starts on an element boundary and a byte-plane shuffle lines up
with the elements. Parts and frames are produced on demand from the items' own memory: a range
lying inside one CPU tensor is a zero-copy view; any other range is assembled in a scratch
buffer (copying from accelerator memory if need be).
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections.abc import Sequence

import torch

from ..crc32c import checksum, combine
from . import frames
from .frames import FrameTable
from .tensorbytes import memory_of

__all__ = ["ALIGN", "Packed", "assign_objects", "element_size"]

ALIGN = 8


def element_size(dtype: torch.dtype) -> int | None:
    """The element size a byte-plane shuffle should use for ``dtype`` (None: do not shuffle)."""
    if dtype.is_floating_point:
        return dtype.itemsize
    if dtype.is_complex:
        return dtype.itemsize // 2
    return None


class Packed:
    """The items of one object, packed; ``starts``/``lengths`` locate each item's bytes, and
    every ``frame_size`` bytes are a frame with its own CRC32C."""

    def __init__(
        self, values: list[torch.Tensor | bytes], elements: list[int | None], frame_size: int
    ) -> None:
        self._values = values
        self._elements = elements
        self.frame_size = frame_size
        self._crcs: dict[int, int] = {}
        self._running: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.lengths = [v.numel() if isinstance(v, torch.Tensor) else len(v) for v in values]
        self.starts: list[int] = []
        end = 0
        for length in self.lengths:
            start = -(-end // ALIGN) * ALIGN
            self.starts.append(start)
            end = start + length
        self.size = end

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(item, lo, hi)``: the part of each item's bytes inside ``[start, end)``."""
        # A bisection, not a scan: objects of many small tensors are read frame by frame.
        pieces = []
        for i in range(max(0, bisect.bisect_right(self.starts, start) - 1), len(self.starts)):
            s, n = self.starts[i], self.lengths[i]
            if s >= end:
                break
            if s + n > start and n > 0:
                pieces.append((i, max(start, s) - s, min(end, s + n) - s))
        return pieces

    def view(self, start: int, end: int) -> memoryview | None:
        """Bytes ``[start, end)`` without a copy when they lie inside one item in CPU memory."""
        return self._sole_view(self._pieces(start, end), end - start)

    def views(self, start: int, end: int) -> list[memoryview] | None:
        """Bytes ``[start, end)`` as views of the items' memory and of zeros for the alignment
        gaps, when every item in the range is in CPU memory."""
        out: list[memoryview] = []
        at = start
        for i, lo, hi in self._pieces(start, end):
            value = self._values[i]
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                return None
            if self.starts[i] + lo > at:
                out.append(memoryview(bytes(self.starts[i] + lo - at)))
            memory = memoryview(value) if isinstance(value, bytes) else memory_of(value)
            out.append(memory[lo:hi])
            at = self.starts[i] + hi
        if at < end:
            out.append(memoryview(bytes(end - at)))
        return out

    def _sole_view(self, pieces: list[tuple[int, int, int]], length: int) -> memoryview | None:
        if len(pieces) != 1 or pieces[0][2] - pieces[0][1] != length:
            return None
        i, lo, hi = pieces[0]
        value = self._values[i]
        if not isinstance(value, torch.Tensor):
            return memoryview(value)[lo:hi]
        return memory_of(value)[lo:hi] if value.device.type == "cpu" else None

    def read(self, start: int, end: int, scratch: memoryview) -> memoryview:
        """Bytes ``[start, end)``: a view of an item's memory, or ``scratch`` filled with them."""
        pieces = self._pieces(start, end)
        direct = self._sole_view(pieces, end - start)
        if direct is not None:
            return direct
        out = scratch[: end - start]
        if not out:
            return out
        target = torch.frombuffer(out, dtype=torch.uint8)
        if sum(hi - lo for _, lo, hi in pieces) != len(out):
            target.zero_()  # alignment gaps
        for i, lo, hi in pieces:
            value, at = self._values[i], self.starts[i] + lo - start
            if isinstance(value, torch.Tensor):
                # torch copies without the GIL, so parts are assembled in parallel.
                target[at : at + hi - lo].copy_(value[lo:hi])
            else:
                out[at : at + hi - lo] = value[lo:hi]
        return out

    def shuffle_size(self, start: int, end: int) -> int | None:
        """The element size shared by every item in ``[start, end)``, if there is one."""
        sizes = {self._elements[i] for i, _, _ in self._pieces(start, end)}
        return sizes.pop() if len(sizes) == 1 else None

    def frame_checksum(self, number: int) -> int:
        """CRC32C of frame ``number``, computed once, by whichever worker thread asks first (the
        frame table's or a part's wire checksum); others asking meanwhile wait for it."""
        while True:
            with self._lock:
                crc = self._crcs.get(number)
                if crc is not None:
                    return crc
                running = self._running.get(number)
                if running is None:
                    running = self._running[number] = threading.Event()
                    break
            running.wait()
        try:
            start = number * self.frame_size
            crc = self._crc_of(start, min(start + self.frame_size, self.size))
            with self._lock:
                self._crcs[number] = crc
            return crc
        finally:
            with self._lock:
                del self._running[number]
            running.set()

    def checksum(self, start: int, end: int) -> int:
        """CRC32C of bytes ``[start, end)``, combined from the checksums of the whole frames
        inside it, so that uploading a part does not read its bytes again."""
        crc, at = 0, start
        while at < end:
            number = at // self.frame_size
            frame_end = min((number + 1) * self.frame_size, self.size)
            stop = min(frame_end, end)
            whole = at == number * self.frame_size and stop == frame_end
            piece = self.frame_checksum(number) if whole else self._crc_of(at, stop)
            crc = combine(crc, piece, stop - at)
            at = stop
        return crc

    def _crc_of(self, start: int, end: int) -> int:
        views = self.views(start, end)
        if views is None:
            views = [self.read(start, end, memoryview(bytearray(end - start)))]
        crc = 0
        for view in views:
            crc = checksum(view, crc)
        return crc

    def frame_table(self) -> FrameTable:
        """CRC32C of every frame of the bytes as they are (run in a worker thread)."""
        count = -(-self.size // self.frame_size)
        crcs = [self.frame_checksum(number) for number in range(count)]
        return FrameTable.raw(self.frame_size, crcs, self.size)

    def encode_frame(
        self, number: int, level: int, shuffle: bool
    ) -> tuple[bytes | memoryview, int, int]:
        """Frame ``number`` compressed: its stored bytes, codec and CRC32C (worker thread)."""
        start = number * self.frame_size
        end = min(start + self.frame_size, self.size)
        raw = self.view(start, end)
        if raw is None:
            # Across items: assembled in a buffer of its own, which may come back as stored.
            raw = self.read(start, end, memoryview(bytearray(end - start)))
        itemsize = self.shuffle_size(start, end) if shuffle else None
        stored, codec = frames.encode(raw, level, itemsize)
        return stored, codec, checksum(stored)


def assign_objects(sizes: Sequence[int], max_objects: int, min_object_size: int) -> list[int]:
    """Assign items to objects so that object sizes are balanced; returns each item's object.

    Uses as many objects as make them at least ``min_object_size`` (at most ``max_objects``, at
    least one), so small states do not scatter into tiny objects. Largest items go first to the
    lightest object (LPT), which keeps the heaviest object within 4/3 of the optimum.
    """
    total = sum(sizes)
    count = max(1, min(max_objects, total // max(1, min_object_size)))
    heap = [(0, i) for i in range(count)]
    assignment = [0] * len(sizes)
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, obj = heapq.heappop(heap)
        assignment[item] = obj
        heapq.heappush(heap, (load + sizes[item], obj))
    return assignment
