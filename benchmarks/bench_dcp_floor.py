"""DCP's own cost: ``async_save`` into a storage layer that stores nothing.

Every storage layer pays for DCP's per-tensor work (Stateful checks, planning, deduplication,
resolving each item, a debug log record per call) before and around its own. This benchmark
measures that floor with a writer that stages like S3Writer (the same reusable buffers) and
then discards every item, so no storage layer can save faster than the "total" column, and none
can stall less than the "stall" column. Each workload runs with DCP's logger at its default
(DEBUG into a NullHandler) and quietened to INFO, as the README suggests. No server is needed.

    python -m benchmarks.bench_dcp_floor                       # 2 GiB large, 20,000 small
    python -m benchmarks.bench_dcp_floor --small-count 2000 --size-gib 0.25 --repeat 1

With ``--load``, the load floor instead (`benchmarks.dcp_load_floor`): DCP loading 20,000
tensors of 4-64 KiB from memory, beside s3ckpt loading them from a local SeaweedFS and the raw
client's GETs of the same bytes:

    python -m benchmarks.bench_dcp_floor --load --repeat 5
    .venv-peers/bin/python -m benchmarks.bench_dcp_floor --load --peer   # + s3torchconnector
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from s3ckpt.config import MiB
from s3ckpt.dcp.staging import StagingBuffers

from . import options
from .common import GB, format_table, machine_info, write_json
from .dcp_load_floor import PHASES, run_load_floor, uniform_small_specs
from .peers import workload_specs
from .workload import build_state, state_bytes

DCP_LOGGER = "c10d-NullHandler-dcp_logger"  # where torch's DCP logs every decorated call


class NullWriter(StorageWriter):
    """Stages like S3Writer, resolves every item as a writer must, and stores nothing."""

    def __init__(self) -> None:
        self._buffers = StagingBuffers()

    # AsyncStager (a runtime-checked protocol: every member must exist, or DCP stages its own
    # way): the same staging S3Writer does, so the stall compares like with like.
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._buffers.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.release()

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        pass

    def storage_meta(self) -> None:
        self._buffers.save_started()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            planner.resolve_data(item)
            results.append(WriteResult(item.index, 0, None))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.size_gib(2.0, "large workload")
    p.add_argument("--small-count", type=count, default=20_000, help="small workload tensors")
    p.add_argument("--load", action="store_true", help="the load floor (needs SeaweedFS)")
    p.add_argument("--load-count", type=count, default=20_000, help="tensors of 4-64 KiB")
    p.add_argument(
        "--peer", action="store_true", help="with --load, s3torchconnector's load too (.venv-peers)"
    )
    p.repeat(5)
    p.seed()
    p.cores()
    p.json("dcp-floor.json", load="dcp-load-floor.json")
    return p.parse(argv)


def _save(state: dict[str, torch.Tensor], writer: NullWriter, level: int) -> tuple[float, float]:
    """One async_save as a training loop does it: (stall, seconds until it is done)."""
    logging.getLogger(DCP_LOGGER).setLevel(level)
    gc.collect()
    started = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    stall = time.perf_counter() - started
    future.result()  # type: ignore[union-attr]  # a Future: no staging response asked for
    return stall, time.perf_counter() - started


def load_main(args: argparse.Namespace) -> int:
    specs = uniform_small_specs(args.load_count)
    state = build_state(specs, args.seed)
    floor = run_load_floor(state, args.repeat, args.trainer_core, args.server_core, args.peer)
    summary = floor.summary()
    headers = ["tensors", "GB", "floor s", "transfer s", "s3ckpt load s", "/ (floor+transfer)"]
    headers += ["floor µs/t", "s3ckpt µs/t", "floor CPU s", "s3ckpt CPU s", "raw GET CPU s"]
    headers += ["CPU / (floor+GETs)"]
    row = [summary["tensors"], summary["bytes"] / GB, summary["floor_s"], summary["transfer_s"]]
    row += [summary["s3ckpt_load_s"], summary["ratio"], summary["floor_us_per_tensor"]]
    row += [summary["s3ckpt_us_per_tensor"], summary["floor_cpu_s"], summary["s3ckpt_cpu_s"]]
    row += [summary["transfer_cpu_s"], summary["cpu_ratio"]]
    if args.peer:
        headers += ["s3torchconnector s", "s3tc / s3ckpt"]
        row += [summary["s3torchconnector_load_s"], summary["s3torchconnector_over_s3ckpt"]]
    print(format_table(headers, [row]))
    phases = summary["phases_us_per_tensor"]
    rows = [[reader, *phases[reader].values(), sum(phases[reader].values())] for reader in phases]
    print("\nµs per tensor (medians): the record, DCP's planning, read_data, its data, the rest")
    print("(collector: what of each Python's cyclic collector ran, in any thread)")
    print(format_table(["reader", *PHASES, "total"], rows))
    full = ", ".join(f"{r.split()[0]} {n:g}" for r, n in summary["full_collections"].items())
    print(f"full collections per load (medians): {full}")
    write_json(args.json, {"machine": machine_info(), "settings": vars(args), "summary": summary})
    print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load:
        return load_main(args)
    if not isinstance(NullWriter(), AsyncStager):
        raise RuntimeError("NullWriter is not an AsyncStager for this torch: DCP would stage")
    size = int(args.size_gib * 1024 * MiB)
    runs: dict[str, dict[str, Any]] = {}
    logger = logging.getLogger(DCP_LOGGER)
    level_before = logger.level
    levels = {"default": level_before, "quiet": logging.INFO}  # torch's default: DEBUG
    for workload in ("large", "small"):
        specs = workload_specs(workload, size, args.small_count)
        state = build_state(specs, args.seed)
        writer = NullWriter()
        for level in levels.values():
            _save(state, writer, level)  # the first save allocates the staging buffers
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in levels}
        for _ in range(args.repeat):  # interleaved, so drift hits both alike
            for name, level in levels.items():
                timings[name].append(_save(state, writer, level))
        writer.close()
        for name, pairs in timings.items():
            runs[f"{workload}/{name}"] = {
                "tensors": len(specs),
                "bytes": state_bytes(specs),
                "stall_s": [stall for stall, _ in pairs],
                "total_s": [total for _, total in pairs],
            }
        del state
    logger.setLevel(level_before)

    rows = []
    for case, run in runs.items():
        stall, total = statistics.median(run["stall_s"]), statistics.median(run["total_s"])
        per_tensor_us = (total - stall) / run["tensors"] * 1e6
        rows.append([case, run["tensors"], run["bytes"] / GB, stall, total, per_tensor_us])
        run.update(stall_median_s=stall, total_median_s=total)
    headers = ["workload/DCP logging", "tensors", "GB", "stall s", "total s", "after stall µs/t"]
    print(format_table(headers, rows))
    write_json(args.json, {"machine": machine_info(), "settings": vars(args), "runs": runs})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
