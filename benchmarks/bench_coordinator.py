"""Coordinator cost per save, as a function of ranks and chunks, first and repeated saves.

What rank 0 alone does in a save, measured on a synthetic save (`coordinator_state`: an FSDP
layout, every FQN sharded over every rank, 4 objects per rank) so that thousands of ranks fit
on one machine. Each point runs in a fresh process, twice (the first save, then a repeated one
with the same structure), and reports process CPU seconds and peak RSS growth:

- DCP planning: unpickling every rank's local plan, ``create_global_plan``,
  `S3Writer.prepare_global_plan` and pickling the plans scattered back. First saves with
  `CachingSavePlanner` plan in full; repeated ones find every rank's plan cached and exchange
  empty plans (what the `CheckpointManager` does);
- s3ckpt's gather: unpickling every rank's `RankResults` (DCP gathers them for ``finish``);
- ``finish`` without its encode, and the record's encode (``s3ckpt.format.record.encode``);
- the record's size and decode (to DCP's ``Metadata``) per chunk: what every rank pays on load;
- the commit (``commit_*`` in the JSON): against a real server behind `FaultProxy` adding a
  delay to every request, the whole commit of ``--commit-ranks`` x 4 objects: the pre-commit
  listing, the PUT, the listing after it and the lease; requests counted by operation.

    python -m benchmarks.bench_coordinator                  # ~3 min on 2 busy cores
    python -m benchmarks.bench_coordinator --quick          # CI-size smoke
    python -m benchmarks.bench_coordinator --ranks 64 1024 --chunks 100 --no-commit
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

from torch.distributed.checkpoint.planner import SavePlan

import s3ckpt.dcp.writer as writer_module
from s3ckpt import S3Config, S3Writer
from s3ckpt.dcp.commit import commit
from s3ckpt.dcp.planning import CachingSavePlanner
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.format import layout
from s3ckpt.format.layout import Location
from s3ckpt.format.record import decode
from s3ckpt.testing.faultproxy import Delay, FaultProxy

from . import options
from .common import MiB, RssSampler, format_table, machine_info, median, write_json
from .coordinator_state import local_plans, synthetic

_T = TypeVar("_T")
GOAL_US_PER_CHUNK = 10.0  # s3ckpt's own coordinator work: gather, finish, encode, checks


def _cpu(call: Callable[[], _T]) -> tuple[_T, float]:
    started = time.process_time()
    value = call()
    return value, time.process_time() - started


def _offline_writer() -> S3Writer:
    """A writer whose hooks run without a server (its commit is replaced where it would run)."""
    config = S3Config(
        endpoint_url="http://127.0.0.1:9", region="us-east-1", access_key_id="x",
        secret_access_key="x",
    )  # fmt: skip
    return S3Writer("bench", "ck", config=config)


def plan_cost(ranks: int, chunks: int) -> dict[str, float]:
    """DCP's planning on the coordinator, first and repeated, with `CachingSavePlanner`."""
    writer, planner = _offline_writer(), CachingSavePlanner()
    full = [pickle.dumps(plan) for plan in local_plans(ranks, chunks)]
    empty = [pickle.dumps(SavePlan([], usable=False))] * ranks
    out: dict[str, float] = {}
    try:
        for name, gathered in (("first", full), ("repeated", empty)):

            def once(gathered: list[bytes] = gathered) -> int:
                plans = [pickle.loads(blob) for blob in gathered]
                delta, _ = planner.create_global_plan(plans)
                scattered = writer.prepare_global_plan(delta)
                return sum(len(pickle.dumps(plan)) for plan in scattered)

            sent, cpu = _cpu(once)
            out[f"plan_{name}_cpu_s"] = cpu
            out[f"plan_{name}_bytes"] = sum(map(len, gathered)) + sent
    finally:
        planner.forget()
    return out


