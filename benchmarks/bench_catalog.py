"""The catalog at scale: ``list_checkpoints`` and ``latest`` over 1,000 committed checkpoints.

``python -m benchmarks.bench_catalog`` (a local SeaweedFS unless ``--endpoint-url``). One real
checkpoint is saved with ``dcp.save``; its objects are then copied server-side (CopyObject) under
999 more prefixes ``step-00001`` ..., so every ``.metadata`` is a valid s3ckpt record and the set-up
takes seconds, not 1,000 saves. Each call is timed ``--repeat`` times; the median is reported and
written to ``benchmarks/results/catalog.json``. The goal: under 5 s each.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import torch
import torch.distributed.checkpoint as dcp
from botocore.config import Config

from benchmarks import options
from benchmarks.common import Endpoint, format_table, machine_info, median, write_json
from s3ckpt import S3Config, S3Writer
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.tools import catalog

GOAL_S = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.add_argument("--count", type=count, default=1000, help="committed checkpoints to list")
    p.add_argument("--copy-threads", type=count, default=32, help="concurrent CopyObject calls")
    p.repeat(3)
    p.server()
    p.json("catalog.json")
    return p.parse(argv)


def _client(ep: Endpoint, threads: int) -> Any:
    return boto3.session.Session().client(
        "s3",
        endpoint_url=ep.url,
        region_name=ep.region or "us-east-1",
        aws_access_key_id=ep.access_key_id,
        aws_secret_access_key=ep.secret_access_key,
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=threads,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def populate(
    config: S3Config, client: Any, bucket: str, prefix: str, args: argparse.Namespace
) -> float:
    """One real checkpoint, then ``count - 1`` server-side copies of its objects; seconds taken."""
    started = time.perf_counter()
    state = {"w": torch.arange(1024, dtype=torch.float32), "step": 0}
    dcp.save(state, storage_writer=S3Writer(f"s3://{bucket}/{prefix}/step-00000", config=config))
    source = f"{prefix}/step-00000/"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=source)["Contents"]]

    def copy(job: tuple[int, str]) -> None:
        step, key = job
        target = f"{prefix}/step-{step:05d}/{key[len(source) :]}"
        client.copy_object(Bucket=bucket, Key=target, CopySource={"Bucket": bucket, "Key": key})

    jobs = [(step, key) for step in range(1, args.count) for key in keys]
    with ThreadPoolExecutor(args.copy_threads) as pool:
        list(pool.map(copy, jobs))
    return time.perf_counter() - started


def remove(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def timed(call: Any, repeat: int) -> tuple[list[float], Any]:
    runs, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = call()
        runs.append(time.perf_counter() - started)
    return runs, result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    machine = machine_info()
    with options.endpoint(args) as ep:
        defaults = S3Config()
        config = ep.config(part_size=defaults.part_size, max_concurrency=defaults.max_concurrency)
        client = _client(ep, args.copy_threads)
        bridge.run(get_store(config).create_bucket(args.bucket))
        prefix = f"catalog-{int(time.time())}"
        url = f"s3://{args.bucket}/{prefix}"
        print(f"catalog benchmark: {args.count} checkpoints under {url}, {ep.server}", flush=True)
        try:
            setup_s = populate(config, client, args.bucket, prefix, args)
            print(f"set up in {setup_s:.1f} s", flush=True)
            list_runs, infos = timed(lambda: catalog.list_checkpoints(url, config), args.repeat)
            latest_runs, newest = timed(lambda: catalog.latest(url, config), args.repeat)
        finally:
            remove(client, args.bucket, prefix)
    committed = sum(info.committed for info in infos)
    latest_step = None if newest is None else newest.step
    correct = committed == args.count and latest_step == args.count - 1
    results = {
        "list_checkpoints": {
            "runs_s": list_runs,
            "median_s": median(list_runs),
            "found": committed,
        },
        "latest": {"runs_s": latest_runs, "median_s": median(latest_runs), "step": latest_step},
    }
    report = {
        "machine": machine,
        "server": {"name": ep.server, "endpoint": ep.url, "local": ep.server_pid is not None},
        "settings": {
            "count": args.count,
            "repeat": args.repeat,
            "max_concurrency": config.max_concurrency,
            "setup_s": setup_s,
            "goal_s": GOAL_S,
        },
        "results": results,
        "correct": correct,
    }
    write_json(args.json, report)
    rows = [
        [name, r["median_s"], min(r["runs_s"]), max(r["runs_s"]), r["median_s"] < GOAL_S]
        for name, r in results.items()
    ]
    print(format_table(["call", "median s", "min s", "max s", f"< {GOAL_S:g} s"], rows))
    print(f"{committed} committed found, latest step {latest_step}; JSON: {args.json}")
    if not correct:
        print("FAILED: the catalog did not see every checkpoint", file=sys.stderr)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
