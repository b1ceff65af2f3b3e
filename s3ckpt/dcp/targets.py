"""Read items as byte-range targets (`format.readplan.Target`): what `S3Reader` and
`SafetensorsReader` share. A chunk stored as raw row-major bytes at ``base`` in object ``key``
serves a read item either zero-copy (bytes streamed straight into a contiguous CPU destination
of the stored dtype, when the item is one contiguous run) or through pieces of at most
``part_size`` bytes copied into the (strided, other-device) destination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..errors import MetadataError
from ..format import readplan
from ..format.readplan import Target
from ..format.tensorbytes import memory_at

__all__ = ["StoredChunk", "collect", "tensor_targets"]

Finish = Callable[[], None]


class StoredChunk(NamedTuple):
    """Where one chunk of a tensor is stored: its object (full key), first byte, shape, dtype.
    (A tuple: a load makes one per tensor it reads.)"""

    key: str
    base: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def collect(
    items: Sequence[ReadItem], targets_of: Callable[[int, ReadItem], tuple[list[Target], Finish]]
) -> tuple[list[Target], Callable[[int], None]]:
    """Every read item's targets, and what to call as each target completes (an item whose
    targets are all in is finished; one without any, at once)."""
    remaining: dict[int, int] = {}
    finishers: dict[int, Finish] = {}
    targets: list[Target] = []
    for number, item in enumerate(items):
        item_targets, finish = targets_of(number, item)
        targets.extend(item_targets)
        remaining[number] = len(item_targets)
        finishers[number] = finish
    for number, count in remaining.items():
        if count == 0:
            finishers[number]()

    def done(item: int) -> None:
        remaining[item] -= 1
        if remaining[item] == 0:
            finishers[item]()

    return targets, done


def tensor_targets(
    number: int,
    item: ReadItem,
    planner: LoadPlanner,
    chunk: StoredChunk,
    part_size: int,
    checkpoint_id: str,
    url: str,
    *,
    exact_dtype: bool = False,
) -> tuple[list[Target], Finish]:
    """The byte ranges of tensor read item ``number``, and what to call once all have arrived
    (commit it to the planner). A destination of another shape, or with ``exact_dtype`` of
    another dtype, is a MetadataError."""
    key, shape, dtype = chunk.key, chunk.shape, chunk.dtype
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    dest = planner.resolve_tensor(item).detach()
    if dest.shape != lengths:  # a torch.Size is a tuple
        raise MetadataError(
            f"{checkpoint_id}: {item.dest_index.fqn} expects shape {tuple(dest.shape)}, "
            f"the checkpoint has {lengths}",
            url=url,
        )
    if exact_dtype and dest.dtype != chunk.dtype:
        raise MetadataError(
            f"{checkpoint_id}: {item.dest_index.fqn} is {dest.dtype} in the state dict but "
            f"{chunk.dtype} in {url}: load into a tensor of the stored dtype, then convert it",
            url=url,
        )

    def finish() -> None:
        planner.commit_tensor(item, dest)

    base, itemsize = chunk.base, dtype.itemsize
    whole = lengths == shape and not any(offsets)  # the whole chunk: most reads
    if (
        dest.is_cpu
        and dest.dtype == dtype
        and dest.is_contiguous()
        and (whole or readplan.is_exact(shape, offsets, lengths))
    ):
        if whole:
            start, end = 0, dest.numel() * itemsize
        else:
            start, end = readplan.covering_range(shape, offsets, lengths, itemsize)
        if end == start:
            return [], finish
        sink = memory_at(dest.data_ptr(), end - start)  # all of dest: checked just above
        return [Target(number, key, base + start, base + end, sink=sink)], finish

    targets = []
    for piece_offsets, piece_lengths in readplan.split_rect(
        shape, offsets, lengths, itemsize, part_size
    ):
        start, end = readplan.covering_range(shape, piece_offsets, piece_lengths, itemsize)
        region = dest
        for dim, (at, skip, n) in enumerate(
            zip(piece_offsets, offsets, piece_lengths, strict=True)
        ):
            region = region.narrow(dim, at - skip, n)
        place = _Placer(shape, piece_lengths, dtype, region)
        targets.append(Target(number, key, base + start, base + end, place=place))
    return targets, finish


class _Placer:
    """Copies the covering bytes of a row-major sub-rectangle into its (strided) destination."""

    def __init__(
        self,
        shape: tuple[int, ...],
        lengths: tuple[int, ...],
        dtype: torch.dtype,
        dest: torch.Tensor,
    ) -> None:
        self.strides = readplan.row_major_strides(shape)
        self.lengths = lengths
        self.dtype = dtype
        self.dest = dest

    def __call__(self, data: memoryview) -> None:
        flat = torch.frombuffer(data, dtype=self.dtype)
        self.dest.copy_(flat.as_strided(self.lengths, self.strides, 0))
