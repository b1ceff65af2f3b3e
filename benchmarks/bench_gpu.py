"""The GPU check of the training-overhead issue, as one run for a lent GPU host (meant to fit
under 10 min: the training part has a 7-minute timeout; not yet run on a GPU).

1. Stall: ``dcp.async_save`` with `S3Writer` on a CUDA state (steady state, the writer's pinned
   staging buffers warm) against a pinned device-to-host copy of the same bytes into kept
   buffers, the least a save must block for.
2. Reuse: the staging buffers are pinned, and the same memory is staged into on every save.
3. Training: `bench_training` on the GPU (none, sync, async THREAD), the same table as on CPU.

    python -m benchmarks.bench_gpu                       # all three (training capped at 7 min)
    python -m benchmarks.bench_gpu --skip-training       # 1 and 2 only

Without CUDA it says so and exits 2 (``--device cpu`` runs 1 and 2 on the CPU, to try the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Writer

from . import options
from .bench_training import create_bucket
from .common import ROOT, s3_endpoint, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    p.add_argument("--device", default="cuda")
    p.size_gib(1.0, "state of the stall check")
    p.add_argument("--saves", type=options.positive_int, default=4)
    p.add_argument("--skip-training", action="store_true")
    p.json("gpu.json")
    return p.parse(argv)


def _state(gib: float, device: str) -> dict[str, torch.Tensor]:
    count = max(1, round(gib * 8))  # 128 MiB tensors, like large layers
    numel = (128 << 20) // 4
    return {f"layer{i}": torch.randn(numel, device=device) for i in range(count)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stall_and_reuse(args: argparse.Namespace, config: Any, bucket: str) -> dict[str, Any]:
    state = _state(args.size_gib, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pin = args.device.startswith("cuda")
    kept = {k: torch.empty_like(t, device="cpu", pin_memory=pin) for k, t in state.items()}
    copies = []
    for _ in range(5):
        _sync(args.device)
        started = time.perf_counter()
        for name, tensor in state.items():
            kept[name].copy_(tensor, non_blocking=pin)
        _sync(args.device)
        copies.append(time.perf_counter() - started)

    writer = S3Writer(f"s3://{bucket}/gpu", config=config, overwrite=True)
    stalls, pointers, pinned = [], [], []
    for i in range(args.saves):
        for tensor in state.values():
            tensor.add_(1.0)  # a training step between saves
        _sync(args.device)
        started = time.perf_counter()
        future = dcp.async_save(
            state, checkpoint_id=f"s3://{bucket}/gpu/{i}", storage_writer=writer
        )
        stalls.append(time.perf_counter() - started)
        future.result()  # type: ignore[union-attr]  # a Future: no staging response asked for
        # The benchmark looks inside the writer: which memory did this save stage into?
        buffers = writer._staging._buffers or {}
        pointers.append(sorted(t.data_ptr() for t in buffers.values()))
        pinned.append(all(t.is_pinned() for t in buffers.values()) if buffers else False)
    steady = statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0]
    copy = statistics.median(copies)
    return {
        "bytes": nbytes,
        "pinned_copy_s": copy,
        "stall_first_s": stalls[0],
        "stall_steady_s": steady,
        "stall_over_copy": steady / copy,
        "staging_pinned": all(pinned),
        "staging_reused": all(p == pointers[0] for p in pointers[1:]),
    }


def training(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "training.json"
    command = [
        sys.executable, "-m", "benchmarks.bench_training", "--device", args.device,
        "--modes", "none", "sync", "thread", "--repeat", "2", "--model", "gpt",
        "--width", "1024", "--layers", "8", "--interval", "100", "--checkpoints", "3",
        "--json", str(out), "--chart", str(out.with_suffix(".png")),
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, timeout=420)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (run this on a GPU host)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report: dict[str, Any] = {"device": device_name, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp, s3_endpoint(None, None, None, None) as endpoint:
        config = endpoint.config(part_size=16 << 20, max_concurrency=16)
        bucket = "bench-gpu"
        create_bucket(config, bucket)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            report["stall"] = stall_and_reuse(args, config, bucket)
        finally:
            dist.destroy_process_group()
    s = report["stall"]
    print(f"device: {device_name}; state {s['bytes'] / 2**30:.2f} GiB")
    print(f"pinned device-to-host copy into kept buffers: {s['pinned_copy_s'] * 1e3:.0f} ms")
    print(
        f"async_save stall: first {s['stall_first_s'] * 1e3:.0f} ms, steady "
        f"{s['stall_steady_s'] * 1e3:.0f} ms = {s['stall_over_copy']:.2f}x the copy"
    )
    print(f"staging buffers pinned: {s['staging_pinned']}, reused: {s['staging_reused']}")
    if not args.skip_training:
        report["training"] = training(args)
    write_json(args.json, report)
    print(f"JSON: {args.json}")
    return 0 if s["staging_reused"] and s["staging_pinned"] == args.device.startswith("cuda") else 1


if __name__ == "__main__":
    sys.exit(main())
