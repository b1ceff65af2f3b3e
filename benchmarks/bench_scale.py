"""Scale benchmark: how planning, the commit record and requests grow with tensors, ranks, bytes.

The goal it checks: 100k tensors plan, save and load without pathological slowdown. Three axes:

- tensors: 1k, 10k, 100k small tensors (256 B-4 KiB each) at world size 1;
- world: 1, 2, 4 ranks (gloo on 127.0.0.1, spawned processes), each holding ~10k tensors, as
  DTensor shards of one global state (``--dist-mode dtensor``) or per-rank-distinct tensors;
- size: 64 MiB and 256 MiB (1 GiB with ``--big``) of 16 MiB tensors at world size 1.

Every point runs in fresh processes (so peak RSS is the point's own, and every rank has its own
transfer engine) that save, then load into zeroed tensors and check them bit for bit. Phases are
timed by subclassing `S3Writer`/`S3Reader` and stamping their DCP hooks: planning is dcp.save's
start until ``write_data`` is entered (storage setup, DCP's local and global planning and the plan
exchange); ``finish`` runs on the coordinator, and its JSON encode is timed by wrapping
``s3ckpt.dcp.writer.encode`` in the worker process. Requests are deltas of each rank's
``get_store(config).stats.requests``, summed over ranks; the bucket's checksum probe is done
before measuring. One repetition per point: on a shared 2-core machine treat +-20% as noise.

    python -m benchmarks.bench_scale                           # all axes, default points
    python -m benchmarks.bench_scale --axes tensors --tensors 1000 10000
    python -m benchmarks.bench_scale --axes size --big         # adds the 1 GiB point
    python -m benchmarks.bench_scale --profile                 # cProfile rank 0 of every point
    python -m benchmarks.bench_scale --axes tensors --gc off   # the same without the cyclic GC

``--gc off`` exists because at 100k tensors CPython's cyclic GC (rescanning DCP's plans) is
about half of the CPU; with it off every per-chunk cost is flat from 1k to 100k.
See docs/scaling.md for what the numbers imply at 1,024 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import math
import multiprocessing
import os
import pstats
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import s3ckpt.dcp.writer as writer_module
from s3ckpt import S3Config, S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.format.layout import Location
from s3ckpt.format.packing import assign_objects as pack
from s3ckpt.tools.localserver import free_port

from . import options
from .common import (
    RESULTS,
    ROOT,
    Endpoint,
    RssSampler,
    format_table,
    machine_info,
    rank_process,
    write_json,
)
from .scale_layouts import LAYOUTS, LayoutPoint, layout_table, run_layout_point

AXES = ("tensors", "world", "size", "layouts")
SMALL_BYTES = (256, 512, 1024, 2048, 4096)  # cycled: 1,587 B a tensor on average
LARGE_TENSOR = 16 * MiB
_COLS = 16  # small tensors are (n, 16) fp32 matrices so they can be sharded along dim 0


@dataclass(frozen=True)
class Point:
    """One measured configuration; pickled into every rank process."""

    axis: str
    label: str
    world: int
    tensors: int  # per rank
    large_bytes: int  # > 0: the state is this many bytes of LARGE_TENSOR tensors
    dist_mode: str  # "dtensor", "distinct" or "plain" (world 1, ordinary tensors)
    config: S3Config
    bucket: str
    prefix: str
    objects_per_rank: int
    spread_keys: bool = False
    gc_mode: str = "default"  # "freeze": gc.freeze() once the state is built; "off": no cyclic GC
    profile_dir: str | None = None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


# ------------------------------------------------------------------------------------ the state


def _pattern(numel: int, seed: int) -> torch.Tensor:
    """Cheap, exact, distinct per tensor: int32 ramp XOR seed, viewed as fp32."""
    return torch.arange(numel, dtype=torch.int32).bitwise_xor_(seed).view(torch.float32)


def _shapes(point: Point) -> list[tuple[str, tuple[int, int]]]:
    """Names and per-rank (local) shapes; names look like a model's, ~35 characters."""
    if point.large_bytes:
        count = math.ceil(point.large_bytes / LARGE_TENSOR)
        rows = LARGE_TENSOR // 4 // 1024
        return [(f"model.layers.{i}.mlp.fc1.weight", (rows, 1024)) for i in range(count)]
    shapes = []
    for i in range(point.tensors):
        rows = SMALL_BYTES[i % len(SMALL_BYTES)] // 4 // _COLS
        shapes.append((f"model.layers.{i // 8}.block.p{i % 8}.weight", (rows, _COLS)))
    return shapes


