"""`RankResults`: what one rank's ``write_data`` returns, kept as columns.

DCP pickles every rank's results and the coordinator unpickles all of them before ``finish``:
as torch's ``WriteResult`` dataclasses (a ``MetadataIndex``, a ``torch.Size``, a locator each)
that cost about 24 us and 124 bytes per chunk on the coordinator, the largest part of s3ckpt's
own coordinator time per save. As columns (names, offsets, object numbers, starts, lengths)
they unpickle at about 1 us per chunk. DCP never looks inside the results; `RankResults` is
still a sequence of ``WriteResult`` for anyone who does.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ..format.frames import FrameTable
from ..format.record import Locator

__all__ = ["Located", "RankResults", "Stored"]


@dataclass
class Stored:
    """A ``WriteResult``'s storage data in the sequence view: where the item is, and (in
    incremental saves) its digest."""

    locator: Locator
    digest: str | None = None


# (fqn, offset or None, key, start, length, digest or None): one item, as `finish` reads it.
Located = tuple[str, tuple[int, ...] | None, str, int, int, str | None]


class RankResults(Sequence[WriteResult]):
    """The items one rank stored (or referenced), and the frame tables of the objects it
    uploaded (``frames``, object key -> table; referenced objects have none here)."""

    def __init__(self) -> None:
        self.fqns: list[str] = []
        self.offsets: list[tuple[int, ...] | None] = []
        self.keys: list[str] = []  # each object key once
        self.objects = array("I")  # per item: its key's position in ``keys``
        self.starts = array("Q")
        self.lengths = array("Q")
        self.digests: list[str | None] = []
        self.frames: dict[str, FrameTable] = {}
        self._key_numbers: dict[str, int] = {}

    def add(self, index: MetadataIndex, locator: Locator, digest: str | None = None) -> None:
        number = self._key_numbers.get(locator.key)
        if number is None:
            number = self._key_numbers[locator.key] = len(self.keys)
            self.keys.append(locator.key)
        self.fqns.append(index.fqn)
        self.offsets.append(None if index.offset is None else tuple(index.offset))
        self.objects.append(number)
        self.starts.append(locator.offset)
        self.lengths.append(locator.length)
        self.digests.append(digest)

    def located(self) -> Iterator[Located]:
        keys = self.keys
        for fqn, offset, number, start, length, digest in zip(
            self.fqns,
            self.offsets,
            self.objects,
            self.starts,
            self.lengths,
            self.digests,
            strict=True,
        ):
            yield fqn, offset, keys[number], start, length, digest

    def __len__(self) -> int:
        return len(self.fqns)

    @overload
    def __getitem__(self, position: int) -> WriteResult: ...

    @overload
    def __getitem__(self, position: slice) -> list[WriteResult]: ...

    def __getitem__(self, position: int | slice) -> WriteResult | list[WriteResult]:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        key, length = self.keys[self.objects[position]], self.lengths[position]
        locator = Locator(key, self.starts[position], length)
        index = MetadataIndex(self.fqns[position], self.offsets[position])
        return WriteResult(index, length, Stored(locator, self.digests[position]))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_key_numbers"]  # rebuilt only where items are added: on the rank
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._key_numbers = {key: number for number, key in enumerate(self.keys)}
