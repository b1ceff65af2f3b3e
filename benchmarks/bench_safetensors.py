"""Safetensors on S3: exporting a checkpoint, and loading HF files with `SafetensorsReader`.

``python -m benchmarks.bench_safetensors`` (a local SeaweedFS unless ``--endpoint-url``; about
two minutes on 2 cores; ``--quick``: 128 MiB, seconds). The client is pinned to one core and
the local server to the other, as in the other benchmarks.

A transformer-shaped bf16 model of ``--size-gib`` (an embedding and an output matrix of 32000 x
hidden, layers of attention and MLP matrices, fp32 norms) is saved with `S3Writer`; then, with
the state freed, ``--repeat`` times each:

1. **export** to a local directory and to an ``s3://`` prefix (`export_safetensors`,
   ``--max-shard-size``, default 500MB: several files and an index): wall time, tensor GB/s,
   and the peak RSS growth above the RSS before the export, against the largest tensor.
2. **load** the exported S3 files into a preallocated state dict: ``dcp.load`` through
   `SafetensorsReader`, against downloading the files (boto3's ``download_file``, 16 threads, to
   a local temp dir) and ``safetensors.torch.load_file`` + ``copy_`` into the state; and the
   same for half the layers (what one pipeline stage loads): time and bytes fetched (the
   reader's from s3ckpt's byte counter, the download's the files' sizes).

Results: a table and ``benchmarks/results/safetensors[-quick].json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import boto3
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from s3ckpt import S3Config, S3Writer, SafetensorsReader, export_safetensors
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store

from . import options
from .common import (
    GB,
    Endpoint,
    MiB,
    RssSampler,
    format_table,
    machine_info,
    median,
    pin_threads,
    write_json,
)

VOCAB = 32000
State = dict[str, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    p.quick("128 MiB, 1 repetition")
    p.size_gib(1.0, "model", quick=1 / 8)
    p.scaled("--hidden", 2048, 512, "the model's width", type=options.positive_int)
    p.add_argument("--max-shard-size", default="500MB")
    p.repeat(2, quick=1)
    p.cores()
    p.server(bucket="bench-safetensors-")
    p.json("safetensors.json")
    return p.parse(argv)


def model(gib: float, hidden: int) -> State:
    """Layers of 4 attention and 3 MLP (2.75 x hidden) bf16 matrices, until ``gib`` is reached."""
    generator = torch.Generator().manual_seed(0)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator).bfloat16()

    state = {"embed.weight": matrix(VOCAB, hidden), "lm_head.weight": matrix(VOCAB, hidden)}
    mlp = int(hidden * 2.75) // 64 * 64
    layer = 0
    while sum(t.numel() * t.element_size() for t in state.values()) < gib * 1024**3:
        at = f"layers.{layer}"
        for name in ("q", "k", "v", "o"):
            state[f"{at}.attn.{name}.weight"] = matrix(hidden, hidden)
        state[f"{at}.mlp.gate.weight"] = matrix(mlp, hidden)
        state[f"{at}.mlp.up.weight"] = matrix(mlp, hidden)
        state[f"{at}.mlp.down.weight"] = matrix(hidden, mlp)
        state[f"{at}.norm.weight"] = torch.ones(hidden)
        layer += 1
    return state


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _client(ep: Endpoint) -> Any:
    return boto3.session.Session().client(
        "s3",
        endpoint_url=ep.url,
        region_name=ep.region or "us-east-1",
        aws_access_key_id=ep.access_key_id,
        aws_secret_access_key=ep.secret_access_key,
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=16,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _remove(client: Any, bucket: str, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def _export(url: str, dest: str, config: S3Config, shard: str) -> dict[str, Any]:
    gc.collect()
    with RssSampler() as rss:
        started = time.perf_counter()
        done = export_safetensors(url, dest, config, max_shard_size=shard)
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "files": len(done.files),
        "tensor_bytes": done.tensor_bytes,
        "rss_growth": rss.peak - rss.baseline,
    }


def _reader_load(bucket: str, prefix: str, config: S3Config, state: State) -> dict[str, Any]:
    _zero(state)
    stats = get_store(config).stats
    before = stats.bytes_received
    started = time.perf_counter()
    dcp.load(state, storage_reader=SafetensorsReader(bucket, prefix, config=config))
    return {"seconds": time.perf_counter() - started, "fetched": stats.bytes_received - before}


def _download_load(client: Any, bucket: str, prefix: str, state: State) -> dict[str, Any]:
    """What one does without a reader on S3: download the files, load them, copy them in."""
    transfer = TransferConfig(max_concurrency=16, multipart_chunksize=16 * MiB)
    _zero(state)
    started = time.perf_counter()
    fetched = 0
    with tempfile.TemporaryDirectory(prefix="bench-safetensors-") as tmp:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
        files = sorted(
            o["Key"].rpartition("/")[2] for o in listed if o["Key"].endswith(".safetensors")
        )
        for name in files:
            client.download_file(bucket, f"{prefix}/{name}", f"{tmp}/{name}", Config=transfer)
            fetched += os.path.getsize(f"{tmp}/{name}")
            for key, tensor in safetensors.torch.load_file(f"{tmp}/{name}").items():
                if key in state:
                    state[key].copy_(tensor)
            gc.collect()
    return {"seconds": time.perf_counter() - started, "fetched": fetched}


def _zero(state: State) -> None:
    for tensor in state.values():
        tensor.zero_()


def _check(state: State, expected: State) -> None:
    for name, tensor in state.items():
        if not torch.equal(tensor, expected[name]):
            raise SystemExit(f"loaded {name} differs from the saved tensor")


def _repeat(run: Callable[[], dict[str, Any]], times: int) -> dict[str, Any]:
    runs = [run() for _ in range(times)]
    summary = {key: median([r[key] for r in runs]) for key in runs[0]}
    return {**summary, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    machine = machine_info()
    with options.endpoint(args) as ep:
        pinned = pin_threads(ep.server_pid, args.server_core) and pin_threads(0, args.trainer_core)
        defaults = S3Config()
        config = ep.config(part_size=defaults.part_size, max_concurrency=defaults.max_concurrency)
        client = _client(ep)
        bridge.run(get_store(config).create_bucket(args.bucket))
        url = f"s3://{args.bucket}/ck"
        state = model(args.size_gib, args.hidden)
        total, largest = nbytes(state), max(t.numel() * t.element_size() for t in state.values())
        print(
            f"safetensors benchmark: {total / 2**30:.2f} GiB in {len(state)} tensors (largest "
            f"{largest / MiB:.0f} MiB), {ep.server}",
            flush=True,
        )
        try:
            started = time.perf_counter()
            dcp.save(state, storage_writer=S3Writer(url, config=config))
            save_s = time.perf_counter() - started
            del state
            gc.collect()
            results: dict[str, Any] = {}
            with tempfile.TemporaryDirectory(prefix="bench-safetensors-") as tmp:
                counter = iter(range(1_000_000))

                def local() -> dict[str, Any]:
                    return _export(url, f"{tmp}/{next(counter)}", config, args.max_shard_size)

                def remote() -> dict[str, Any]:
                    dest = f"s3://{args.bucket}/hf-{next(counter)}"
                    return _export(url, dest, config, args.max_shard_size)

                results["export to a local directory"] = _repeat(local, args.repeat)
            results["export to S3"] = _repeat(remote, args.repeat)
            hf = f"hf-{args.repeat}"  # the first export to S3
            expected = model(args.size_gib, args.hidden)
            state = {k: torch.empty_like(v) for k, v in expected.items()}
            layers = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
            half = {
                k: v
                for k, v in state.items()
                if k.startswith("layers.") and int(k.split(".")[1]) < len(layers) // 2
            }
            for what, part in (("whole model", state), ("half the layers", half)):
                results[f"load {what}: SafetensorsReader"] = _repeat(
                    functools.partial(_reader_load, args.bucket, hf, config, part), args.repeat
                )
                _check(part, expected)
                results[f"load {what}: download + safetensors.torch.load_file"] = _repeat(
                    functools.partial(_download_load, client, args.bucket, hf, part), args.repeat
                )
                _check(part, expected)
        finally:
            _remove(client, args.bucket, "")
    rows = []
    for case, r in results.items():
        data = r.get("tensor_bytes") or (nbytes(half) if "half" in case else total)
        growth = r.get("rss_growth")
        rows.append(
            [
                case,
                r["seconds"],
                data / GB / r["seconds"],
                r.get("files"),
                None if growth is None else growth / MiB,
                None if growth is None else growth / largest,
                None if "fetched" not in r else r["fetched"] / GB,
            ]
        )
    headers = ["case", "s", "GB/s", "files", "peak RSS MiB", "x largest", "GB fetched"]
    print(format_table(headers, rows))
    report = {
        "machine": machine,
        "server": {"name": ep.server, "endpoint": ep.url, "local": ep.server_pid is not None},
        "settings": {
            "model_bytes": total,
            "tensors": len(expected),
            "largest_tensor": largest,
            "max_shard_size": args.max_shard_size,
            "part_size": config.part_size,
            "max_concurrency": config.max_concurrency,
            "repeat": args.repeat,
            "pinned": pinned,
            "save_s": save_s,
        },
        "results": results,
    }
    write_json(args.json, report)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
