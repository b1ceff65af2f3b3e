"""Turn a load's byte needs into GET requests. No I/O.

A `Target` is one destination of bytes: either a memory region that receives an exact byte range
(zero-copy into the destination tensor) or a function that consumes the range's bytes (copies into
a strided destination, or hands non-tensor bytes to the planner). `plan_fetches` merges targets in
the same object whose ranges are close (one round trip beats a few wasted bytes), splits large
zero-copy targets so they download concurrently, and caps every fetch's size. A fetch streams
into its zero-copy targets directly; only the other targets get a buffer (`destinations`), so the
memory a load holds beyond its destination tensors is bounded by ``max_size x concurrency``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .ranges import coalesce

__all__ = ["Fetch", "Target", "destinations", "plan_fetches"]


@dataclass(eq=False)
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
    """
    by_key: dict[str, list[Target]] = defaultdict(list)
    for target in targets:
        if target.end > target.start:
            by_key[target.key].extend(_split(target, align[target.key]))
    fetches: list[Fetch] = []
    for key, group in sorted(by_key.items()):
        frame = align[key]
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
    if target.sink is None:
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
