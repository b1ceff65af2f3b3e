"""Throttling benchmark: saves and loads through a store that admits R requests a second.

A `FaultProxy` rule `RateLimit(R)` (`s3ckpt.testing.faultproxy`) sits in front of the server: it
forwards at most R requests a second (a token bucket holding one second's worth, full at the start)
and answers every other request 503 SlowDown, as AWS S3 does beyond a key prefix's rate. Each case
runs through a proxy of its own, and so on a store of its own (fresh limits), with s3ckpt's adaptive
limits (`s3ckpt.engine.throttle`, the default) and without them
(``S3Config(adapt_to_throttling=False)``: backoff alone, as before):

- ``objects``: a save's and a load's requests at the engine's contract, small enough that R is
  what bounds them: ``--objects`` objects of ``--object-kib`` put concurrently under the store's
  request slots, as a save uploads its objects, then read back, as a load reads them.
- ``dcp``: ``dcp.save`` and ``dcp.load`` of a state in ``--dcp-objects`` objects at
  ``--dcp-rate``. A save's objects are at least ``part_size`` (5 MiB here), so these hold
  constant tensors, compressed (zstd) to a few KiB each: many requests, few bytes, as in
  ``objects``.

Reported per case: the requests the proxy received, the share it refused, and the time against
forwarded / R ("time ratio"; goals, issue #23: refused <= 10% of the requests, time <= 1.3 x
forwarded / R). The bucket's first second is free, so a short case may come in under 1.0; "past
burst" compares with (forwarded - R) / R instead, the least time the rate allows.

    python -m benchmarks.bench_throttle                       # local SeaweedFS, ~4 min
    python -m benchmarks.bench_throttle --rates 20 --objects 200 --only objects
    python -m benchmarks.bench_throttle --endpoint-url http://s3.example --access-key K \\
        --secret-key S

An ``--endpoint-url`` must be plain http: the proxy in front of it forwards plain http.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt import S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB, S3Config
from s3ckpt.engine import bridge
from s3ckpt.engine.contract import ObjectStore
from s3ckpt.engine.store import get_store
from s3ckpt.testing.faultproxy import FaultProxy, RateLimit

from . import options
from .bench_faults import backdoor
from .common import Endpoint, format_table, machine_info, write_json

MODES = {"adaptive": True, "off": False}
_DCP_PART = 5 * MiB
GOAL_REFUSED = 0.10
GOAL_TIME = 1.3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count, rate = options.positive_int, options.positive_float
    p.add_argument("--rates", type=rate, nargs="+", default=[20.0, 50.0, 100.0])
    p.add_argument("--objects", type=count, default=400, help="objects of the 'objects' cases")
    p.add_argument("--object-kib", type=count, default=16)
    p.add_argument("--dcp-rate", type=rate, default=20.0)
    p.add_argument("--dcp-objects", type=count, default=100, help="objects of the dcp cases")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--only", choices=("objects", "dcp"), help="one part (default: both)")
    p.concurrency()
    p.server()
    p.json("throttle.json")
    return p.parse(argv)


def _config(endpoint: Endpoint, url: str, concurrency: int, adaptive: bool) -> S3Config:
    return S3Config(
        endpoint_url=url,
        region=endpoint.region,
        access_key_id=endpoint.access_key_id,
        secret_access_key=endpoint.secret_access_key,
        max_concurrency=concurrency,
        part_size=_DCP_PART,
        adapt_to_throttling=adaptive,
    )


def _measure(
    endpoint: Endpoint, args: argparse.Namespace, rate: float, mode: str, case: str, run: Any
) -> dict[str, Any]:
    """``run(config)`` through a fresh proxy admitting ``rate`` requests/s; its numbers."""
    with FaultProxy(endpoint.url) as proxy:
        rule = proxy.add_rule(RateLimit(rate))
        config = _config(endpoint, proxy.endpoint_url, args.concurrency, MODES[mode])
        store = get_store(config)
        started = time.perf_counter()
        error = None
        try:
            run(config, store)
        except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
            error = f"{type(e).__name__}: {e}"[:300]
        seconds = time.perf_counter() - started
        received, refused = rule.matched, rule.fired
    forwarded = received - refused
    ideal = forwarded / rate
    past_burst = max(forwarded - rate, 0) / rate  # the bucket starts with a second's worth
    row = {
        "case": case,
        "rate": rate,
        "limiter": mode,
        "ok": error is None,
        "error": error,
        "seconds": seconds,
        "requests": received,
        "refused": refused,
        "refused_share": refused / received if received else None,
        "ideal_s": ideal,
        "time_ratio": seconds / ideal if ideal else None,
        "past_burst_ratio": seconds / past_burst if past_burst else None,
        "client_requests": store.stats.requests,
        "client_retries": store.stats.retries,
        "client_throttled": store.stats.throttled,
    }
    share, ratio = row["refused_share"], row["time_ratio"]
    row["goals_met"] = bool(
        row["ok"]
        and isinstance(share, float)
        and share <= GOAL_REFUSED
        and isinstance(ratio, float)
        and ratio <= GOAL_TIME
    )
    print(_line(row), flush=True)
    return row


def _line(row: dict[str, Any]) -> str:
    share = row["refused_share"]
    return (
        f"{row['case']:>12} R={row['rate']:<5g} {row['limiter']:>8}: {row['seconds']:.1f} s, "
        f"{row['requests']} requests, {row['refused']} refused"
        + (f" ({share:.0%})" if share is not None else "")
        + ("" if row["ok"] else f", FAILED {row['error']}")
    )


def _objects(prefix: str, count: int) -> list[str]:
    return [f"{prefix}/{i:05d}" for i in range(count)]


def _put_all(bucket: str, keys: list[str], body: bytes) -> Callable[[S3Config, ObjectStore], None]:
    """Put every key concurrently, each under a request slot (as `S3Store.upload` does)."""

    def run(config: S3Config, store: ObjectStore) -> None:
        async def one(key: str) -> None:
            async with store.slot():
                await store.put(bucket, key, body)

        bridge.run(bridge.gather_or_cancel(one(k) for k in keys))

    return run


def _get_all(bucket: str, keys: list[str], size: int) -> Callable[[S3Config, ObjectStore], None]:
    """Read every key back concurrently (`get` takes its slot)."""

    def run(config: S3Config, store: ObjectStore) -> None:
        async def one(key: str) -> None:
            blob = await store.get(bucket, key)
            if len(blob.data) != size:
                raise AssertionError(f"{key}: {len(blob.data)} bytes, not {size}")

        bridge.run(bridge.gather_or_cancel(one(k) for k in keys))

    return run


def run_objects(endpoint: Endpoint, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    size = args.object_kib * 1024
    body = secrets.token_bytes(size)
    stored = _objects(f"{root}/stored", args.objects)
    direct = _config(endpoint, endpoint.url, args.concurrency, True)
    _put_all(args.bucket, stored, body)(direct, get_store(direct))
    rows = []
    for rate in args.rates:
        for mode in args.modes:
            keys = _objects(f"{root}/{rate:g}-{mode}", args.objects)
            save = _put_all(args.bucket, keys, body)
            rows.append(_measure(endpoint, args, rate, mode, "objects save", save))
            load = _get_all(args.bucket, stored, size)
            rows.append(_measure(endpoint, args, rate, mode, "objects load", load))
    return rows


def _state(count: int) -> dict[str, torch.Tensor]:
    """One 5 MiB tensor per object, each of one value: it compresses to almost nothing."""
    return {f"t{i:03d}": torch.full((_DCP_PART // 4,), float(i)) for i in range(count)}


def run_dcp(endpoint: Endpoint, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    state = _state(args.dcp_objects)
    options = WriteOptions(objects_per_rank=args.dcp_objects, compression="zstd")
    rows = []
    for mode in args.modes:
        prefix = f"{root}/dcp-{mode}"

        def save(config: S3Config, store: ObjectStore, prefix: str = prefix) -> None:
            writer = S3Writer(args.bucket, prefix, config=config, options=options)
            dcp.save(state, storage_writer=writer, no_dist=True)

        def load(config: S3Config, store: ObjectStore, prefix: str = prefix) -> None:
            loaded = {name: torch.empty_like(t) for name, t in state.items()}
            dcp.load(loaded, storage_reader=S3Reader(args.bucket, prefix, config=config))
            wrong = [n for n, t in state.items() if not torch.equal(loaded[n], t)]
            if wrong:
                raise AssertionError(f"loaded tensors differ: {wrong[:3]}")

        rows.append(_measure(endpoint, args, args.dcp_rate, mode, "dcp save", save))
        rows.append(_measure(endpoint, args, args.dcp_rate, mode, "dcp load", load))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "case",
        "R/s",
        "limiter",
        "requests",
        "503s",
        "503 share",
        "s",
        "forwarded/R s",
        "time ratio",
        "past burst",
        "goals",
    ]
    body = [
        [
            r["case"],
            f"{r['rate']:g}",
            r["limiter"],
            r["requests"],
            r["refused"],
            None if r["refused_share"] is None else f"{r['refused_share']:.1%}",
            r["seconds"],
            r["ideal_s"],
            r["time_ratio"],
            r["past_burst_ratio"],
            ("met" if r["goals_met"] else "missed") if r["ok"] else "FAILED",
        ]
        for r in rows
    ]
    return format_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Without the limits, thousands of retries: each an INFO record of s3ckpt.engine.
    logging.getLogger("s3ckpt.engine").setLevel(logging.ERROR)
    started = time.time()
    report: dict[str, Any] = {"machine": machine_info(), "args": vars(args) | {"json": None}}
    root = f"bench-throttle/{secrets.token_hex(4)}"
    with options.endpoint(args) as ep:
        client = backdoor(ep)
        if args.bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=args.bucket)
        report["server"] = {"name": ep.server, "endpoint": ep.url}
        rows: list[dict[str, Any]] = []
        if args.only != "dcp":
            rows += run_objects(ep, args, root)
        if args.only != "objects":
            rows += run_dcp(ep, args, root)
    report["rows"] = rows
    adaptive = [r for r in rows if r["limiter"] == "adaptive"]
    report["goals"] = {"adaptive_meets_both": all(r["goals_met"] for r in adaptive)}
    report["wall_s"] = time.time() - started
    write_json(args.json, report)
    print(table(rows))
    print(
        f"goals: 503 share <= {GOAL_REFUSED:.0%}, time <= {GOAL_TIME} x forwarded/R; "
        f"JSON: {args.json}"
    )
    return 0 if all(r["ok"] for r in adaptive) else 1


if __name__ == "__main__":
    sys.exit(main())
