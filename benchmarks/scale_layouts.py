"""The ``layouts`` axis of `bench_scale`: replicated (DDP) and HSDP states on 8 and 16 ranks,
what the store serves per restore and what the coordinator spends per save.

Each point spawns its ranks (gloo on 127.0.0.1; small per-rank state: ``tensors`` fp32
tensors of 64 x 64). Every rank builds the state, then saves it twice through one `S3Writer`
and one `CachingSavePlanner` (``step-1``: the first save, planned in full; ``step-2``: a
repeated save of the same structure, planned from the cache, as the `CheckpointManager`
saves), then restores ``step-2`` into zeroed tensors through a `FaultProxy` that rank 0 runs,
and checks every element. Reported:

- per save, rank 0 (the coordinator): process CPU of the whole ``dcp.save`` and of its
  phases (planning until ``write_data``; ``finish``), and its peak RSS growth;
- per restore: GET bytes and GETs the store served (the proxy's counters, all ranks), over
  the data bytes stored, in all and without the record's GETs; ``.metadata`` GETs; record
  bytes per chunk.

Layouts: ``replicated``, every rank holds every tensor whole (DCP saves each once);
``hsdp``, a (replicas x 4) mesh, ``[Replicate(), Shard(0)]``: each shard held by every replica.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from s3ckpt import S3Config, S3Reader, S3Writer
from s3ckpt.dcp.planning import CachingSavePlanner
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.format.layout import Location
from s3ckpt.testing.faultproxy import Delay, FaultProxy
from s3ckpt.tools.localserver import free_port

from .common import MiB, RssSampler, format_table, rank_process

__all__ = ["LAYOUTS", "LayoutPoint", "layout_table", "run_layout_point"]

LAYOUTS = ("replicated", "hsdp")
_SHARDS = 4  # HSDP: ranks per replica
_SIDE = 64  # each tensor: 64 x 64 fp32 = 16 KiB


@dataclass(frozen=True)
class LayoutPoint:
    layout: str
    world: int
    tensors: int
    config: S3Config
    bucket: str
    prefix: str

    @property
    def label(self) -> str:
        return f"{self.layout}-w{self.world}"


def _full(i: int) -> torch.Tensor:
    """Exact, distinct per tensor: an int32 ramp XOR ``i``, viewed as fp32."""
    ramp = torch.arange(_SIDE * _SIDE, dtype=torch.int32).bitwise_xor_(i)
    return ramp.view(torch.float32).view(_SIDE, _SIDE)


def _state(point: LayoutPoint, *, zeros: bool) -> dict[str, Any]:
    names = [f"model.layers.{i // 8}.block.p{i % 8}.weight" for i in range(point.tensors)]
    full = {name: _full(i) for i, name in enumerate(names)}
    if zeros:
        full = {name: torch.zeros_like(t) for name, t in full.items()}
    if point.layout == "replicated":
        return dict(full)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shards = min(_SHARDS, point.world)
    mesh = init_device_mesh(
        "cpu", (point.world // shards, shards), mesh_dim_names=("replica", "shard")
    )
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    rows = _SIDE // shards
    return {
        name: DTensor.from_local(
            t[coordinate[1] * rows : (coordinate[1] + 1) * rows].clone(),
            mesh,
            [Replicate(), Shard(0)],
            run_check=False,
        )
        for name, t in full.items()
    }


class _Stamped(S3Writer):
    """Stamps process CPU where DCP enters the hooks (the coordinator's phases)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cpu: dict[str, float] = {}

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        self.cpu.setdefault("write", time.process_time())
        return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.cpu["finish_start"] = time.process_time()
        super().finish(metadata, results)
        self.cpu["finish_end"] = time.process_time()


def rank_main(rank: int, point: LayoutPoint, port: int, out_dir: str) -> None:
    rank_process(rank, point.world, port, out_dir, 600, lambda: _rank_run(rank, point))


def _rank_run(rank: int, point: LayoutPoint) -> dict[str, Any]:
    store = get_store(point.config)
    bridge.run(store.uploads.wire_mode(point.bucket, f"{point.prefix}/warmup-{rank}"))  # type: ignore[attr-defined]  # S3Store's
    state = _state(point, zeros=False)
    writer = _Stamped(point.bucket, config=point.config)
    planner = CachingSavePlanner()
    saves: dict[str, Any] = {}
    metadata: Metadata | None = None
    for name, step in (("first", 1), ("repeated", 2)):
        writer.cpu = {}
        dist.barrier()
        with RssSampler() as rss:
            started = time.process_time()
            metadata = dcp.save(
                state, checkpoint_id=f"s3://{point.bucket}/{point.prefix}/step-{step}",
                storage_writer=writer, planner=planner,
            )  # fmt: skip
            ended = time.process_time()
        cpu = writer.cpu
        saves[name] = {
            "cpu_s": ended - started,
            "plan_cpu_s": cpu["write"] - started,
            "finish_cpu_s": cpu["finish_end"] - cpu["finish_start"]
            if "finish_end" in cpu
            else None,
            "rss_increase": rss.peak - rss.baseline,
        }
    planner.forget()
    assert metadata is not None
    url = f"s3://{point.bucket}/{point.prefix}/step-2"
    proxy = FaultProxy(str(point.config.endpoint_url)) if rank == 0 else None
    endpoint = [proxy.start().endpoint_url if proxy is not None else None]
    dist.broadcast_object_list(endpoint, src=0)
    records = None if proxy is None else proxy.add_rule(Delay(0.0), op="GetObject", key=".metadata")
    config = dataclasses.replace(point.config, endpoint_url=endpoint[0])
    dest = _state(point, zeros=True)
    dist.barrier()
    started_wall = time.perf_counter()
    dcp.load(dest, storage_reader=S3Reader(url, config=config))
    load_s = time.perf_counter() - started_wall
    dist.barrier()  # every rank done: the counters are the restore's
    want = _state(point, zeros=False)
    bad = sum(not torch.equal(_local(dest[k]), _local(want[k])) for k in want)
    out: dict[str, Any] = {"rank": rank, "saves": saves, "load_s": load_s, "mismatches": bad}
    if proxy is not None and records is not None:
        out["served_bytes"] = proxy.served["GetObject"]
        out["gets"] = proxy.requests["GetObject"]
        out["metadata_gets"] = records.fired
        proxy.stop()
        location = Location.of(url)
        listed = bridge.run(store.list_objects(point.bucket, location.prefix + "/"))
        out["stored_bytes"] = sum(o.size for o in listed.objects if "/data-" in o.key)
        head = bridge.run(store.head(point.bucket, location.metadata_key))
        out["record_bytes"] = head.size if head else None
        out["chunks"] = sum(
            len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
            for md in metadata.state_dict_metadata.values()
        )
    return out


def _local(value: Any) -> torch.Tensor:
    local: torch.Tensor = value.to_local() if hasattr(value, "to_local") else value
    return local


def run_layout_point(point: LayoutPoint, timeout_s: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    port, started = free_port(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="s3ckpt-layouts-") as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, point, port, tmp), name=f"rank{r}")
            for r in range(point.world)
        ]
        for proc in procs:
            proc.start()
        deadline = started + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.perf_counter()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        ranks = []
        for r in range(point.world):
            path = Path(tmp) / f"rank-{r}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {"error": "no output"})
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
    summary: dict[str, Any] = {
        "point": {"axis": "layouts", "label": point.label, "layout": point.layout,
                  "world": point.world, "tensors": point.tensors},
        "elapsed_s": time.perf_counter() - started,
        "errors": errors,
    }  # fmt: skip
    if not errors:
        coordinator = ranks[0]
        summary.update(
            {k: coordinator[k] for k in ("served_bytes", "gets", "metadata_gets", "stored_bytes")}
        )
        summary.update({k: coordinator[k] for k in ("record_bytes", "chunks", "saves")})
        summary["load_s"] = max(r["load_s"] for r in ranks)
        summary["mismatches"] = sum(r["mismatches"] for r in ranks)
    return summary


