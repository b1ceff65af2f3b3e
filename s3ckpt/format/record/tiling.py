"""The geometry checks that a tensor's chunks tile it exactly once, which :func:`encode` and
:func:`decode` both make: a record legal field by field can still leave a gap or an overlap."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import compress
from operator import add

from ..jsoncheck import fail


def check_chunk(
    offsets: Sequence[int], sizes: Sequence[int], size: Sequence[int], where: str
) -> None:
    if len(offsets) != len(size) or len(sizes) != len(size):
        fail(
            f"{where}: offsets {list(offsets)} and sizes {list(sizes)} do not match tensor "
            f"size {list(size)}"
        )
    if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
        fail(
            f"{where}: offsets {list(offsets)} + sizes {list(sizes)} exceed tensor size "
            f"{list(size)}"
        )


# A chunk as the tiling check sees it: its position in the record, offsets and sizes.
Box = tuple[int, Sequence[int], Sequence[int]]
# Comparisons the overlap sweep may make: a second of Python (measured), for a layout that no
# DTensor sharding makes.
_MAX_COMPARISONS = 1 << 20


def check_extent(length: int, sizes: Sequence[int], itemsize: int, dtype: str, where: str) -> int:
    """A chunk's element count, once its locator is found to hold exactly its bytes.

    The reader sizes every read from the sizes and the dtype; a locator of another length would
    have it read a neighbour's bytes, or another dtype's, with every checksum passing. Packed
    dtypes (``float4_e2m1fn_x2``) count packed elements, as ``itemsize`` and the writer do.
    ``dtype`` is the dtype's name in the record, for the message.
    """
    count = math.prod(sizes)
    if length != count * itemsize:
        fail(
            f"{where}.locator: {length} bytes, but {count} torch.{dtype} elements (sizes "
            f"{list(sizes)}) "
            f"take {count * itemsize}"
        )
    return count


def check_tiling(size: Sequence[int], volume: int, boxes: list[Box], where: str) -> None:
    """The chunks of a tensor must cover it exactly once.

    DCP fills a destination from whichever chunks intersect it, so a gap loads as elements never
    written and an overlap as elements from either chunk. ``boxes`` are the non-empty chunks,
    which lie inside the tensor (`check_chunk`) and start at distinct offsets; ``volume`` is
    their element count. Equal volumes and no overlap make an exact tiling: one chunk needs no
    more, the chunks of any DTensor sharding form a grid (linear in chunks), and any other
    layout is swept for overlaps, within `_MAX_COMPARISONS`.
    """
    numel = math.prod(size)
    if volume != numel:
        how = "leave a gap" if volume < numel else "overlap"
        fail(f"{where}: its chunks hold {volume} elements, the tensor {numel}: they {how}")
    if len(boxes) > 1 and not _is_grid(size, boxes):
        _check_disjoint(boxes, where)


def _is_grid(size: Sequence[int], boxes: list[Box]) -> bool:
    """Whether, in every dimension, the chunks' extents partition the tensor's.

    Each chunk is then one cell of that grid, and distinct offsets make distinct cells, which
    cannot overlap.
    """
    offsets = list(zip(*(offsets for _, offsets, _ in boxes), strict=True))
    sizes = list(zip(*(sizes for _, _, sizes in boxes), strict=True))
    return _is_grid_columns(size, offsets, sizes)


def _check_disjoint(boxes: list[Box], where: str) -> None:
    """No two chunks overlap: a sweep along the dimension where most chunks start apart compares
    each chunk with those still open where it starts; a layout needing too many is refused."""
    dim = max(range(len(boxes[0][1])), key=lambda d: len({b[1][d] for b in boxes}))
    budget = _MAX_COMPARISONS
    open_boxes: list[Box] = []
    for box in sorted(boxes, key=lambda b: b[1][dim]):
        position, offsets, sizes = box
        open_boxes = [b for b in open_boxes if b[1][dim] + b[2][dim] > offsets[dim]]
        budget -= len(open_boxes) + 1
        if budget < 0:
            fail(f"{where}: {len(boxes)} chunks in a layout too irregular to check for overlaps")
        for other, other_offsets, other_sizes in open_boxes:
            if all(
                a < b + m and b < a + n
                for a, n, b, m in zip(offsets, sizes, other_offsets, other_sizes, strict=True)
            ):
                fail(f"{where}: chunks {other} and {position} overlap")
        open_boxes.append(box)


def check_tiling_columns(
    size: Sequence[int],
    offsets: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    counts: list[int],
    where: str,
) -> None:
    """`check_tiling` of chunks given as columns (``offsets[d][i]``: chunk i's offset in
    dimension d) with their element counts: the grid test runs on the columns, and the boxes of
    the overlap sweep are made only for a layout that is not a grid."""
    numel = math.prod(size)
    volume = sum(counts)
    if volume != numel:
        how = "leave a gap" if volume < numel else "overlap"
        fail(f"{where}: its chunks hold {volume} elements, the tensor {numel}: they {how}")
    if 0 in counts:
        keep = [bool(count) for count in counts]
        offsets = [list(compress(column, keep)) for column in offsets]
        sizes = [list(compress(column, keep)) for column in sizes]
    if sum(map(bool, counts)) < 2 or _is_grid_columns(size, offsets, sizes):
        return
    positions = [i for i, count in enumerate(counts) if count]
    _check_disjoint(
        list(zip(positions, zip(*offsets, strict=False), zip(*sizes, strict=False), strict=True)),
        where,
    )


def _is_grid_columns(
    size: Sequence[int], offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
) -> bool:
    """`_is_grid` on columns: in each dimension, the distinct (start, length) pairs, sorted,
    must each start where the one before ends, from 0 to the tensor's extent."""
    for extent, column, lengths in zip(size, offsets, sizes, strict=True):
        starts, steps = zip(*sorted(set(zip(column, lengths, strict=True))), strict=True)
        ends = list(map(add, starts, steps))
        if starts[0] != 0 or ends[-1] != extent or list(starts[1:]) != ends[:-1]:
            return False
    return True
