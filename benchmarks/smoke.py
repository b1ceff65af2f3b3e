"""Every benchmark at a tiny size, so that none rots: CI runs this after the tests.

Each runs in its own process, as a user runs it, against one SeaweedFS this script starts (the
benchmarks that need no server get none), with a time limit; its JSON goes to a temporary
directory. Figures from these runs mean nothing: only that each benchmark still runs end to end.

    python -m benchmarks.smoke                 # all of them
    python -m benchmarks.smoke bench_core      # some
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from s3ckpt.config import S3Config
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.tools.localserver import SeaweedFS

from . import options
from .common import ROOT, format_table


@dataclass(frozen=True)
class Case:
    module: str
    argv: str  # split on spaces
    server: bool = True  # takes --endpoint-url, --access-key, --secret-key, --bucket
    chart: bool = False  # takes --chart (its default may be a tracked file: docs/*.png)
    timeout_s: float = 240.0


CASES = [
    Case("bench_catalog", "--count 3 --repeat 1"),
    Case("bench_core", "--size-gib 0.01 --repeat 1"),
    Case("bench_dcp_floor", "--size-gib 0.01 --small-count 50 --repeat 1", server=False),
    Case("bench_dcp_floor", "--load --load-count 50 --repeat 1", server=False),  # own server
    Case("bench_record", "--chunks 400 --ranks 4 --repeat 1", server=False),
    Case("bench_record", "--layout small --chunks 200 --repeat 1", server=False),
    Case("bench_faults", "--cycles 1 --size-mib 40 --only cycles"),
    Case("bench_gpu", "--device cpu --skip-training --size-gib 0.01 --saves 2", server=False),
    Case("bench_incremental", "--quick"),
    Case("bench_manager", "--width 64 --layers 1 --batch 4 --interval 2 --saves 2 --repeat 1"),
    Case(
        "bench_peers",
        "--systems s3ckpt raw --workloads large --size-gib 0.005 --repeat 1 --no-proxy",
        chart=True,
    ),
    Case(
        "bench_throttle",
        "--rates 50 --objects 20 --object-kib 4 --dcp-rate 50 --dcp-objects 8 --modes adaptive",
    ),
    Case(
        "bench_training",
        "--width 64 --layers 1 --batch 4 --interval 2 --checkpoints 2 --modes none thread "
        "--repeat 1",
        chart=True,
    ),
    Case("bench_safetensors", "--size-gib 0.02 --repeat 1"),
    Case("bench_coordinator", "--ranks 4 --chunks 20 --commit-ranks 8 --latency-ms 5"),
    Case(
        "bench_scale",
        "--axes layouts --layouts replicated hsdp --layout-worlds 4 --layout-tensors 20",
    ),
]


def run(case: Case, server: SeaweedFS | None, out: Path) -> tuple[str, float, str]:
    argv = [sys.executable, "-m", f"benchmarks.{case.module}", *case.argv.split()]
    argv += ["--json", str(out / f"{case.module}.json")]
    argv += ["--chart", str(out / f"{case.module}.png")] if case.chart else []
    if case.server and server is not None:
        endpoint, bucket = server.endpoint, f"smoke-{case.module.replace('_', '-')}"
        config = S3Config(
            endpoint_url=endpoint.endpoint_url,
            access_key_id=endpoint.access_key_id,
            secret_access_key=endpoint.secret_access_key,
        )
        bridge.run(get_store(config).create_bucket(bucket))
        argv += ["--endpoint-url", endpoint.endpoint_url, "--bucket", bucket]
        argv += ["--access-key", endpoint.access_key_id, "--secret-key", endpoint.secret_access_key]
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=case.timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return "timed out", time.monotonic() - started, ""
    seconds = time.monotonic() - started
    if done.returncode != 0:
        return f"exit {done.returncode}", seconds, (done.stdout + done.stderr)[-3000:]
    if not (out / f"{case.module}.json").exists():
        return "no JSON", seconds, done.stdout[-3000:]
    return "ok", seconds, ""


def main(argv: list[str] | None = None) -> int:
    p = options.Parser(__file__, __doc__)
    p.add_argument("only", nargs="*", help="benchmark modules to run (default: all)")
    args = p.parse_args(argv)
    unknown = set(args.only) - {c.module for c in CASES}
    if unknown:
        p.error(f"no smoke case for {sorted(unknown)}")
    cases = [c for c in CASES if not args.only or c.module in args.only]
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp, SeaweedFS() as server:
        for case in cases:
            print(f"{case.module} ...", flush=True)
            outcome, seconds, tail = run(case, server, Path(tmp))
            rows.append([case.module, outcome, f"{seconds:.0f}"])
            if outcome != "ok":
                failed.append(case.module)
                print(tail, flush=True)
    print(format_table(["benchmark", "outcome", "s"], rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