def local_tensors(point: Point, rank: int, *, zeros: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensors (data or zeroed destinations), with the names they are saved under."""
    for i, (name, shape) in enumerate(_shapes(point)):
        numel = shape[0] * shape[1]
        if point.dist_mode == "distinct":
            name, seed = f"rank{rank}.{name}", rank * 10_000_019 + i
        else:
            seed = rank * 10_000_019 + i if point.dist_mode == "dtensor" else i
        data = torch.zeros(numel) if zeros else _pattern(numel, seed)
        yield name, data.view(shape)


def build_state(point: Point, rank: int, *, zeros: bool) -> dict[str, Any]:
    """Plain tensors, or DTensors sharded on dim 0 (from_local: no communication per tensor)."""
    if point.dist_mode != "dtensor":
        return dict(local_tensors(point, rank, zeros=zeros))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (point.world,))
    return {
        name: DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        for name, local in local_tensors(point, rank, zeros=zeros)
    }


def count_mismatches(point: Point, rank: int, state: dict[str, Any]) -> int:
    """Bit-exact comparison of the loaded local data against a regenerated copy."""
    bad = 0
    for name, want in local_tensors(point, rank, zeros=False):
        got = state[name]
        got = got.to_local() if hasattr(got, "to_local") else got
        bad += not torch.equal(got.view(torch.int32), want.view(torch.int32))
    return bad


# ------------------------------------------------------------------------------ timed hooks


class Marks:
    """Wall and process-CPU stamps since a start, by name (the first stamp of a name wins).

    CPU (all threads of the rank) is kept beside wall time because on a shared machine wall
    time mostly measures the other tenants; ``""`` names the start.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.at: dict[str, float] = {"": 0.0}
        self.cpu: dict[str, float] = {"": 0.0}

    def __call__(self, name: str) -> None:
        self.at.setdefault(name, time.perf_counter() - self.start)
        self.cpu.setdefault(name, time.process_time() - self.cpu_start)

    def span(self, first: str, last: str, *, cpu: bool = False) -> float | None:
        table = self.cpu if cpu else self.at
        if first not in table or last not in table:
            return None
        return table[last] - table[first]


class TimedWriter(S3Writer):
    """S3Writer that stamps when DCP enters each hook; behaviour unchanged."""

    def __init__(self, *args: Any, marks: Marks, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marks = marks

    def set_up_storage_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        self.marks("setup_start")
        super().set_up_storage_writer(is_coordinator, **kwargs)
        self.marks("setup_end")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.marks("local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.marks("global_plan_start")
        out = super().prepare_global_plan(plans)
        self.marks("global_plan_end")
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.marks("write_start")
        future = super().write_data(plan, planner)
        self.marks("write_returned")
        future.add_done_callback(lambda _: self.marks("write_done"))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.marks("write_done")  # if DCP woke before the future's callback ran
        self.marks("finish_start")
        super().finish(metadata, results)
        self.marks("finish_end")


class TimedReader(S3Reader):
    """S3Reader that stamps when DCP enters each hook; behaviour unchanged."""

    def __init__(self, *args: Any, marks: Marks, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marks = marks

    def read_metadata(self) -> Metadata:
        self.marks("read_metadata_start")
        out = super().read_metadata()
        self.marks("read_metadata_end")
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.marks("read_start")
        future = super().read_data(plan, planner)
        self.marks("read_returned")
        future.add_done_callback(lambda _: self.marks("read_done"))
        return future


def install_encode_timer(log: list[tuple[float, float, int]]) -> bool:
    """Time the JSON encode inside finish by wrapping the name `S3Writer.finish` calls."""
    original: Callable[..., bytes] | None = getattr(writer_module, "encode", None)
    if original is None:
        return False

    def timed(*args: Any, **kwargs: Any) -> bytes:
        started, cpu = time.perf_counter(), time.thread_time()
        record = original(*args, **kwargs)
        log.append((time.perf_counter() - started, time.thread_time() - cpu, len(record)))
        return record

    writer_module.encode = timed  # type: ignore[attr-defined]
    return True


@contextlib.contextmanager
def profiled(point: Point, rank: int, phase: str) -> Iterator[None]:
    """cProfile rank 0's block when asked; writes .prof and a text top-30 beside it."""
    if point.profile_dir is None or rank != 0:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        base = Path(point.profile_dir) / f"{point.axis}-{point.label}-{phase}"
        profile.dump_stats(f"{base}.prof")
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(30)
        Path(f"{base}.txt").write_text(text.getvalue())


# ------------------------------------------------------------------------------- rank process


def rank_main(rank: int, world: int, port: int, point: Point, out_dir: str) -> None:
    """One rank of one point: save, load, verify; writes its numbers to ``rank-<r>.json``."""
    rank_process(rank, world, port, out_dir, 1800, lambda: _rank_run(rank, point))


def _rank_run(rank: int, point: Point) -> dict[str, Any]:
    store = get_store(point.config)
    # A training job saves repeatedly: start the client and settle the bucket's checksum
    # probe before measuring, so the counts are those of a steady-state save.
    bridge.run(store.check_bucket(point.bucket))
    bridge.run(store.uploads.wire_mode(point.bucket, f"{point.prefix}/warmup-{rank}"))  # type: ignore[attr-defined]  # S3Store's
    encodes: list[tuple[float, float, int]] = []
    install_encode_timer(encodes)
    build_started = time.perf_counter()
    state = build_state(point, rank, zeros=False)
    build_s = time.perf_counter() - build_started
    gc.collect()
    _apply_gc_mode(point.gc_mode)

    marks = Marks()
    writer = TimedWriter(
        point.url,
        config=point.config,
        options=WriteOptions(
            objects_per_rank=point.objects_per_rank, spread_keys=point.spread_keys
        ),
        marks=marks,
    )
    dist.barrier()
    requests = store.stats.requests
    with RssSampler() as save_rss, profiled(point, rank, "save"):
        marks.reset()
        dcp.save(state, storage_writer=writer)
        marks("save_end")
    save: dict[str, Any] = {
        "requests": store.stats.requests - requests,
        **_phases(
            marks,
            seconds=("", "save_end"),
            plan_s=("", "write_start"),
            setup_s=("setup_start", "setup_end"),
            local_plan_s=("", "local_plan"),
            global_plan_s=("local_plan", "global_plan_end"),
            pack_s=("write_start", "write_returned"),
            write_s=("write_start", "write_done"),
            gather_s=("write_done", "finish_start"),
            finish_s=("finish_start", "finish_end"),
        ),
        "encode_s": encodes[0][0] if encodes else None,
        "encode_cpu_s": encodes[0][1] if encodes else None,
        "record_bytes": encodes[0][2] if encodes else None,
        "marks": marks.at,
        **_rss(save_rss),
    }
    if rank == 0:
        head = bridge.run(store.head(point.bucket, Location.of(point.url).metadata_key))
        save["metadata_bytes"] = head.size if head else None
    del state, writer
    gc.collect()

    dest = build_state(point, rank, zeros=True)
    gc.collect()
    _apply_gc_mode(point.gc_mode)
    marks = Marks()
    dist.barrier()
    requests = store.stats.requests
    with RssSampler() as load_rss, profiled(point, rank, "load"):
        marks.reset()
        dcp.load(dest, storage_reader=TimedReader(point.url, config=point.config, marks=marks))
        marks("load_end")
    load = {
        "requests": store.stats.requests - requests,
        **_phases(
            marks,
            seconds=("", "load_end"),
            read_metadata_s=("read_metadata_start", "read_metadata_end"),
            plan_s=("", "read_start"),
            targets_s=("read_start", "read_returned"),
            read_s=("read_start", "read_done"),
        ),
        "marks": marks.at,
        **_rss(load_rss),
    }
    mismatches = count_mismatches(point, rank, dest)
    return {"rank": rank, "build_s": build_s, "save": save, "load": load, "mismatches": mismatches}


def _phases(marks: Marks, **spans: tuple[str, str]) -> dict[str, float | None]:
    """Each named span as wall seconds (``name``) and process CPU seconds (``name_cpu``)."""
    out: dict[str, float | None] = {}
    for name, (first, last) in spans.items():
        out[name] = marks.span(first, last)
        cpu_name = "cpu_s" if name == "seconds" else name.removesuffix("_s") + "_cpu_s"
        out[cpu_name] = marks.span(first, last, cpu=True)
    return out


def _apply_gc_mode(mode: str) -> None:
    """Take what exists now out of the cyclic GC's scans ("freeze"), or stop it ("off")."""
    if mode == "freeze":
        gc.freeze()
    elif mode == "off":
        gc.disable()


def _rss(sampler: RssSampler) -> dict[str, int]:
    return {"rss_peak": sampler.peak, "rss_increase": sampler.peak - sampler.baseline}


# ------------------------------------------------------------------------------------- parent


def run_point(point: Point, timeout_s: float) -> dict[str, Any]:
    """Spawn the ranks, bound them in time, and combine what they report."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="s3ckpt-scale-") as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, point.world, port, point, tmp), name=f"rank{r}")
            for r in range(point.world)
        ]
        for proc in procs:
            proc.start()
        deadline = started + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.perf_counter()))
        timed_out = any(proc.is_alive() for proc in procs)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        ranks = []
        for r in range(point.world):
            path = Path(tmp) / f"rank-{r}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {"error": "no output"})
    elapsed = time.perf_counter() - started
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
    if timed_out:
        errors.insert(0, f"timed out after {timeout_s:.0f} s")
    summary = {"point": _describe(point), "elapsed_s": elapsed, "errors": errors, "ranks": ranks}
    if not errors:
        summary.update(combine(point, ranks))
    return summary


def _describe(point: Point) -> dict[str, Any]:
    shapes = _shapes(point)
    local_bytes = sum(rows * cols * 4 for _, (rows, cols) in shapes)
    fqns = len(shapes) * (point.world if point.dist_mode == "distinct" else 1)
    chunks = len(shapes) * point.world
    return {
        "axis": point.axis,
        "label": point.label,
        "world": point.world,
        "dist_mode": point.dist_mode,
        "gc_mode": point.gc_mode,
        "tensors_per_rank": len(shapes),
        "fqns": fqns,
        "chunks": chunks,
        "bytes_total": local_bytes * point.world,
        "objects_per_rank": point.objects_per_rank,
        "spread_keys": point.spread_keys,
        "part_size": point.config.part_size,
        "max_concurrency": point.config.max_concurrency,
    }


def predicted_save_requests(point: Point) -> int:
    """The request model docs/scaling.md extrapolates with; the table checks it against counts.

    Per rank: its items packed as `S3Writer` packs them; an object up to the multipart threshold
    is one PUT, a larger one is create + one PUT per part + complete. The coordinator adds HEAD
    bucket and HEAD .metadata (setup) and the commit PUT.
    """
    sizes = [rows * cols * 4 for _, (rows, cols) in _shapes(point)]
    config = point.config
    owner = pack(sizes, point.objects_per_rank, config.part_size)
    objects: dict[int, int] = {}
    for size, obj in zip(sizes, owner, strict=True):
        objects[obj] = objects.get(obj, 0) + size
    per_rank = sum(
        1 if size <= config.multipart_threshold else 2 + math.ceil(size / config.part_size)
        for size in objects.values()
    )
    return per_rank * point.world + 3


def combine(point: Point, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Coordinator (rank 0) phases; requests and CPU summed over ranks; wall and RSS the worst."""
    coord_save, coord_load = ranks[0]["save"], ranks[0]["load"]
    saves, loads = [r["save"] for r in ranks], [r["load"] for r in ranks]
    out: dict[str, Any] = {
        "save_s": max(s["seconds"] for s in saves),
        "load_s": max(s["seconds"] for s in loads),
        "save_cpu_s": sum(s["cpu_s"] for s in saves),
        "load_cpu_s": sum(s["cpu_s"] for s in loads),
        "write_s": max(s["write_s"] or 0.0 for s in saves),
        "read_s": max(s["read_s"] or 0.0 for s in loads),
        "metadata_bytes": coord_save.get("metadata_bytes"),
        "save_requests": sum(s["requests"] for s in saves),
        "load_requests": sum(s["requests"] for s in loads),
        "save_rss_peak": max(s["rss_peak"] for s in saves),
        "save_rss_increase": max(s["rss_increase"] for s in saves),
        "load_rss_peak": max(s["rss_peak"] for s in loads),
        "mismatches": sum(r["mismatches"] for r in ranks),
        "predicted_save_requests": predicted_save_requests(point),
    }
    for name in ("plan", "setup", "local_plan", "global_plan", "pack", "gather", "finish"):
        out[f"{name}_s"] = coord_save[f"{name}_s"]
        out[f"{name}_cpu_s"] = coord_save[f"{name}_cpu_s"]
    out["encode_s"], out["encode_cpu_s"] = coord_save["encode_s"], coord_save["encode_cpu_s"]
    for name in ("plan", "read_metadata", "targets"):
        out[f"load_{name}_s"] = coord_load[f"{name}_s"]
        out[f"load_{name}_cpu_s"] = coord_load[f"{name}_cpu_s"]
    return out


def delete_prefix(config: S3Config, bucket: str, prefix: str) -> None:
    """Remove what a point left (data objects and .metadata) so the server stays small."""
    store = get_store(config)
    keys = [o.key for o in bridge.run(store.list_objects(bucket, prefix + "/")).objects]
    if keys:
        bridge.run(store.delete(bucket, keys))


def default_timeout(point: Point) -> float:
    """Generous on a loaded 2-core machine, yet a hang cannot stall the run."""
    info = _describe(point)
    return float(180.0 + 0.005 * info["chunks"] + 90.0 * info["bytes_total"] / 2**30)


def plan_points(args: argparse.Namespace, config: S3Config, root: str) -> list[Point]:
    base = Point(
        axis="",
        label="",
        world=1,
        tensors=0,
        large_bytes=0,
        dist_mode="plain",
        config=config,
        bucket=args.bucket,
        prefix="",
        objects_per_rank=args.objects_per_rank,
        spread_keys=args.spread_keys,
        gc_mode=args.gc,
        profile_dir=str(args.profile_dir) if args.profile else None,
    )
    points = []
    if "tensors" in args.axes:
        for n in args.tensors:
            label = _count_label(n)
            points.append(replace(base, axis="tensors", label=label, tensors=n))
    if "world" in args.axes:
        for w in args.worlds:
            label = f"w{w}"
            points.append(
                replace(
                    base,
                    axis="world",
                    label=label,
                    world=w,
                    tensors=args.world_tensors,
                    dist_mode=args.dist_mode,
                )
            )
    if "size" in args.axes:
        sizes = list(args.sizes_mib) + ([1024] if args.big else [])
        for mib in sizes:
            label = f"{mib}MiB"
            points.append(replace(base, axis="size", label=label, large_bytes=mib * MiB))
    return [replace(p, prefix=f"{root}/{p.axis}-{p.label}") for p in points]


def _count_label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 and n >= 1000 else str(n)


# ------------------------------------------------------------------------------------ reports


def _mib(value: float | None) -> float | None:
    return None if value is None else value / MiB


def _failed_row(result: dict[str, Any], width: int) -> list[Any]:
    return [result["point"]["label"], "FAILED"] + [None] * (width - 2)


def size_table(results: list[dict[str, Any]]) -> str:
    """What a save puts on the wire and in memory."""
    headers = ["point", "ranks", "fqns", "chunks", "MiB", "meta KiB", "save req", "model"]
    headers += ["load req"]
    headers += ["save RSS MiB", "load RSS MiB"]
    rows = []
    for r in results:
        if r["errors"]:
            rows.append(_failed_row(r, len(headers)))
            continue
        p, meta = r["point"], r["metadata_bytes"]
        rows.append(
            [
                *(p["label"], p["world"], p["fqns"], p["chunks"], p["bytes_total"] / MiB),
                None if meta is None else meta / 1024,
                *(r["save_requests"], r["predicted_save_requests"], r["load_requests"]),
                *(_mib(r["save_rss_peak"]), _mib(r["load_rss_peak"])),
            ]
        )
    return format_table(headers, rows)


def time_table(results: list[dict[str, Any]]) -> str:
    """Where a save's and a load's time goes: wall and CPU seconds side by side."""
    headers = ["point", "plan", "plan CPU", "write", "gather", "finish", "finish CPU", "encode"]
    headers += ["save", "save CPU", "ld meta", "ld plan", "ld plan CPU", "load", "load CPU"]
    rows = []
    for r in results:
        if r["errors"]:
            rows.append(_failed_row(r, len(headers)))
            continue
        rows.append(
            [
                *(r["point"]["label"], r["plan_s"], r["plan_cpu_s"], r["write_s"]),
                *(r["gather_s"], r["finish_s"], r["finish_cpu_s"], r["encode_cpu_s"]),
                *(r["save_s"], r["save_cpu_s"], r["load_read_metadata_s"]),
                *(r["load_plan_s"], r["load_plan_cpu_s"], r["load_s"], r["load_cpu_s"]),
            ]
        )
    return format_table(headers, rows)


_PER_CHUNK = {  # linearity column: (result key, scaled per 1k chunks (True) or per chunk)
    "meta B/chunk": ("metadata_bytes", False),
    "encode CPU/1k": ("encode_cpu_s", True),
    "finish CPU/1k": ("finish_cpu_s", True),
    "plan CPU/1k": ("plan_cpu_s", True),
    "save CPU/1k": ("save_cpu_s", True),
    "ld meta s/1k": ("load_read_metadata_s", True),
    "ld plan CPU/1k": ("load_plan_cpu_s", True),
    "load CPU/1k": ("load_cpu_s", True),
    "save s/1k": ("save_s", True),
    "load s/1k": ("load_s", True),
}


def linearity(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-chunk costs at each point, and the largest point's over the smallest's (1.0 = linear)."""
    rows = []
    for r in results:
        if r["errors"]:
            continue
        chunks = r["point"]["chunks"]
        row: dict[str, Any] = {"label": r["point"]["label"], "chunks": chunks}
        for column, (key, per_k) in _PER_CHUNK.items():
            value = r.get(key)
            row[column] = None if value is None else value * (1000 if per_k else 1) / chunks
        rows.append(row)
    growth: dict[str, float | None] = {}
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        for column in _PER_CHUNK:
            a, b = first[column], last[column]
            growth[column] = b / a if a and b is not None else None
    return {"rows": rows, "growth_last_over_first": growth}


def throughput_table(results: list[dict[str, Any]]) -> str:
    """For the size axis: rates, and memory beside the bytes in flight a rank may hold."""
    headers = ["point", "MiB", "save MiB/s", "load MiB/s", "save RSS +MiB", "load RSS MiB"]
    headers += ["in flight MiB"]
    rows = []
    for r in results:
        if r["errors"]:
            rows.append(_failed_row(r, len(headers)))
            continue
        p = r["point"]
        mib = p["bytes_total"] / MiB
        rows.append(
            [
                *(p["label"], mib, mib / r["save_s"], mib / r["load_s"]),
                *(_mib(r["save_rss_increase"]), _mib(r["load_rss_peak"])),
                p["part_size"] * p["max_concurrency"] / MiB,
            ]
        )
    return format_table(headers, rows)


def linearity_table(lin: dict[str, Any]) -> str:
    headers = ["point", "chunks", *_PER_CHUNK]
    rows = [[row["label"], row["chunks"], *(row[c] for c in _PER_CHUNK)] for row in lin["rows"]]
    growth = lin["growth_last_over_first"]
    if growth:
        rows.append(["last/first", None, *(growth.get(c) for c in _PER_CHUNK)])
    return format_table(headers, rows)


# --------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.quick("the tensors and layouts axes at CI size")
    p.scaled("--axes", list(AXES), ["tensors", "layouts"], "axes to run", nargs="+", choices=AXES)
    tensors = [1_000, 10_000, 100_000]
    p.scaled("--tensors", tensors, [1_000], "the tensors axis", nargs="+", type=count)
    p.add_argument("--worlds", nargs="+", type=count, default=[1, 2, 4])
    p.add_argument("--world-tensors", type=count, default=10_000, help="tensors per rank")
    p.add_argument("--dist-mode", choices=("dtensor", "distinct"), default="dtensor")
    p.add_argument("--sizes-mib", nargs="+", type=count, default=[64, 256])
    p.add_argument("--big", action="store_true", help="add the 1 GiB point to the size axis")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.scaled("--layout-worlds", [8, 16], [4], "ranks of a layout", nargs="+", type=count)
    p.scaled("--layout-tensors", 256, 32, "64 x 64 fp32 tensors", type=count)
    p.add_argument("--objects-per-rank", type=count, default=4)
    p.add_argument("--spread-keys", action="store_true", help="WriteOptions(spread_keys=True)")
    p.add_argument(
        "--gc",
        choices=("default", "freeze", "off"),
        default="default",
        help="cyclic GC in the ranks: as is, gc.freeze() after building the state, or disabled",
    )
    p.add_argument("--profile", action="store_true", help="cProfile rank 0 of every point")
    p.add_argument("--profile-dir", type=Path, default=RESULTS / "scale-profiles")
    p.part_size()
    p.concurrency()
    p.timeout("scales with the point")
    p.server()
    p.json("scale.json")
    return p.parse(argv)


@dataclass
class Run:
    """Results by axis, in the order measured."""

    by_axis: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, result: dict[str, Any]) -> None:
        self.by_axis.setdefault(result["point"]["axis"], []).append(result)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = time.time(), machine_info()
    run = Run()
    with options.endpoint(args) as ep:
        config = _config(args, ep)
        bridge.run(get_store(config).create_bucket(args.bucket))
        if args.profile:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
        root = f"scale-{secrets.token_hex(4)}"
        print(f"s3ckpt scale benchmark against {ep.server} at {ep.url}", flush=True)
        if "layouts" in args.axes:
            for layout_point in layout_points(args, config, root):
                print(f"  layouts={layout_point.label}: ", end="", flush=True)
                result = run_layout_point(layout_point, args.timeout_s or 600.0)
                _cleanup(config, args.bucket, layout_point.prefix)
                run.add(result)
                _progress(result, f"load {result.get('load_s', 0.0):.2f} s")
        for point in plan_points(args, config, root):
            timeout = args.timeout_s or default_timeout(point)
            print(f"  {point.axis}={point.label}: ", end="", flush=True)
            result = run_point(point, timeout)
            _cleanup(config, args.bucket, point.prefix)
            run.add(result)
            _progress(
                result,
                f"save {result.get('save_s', 0.0):.2f} s, load {result.get('load_s', 0.0):.2f} s",
            )
    report: dict[str, Any] = {
        "machine": machine,
        "server": {"name": ep.server, "endpoint": ep.url, "local": ep.server_pid is not None},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "commit": _git_commit(),
        "wall_s": time.time() - started,
        "axes": {},
    }
    failed = False
    for axis, results in run.by_axis.items():
        if axis == "layouts":
            report["axes"][axis] = {"results": results}
            print("\naxis: layouts (per restore: what the store served; per save: rank 0)")
            print(layout_table(results))
            failed |= any(r["errors"] or r.get("mismatches") for r in results)
            continue
        lin = linearity(results)
        report["axes"][axis] = {"results": results, "linearity": lin}
        print(f"\naxis: {axis}" + (f" ({args.dist_mode})" if axis == "world" else ""))
        print(size_table(results))
        print(time_table(results))
        print(throughput_table(results) if axis == "size" else linearity_table(lin))
        failed |= any(r["errors"] or r.get("mismatches") for r in results)
    report["settings"]["part_size"] = config.part_size
    report["settings"]["config"] = {
        k: v for k, v in asdict(config).items() if "key" not in k and "token" not in k
    }
    write_json(args.json, report)
    print(
        "\nSeconds; plan: dcp.save start until write_data is entered (coordinator); write: "
        "write_data until its uploads finish (slowest rank); gather: until finish starts "
        "(other ranks + DCP's gather of results); finish: the coordinator's finish (JSON encode "
        "+ commit PUT); ld meta: GET + decode of .metadata (every rank does it); CPU: process "
        "CPU (coordinator for phases, summed over ranks for save/load); requests summed over "
        "ranks; RSS: worst rank; /1k: per 1,000 chunks (chunk = one rank's piece of a tensor)."
    )
    print(f"JSON: {args.json}")
    return 1 if failed else 0


def layout_points(args: argparse.Namespace, config: S3Config, root: str) -> list[LayoutPoint]:
    return [
        LayoutPoint(
            layout, world, args.layout_tensors, config, args.bucket, f"{root}/{layout}-w{world}"
        )
        for world in args.layout_worlds
        for layout in args.layouts
    ]


def _cleanup(config: S3Config, bucket: str, prefix: str) -> None:
    try:
        delete_prefix(config, bucket, prefix)
    except Exception as e:  # a leftover prefix costs disk, not correctness
        print(f"    (could not delete {prefix}: {e})", flush=True)


def _progress(result: dict[str, Any], done: str) -> None:
    if result["errors"]:
        print(f"FAILED after {result['elapsed_s']:.0f} s", flush=True)
        print("    " + result["errors"][0][-1500:].replace("\n", "\n    "), flush=True)
    else:
        print(f"{done} ({result['elapsed_s']:.0f} s in all)", flush=True)


def _git_commit() -> str | None:
    """The s3ckpt commit measured (with "+dirty" when the tree has changes)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "s3ckpt"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return f"{head}+dirty" if head and dirty else head or None


def _config(args: argparse.Namespace, endpoint: Endpoint) -> S3Config:
    return endpoint.config(part_size=args.part_size_mib * MiB, max_concurrency=args.concurrency)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
