"""The floor of a DCP load of many small tensors, and s3ckpt's load of them beside it.

`bench_dcp_floor --load` runs this. A `MemoryReader` hands DCP each item's bytes from memory
(one copy into the destination, as a zero-copy GET into it would leave them), so its time is
DCP's own per-item work (planning, resolve, commit) plus a memcpy: no storage layer loads
faster. Against a local SeaweedFS (pinned to another core than this process), the same state is
saved with `S3Writer` and loaded with `S3Reader`, and the raw client (`benchmarks.raw`) GETs the
same objects' bytes with the same part size and concurrency: the transfer time. s3ckpt's goal
is ``load <= 1.3 x (floor + transfer)``. With ``peer``, s3torchconnector's ``S3StorageReader``
loads the same state too (saved by its ``S3StorageWriter``), in the same interleaved rounds;
it needs the peers' venv (`benchmarks.bench_peers`).
"""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from s3ckpt import S3Reader, S3Writer
from s3ckpt.config import S3Config
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store

from .common import Endpoint, cpu_since, cpu_times, median, pin_threads, s3_endpoint
from .raw import RawClient
from .workload import TensorSpec

__all__ = ["MemoryReader", "MemoryWriter", "run_load_floor", "uniform_small_specs"]

_KEY = "memory"


