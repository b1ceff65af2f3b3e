"""Training time lost to checkpoints: a real training loop checkpointing every N steps.

What users feel is not the stall alone but how much longer training takes while checkpoints go
to the store. Each run is a fresh child process pinned to one core with one torch thread; the
local SeaweedFS is pinned to another core (on 2 cores a server sharing the trainer's core would
bound everything). Modes run interleaved, repetitions of all modes in turn, medians reported:

- ``none``: the same steps without checkpoints (the baseline);
- ``sync``: ``dcp.save`` with `S3Writer`;
- ``thread`` / ``process``: ``dcp.async_save`` with `S3Writer`, THREAD or PROCESS checkpointer;
- ``thread-nice0``: THREAD with the storage layer's threads at the trainer's priority
  (``S3CKPT_IO_NICE=0``; by default they run at nice +10, see `s3ckpt.engine.bridge`);
- ``thread-first``: THREAD, a job's first checkpoints: the writer made before training, no
  save before the timed loop, so the one-time costs (client, buffers, probes) land in it;
- ``thread-prepared``: ``thread-first`` with ``S3Writer.prepare_staging`` called before training
  (what `CheckpointManager.restore` does): the buffers' first touch moves out of the first save;
- ``thread-io``: THREAD with the storage layer's threads pinned to the server's core
  (``S3CKPT_IO_CPUS``): what a spare core would take off the trainer's (here it is the
  server's, so this measures the trainer's side only);
- ``raw``: the floor: the same tensors copied into kept CPU buffers and uploaded by a plain
  aiobotocore client from a background thread (no DCP, no checksums, no commit);
- ``s3torchconnector`` / ``fsspec``: the peers' DCP writers (``S3StorageWriter``, torch's
  ``FsspecWriter`` over s3fs) with ``dcp.async_save`` THREAD, where installed (the peers' venv,
  `benchmarks/requirements-peers.txt`).

Every checkpoint mode but ``thread-first`` and ``thread-prepared`` saves once before the timed
loop (warm buffers and client, as in a long job), then checkpoints after steps N, 2N, ... and
trains N more steps after the last one before waiting for it to be durable, so the last upload
overlaps like the others.
The loop's wall time includes that wait. Blocking is the time spent inside the save call plus
waiting for the previous save. Each checkpoint's share of the in-run loss (its blocking, and the
slowing of the steps after it) is kept too, so that a run's first checkpoint is compared with its
later ones against the same clean step ("1st ckpt +s"): what a job's first save costs more,
without the drift between runs. CPU is the trainer process's and its children's (PROCESS mode's
checkpoint process), all threads; the second table splits the trainer process's CPU by thread
(from /proc/self/task), per GB saved.

    python -m benchmarks.bench_training                     # MLP, 4 checkpoints 25 steps apart
    python -m benchmarks.bench_training --model gpt --modes none sync thread
    python -m benchmarks.bench_training --sweep 5 10 25     # the shortest interval under 5% lost
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from s3ckpt.config import MiB, S3Config

from . import options
from .common import (
    GB,
    ROOT,
    Endpoint,
    format_table,
    machine_info,
    median,
    pin_threads,
    write_json,
)

MODES = (
    "none", "sync", "thread", "thread-first", "thread-prepared", "thread-io", "thread-nice0",
    "process", "raw",
    "s3torchconnector", "fsspec",
)  # fmt: skip
_PEER_PACKAGES = {"s3torchconnector": "s3torchconnector", "fsspec": "s3fs"}
_KEY_ENV, _SECRET_ENV = "S3CKPT_BENCH_ACCESS_KEY", "S3CKPT_BENCH_SECRET_KEY"
_LOST_GOAL = 0.05  # the sweep looks for the shortest interval losing less than this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--width", type=count, default=2048, help="MLP width / GPT embedding size")
    p.add_argument("--layers", type=count, default=4)
    p.add_argument("--batch", type=count, default=64)
    p.add_argument("--interval", type=count, default=25, help="steps between checkpoints")
    p.add_argument("--checkpoints", type=count, default=4)
    p.add_argument("--modes", nargs="+", choices=MODES, help="default: all, peers where installed")
    p.add_argument("--sweep", nargs="*", type=count, metavar="N", help="intervals for thread mode")
    p.chart(ROOT / "docs" / "training-overhead.png")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host")
    p.repeat(3)
    p.cores()
    p.part_size()
    p.server(bucket="bench-training-")
    p.json("training.json")
    p.child(choices=MODES)
    return p.parse(argv)


# ----------------------------------------------------------------------------- the child


def child_main(args: argparse.Namespace) -> int:
    """One run of one mode: pinned, one torch thread, numbers as JSON to ``--child-out``."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.trainer_core})
    from . import training_loop  # torch is imported after pinning, so its threads inherit it

    config = S3Config(
        endpoint_url=args.endpoint_url,
        region=args.region,
        access_key_id=os.environ[_KEY_ENV],
        secret_access_key=os.environ[_SECRET_ENV],
        part_size=args.part_size_mib * MiB,
    )
    result = training_loop.run(args, config)
    args.child_out.write_text(json.dumps(result))
    return 0