def _data_served(result: dict[str, Any]) -> int:
    """The data objects' bytes served: all GET bytes less the whole-record GETs."""
    return int(result["served_bytes"] - result["metadata_gets"] * result["record_bytes"])


def layout_table(results: list[dict[str, Any]]) -> str:
    headers = ["point", "ranks", "chunks", "stored KiB", "served/stored", "data/stored", "GETs"]
    headers += ["meta GETs"]
    headers += ["rec B/chunk", "save CPU 1st", "rep", "plan CPU 1st", "rep", "finish CPU"]
    headers += ["RSS +MiB", "load s"]
    rows: list[list[Any]] = []
    for r in results:
        p = r["point"]
        if r["errors"]:
            rows.append([p["label"], "FAILED"] + [None] * (len(headers) - 2))
            continue
        first, repeated = r["saves"]["first"], r["saves"]["repeated"]
        rows.append(
            [
                *(p["label"], p["world"], r["chunks"], r["stored_bytes"] / 1024),
                r["served_bytes"] / r["stored_bytes"],
                _data_served(r) / r["stored_bytes"],
                *(r["gets"], r["metadata_gets"]),
                r["record_bytes"] / r["chunks"],
                *(first["cpu_s"], repeated["cpu_s"], first["plan_cpu_s"], repeated["plan_cpu_s"]),
                first["finish_cpu_s"],
                max(first["rss_increase"], repeated["rss_increase"]) / MiB,
                r["load_s"],
            ]
        )
    return format_table(headers, rows)
