"""Read planning: which byte ranges a load needs, and the GETs that fetch them. No I/O.

Geometry first: a chunk is stored as raw C-order bytes, and a resharded load may want only a
sub-rectangle of it, so rectangles map to covering byte ranges (`covering_range`, `split_rect`).
Then requests: a `Target` is one destination of bytes, either a memory region that receives an
exact byte range (zero-copy into the destination tensor) or a function that consumes the range's
bytes (copies into a strided destination, or hands non-tensor bytes to the planner).
`plan_fetches` merges targets in the same object whose ranges are close (`coalesce`: one round
trip beats a few wasted bytes), splits large zero-copy targets so they download concurrently,
and caps every fetch's size. A fetch streams into its zero-copy targets directly; only the other
targets get a buffer (`destinations`), so the memory a load holds beyond its destination tensors
is bounded by ``max_size x concurrency`` (and, for compressed objects, 1 MiB and a zstd window of
at most a frame per frame being decoded: `frames.decode_into`). `s3ckpt.dcp.fetching` runs the
plan. All byte ranges are half-open ``(start, end)``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .frames import FrameTable

__all__ = [
    "Fetch",
    "Merged",
    "Target",
    "check_plan",
    "coalesce",
    "covering_range",
    "destinations",
    "is_exact",
    "plan_fetches",
    "row_major_strides",
    "split_rect",
]

Rect = tuple[tuple[int, ...], tuple[int, ...]]


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-order array, so a multi-index maps to a linear element index."""
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative dimension")
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def _check_rect(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> None:
    """Reject a rectangle that does not lie inside the chunk; a bad plan would read wrong bytes."""
    if not len(shape) == len(offsets) == len(lengths):
        raise ValueError(
            f"shape {tuple(shape)}, offsets {tuple(offsets)} and lengths {tuple(lengths)} "
            "must have the same number of dimensions"
        )
    for dim, (d, o, n) in enumerate(zip(shape, offsets, lengths, strict=True)):
        if d < 0 or o < 0 or n < 0:
            raise ValueError(f"dim {dim}: negative size (shape {d}, offset {o}, length {n})")
        if o + n > d:
            raise ValueError(f"dim {dim}: offset {o} + length {n} exceeds the chunk's size {d}")


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _check_range(what: str, start: int, end: int) -> None:
    if not 0 <= start <= end:
        raise ValueError(f"{what} ({start}, {end}) is not a byte range with 0 <= start <= end")


def _span(
    strides: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """Byte range from the first to one past the last element of a non-empty rectangle."""
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def covering_range(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """Smallest byte range (relative to the chunk start) holding every element of the rectangle.

    Fetching this one range is enough to extract the rectangle; empty rectangles give ``(0, 0)``.
    """
    _check_rect(shape, offsets, lengths)
    _check_positive("itemsize", itemsize)
    if 0 in lengths:
        return (0, 0)
    return _span(row_major_strides(shape), offsets, lengths, itemsize)


def is_exact(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether the rectangle is one contiguous run, so its covering range wastes no bytes.

    That holds when every dimension after the first one whose length is not 1 is taken in full.
    """
    _check_rect(shape, offsets, lengths)
    if 0 in lengths:
        return True
    outer = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    return all(n == d for n, d in zip(lengths[outer + 1 :], shape[outer + 1 :], strict=True))


def split_rect(
    shape: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    itemsize: int,
    max_bytes: int,
) -> list[Rect]:
    """Tile a rectangle, in row-major order, into pieces whose covering range fits ``max_bytes``.

    This bounds the memory of each fetch. Pieces are runs of slices along the outermost dimension
    longer than 1; a slice too big on its own is split the same way along later dimensions, down to
    single elements, so each piece covers at most ``max(max_bytes, itemsize)`` bytes. A rectangle
    that fits comes back unchanged as the only piece; an empty one gives no pieces.
    """
    _check_rect(shape, offsets, lengths)
    _check_positive("itemsize", itemsize)
    _check_positive("max_bytes", max_bytes)
    if 0 in lengths:
        return []  # nothing to fetch; a zero-length GET is not expressible as an HTTP Range
    strides = row_major_strides(shape)

    def pieces(start_dim: int, offs: list[int], lens: list[int]) -> Iterator[Rect]:
        first, end = _span(strides, offs, lens, itemsize)
        dim = next((i for i in range(start_dim, len(lens)) if lens[i] > 1), None)
        if end - first <= max_bytes or dim is None:
            yield tuple(offs), tuple(lens)
            return
        step = strides[dim] * itemsize  # each extra slice along ``dim`` adds this many bytes
        one = end - first - (lens[dim] - 1) * step
        run = 1 if one > max_bytes else (max_bytes - one) // step + 1
        for s in range(0, lens[dim], run):
            sub_offs, sub_lens = list(offs), list(lens)
            sub_offs[dim] += s
            sub_lens[dim] = min(run, lens[dim] - s)
            if one > max_bytes:
                yield from pieces(dim + 1, sub_offs, sub_lens)
            else:
                yield tuple(sub_offs), tuple(sub_lens)

    return list(pieces(0, list(offsets), list(lengths)))


@dataclass(frozen=True, slots=True)
class Merged:
    """One GET ``[start, end)`` serving the input ranges whose indices are in ``members``."""

    start: int
    end: int
    members: tuple[int, ...]  # indices into the input list, in ascending start order


def coalesce(ranges: Sequence[tuple[int, int]], *, max_gap: int, max_size: int) -> list[Merged]:
    """Merge byte ranges into fewer, larger requests, sorted by start.

    Sorted neighbours merge when the gap from the merged end to the next start is at most
    ``max_gap`` and the merged range stays within ``max_size``. A range lying wholly inside the
    current merged range always joins it (it costs no extra bytes), even when that range is an
    oversized single one. Overlaps count as negative gaps. Only all-empty groups give empty results.
    """
    if max_gap < 0:
        raise ValueError(f"max_gap must be >= 0, got {max_gap}")
    _check_positive("max_size", max_size)
    for i, (start, end) in enumerate(ranges):
        _check_range(f"range {i}", start, end)
    groups: list[tuple[int, int, list[int]]] = []
    for i in sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1], i)):
        start, end = ranges[i]
        if groups:
            g_start, g_end, members = groups[-1]
            if start - g_end <= max_gap and (end <= g_end or end - g_start <= max_size):
                groups[-1] = (g_start, max(g_end, end), members)
                members.append(i)
                continue
        groups.append((start, end, [i]))
    return [Merged(g_start, g_end, tuple(members)) for g_start, g_end, members in groups]


@dataclass(eq=False, slots=True)
class Target:
    """Bytes ``[start, end)`` of object ``key``, for read item number ``item``.

    Exactly one of ``sink`` (a writable view of ``end - start`` bytes) and ``place`` is set.
    """

    item: int
    key: str
    start: int
    end: int
    sink: memoryview | None = None
    place: Callable[[memoryview], None] | None = None


@dataclass(eq=False)
class Fetch:
    """One ranged GET serving ``targets``."""

    key: str
    start: int
    end: int
    targets: list[Target] = field(default_factory=list)


def plan_fetches(
    targets: Sequence[Target], *, max_gap: int, max_size: int, align: Mapping[str, int]
) -> list[Fetch]:
    """Group, merge and split targets into fetches; every target is served by exactly one.

    ``align[key]`` is the object's frame size: reads fetch whole frames, so zero-copy targets are
    cut at frame boundaries and merging works on frame-aligned ranges of at most ``max_size``.
    An object not in ``align`` has no frames (a safetensors file): its ranges are fetched as
    they are, zero-copy targets cut every ``max_size`` bytes.
    """
    by_key: dict[str, list[Target]] = defaultdict(list)
    for target in targets:
        if target.end > target.start:
            by_key[target.key].extend(_split(target, align.get(target.key, max_size)))
    fetches: list[Fetch] = []
    for key, group in sorted(by_key.items()):
        frame = align.get(key, 1)
        ranges = [(t.start // frame * frame, -(-t.end // frame) * frame) for t in group]
        merged = coalesce(ranges, max_gap=max_gap, max_size=max_size)
        fetches.extend(Fetch(key, m.start, m.end, [group[i] for i in m.members]) for m in merged)
    return fetches


def _split(target: Target, frame: int) -> list[Target]:
    """A zero-copy target is cut at every frame boundary, each piece a slice of its sink.

    A piece then lies in one frame, so merging puts it in the fetch that already holds that
    frame even when a fetch closes between two tensors; no frame is fetched twice. This holds
    for targets smaller than a frame too: one across a boundary would otherwise pull in both
    frames, the first of which the previous fetch may already hold.
    """
    if target.sink is None or target.start // frame == (target.end - 1) // frame:
        return [target]
    cuts = [target.start, *range((target.start // frame + 1) * frame, target.end, frame)]
    return [
        Target(target.item, target.key, s, e, sink=target.sink[s - target.start : e - target.start])
        for s, e in itertools.pairwise([*cuts, target.end])
    ]


def destinations(
    fetch: Fetch,
) -> tuple[list[tuple[int, memoryview]], list[tuple[Target, memoryview]]]:
    """Where a fetch's bytes go: ``(offset, view)`` segments for the download to fill, and the
    targets whose bytes land in a fresh buffer first (call this once a request slot is held)."""
    segments: list[tuple[int, memoryview]] = []
    buffered: list[tuple[Target, memoryview]] = []
    for target in fetch.targets:
        view = target.sink
        if view is None:
            view = memoryview(bytearray(target.end - target.start))
            buffered.append((target, view))
        segments.append((target.start, view))
    return segments, buffered


def check_plan(key: str, table: FrameTable, limit: int) -> list[Fetch]:
    """Fetches without targets that cover a whole object in runs of whole frames of about
    ``limit`` stored bytes: what `s3ckpt verify` reads (bytes that are only checked)."""
    fetches: list[Fetch] = []
    start = 0
    for number, end in enumerate(table.starts[1:]):
        if end - table.starts[start] >= limit or end == table.size:
            raw_end = min((number + 1) * table.frame_size, table.raw_size)
            fetches.append(Fetch(key, start * table.frame_size, raw_end))
            start = number + 1
    return fetches