def _child(
    args: argparse.Namespace, endpoint: Endpoint, mode: str, interval: int
) -> dict[str, Any]:
    out = Path(f"/tmp/s3ckpt-training-{secrets.token_hex(4)}.json")
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_training",
        "--child",
        mode,
        "--child-out",
        str(out),
        "--endpoint-url",
        endpoint.url,
        "--bucket",
        args.bucket,
        "--interval",
        str(interval),
    ]
    for name in ("model", "width", "layers", "batch", "checkpoints", "trainer_core"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--part-size-mib", str(args.part_size_mib), "--device", args.device]
    if endpoint.region:
        command += ["--region", endpoint.region]
    env = os.environ | {_KEY_ENV: endpoint.access_key_id, _SECRET_ENV: endpoint.secret_access_key}
    if mode == "thread-nice0":
        env["S3CKPT_IO_NICE"] = "0"
    if mode == "thread-io":
        env["S3CKPT_IO_CPUS"] = str(args.server_core)
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
        )
        if done.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    return result


# ----------------------------------------------------------------------------- the parent


def create_bucket(config: S3Config, bucket: str) -> None:
    from .raw import RawClient

    async def create() -> None:
        async with RawClient(config) as raw:
            await raw.ensure_bucket(bucket)

    asyncio.run(create())


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians per mode, and the time lost against ``none`` and the cut against ``sync``."""
    base = median([r["wall_s"] for r in runs.get("none", [])])
    out: dict[str, dict[str, Any]] = {}
    for mode, results in runs.items():
        wall = median([r["wall_s"] for r in results])
        cpu = median([r["cpu_s"] for r in results])
        lost = None if base is None or wall is None else wall - base
        saved_gb = results[0]["checkpoints"] * results[0]["state_bytes"] / GB if results else 0.0
        # PROCESS mode uploads from its own process: its trainer's threads say nothing
        threads = [r["other_threads_cpu_s"] for r in results]
        background = None if mode == "process" else median(threads)
        out[mode] = {
            "in_run_lost_s": median([r["in_run_lost_s"] for r in results]),
            # what was lost, against the time the same steps take without checkpoints
            "in_run_fraction": median(
                [r["in_run_lost_s"] / (r["clean_step_s"] * r["steps"]) for r in results]
            ),
            # the storage layer's threads in the trainer (PROCESS mode's process is apart)
            "background_cpu_s": background,
            "background_cpu_s_per_gb": None
            if background is None or not saved_gb
            else background / saved_gb,
            "in_run_all": [r["in_run_lost_s"] for r in results],
            # the first checkpoint's in-run loss beyond the median of the run's later ones
            "first_extra_s": median([_first_extra(r) for r in results]),
            "thread_cpu_s_per_gb": _per_thread(results, saved_gb),
            "slowed_s": median([r["slowed_s"] for r in results]),
            "clean_step_s": median([r["clean_step_s"] for r in results]),
            "wall_s": wall,
            "wall_all": [r["wall_s"] for r in results],
            "lost_s": lost,
            "lost_fraction": None if lost is None or not base else lost / base,
            "blocking_s": median([r["blocking_s"] for r in results]),
            "cpu_s": cpu,
            "state_bytes": results[0]["state_bytes"] if results else None,
        }
    for kind in ("lost_s", "in_run_lost_s"):
        sync_lost = out.get("sync", {}).get(kind)
        for numbers in out.values():
            lost = numbers[kind]
            cut = None if lost is None or not sync_lost or sync_lost <= 0 else 1 - lost / sync_lost
            numbers[f"cut_vs_sync{'' if kind == 'lost_s' else '_in_run'}"] = cut
    return out


def _first_extra(result: dict[str, Any]) -> float | None:
    """A run's first checkpoint's loss beyond its later ones' median: what a job's first save
    costs more, measured against the same run's clean step (None without two checkpoints)."""
    lost = result.get("lost_by_checkpoint_s", [])
    later = median(lost[1:])
    return None if later is None else lost[0] - later