def finish_cost(ranks: int, chunks: int) -> dict[str, Any]:
    """The gather and ``finish`` of one save, commit left out."""
    save = synthetic(ranks, chunks)
    blobs = [pickle.dumps(rank) for rank in save.results]  # what each rank sends
    writer = _offline_writer()
    writer._save_id = save.save_id
    encodes: list[tuple[float, int]] = []
    records: list[bytes] = []
    encode = writer_module.encode  # type: ignore[attr-defined]  # patched below, so the module's name

    def timed(*args: Any, **kwargs: Any) -> bytes:
        record, cpu = _cpu(lambda: encode(*args, **kwargs))
        encodes.append((cpu, len(record)))
        records.append(record)
        return record

    async def no_commit(*args: Any, **kwargs: Any) -> None:
        return None

    with (
        RssSampler() as rss,
        mock.patch.object(writer_module, "encode", timed),
        mock.patch.object(writer_module, "commit", no_commit),
    ):
        results, gather_cpu = _cpu(lambda: [pickle.loads(blob) for blob in blobs])
        _, finish_cpu = _cpu(lambda: writer.finish(save.metadata, results))
    encode_cpu, record_bytes = encodes[0]
    # Every rank's cost before its first tensor read (the record's, labelled as such).
    _, decode_cpu = _cpu(lambda: decode(records[0], url="s3://bench/ck/.metadata").metadata)
    return {
        "chunks": save.chunks,
        "objects": len(save.objects),
        "gather_bytes": sum(map(len, blobs)),
        "gather_cpu_s": gather_cpu,
        "finish_cpu_s": finish_cpu - encode_cpu,
        "encode_cpu_s": encode_cpu,
        "record_bytes": record_bytes,
        "decode_cpu_s": decode_cpu,
        "rss_increase": rss.peak - rss.baseline,
    }


def point(ranks: int, chunks: int) -> dict[str, Any]:
    """One point, in its own process: planning, then the first and a repeated finish."""
    out: dict[str, Any] = {"ranks": ranks, "chunks_per_rank": chunks}
    out |= plan_cost(ranks, chunks)
    for name in ("first", "repeated"):
        out[name] = finish_cost(ranks, chunks)
    return out


def commit_cost(
    config: S3Config,
    bucket: str,
    ranks: int,
    latency_s: float,
    probe_s: float = 0.5,
    repeats: int = 2,
) -> dict[str, Any]:
    """The whole commit of ``ranks`` x 4 uploaded objects, with every request delayed by
    ``latency_s`` and by ``probe_s`` (medians of ``repeats``): the difference over the
    difference of the delays is the round trips in a row (a long probe delay stands out of a
    busy server's own time)."""
    store = get_store(config)
    location = Location.of(f"s3://{bucket}/commit-{os.getpid()}-{time.time_ns()}")
    save_id = layout.new_save_id()
    keys = [
        location.key(layout.data_key(save_id, r, i, 0, "000000"))
        for r in range(ranks)
        for i in range(4)
    ]

    async def upload() -> None:
        async def one(key: str) -> None:
            async with store.slot():
                await store.put(bucket, key, b"x")

        await asyncio.gather(*(one(key) for key in keys))

    bridge.run(upload())
    out: dict[str, Any] = {"ranks": ranks, "objects": len(keys), "latency_s": latency_s}
    runs: dict[str, list[tuple[float, float]]] = {}
    with FaultProxy(str(config.endpoint_url)) as proxy:
        slow = get_store(dataclasses.replace(config, endpoint_url=proxy.endpoint_url))
        # A steady-state save's client: connected, the bucket's checksum support known.
        bridge.run(slow.uploads.wire_mode(bucket, location.key("warmup")))  # type: ignore[attr-defined]
        for name, delay in (("delayed", latency_s), ("probed", probe_s)) * repeats:
            rule = proxy.add_rule(Delay(delay))
            before = proxy.requests
            objects = dict.fromkeys(keys, 1)
            started, cpu = time.perf_counter(), time.process_time()
            committing = commit(slow, location, b"{}", objects, save_id=save_id, overwrite=False)
            bridge.run(committing)
            runs.setdefault(name, []).append(
                (time.perf_counter() - started, time.process_time() - cpu)
            )
            out[f"{name}_requests"] = dict(proxy.requests - before)
            proxy.remove_rule(rule)
            bridge.run(store.delete(bucket, [location.metadata_key]))
    for name, measured in runs.items():
        out[f"{name}_s"] = median([wall for wall, _ in measured])
        out[f"{name}_cpu_s"] = median([cpu for _, cpu in measured])
    listed = bridge.run(store.list_objects(bucket, location.prefix + "/")).objects
    bridge.run(store.delete(bucket, [o.key for o in listed]))
    out["round_trips_in_a_row"] = (out["probed_s"] - out["delayed_s"]) / (probe_s - latency_s)
    return out


