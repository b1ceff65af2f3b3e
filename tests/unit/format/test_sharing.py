"""The shared-read planner: every wanted byte reaches every rank that wants it, fetched once."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from s3ckpt.format.sharing import Span, assign

MiB = 64  # "MiB" of the tests: small, since `check` looks at every byte


def bytes_of(spans: list[Span]) -> Counter[tuple[str, int]]:
    """Each (key, byte) a list of spans covers, with multiplicity."""
    return Counter((s.key, b) for s in spans for b in range(s.start, s.end))


FRAME = MiB  # one frame per "MiB" in these tests


def frames_of(wanted: list[list[Span]]) -> dict[str, int]:
    return {s.key: FRAME for spans in wanted for s in spans}


def check(wanted: list[list[Span]], hosts: list[str]) -> None:
    """The invariants, byte by byte: each rank gets each byte it wants exactly once (fetched by
    itself or received), and each frame that anyone reads is fetched by exactly one rank."""
    shares = assign(wanted, hosts, frames_of(wanted))
    fetching: dict[tuple[str, int], set[int]] = {}
    if shares is None:
        for rank, spans in enumerate(wanted):
            for key, byte in bytes_of(spans):
                fetching.setdefault((key, byte // FRAME), set()).add(rank)
        assert all(len(ranks) == 1 for ranks in fetching.values()), "nothing shared"
        return
    for rank, (spans, share) in enumerate(zip(wanted, shares, strict=True)):
        want = set(bytes_of(spans))
        received = bytes_of([t.span for t in share.receives])
        assert all(n == 1 for n in received.values()), "no byte is received twice"
        assert set(received) <= want, "nothing unasked for arrives"
        for transfer in share.receives:
            assert transfer.source != rank and rank in transfer.to
        assert all(t.source == rank and rank not in t.to for t in share.sends)
        sent = set(bytes_of([t.span for t in share.sends]))
        assert not sent & set(received), "what a rank sends, it fetched"
        for key, byte in (want - set(received)) | sent:
            fetching.setdefault((key, byte // FRAME), set()).add(rank)
    assert all(len(ranks) == 1 for ranks in fetching.values()), "each frame fetched once"
    tags = [t.tag for share in shares for t in share.sends]
    assert len(tags) == len(set(tags))
    for share in shares:
        assert [t.tag for t in share.receives] == sorted(t.tag for t in share.receives)
        for t in share.sends + share.receives:
            assert t.span.start // FRAME == (t.span.end - 1) // FRAME, "a transfer in one frame"


def replicated(ranks: int, tensors: int, size: int) -> list[list[Span]]:
    return [[Span(f"obj{t % 3}", t * size, (t + 1) * size) for t in range(tensors)]] * ranks


def test_replicas_each_fetch_a_balanced_quarter() -> None:
    wanted = replicated(4, 16, MiB)
    shares = assign(wanted, ["a", "a", "b", "b"], frames_of(wanted))
    assert shares is not None
    check(wanted, ["a", "a", "b", "b"])
    assert [share.fetched_for_others for share in shares] == [4 * MiB] * 4
    assert all(len(share.receives) == 12 for share in shares)


def test_an_hsdp_mesh_shares_within_each_shard_only() -> None:
    """2 replicas x 2 shards: ranks 0 and 2 read shard A, ranks 1 and 3 shard B."""
    a = [Span("a", i * MiB, (i + 1) * MiB) for i in range(4)]
    b = [Span("b", i * MiB, (i + 1) * MiB) for i in range(4)]
    wanted = [a, b, a, b]
    shares = assign(wanted, ["h0", "h0", "h1", "h1"], frames_of(wanted))
    assert shares is not None
    check(wanted, ["h0", "h0", "h1", "h1"])
    for rank, share in enumerate(shares):
        partner = (rank + 2) % 4
        assert {t.source for t in share.receives} == {partner}
        assert share.fetched_for_others == 2 * MiB


def test_two_ranks_reading_one_frame_share_it() -> None:
    wanted = [[Span("k", 0, 10)], [Span("k", 10, 20)]]
    shares = assign(wanted, ["x", "y"], frames_of(wanted))
    assert shares is not None and shares[1].receives[0].span == Span("k", 10, 20)
    check(wanted, ["x", "y"])


def test_nothing_shared_needs_no_exchange() -> None:
    wanted = [[Span("k", 0, 10)], [Span("k", FRAME, FRAME + 10)], [Span("j", 0, 5)]]
    assert assign(wanted, ["x", "y", "z"], frames_of(wanted)) is None


def test_overlapping_resharded_reads_have_one_fetcher_per_frame() -> None:
    wanted = [[Span("k", 0, 100)], [Span("k", 50, 150)], [Span("k", 90, 120), Span("k", 0, 10)]]
    shares = assign(wanted, ["x", "y", "z"], {"k": 1000})
    assert shares is not None
    check(wanted, ["x", "y", "z"])
    # One frame, so one owner (the first of equals), which also fetches [120, 150) for rank 1
    # alone: those bytes are in a frame it reads from.
    assert [bool(share.sends) for share in shares] == [True, False, False]
    assert sum(t.span.size for share in shares for t in share.receives) == 100 + 40
    assert Span("k", 120, 150) in {t.span for t in shares[0].sends}


def test_hosts_share_the_fetching() -> None:
    """Four ranks on two hosts, one of which already fetches 8 MiB alone: the shared pieces go
    to the other host first."""
    shared = [Span("s", i * MiB, (i + 1) * MiB) for i in range(4)]
    own = [Span("own", 0, 8 * MiB)]
    wanted = [shared + own, shared, shared, shared]
    shares = assign(wanted, ["busy", "busy", "idle", "idle"], frames_of(wanted))
    assert shares is not None
    fetched = [share.fetched_for_others for share in shares]
    assert fetched[0] == 0 and fetched[2] + fetched[3] >= 3 * MiB


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.randint(1, 6)
    wanted = []
    for _ in range(ranks):
        spans = []
        for _ in range(rng.randint(0, 5)):
            start = rng.randrange(0, 200)
            spans.append(Span(rng.choice("ab"), start, start + rng.randrange(0, 60)))
        wanted.append(spans)
    check(wanted, [rng.choice("xy") for _ in range(ranks)])


def test_a_range_that_is_no_range_is_refused() -> None:
    with pytest.raises(ValueError, match="not a byte range"):
        assign([[Span("k", 5, 2)]], ["h"], {"k": FRAME})
    with pytest.raises(ValueError, match="hosts"):
        assign([[Span("k", 0, 2)]], [], {"k": FRAME})