def uniform_small_specs(count: int, low: int = 4096, high: int = 65536) -> list[TensorSpec]:
    """``count`` fp32 vectors of ``low`` to ``high`` bytes, spread evenly (the issue's 4-64 KiB)."""
    step = (high - low) / max(1, count - 1)
    return [
        TensorSpec(f"small.{i:05d}", ((low + int(i * 7919 % count * step)) // 4,), torch.float32)
        for i in range(count)
    ]


class MemoryWriter(StorageWriter):
    """Keeps each item's bytes in memory; `MemoryReader` loads them."""

    def __init__(self) -> None:
        self.items: dict[MetadataIndex, Any] = {}
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            kept = data.getvalue() if isinstance(data, io.BytesIO) else data.detach().clone()
            self.items[item.index] = kept
            results.append(WriteResult(item.index, 0, _KEY))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None


class MemoryReader(StorageReader):
    """Loads what a `MemoryWriter` kept: whole items only (no resharding)."""

    def __init__(self, writer: MemoryWriter) -> None:
        assert writer.metadata is not None
        self.metadata, self.items = writer.metadata, writer.items

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **_: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            stored = self.items[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(stored))
                continue
            dest = planner.resolve_tensor(item).detach()
            dest.copy_(stored)
            planner.commit_tensor(item, dest)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


PHASES = ("record", "dcp", "plan", "data", "rest")


class Collector:
    """While entered: the seconds Python's cyclic collector ran, in any thread, and its full
    passes. A pass over a state dict of many tensors costs a load as much as a phase of it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started: dict[int, float] = {}

    def __enter__(self) -> Collector:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        now, thread = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        self.seconds += now - self._started.pop(thread, now)
        self.full += info["generation"] == 2


class TimedReader(StorageReader):
    """Forwards to ``inner`` and times its phases of a load (wall seconds): ``record`` (its
    ``read_metadata``: for s3ckpt the GET, the decode and DCP's ``Metadata``), ``dcp`` (DCP's
    planning, from then to ``read_data``), ``plan`` (``read_data`` until it returns), ``data``
    (until its future completes: s3ckpt's fetches, which DCP waits for next). ``rest`` (the
    caller's: the load less these) is DCP's flattening before and its bookkeeping after.
    ``collected`` holds what of each phase the ``collector`` ran."""

    def __init__(self, inner: StorageReader, collector: Collector) -> None:
        self.inner = inner
        self.collector = collector
        self.phases: dict[str, float] = {}
        self.collected: dict[str, float] = {}
        self._at = (0.0, 0.0)  # the last phase's end: wall and collector seconds

    def _phase(self, name: str, started: tuple[float, float]) -> None:
        self._at = time.perf_counter(), self.collector.seconds
        self.phases[name] = self._at[0] - started[0]
        self.collected[name] = self._at[1] - started[1]

    def _now(self) -> tuple[float, float]:
        return time.perf_counter(), self.collector.seconds

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    def read_metadata(self) -> Metadata:
        started = self._now()
        metadata = self.inner.read_metadata()
        self._phase("record", started)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **kw: Any) -> None:
        self.inner.set_up_storage_reader(metadata, is_coordinator, **kw)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._phase("dcp", self._at)
        future = self.inner.read_data(plan, planner)
        self._phase("plan", self._at)
        future.wait()
        self._phase("data", self._at)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


@dataclass
class LoadFloor:
    """Seconds (medians) and CPU of each way of loading the same state."""

    tensors: int
    nbytes: int
    floor_s: list[float]
    s3ckpt_s: list[float]
    transfer_s: list[float]
    floor_cpu_s: list[float]
    s3ckpt_cpu_s: list[float]
    transfer_cpu_s: list[float]
    peer_s: list[float] = field(default_factory=list)  # s3torchconnector's, if it ran
    peer_cpu_s: list[float] = field(default_factory=list)
    # Each load's `TimedReader` phases, by reader ("floor", "s3ckpt"), and the collector's
    # seconds in each of them (by reader + " collector").
    phases: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def phases_us_per_tensor(self, reader: str) -> dict[str, float]:
        """The median of each phase, in microseconds per tensor."""
        runs = self.phases.get(reader, [])
        return {
            name: (median([run[name] for run in runs]) or 0.0) / self.tensors * 1e6
            for name in PHASES
        }

    def summary(self) -> dict[str, Any]:
        floor, load, wire = (
            median(x) or 0.0 for x in (self.floor_s, self.s3ckpt_s, self.transfer_s)
        )
        peer = median(self.peer_s)
        return {
            "s3torchconnector_load_s": peer,
            "s3torchconnector_cpu_s": median(self.peer_cpu_s),
            "s3torchconnector_over_s3ckpt": peer / load if peer and load else None,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "floor_s": floor,
            "s3ckpt_load_s": load,
            "transfer_s": wire,
            "floor_cpu_s": median(self.floor_cpu_s),
            "s3ckpt_cpu_s": median(self.s3ckpt_cpu_s),
            "transfer_cpu_s": median(self.transfer_cpu_s),
            "ratio": load / (floor + wire) if floor + wire else None,
            "cpu_ratio": _ratio(self.s3ckpt_cpu_s, self.floor_cpu_s, self.transfer_cpu_s),
            "floor_us_per_tensor": floor / self.tensors * 1e6,
            "s3ckpt_us_per_tensor": load / self.tensors * 1e6,
            "phases_us_per_tensor": {
                reader: self.phases_us_per_tensor(reader) for reader in self.phases
            },
            "full_collections": {
                reader: median([run["full"] for run in runs])
                for reader, runs in self.phases.items()
                if reader.endswith("collector")
            },
        }


def _ratio(load: list[float], floor: list[float], wire: list[float]) -> float | None:
    """s3ckpt's CPU over the floor's plus the raw GETs': the ratio a busy machine's wall
    times cannot show."""
    below = (median(floor) or 0.0) + (median(wire) or 0.0)
    return (median(load) or 0.0) / below if below else None


def _blank(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, -7.0) for name, t in state.items()}


@dataclass(frozen=True)
class Loaded:
    """One load: seconds, CPU seconds, its `TimedReader` phases and the collector's seconds in
    each (with ``rest`` and ``full``, its full passes)."""

    seconds: float
    cpu: float
    phases: dict[str, float]
    collected: dict[str, float]


def _timed_load(state: dict[str, torch.Tensor], reader: StorageReader) -> Loaded:
    dest = _blank(state)
    gc.collect()
    with Collector() as collector:
        timed = TimedReader(reader, collector)
        before, started = cpu_times(), time.perf_counter()
        dcp.load(dest, storage_reader=timed, no_dist=True)
        seconds, cpu = time.perf_counter() - started, cpu_since(before)["cpu_s"]
    bad = next((name for name, t in state.items() if not torch.equal(dest[name], t)), None)
    if bad is not None:
        raise RuntimeError(f"{type(reader).__name__} loaded {bad} wrong")
    phases = {**timed.phases, "rest": seconds - sum(timed.phases.values())}
    rest = collector.seconds - sum(timed.collected.values())
    return Loaded(seconds, cpu, phases, {**timed.collected, "rest": rest, "full": collector.full})


def _object_views(config: S3Config, bucket: str, prefix: str) -> dict[str, memoryview]:
    """Buffers as large as each data object s3ckpt wrote under ``prefix``."""
    store = get_store(config)

    async def sizes() -> dict[str, int]:
        listing = await store.list_objects(bucket, f"{prefix}/data-")
        return {o.key: o.size for o in listing.objects if not o.key.endswith(".lease")}

    return {k: memoryview(bytearray(n)) for k, n in bridge.run(sizes()).items()}


def _peer(
    ep: Endpoint, bucket: str
) -> tuple[Callable[[], StorageWriter], Callable[[], StorageReader]]:
    """s3torchconnector's writer and reader of ``s3://bucket/small-s3tc``: it takes its endpoint
    and keys from the environment only."""
    from .peers import S3TorchConnectorAdapter, Target, peer_env

    region = ep.region or "us-east-1"
    target = Target(ep.url, ep.access_key_id, ep.secret_access_key, region, bucket, "", 0, 0)
    os.environ.update(peer_env(target))
    adapter = S3TorchConnectorAdapter(target)
    prefix = adapter.checkpoint_id("small-s3tc")
    return (lambda: _at(adapter.writer(), prefix)), (lambda: _at(adapter.reader(), prefix))


_Storage = TypeVar("_Storage", StorageWriter, StorageReader)


def _at(storage: _Storage, checkpoint_id: str) -> _Storage:
    storage.reset(checkpoint_id)
    return storage


def run_load_floor(
    state: dict[str, torch.Tensor],
    repeat: int,
    trainer_core: int,
    server_core: int,
    peer: bool = False,
) -> LoadFloor:
    """Interleaved: floor, s3ckpt, transfer (and s3torchconnector with ``peer``), ``repeat``
    times (after one warm-up each)."""
    logging.getLogger("c10d-NullHandler-dcp_logger").setLevel(logging.INFO)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {trainer_core})
    memory = MemoryWriter()
    dcp.save(state, storage_writer=memory, no_dist=True)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    result = LoadFloor(len(state), nbytes, [], [], [], [], [], [])
    with s3_endpoint(None, None, None, None) as ep:
        pin_threads(ep.server_pid, server_core)
        config = ep.config(part_size=S3Config().part_size, max_concurrency=16)
        bucket = "bench-load-floor"

        async def setup() -> None:
            async with RawClient(config) as raw:
                await raw.ensure_bucket(bucket)

        asyncio.run(setup())
        dcp.save(state, storage_writer=S3Writer(bucket, "small", config=config), no_dist=True)
        views = _object_views(config, bucket, "small")
        peer_reader: Callable[[], StorageReader] | None = None
        if peer:
            peer_writer, peer_reader = _peer(ep, bucket)
            dcp.save(state, storage_writer=peer_writer(), no_dist=True)

        async def transfer() -> tuple[float, float]:
            async with RawClient(config) as raw:
                await raw.download(bucket, views)  # warm connections
                before = cpu_times()
                seconds = await raw.download(bucket, views)
                return seconds, cpu_since(before)["cpu_s"]

        for rep in range(repeat + 1):
            floor = _timed_load(state, MemoryReader(memory))
            load = _timed_load(state, S3Reader(bucket, "small", config=config))
            wire, wire_cpu = asyncio.run(transfer())
            other = ""
            if peer_reader is not None:
                theirs = _timed_load(state, peer_reader())
                other = f", s3torchconnector {theirs.seconds:.2f} s ({theirs.cpu:.2f} s CPU)"
                if rep:
                    result.peer_s.append(theirs.seconds)
                    result.peer_cpu_s.append(theirs.cpu)
            print(
                f"  [{rep}/{repeat}] floor {floor.seconds:.2f} s ({floor.cpu:.2f} s CPU), s3ckpt "
                f"{load.seconds:.2f} s ({load.cpu:.2f} s CPU), transfer {wire:.2f} s "
                f"({wire_cpu:.2f} s CPU){other}" + (" (warm-up)" if rep == 0 else ""),
                flush=True,
            )
            if rep:
                result.floor_s.append(floor.seconds)
                result.s3ckpt_s.append(load.seconds)
                result.transfer_s.append(wire)
                result.floor_cpu_s.append(floor.cpu)
                result.s3ckpt_cpu_s.append(load.cpu)
                result.transfer_cpu_s.append(wire_cpu)
                for name, loaded in (("floor", floor), ("s3ckpt", load)):
                    result.phases.setdefault(name, []).append(loaded.phases)
                    result.phases.setdefault(f"{name} collector", []).append(loaded.collected)
    return result
