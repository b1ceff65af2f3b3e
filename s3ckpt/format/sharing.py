"""Which rank fetches each byte range of a load, and which ranks receive it from that one. No I/O.

Data-parallel replicas (DDP, the replica dimension of HSDP) and overlapping resharded reads ask the
store for the same bytes many times: 128 replicas of a 1 TB state would fetch 128 TB to restart.
A read fetches whole frames (they are what the record checksums), so the unit of sharing is a
frame: `assign` gives every frame that several ranks read from to one of them (the least loaded
by bytes, spread over hosts), which fetches what any rank needs of it and sends each of the others
its part (`s3ckpt.dcp.exchange`); a frame that one rank alone reads from is that rank's. So every
stored frame is fetched once, and a rank holds, beyond its destinations, only the bytes it fetched
for others until they are sent.

Ranks are positions in the list given (DCP's plan order); transfers are numbered (``tag``) so
that each send meets its receive, and every rank lists them in that order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Share", "Span", "Transfer", "assign"]


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """Bytes ``[start, end)`` of object ``key``."""

    key: str
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Transfer:
    """``span`` going from rank ``source`` to the ranks ``to``, as transfer number ``tag``."""

    span: Span
    source: int
    to: tuple[int, ...]
    tag: int


@dataclass
class Share:
    """One rank's part in a shared load: what it receives and what it sends (each in ``tag``
    order); whatever else of its spans it fetches itself."""

    receives: list[Transfer] = field(default_factory=list)
    sends: list[Transfer] = field(default_factory=list)

    @property
    def fetched_for_others(self) -> int:
        return sum(t.span.size for t in self.sends)


def assign(
    wanted: Sequence[Sequence[Span]], hosts: Sequence[str], frames: Mapping[str, int]
) -> list[Share] | None:
    """Each rank's `Share`, or None when no frame is read by two ranks (nothing to share).

    ``wanted[r]`` are the spans rank ``r`` reads (overlapping ones allowed); ``hosts[r]`` its
    host, so that the bytes a host's ranks fetch stay balanced too; ``frames[key]`` the frame
    size of object ``key``.
    """
    if len(wanted) != len(hosts):
        raise ValueError(f"{len(wanted)} ranks' spans but {len(hosts)} hosts")
    by_frame: dict[tuple[str, int], list[tuple[Span, tuple[int, ...]]]] = defaultdict(list)
    for span, ranks in _pieces(wanted, frames):
        by_frame[(span.key, span.start // frames[span.key])].append((span, ranks))
    groups = []
    for pieces in by_frame.values():
        needers = sorted({r for _, ranks in pieces for r in ranks})
        groups.append((pieces, needers, sum(span.size for span, _ in pieces)))
    if all(len(needers) == 1 for _, needers, _ in groups):
        return None
    load = [0] * len(wanted)
    by_host: dict[str, int] = defaultdict(int)
    for _, needers, size in groups:
        if len(needers) == 1:
            load[needers[0]] += size
            by_host[hosts[needers[0]]] += size
    shares = [Share() for _ in wanted]
    transfers: list[Transfer] = []
    # Largest first onto the least loaded (LPT): within 4/3 of the best balance.
    for pieces, needers, size in sorted(groups, key=lambda g: (-g[2], g[0][0][0])):
        if len(needers) == 1:
            continue
        owner = min(needers, key=lambda r: (load[r], by_host[hosts[r]], r))
        load[owner] += size
        by_host[hosts[owner]] += size
        transfers += _transfers(pieces, owner)
    transfers.sort(key=lambda t: t.span)
    for tag, transfer in enumerate(transfers, start=1):
        transfer = Transfer(transfer.span, transfer.source, transfer.to, tag)
        shares[transfer.source].sends.append(transfer)
        for rank in transfer.to:
            shares[rank].receives.append(transfer)
    return shares


def _transfers(pieces: list[tuple[Span, tuple[int, ...]]], owner: int) -> list[Transfer]:
    """What the owner of a frame sends: each piece to its other readers (tags come later). Not
    joined: a piece never crosses the end of a rank's read, so each lands in one target."""
    out = []
    for span, ranks in pieces:
        to = tuple(r for r in ranks if r != owner)
        if to:
            out.append(Transfer(span, owner, to, 0))
    return out


def _pieces(
    wanted: Sequence[Sequence[Span]], frames: Mapping[str, int]
) -> list[tuple[Span, tuple[int, ...]]]:
    """The spans cut at every requested start and end of their object and at its frame
    boundaries, each with the ranks that want it (ascending), in key and offset order; bytes
    nobody wants are left out."""
    by_key: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for rank, spans in enumerate(wanted):
        for span in spans:
            if span.end < span.start or span.start < 0:
                raise ValueError(f"rank {rank}: {span} is not a byte range")
            if span.end > span.start:
                frame = frames[span.key]
                by_key[span.key].append((span.start, 1, rank))
                by_key[span.key].append((span.end, -1, rank))
                cuts = range((span.start // frame + 1) * frame, span.end, frame)
                by_key[span.key].extend((cut, 0, rank) for cut in cuts)
    pieces: list[tuple[Span, tuple[int, ...]]] = []
    for key in sorted(by_key):
        events = sorted(by_key[key])
        active: dict[int, int] = defaultdict(int)  # rank -> how many of its spans are open
        at = events[0][0]
        i = 0
        while i < len(events):
            offset = events[i][0]
            if offset > at and active:
                pieces.append((Span(key, at, offset), tuple(sorted(active))))
            while i < len(events) and events[i][0] == offset:
                _, step, rank = events[i]
                if step:
                    active[rank] += step
                    if not active[rank]:
                        del active[rank]
                i += 1
            at = offset
    return pieces