def _per_thread(results: list[dict[str, Any]], saved_gb: float) -> dict[str, float]:
    """Median CPU seconds per GB saved of each thread of the trainer process (on its core)."""
    names = {name for r in results for name in r.get("thread_cpu_s", {})}
    if not saved_gb:
        return {}
    return {
        name: (median([r.get("thread_cpu_s", {}).get(name, 0.0) for r in results]) or 0.0)
        / saved_gb
        for name in sorted(names)
    }


def thread_table(summary: dict[str, dict[str, Any]]) -> str:
    """The trainer core's CPU per GB saved, by thread (the main thread's holds training)."""
    names = sorted({name for n in summary.values() for name in n["thread_cpu_s_per_gb"]})
    names = [name for name in names if name != "training (main)"]
    rows = [
        [mode, *(n["thread_cpu_s_per_gb"].get(name) for name in names)]
        for mode, n in summary.items()
        if n["thread_cpu_s_per_gb"]
    ]
    return format_table(["CPU s/GB by thread", *names], rows)


def table(summary: dict[str, dict[str, Any]], checkpoints: int) -> str:
    headers = ["mode", "in-run lost s", "cut", "blocking s", "slowed s", "1st ckpt +s"]
    headers += ["wall s", "lost s", "cut (wall)", "bg CPU s", "bg CPU s/GB", "MB/ckpt", "walls"]
    rows = []
    for mode, n in summary.items():
        cut = None if n["cut_vs_sync"] is None else f"{100 * n['cut_vs_sync']:.0f}%"
        walls = " ".join(f"{w:.2f}" for w in n["wall_all"])
        size = None if n["state_bytes"] is None else n["state_bytes"] / 1e6
        in_run = n["cut_vs_sync_in_run"]
        rows.append([mode, n["in_run_lost_s"], None if in_run is None else f"{100 * in_run:.0f}%"])
        rows[-1] += [n["blocking_s"], n["slowed_s"], n["first_extra_s"]]
        rows[-1] += [n["wall_s"], n["lost_s"], cut]
        rows[-1] += [n["background_cpu_s"], n["background_cpu_s_per_gb"], size, walls]
    note = (
        f"{checkpoints} checkpoints, medians. in-run lost = blocking + what steps with a save in "
        "flight took beyond the run's own clean step (cut: against sync's); 1st ckpt +s = the "
        "first checkpoint's share of it beyond the median of the run's later ones; lost = wall "
        "- wall(none) across runs, which this machine's drift between runs makes noisy"
    )
    return format_table(headers, rows) + "\n" + note


