"""One rank's side of a load: its read targets cut into the parts it fetches and the parts it
receives from other ranks (a shared load, `format.sharing`), the sends of what it fetched for
others, and when each target is complete.

A target none of whose bytes are shared is fetched as it is. One that is received in part, or
whose bytes this rank sends, is cut at the transfers' ends: the parts this rank fetches become
fetch targets of their own, the others arrive by ``irecv`` straight into the destination's view,
or into one buffer for the whole target, which is placed once complete. What a rank fetched for
others goes out by ``isend`` from that same memory as soon as it is in. ``done(item)`` is called
once per target, when all of its bytes are in (the fetch targets that `readplan.plan_fetches` cuts
at frame boundaries are counted too, so a tensor is never committed early).

Receives run in one thread, in transfer order, with at most `WINDOW` bytes of buffers posted at
a time; sends are posted as fetches finish. A rank whose fetches fail still sends every transfer
(whatever its memory holds) and receives every transfer, so that no rank waits forever;
`Pieces.finish` then tells every rank whether any failed, before any of them returns.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..format.readplan import Fetch, Target
from ..format.sharing import Share, Transfer
from .group import any_failed

__all__ = ["WINDOW", "Pieces"]

WINDOW = 256 * 1024 * 1024  # bytes of receive buffers a rank holds at a time
_INFLIGHT = 64  # receives posted at a time


# Guards the first use of a piece's buffer, from a fetch's thread or the receiving one: rare
# (shared loads of targets that are placed), where a lock per piece cost every load a lock per
# tensor.
_BUFFERS = threading.Lock()


class _Piece:
    """One target, assembled from parts fetched and received; or (``own`` False) bytes this
    rank fetches only to send them on."""

    __slots__ = ("_buffer", "left", "own", "target", "whole")

    def __init__(self, target: Target, own: bool = True) -> None:
        self.target, self.own = target, own
        self.left = 0  # parts not complete yet
        self.whole = False  # fetched as it is: the fetch places it
        self._buffer: bytearray | None = None

    def view(self, start: int, end: int) -> memoryview:
        """Where bytes ``[start, end)`` of the object go: the destination, or the buffer (made
        on first use: from the fetch's thread or the receiving one)."""
        target = self.target
        if target.sink is not None:
            return target.sink[start - target.start : end - target.start]
        with _BUFFERS:
            if self._buffer is None:
                self._buffer = bytearray(target.end - target.start)
            buffer = self._buffer
        return memoryview(buffer)[start - target.start : end - target.start]

    def fill(self, start: int, data: memoryview) -> None:
        self.view(start, start + len(data))[:] = data

    def place(self) -> None:
        if self.target.place is not None:
            self.target.place(self.view(self.target.start, self.target.end))
            self._buffer = None


@dataclass(eq=False, slots=True)
class _Part:
    piece: _Piece
    start: int
    end: int
    sends: list[Transfer] = field(default_factory=list)
    pending: int = 0  # fetch targets of this part still to arrive


class _Index:
    """Transfers of one object by start, to find those within a target."""

    def __init__(self) -> None:
        self.transfers: list[Transfer] = []
        self.starts: list[int] = []

    def add(self, transfer: Transfer) -> None:
        self.transfers.append(transfer)

    def sort(self) -> None:
        self.transfers.sort(key=lambda t: t.span.start)
        self.starts = [t.span.start for t in self.transfers]

    def within(self, target: Target) -> list[Transfer]:
        """The transfers within the target's bytes, by start. The coordinator cut the spans as
        finely as any rank's targets (`S3Reader._spans`), so none crosses a target's end."""
        first = bisect.bisect_left(self.starts, target.start)
        found = self.transfers[first : bisect.bisect_left(self.starts, target.end)]
        for transfer in found:
            if transfer.span.end > target.end:
                raise AssertionError(f"{transfer} crosses the end of a read of {target.key}")
        return found


def _by_key(transfers: Iterable[Transfer]) -> dict[str, _Index]:
    found: dict[str, _Index] = defaultdict(_Index)
    for transfer in transfers:
        found[transfer.span.key].add(transfer)
    for index in found.values():
        index.sort()
    return found


class Pieces:
    """The parts of one rank's read targets; with a ``share`` (its part in a shared load, over
    ``group``, where ``members[r]`` is plan rank ``r``'s global rank), its transfers too."""

    def __init__(
        self,
        targets: Sequence[Target],
        done: Callable[[int], None],
        share: Share | None = None,
        group: dist.ProcessGroup | None = None,
        members: Sequence[int] = (),
    ) -> None:
        self._done, self._group, self._members = done, group, tuple(members)
        self.fetch_targets: list[Target] = []
        self._parts: list[_Part] = []  # fetched ones, by the item number of their fetch targets
        self._receives: list[tuple[Transfer, _Part]] = []
        self._unsent: dict[int, tuple[Transfer, _Part]] = {}
        self._works: list[tuple[dist.Work, torch.Tensor]] = []
        self._placing: list[asyncio.Future[None]] = []
        receives = _by_key(share.receives if share else ())
        sends = _by_key(share.sends if share else ())
        none = _Index()
        for target in targets:
            self._cut(target, receives.get(target.key, none), sends.get(target.key, none))
        for transfer in share.sends if share else ():
            if transfer.tag not in self._unsent:  # in no target of this rank: fetched to send
                span = transfer.span
                piece = _Piece(Target(-1, span.key, span.start, span.end), own=False)
                part = self._fetch(piece, span.start, span.end)
                part.sends.append(transfer)
                self._unsent[transfer.tag] = (transfer, part)
        self._receives.sort(key=lambda r: r[0].tag)

    def _cut(self, target: Target, receives: _Index, sends: _Index) -> None:
        piece = _Piece(target)
        if not receives.transfers and not sends.transfers:  # an unshared load: every target
            piece.whole = True
            self._fetch(piece, target.start, target.end)
            return
        mine, out = receives.within(target), sends.within(target)
        if not mine and not out:
            piece.whole = True
            self._fetch(piece, target.start, target.end)
            return
        at, fetched = target.start, []
        for transfer in mine:
            if transfer.span.start > at:
                fetched.append(self._fetch(piece, at, transfer.span.start))
            part = _Part(piece, transfer.span.start, transfer.span.end)
            piece.left += 1
            self._receives.append((transfer, part))
            at = transfer.span.end
        if at < target.end:
            fetched.append(self._fetch(piece, at, target.end))
        for transfer in out:
            part = next(p for p in fetched if p.start <= transfer.span.start < p.end)
            part.sends.append(transfer)
            self._unsent[transfer.tag] = (transfer, part)

    def _fetch(self, piece: _Piece, start: int, end: int) -> _Part:
        """A part this rank fetches: the whole target as it is, or a part of it that lands in
        the piece's memory."""
        part = _Part(piece, start, end)
        piece.left += 1
        number, target = len(self._parts), piece.target
        self._parts.append(part)
        if piece.whole:
            found = Target(number, target.key, start, end, target.sink, target.place)
        elif target.sink is not None:
            found = Target(number, target.key, start, end, sink=piece.view(start, end))
        else:
            found = Target(number, target.key, start, end, place=self._filler(piece, start))
        self.fetch_targets.append(found)
        return part

    @staticmethod
    def _filler(piece: _Piece, start: int) -> Callable[[memoryview], None]:
        def fill(data: memoryview) -> None:
            piece.fill(start, data)

        return fill

    def planned(self, fetches: Sequence[Fetch]) -> None:
        """Count the fetch targets of each part: `readplan.plan_fetches` cuts zero-copy ones at
        frame boundaries."""
        for fetch in fetches:
            for target in fetch.targets:
                self._parts[target.item].pending += 1
        for part in self._parts:
            if part.pending == 0:  # an empty target: nothing to fetch
                self._complete(part)

    def fetched(self, fetch: Fetch) -> None:
        """On the event loop, after a fetch has landed (and its buffered bytes were placed)."""
        for target in fetch.targets:
            part = self._parts[target.item]
            part.pending -= 1
            if part.pending == 0:
                self._complete(part)

    def _complete(self, part: _Part) -> None:
        for transfer in part.sends:
            self._send(transfer, part)
        piece = part.piece
        piece.left -= 1
        if piece.left or not piece.own:
            return
        if piece.whole or piece.target.place is None:
            self._done(piece.target.item)
        else:
            self._placing.append(asyncio.ensure_future(self._place(piece)))

    async def _place(self, piece: _Piece) -> None:
        await asyncio.get_running_loop().run_in_executor(None, piece.place)
        self._done(piece.target.item)

    def _send(self, transfer: Transfer, part: _Part) -> None:
        if self._unsent.pop(transfer.tag, None) is None:
            return
        data = part.piece.view(transfer.span.start, transfer.span.end)
        tensor = torch.frombuffer(data, dtype=torch.uint8)
        for rank in transfer.to:
            work = dist.isend(tensor, self._members[rank], group=self._group, tag=transfer.tag)
            if work is not None:
                self._works.append((work, tensor))  # the tensor's memory, until it is sent

    def receive_all(self, complete: Callable[[Callable[[], None]], None]) -> None:
        """Post and wait for every receive, in transfer order, a window at a time (in a thread
        of its own); ``complete(call)`` runs ``call`` on the event loop."""
        inflight: deque[tuple[dist.Work, _Part, int]] = deque()
        held = 0
        for transfer, part in self._receives:
            size = transfer.span.size if part.piece.target.sink is None else 0
            while inflight and (len(inflight) >= _INFLIGHT or held + size > WINDOW):
                work, done, buffered = inflight.popleft()
                work.wait()
                held -= buffered
                complete(functools.partial(self._complete, done))
            view = part.piece.view(transfer.span.start, transfer.span.end)
            tensor = torch.frombuffer(view, dtype=torch.uint8)
            source = self._members[transfer.source]
            posted = dist.irecv(tensor, source, group=self._group, tag=transfer.tag)
            assert posted is not None  # (None only for a rank outside the group)
            inflight.append((posted, part, size))
            held += size
        while inflight:
            work, done, _ = inflight.popleft()
            work.wait()
            complete(functools.partial(self._complete, done))

    def send_the_rest(self) -> None:
        """After a failed fetch: send what is still unsent, as it is, so no rank waits for it."""
        for transfer, part in list(self._unsent.values()):
            self._send(transfer, part)

    def finish(self, failed: bool) -> bool:
        """Wait for every send and placement, then whether any rank's load failed (a collective:
        every rank calls it)."""
        for work, _ in self._works:
            work.wait()
        self._works.clear()
        assert self._group is not None
        return any_failed(self._group, failed)

    async def placed(self) -> None:
        await asyncio.gather(*self._placing)