def _us(seconds: float, chunks: int) -> float:
    return seconds * 1e6 / chunks


def table(points: list[dict[str, Any]]) -> str:
    headers = ["ranks", "chunks", "plan 1st", "plan rep", "gather", "finish", "encode"]
    headers += ["s3ckpt", "s3ckpt rep", "RSS +MiB", "rec B/chunk", "rec decode"]
    rows = []
    for p in points:
        first, repeated = p["first"], p["repeated"]
        chunks = first["chunks"]
        own = [s["gather_cpu_s"] + s["finish_cpu_s"] + s["encode_cpu_s"] for s in (first, repeated)]
        rows.append(
            [
                p["ranks"],
                chunks,
                _us(p["plan_first_cpu_s"], chunks),
                _us(p["plan_repeated_cpu_s"], chunks),
                _us(first["gather_cpu_s"], chunks),
                _us(first["finish_cpu_s"], chunks),
                _us(first["encode_cpu_s"], chunks),
                _us(own[0], chunks),
                _us(own[1], chunks),
                first["rss_increase"] / MiB,
                first["record_bytes"] / chunks,
                _us(first["decode_cpu_s"], chunks),
            ]
        )
    return format_table(headers, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.quick("a few small points")
    p.scaled("--ranks", [16, 128, 1024], [4, 16], "ranks of a save", nargs="+", type=count)
    p.scaled("--chunks", [100, 1000], [100], "chunks per rank", nargs="+", type=count)
    p.add_argument("--max-chunks", type=count, default=150_000, help="skip larger points")
    p.scaled("--commit-ranks", 1000, 100, "ranks in the commit (4 objects each)", type=count)
    p.add_argument(
        "--latency-ms", type=float, default=20.0, help="delay added to every request of the commit"
    )
    p.add_argument("--no-commit", action="store_true", help="leave out the commit (no server)")
    p.server()
    p.json("coordinator.json")
    return p.parse(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    grid = [(r, c) for r in args.ranks for c in args.chunks if r * c <= args.max_chunks]
    points = []
    spawn = multiprocessing.get_context("spawn")
    for ranks, chunks in grid:
        print(f"  {ranks} ranks x {chunks} chunks ...", flush=True)
        with ProcessPoolExecutor(1, mp_context=spawn) as fresh:
            points.append(fresh.submit(point, ranks, chunks).result())
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict[str, Any] = {"machine": machine_info(), "settings": settings, "points": points}
    print("\nCoordinator CPU, us per chunk (first save unless 'rep'); RSS: peak growth of finish;")
    print("rec: the record's size and decode+DCP Metadata per chunk (every rank's, on load)")
    print(table(points))
    if not args.no_commit:
        with options.endpoint(args) as ep:
            config = ep.config(part_size=16 * MiB, max_concurrency=16)
            bridge.run(get_store(config).create_bucket(args.bucket))
            result = commit_cost(config, args.bucket, args.commit_ranks, args.latency_ms / 1000)
        report["commit"] = result
        print(
            f"\ncommit of {result['objects']} objects ({result['ranks']} ranks x 4), "
            f"{args.latency_ms:.0f} ms per request: {result['delayed_s']:.2f} s, "
            f"{result['delayed_cpu_s']:.2f} s CPU; {result['round_trips_in_a_row']:.1f} round "
            f"trips in a row (from a {result['probed_s']:.2f} s commit with 500 ms per request); "
            f"requests {result['delayed_requests']}"
        )
    write_json(args.json, report)
    print(
        "\nplan: DCP's gather of local plans + global plan + S3Writer.prepare_global_plan + "
        "the scatter's pickling; gather: unpickling the ranks' results; finish: without its "
        "encode; s3ckpt: gather + finish + encode "
        f"(goal <= {GOAL_US_PER_CHUNK:.0f} us per chunk)."
    )
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