def _interleaved(
    args: argparse.Namespace, endpoint: Endpoint, modes: list[str], interval: int
) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for rep in range(args.repeat):
        for mode in modes:
            result = _child(args, endpoint, mode, interval)
            runs[mode].append(result)
            print(
                f"  [{rep + 1}/{args.repeat}] interval {interval:>3} {mode:>8}: "
                f"{result['wall_s']:.2f} s wall, {result['blocking_s']:.2f} s blocking, "
                f"{result['cpu_s']:.2f} s CPU",
                flush=True,
            )
    return runs


def _sweep(
    args: argparse.Namespace, endpoint: Endpoint, intervals: list[int]
) -> list[dict[str, Any]]:
    """Time lost by thread mode at each interval; the shortest one under the goal."""
    points = []
    for interval in sorted(intervals):
        summary = summarize(_interleaved(args, endpoint, ["none", "thread"], interval))
        thread = summary["thread"]
        points.append({"interval": interval, **thread})
    return points


def _chart(path: Path, summary: dict[str, dict[str, Any]], sweep: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no chart)")
        return
    panels = 2 if sweep else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    modes = [m for m in summary if m != "none"]
    lost = [summary[m]["in_run_lost_s"] or 0.0 for m in modes]
    blocking = [summary[m]["blocking_s"] or 0.0 for m in modes]
    ax = axes[0][0]
    ax.bar(modes, lost, color="#4c78a8", label="training time lost")
    ax.bar(modes, blocking, color="#f58518", width=0.4, label="of which blocking")
    ax.set_ylabel("seconds")
    ax.set_title("time lost to checkpoints, per mode")
    ax.legend()
    if sweep:
        ax = axes[0][1]
        ax.plot([p["interval"] for p in sweep], [100 * (p["in_run_fraction"] or 0) for p in sweep])
        ax.axhline(100 * _LOST_GOAL, color="grey", linestyle="--")
        ax.set_xlabel("steps between checkpoints")
        ax.set_ylabel("% of training time lost (thread, in-run)")
        ax.set_title("checkpoint interval sweep")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    machine = machine_info()
    with options.endpoint(args) as ep:
        pinned = pin_threads(ep.server_pid, args.server_core)
        server = f"on core {args.server_core}" if pinned else "unpinned"
        config = ep.config(part_size=args.part_size_mib * MiB, max_concurrency=8)
        create_bucket(config, args.bucket)
        print(
            f"training benchmark: {args.model} x{args.layers} width {args.width}, batch "
            f"{args.batch}, {args.checkpoints} checkpoints every {args.interval} steps; trainer "
            f"on core {args.trainer_core}, server {server}; "
            f"{ep.server}",
            flush=True,
        )
        modes = args.modes or [
            m
            for m in MODES
            if m not in _PEER_PACKAGES or importlib.util.find_spec(_PEER_PACKAGES[m]) is not None
        ]
        runs = _interleaved(args, ep, modes, args.interval)
        summary = summarize(runs)
        sweep = _sweep(args, ep, args.sweep) if args.sweep else []
    print(table(summary, args.checkpoints))
    print(thread_table(summary))
    if sweep:
        rows = [
            [p["interval"], 100 * (p["in_run_fraction"] or 0), p["in_run_lost_s"]] for p in sweep
        ]
        print(format_table(["interval", "in-run lost %", "in-run lost s"], rows))
        under = [p["interval"] for p in sweep if (p["in_run_fraction"] or 1) < _LOST_GOAL]
        print(f"shortest interval under {100 * _LOST_GOAL:.0f}% lost: {min(under, default='-')}")
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    report["machine"] = machine
    report |= {"server_pinned": pinned, "runs": runs, "summary": summary, "sweep": sweep}
    write_json(args.json, report)
    print(f"JSON: {args.json}")
    _chart(args.chart, summary, sweep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
