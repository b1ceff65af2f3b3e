"""Core benchmark: s3ckpt save / async_save / load against a raw aiobotocore ceiling.

Everything runs in one invocation against one server and bucket, repetitions interleaved so drift
hits every case alike. Raw cases run in this process; each s3ckpt case runs in a fresh child
process (``--child``) so its peak RSS and CPU time are its own. Medians are reported; memory is
the worst repetition. The async_save stall is the steady state of a training job: the child
saves once with the writer (allocating its staging buffers), then the measured save reuses them;
the first stall and the time to copy the same bytes into allocated buffers are reported beside it.

    python -m benchmarks.bench_core                      # 1 GiB, 3 repetitions, local SeaweedFS
    python -m benchmarks.bench_core --size-gib 0.25 --repeat 1 --only save load
    python -m benchmarks.bench_core --checksum off --json /tmp/core-off.json   # price of checksums
    python -m benchmarks.bench_core --endpoint-url https://s3.example --access-key K --secret-key S
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from s3ckpt.config import MiB, S3Config

from . import options
from .common import (
    GB,
    ROOT,
    Endpoint,
    cpu_since,
    cpu_times,
    format_table,
    machine_info,
    median,
    server_cpu_seconds,
    write_json,
)
from .raw import RawClient, object_ranges
from .workload import S3CKPT_CASES, run_case, state_bytes, state_specs

RAW_CASES = ("raw_upload", "raw_download")
CASES = RAW_CASES + S3CKPT_CASES
_KEY_ENV, _SECRET_ENV = "S3CKPT_BENCH_ACCESS_KEY", "S3CKPT_BENCH_SECRET_KEY"
_CEILING = {"save": "raw_upload", "async_save": "raw_upload", "load": "raw_download"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    p.size_gib(1.0, "state dict")
    p.add_argument(
        "--checksum",
        choices=("auto", "crc32c", "md5", "off"),
        default=S3Config().checksum,
        help="s3ckpt's wire checksums (the raw client sends none): 'off' prices them",
    )
    p.add_argument("--only", nargs="+", choices=CASES, default=list(CASES), metavar="CASE")
    p.repeat(3)
    p.seed()
    p.part_size()
    p.concurrency()
    p.timeout("300 s + 120 s per GiB")
    p.server()
    p.json("core.json")
    # Internal: one s3ckpt case in a fresh process (credentials come through the environment).
    p.child(choices=S3CKPT_CASES)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    p.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    args = p.parse(argv)
    if args.timeout_s is None:
        args.timeout_s = 300.0 + 120.0 * args.size_gib
    return args


def _config(args: argparse.Namespace, endpoint: Endpoint) -> S3Config:
    config = endpoint.config(part_size=args.part_size_mib * MiB, max_concurrency=args.concurrency)
    return dataclasses.replace(config, checksum=args.checksum)


def child_main(args: argparse.Namespace) -> int:
    """Run one s3ckpt case and write its numbers as JSON to ``--child-out``."""
    endpoint = Endpoint(
        args.endpoint_url, os.environ[_KEY_ENV], os.environ[_SECRET_ENV], args.region, "child"
    )
    size = int(args.size_gib * 1024 * MiB)
    result = run_case(
        args.child,
        _config(args, endpoint),
        args.bucket,
        args.prefix,
        size,
        args.seed,
        args.verify,
        args.timeout_s,
    )
    args.child_out.write_text(json.dumps(result))
    return 0


class Bench:
    """One benchmark run: a raw client on a private loop, children for the s3ckpt cases."""

    def __init__(self, args: argparse.Namespace, endpoint: Endpoint) -> None:
        self.args = args
        self.endpoint = endpoint
        self.config = _config(args, endpoint)
        self.specs = state_specs(int(args.size_gib * 1024 * MiB))
        self.size = state_bytes(self.specs)
        self.root = f"bench-{secrets.token_hex(4)}"
        self.loop = asyncio.new_event_loop()
        self.raw = RawClient(self.config)
        self.runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.only}
        self.warmup: dict[str, Any] = {}
        self.failures: list[str] = []

    def _await(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, self.args.timeout_s))

    def run(self) -> None:
        self._await(self.raw.__aenter__())
        try:
            self._await(self.raw.ensure_bucket(self.args.bucket))
            self._run_all()
        finally:
            try:
                self._await(self.raw.delete_prefix(self.args.bucket, self.root + "/"))
            finally:
                self._await(self.raw.__aexit__(None, None, None))
                self.loop.close()

    def _run_all(self) -> None:
        only = set(self.args.only)
        raw = self._raw_buffers() if only & set(RAW_CASES) else None
        # First writes to a fresh server are slower: warm it (and the raw client) up once.
        if raw is not None:
            self.warmup["raw"] = self._raw_rep(*raw, prefix=f"{self.root}/warmup-raw")
        load_src = f"{self.root}/load-src"
        if only & set(S3CKPT_CASES):  # also the checkpoint every load reads
            self.warmup["save"] = self._child("save", load_src, verify=False)
        for rep in range(self.args.repeat):
            if raw is not None:
                timings = self._raw_rep(*raw, prefix=f"{self.root}/raw-{rep}")
                for case in RAW_CASES:
                    if case in only and case in timings:
                        self.runs[case].append(timings[case])
            for case in ("save", "async_save"):
                if case in only:
                    prefix = f"{self.root}/{case}-{rep}"
                    self._record(case, self._child(case, prefix, verify=False))
                    self._await(self.raw.delete_prefix(self.args.bucket, prefix + "/"))
            if "load" in only:
                self._record("load", self._child("load", load_src, verify=rep == 0))

    def _record(self, case: str, result: dict[str, Any] | None) -> None:
        if result is not None:
            self.runs[case].append(result)

    def _raw_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Random source bytes and a pre-touched destination, laid out as s3ckpt's objects."""
        generator = torch.Generator().manual_seed(self.args.seed)
        words = torch.rand((self.size + 3) // 4, generator=generator)
        source = words.view(torch.uint8)[: self.size]
        return source, torch.full((self.size,), 0xFF, dtype=torch.uint8)

    def _raw_rep(self, source: torch.Tensor, dest: torch.Tensor, prefix: str) -> dict[str, Any]:
        src, dst = source.numpy().data, dest.numpy().data
        ranges = object_ranges(self.size, self.config.part_size)
        keys = [f"{prefix}/obj-{i}" for i in range(len(ranges))]
        out: dict[str, Any] = {}
        for case, views in (("raw_upload", src), ("raw_download", dst)):
            objects = {k: views[a:b] for k, (a, b) in zip(keys, ranges, strict=True)}
            requests, cpu, server = self.raw.requests, cpu_times(), self._server_cpu()
            store = self.raw.upload if case == "raw_upload" else self.raw.download
            seconds = self._await(store(self.args.bucket, objects))
            out[case] = {
                "case": case,
                "seconds": seconds,
                "bytes": self.size,
                "objects": len(keys),
                **cpu_since(cpu),
                "server_cpu_s": _delta(self._server_cpu(), server),
                "requests": self.raw.requests - requests,
            }
        if not torch.equal(source, dest):
            raise RuntimeError("raw download differs from the upload")
        dest.fill_(0xFF)
        self._await(self.raw.delete_prefix(self.args.bucket, prefix + "/"))
        return out

    def _server_cpu(self) -> float | None:
        return server_cpu_seconds(self.endpoint.server_pid)

    def _child(self, case: str, prefix: str, *, verify: bool) -> dict[str, Any] | None:
        """Run one s3ckpt case in a fresh interpreter; None (and a failure noted) if it fails."""
        a = self.args
        with tempfile.TemporaryDirectory(prefix="s3ckpt-bench-child-") as tmp:
            out = Path(tmp) / "result.json"
            command = [sys.executable, "-m", "benchmarks.bench_core", "--child", case]
            command += ["--endpoint-url", self.endpoint.url, "--bucket", a.bucket]
            command += ["--prefix", prefix, "--size-gib", repr(a.size_gib), "--seed", str(a.seed)]
            command += ["--part-size-mib", str(a.part_size_mib), "--checksum", a.checksum]
            command += ["--concurrency", str(a.concurrency), "--timeout-s", str(a.timeout_s)]
            command += ["--child-out", str(out)] + (["--verify"] if verify else [])
            command += ["--region", a.region] if a.region else []
            env = dict(os.environ)
            env[_KEY_ENV], env[_SECRET_ENV] = (
                self.endpoint.access_key_id,
                self.endpoint.secret_access_key,
            )
            server = self._server_cpu()
            try:
                proc = subprocess.run(
                    command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout_s
                )
            except subprocess.TimeoutExpired:
                self.failures.append(f"{case} ({prefix}): timed out after {a.timeout_s:g} s")
                return None
            if proc.returncode != 0 or not out.exists():
                tail = (proc.stderr or proc.stdout)[-3000:]
                self.failures.append(f"{case} ({prefix}): exit {proc.returncode}\n{tail}")
                return None
            result: dict[str, Any] = json.loads(out.read_text())
        result["server_cpu_s"] = _delta(self._server_cpu(), server)
        if result.get("mismatched_tensors"):
            self.failures.append(f"load: {result['mismatched_tensors']} tensors differ")
        return result

    def summary(self) -> dict[str, dict[str, Any]]:
        """Medians per case; memory is the worst repetition (the bounds are about the worst)."""
        out: dict[str, dict[str, Any]] = {}
        for case, runs in self.runs.items():
            if not runs:
                continue
            seconds = median([r["seconds"] for r in runs])
            row: dict[str, Any] = {
                "seconds": seconds,
                "gb_per_s": self.size / GB / seconds if seconds else None,
                "stall_s": median([r.get("stall_s") for r in runs]),
                "first_stall_s": median([r.get("first_stall_s") for r in runs]),
                "copy_s": median([r.get("copy_s") for r in runs]),
                "cpu_s": median([r["cpu_s"] for r in runs]),
                "server_cpu_s": median([r.get("server_cpu_s") for r in runs]),
                "requests": _whole(median([r["requests"] for r in runs])),
                "repetitions": len(runs),
            }
            if case in S3CKPT_CASES:
                row["rss_increase_max"] = max(r["rss_increase"] for r in runs)
                row["rss_with_state_max"] = max(r["rss_with_state"] for r in runs)
                row["bound"] = runs[0]["bound"]
                row["within_bound"] = all(r["within_bound"] for r in runs)
            out[case] = row
        for case, ceiling in _CEILING.items():
            if case in out and ceiling in out:
                out[case]["vs_raw"] = out[ceiling]["seconds"] / out[case]["seconds"]
        return out


def _whole(value: float | None) -> float | int | None:
    """Request counts print as integers unless a median falls between two."""
    return int(value) if value is not None and float(value).is_integer() else value


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _stall_line(summary: dict[str, dict[str, Any]]) -> str | None:
    """The stall next to its yardsticks: a copy into allocated buffers, and a synchronous save."""
    r = summary.get("async_save")
    if not r or r.get("stall_s") is None or not r.get("copy_s"):
        return None
    stall_ms, copy_ms, first_ms = (r[k] * 1e3 for k in ("stall_s", "copy_s", "first_stall_s"))
    line = (
        f"async_save stall {stall_ms:.0f} ms = {stall_ms / copy_ms:.2f} x a copy into allocated "
        f"buffers ({copy_ms:.0f} ms); first save {first_ms:.0f} ms"
    )
    if "save" in summary:
        line += (
            f"; {100 * r['stall_s'] / summary['save']['seconds']:.1f}% of a synchronous dcp.save"
        )
    return line


def _table(summary: dict[str, dict[str, Any]]) -> str:
    headers = ["case", "s", "GB/s", "vs raw", "stall ms", "peak +MiB", "w/ state MiB"]
    headers += ["bound MiB", "ok", "CPU s", "srv CPU s", "requests"]
    rows = []
    for case in CASES:
        r = summary.get(case)
        if r is None:
            continue
        stall = r["stall_s"] * 1000 if r["stall_s"] is not None else None
        mib = {
            k: r[k] / MiB if k in r else None
            for k in ("rss_increase_max", "rss_with_state_max", "bound")
        }
        ok = None if "within_bound" not in r else ("yes" if r["within_bound"] else "NO")
        rows.append(
            [
                *(case, r["seconds"], r["gb_per_s"], r.get("vs_raw"), stall),
                *(mib["rss_increase_max"], mib["rss_with_state_max"], mib["bound"], ok),
                *(r["cpu_s"], r["server_cpu_s"], r["requests"]),
            ]
        )
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    started, machine = time.time(), machine_info()
    with options.endpoint(args) as ep:
        bench = Bench(args, ep)
        print(
            f"s3ckpt core benchmark: {bench.size / MiB:.0f} MiB state ({len(bench.specs)} tensors),"
            f" {args.repeat} repetition(s), {ep.server} at {ep.url}",
            flush=True,
        )
        bench.run()
    summary = bench.summary()
    report = {
        "machine": machine,
        "server": {"name": ep.server, "endpoint": ep.url, "local": ep.server_pid is not None},
        "settings": {
            "size_gib": args.size_gib,
            "state_bytes": bench.size,
            "tensors": len(bench.specs),
            "repeat": args.repeat,
            "part_size": bench.config.part_size,
            "max_concurrency": bench.config.max_concurrency,
            "checksum": bench.config.checksum,
            "multipart_threshold": bench.config.multipart_threshold,
            "objects": len(object_ranges(bench.size, bench.config.part_size)),
            "bucket": args.bucket,
            "cases": args.only,
            "seed": args.seed,
            "wall_s": time.time() - started,
        },
        "summary": summary,
        "runs": bench.runs,
        "warmup": bench.warmup,
        "failures": bench.failures,
    }
    write_json(args.json, report)
    print(_table(summary))
    stall = _stall_line(summary)
    if stall:
        print(stall)
    print(f"GB = 1e9 bytes; memory is the worst repetition. JSON: {args.json}")
    for failure in bench.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
