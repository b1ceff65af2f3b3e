"""The child side of `bench_peers`: one measured case in a fresh process, numbers as JSON.

A case is a dict (JSON on the command line; keys and secrets come through the environment):
``op`` (save, rank_save, load, raw), ``system``, ``workload``, ``prefix`` and the sizes. Requests
and bytes on the wire are read from the counting proxy right before and after the measured part,
so set-up traffic (bucket checks, the warm-up save) is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .common import RssSampler, counts_delta, cpu_since, cpu_times, proxy_counts
from .peers import (
    Target,
    adapter,
    expected,
    load_subset,
    sharded_state,
    target_from_env,
    workload_specs,
)
from .raw import RawClient, object_ranges
from .workload import TensorSpec, build_state, state_bytes

__all__ = ["child_main"]


def _measured(spec: dict[str, Any], before_cpu: tuple[float, float]) -> dict[str, Any]:
    return {"cpu": cpu_since(before_cpu), "counts": proxy_counts(spec["proxy"])}


def child_save(spec: dict[str, Any], target: Target) -> dict[str, Any]:
    """A warm-up async_save, then the measured one with the same writer to a new id."""
    system = adapter(spec["system"], target)
    specs = workload_specs(spec["workload"], spec["size_bytes"], spec["small_count"])
    state = build_state(specs, spec["seed"])
    gc.collect()
    baseline = RssSampler().baseline
    writer = system.writer()
    started = time.perf_counter()
    ckpt = system.checkpoint_id(spec["prefix"] + "/warm")
    future = dcp.async_save(state, checkpoint_id=ckpt, storage_writer=writer, no_dist=True)
    first_stall = time.perf_counter() - started
    future.result(timeout=spec["timeout_s"])  # type: ignore[union-attr]
    gc.collect()
    before, client, cpu = proxy_counts(spec["proxy"]), system.client_requests(), cpu_times()
    with RssSampler() as rss:
        started = time.perf_counter()
        ckpt = system.checkpoint_id(spec["prefix"] + "/ckpt")
        future = dcp.async_save(state, checkpoint_id=ckpt, storage_writer=writer, no_dist=True)
        stall = time.perf_counter() - started
        future.result(timeout=spec["timeout_s"])  # type: ignore[union-attr]
        seconds = time.perf_counter() - started
    after = _measured(spec, cpu)
    system.close(writer)
    return {
        "seconds": seconds,
        "stall_s": stall,
        "first_stall_s": first_stall,
        "bytes": state_bytes(specs),
        "tensors": len(specs),
        **after["cpu"],
        "rss_extra": rss.peak - baseline,
        "wire": counts_delta(after["counts"], before),
        "client_requests": _delta(system.client_requests(), client),
    }


def child_rank_save(spec: dict[str, Any], target: Target) -> dict[str, Any]:
    """One of the ranks of a synchronous multi-rank save of DTensor shards (gloo, 127.0.0.1)."""
    rank, world = spec["rank"], spec["world"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        system = adapter(spec["system"], target)
        specs = workload_specs(spec["workload"], spec["size_bytes"], spec["small_count"])
        state = sharded_state(specs, spec["seed"], mesh)
        gc.collect()
        writer = system.writer()
        dist.barrier()
        before = proxy_counts(spec["proxy"]) if rank == 0 else None
        cpu = cpu_times()
        with RssSampler() as rss:
            started = time.perf_counter()
            dcp.save(
                state, checkpoint_id=system.checkpoint_id(spec["prefix"]), storage_writer=writer
            )
            seconds = time.perf_counter() - started
        cpu_used = cpu_since(cpu)
        dist.barrier()
        after = proxy_counts(spec["proxy"]) if rank == 0 else None
        system.close(writer)
        return {
            "seconds": seconds,
            "bytes": state_bytes(specs),
            "tensors": len(specs),
            **cpu_used,
            "rss_extra": rss.peak - rss.baseline,
            "wire": counts_delta(after, before) if rank == 0 else {},
        }
    finally:
        dist.destroy_process_group()


def child_load(spec: dict[str, Any], target: Target) -> dict[str, Any]:
    """``dcp.load`` into destination tensors allocated (and touched) before the clock starts."""
    system = adapter(spec["system"], target)
    specs = workload_specs(spec["workload"], spec["size_bytes"], spec["small_count"])
    wanted = load_subset(spec["workload"], specs)
    state = {specs[i].name: _empty(specs[i]) for i in wanted}
    reader = system.reader()
    gc.collect()
    before, client, cpu = proxy_counts(spec["proxy"]), system.client_requests(), cpu_times()
    with RssSampler() as rss:
        started = time.perf_counter()
        dcp.load(
            state,
            checkpoint_id=system.checkpoint_id(spec["prefix"]),
            storage_reader=reader,
            no_dist=True,
        )
        seconds = time.perf_counter() - started
    after = _measured(spec, cpu)
    result = {
        "seconds": seconds,
        "bytes": sum(specs[i].nbytes for i in wanted),
        "tensors": len(wanted),
        **after["cpu"],
        "rss_extra": rss.peak - rss.baseline,
        "wire": counts_delta(after["counts"], before),
        "client_requests": _delta(system.client_requests(), client),
    }
    if spec["verify"]:
        result["mismatched_tensors"] = sum(
            not torch.equal(_bits(state[specs[i].name]), _bits(expected(specs, i, spec["seed"])))
            for i in wanted
        )
    return result


def child_raw(spec: dict[str, Any], target: Target) -> dict[str, Any]:
    """The same number of bytes up and down with `RawClient` (tuned settings): the ceiling."""
    config = target.s3ckpt_config(tuned=True)
    specs = workload_specs(spec["workload"], spec["size_bytes"], spec["small_count"])
    size = state_bytes(specs)
    words = torch.rand((size + 3) // 4, generator=torch.Generator().manual_seed(spec["seed"]))
    source, dest = words.view(torch.uint8)[:size], torch.full((size,), 0xFF, dtype=torch.uint8)
    ranges = object_ranges(size, config.part_size)
    keys = [f"{spec['prefix']}/obj-{i}" for i in range(len(ranges))]
    out: dict[str, Any] = {}

    async def run() -> None:
        async with RawClient(config) as raw:
            await raw.ensure_bucket(target.bucket)
            for op, buffer in (("save", source), ("load", dest)):
                views = buffer.numpy().data
                objects = {k: views[a:b] for k, (a, b) in zip(keys, ranges, strict=True)}
                transfer = raw.upload if op == "save" else raw.download
                before, cpu = proxy_counts(spec["proxy"]), cpu_times()
                with RssSampler() as rss:
                    seconds = await transfer(target.bucket, objects)
                after = _measured(spec, cpu)
                out[op] = {
                    "seconds": seconds,
                    "bytes": size,
                    **after["cpu"],
                    "rss_extra": rss.peak - rss.baseline,
                    "wire": counts_delta(after["counts"], before),
                    "client_requests": None,
                }

    asyncio.run(run())
    if not torch.equal(source, dest):
        out["load"]["mismatched_tensors"] = 1
    return out


def _empty(spec: TensorSpec) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype).fill_(-7)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def child_main(args: argparse.Namespace) -> int:
    spec = json.loads(args.child)
    target = target_from_env(spec["bucket"], spec["local_dir"], tuple(spec["tuned"]))
    ops = {"save": child_save, "rank_save": child_rank_save, "load": child_load}
    ops["raw"] = child_raw
    result = ops[spec["op"]](spec, target)
    args.child_out.write_text(json.dumps(result))
    return 0
