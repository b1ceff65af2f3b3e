"""Worker functions for multi-process tests (spawned: they must live at module level)."""

from __future__ import annotations

import datetime
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from s3ckpt import S3Config, S3Reader, S3Writer

P = ParamSpec("P")


def leaves_at_once(worker: Callable[P, None]) -> Callable[P, None]:
    """Ends a gloo worker that passed with ``os._exit(0)``, skipping interpreter finalization.

    A gloo run-loop thread can drop its last reference to a finished collective (and so to a
    tensor whose Python object it then frees) just after the main thread returns; if the
    interpreter is finalizing by then, the thread's GIL acquire aborts the process ("terminate
    called without an active exception", SIGABRT; 4 exits in 115 two-rank loads here, seen
    with gdb in ``AsyncAllgatherCoalescedWork``'s destructor). That is torch's teardown, not
    the checks the worker ran, so a worker that raised still exits through spawn's error path.
    Not for PROCESS-mode workers: torch stops their checkpoint daemon during finalization.
    """

    @functools.wraps(worker)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        worker(*args, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return run


def reference_state() -> dict[str, torch.Tensor]:
    """The full tensors every test compares against (deterministic, the same in every process)."""
    generator = torch.Generator().manual_seed(1234)
    return {
        "rows": torch.randn(64, 48, generator=generator),
        "cols": torch.randn(40, 96, generator=generator).to(torch.bfloat16),
        "cube": torch.randn(6, 10, 12, generator=generator, dtype=torch.float64),
        "replicated": torch.randn(33, generator=generator),
    }


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def _sharded(full: dict[str, torch.Tensor], world: int, layout: str) -> dict[str, Any]:
    """Shard the reference state; ``layout`` "a" and "b" place each tensor differently."""
    mesh = init_device_mesh("cpu", (world,))
    first, second = (Shard(0), Shard(1)) if layout == "a" else (Shard(1), Shard(0))
    return {
        "rows": distribute_tensor(full["rows"], mesh, [first]),
        "cols": distribute_tensor(full["cols"], mesh, [second]),
        "cube": distribute_tensor(full["cube"], mesh, [Shard(2) if layout == "a" else Shard(1)]),
        "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
        "plain": full["replicated"].clone(),
        "step": 7,
    }


@leaves_at_once
def save_sharded(rank: int, world: int, port: int, config: S3Config, url: str) -> None:
    _init(rank, world, port)
    try:
        state = _sharded(reference_state(), world, "a")
        dcp.save(state, storage_writer=S3Writer(url, config=config))
    finally:
        dist.destroy_process_group()


@leaves_at_once
def load_sharded(rank: int, world: int, port: int, config: S3Config, url: str) -> None:
    _init(rank, world, port)
    try:
        full = reference_state()
        state = _sharded({k: torch.zeros_like(v) for k, v in full.items()}, world, "b")
        state["step"] = 0
        dcp.load(state, storage_reader=S3Reader(url, config=config))
        for name in ("rows", "cols", "cube", "replicated"):
            loaded = state[name]
            assert isinstance(loaded, DTensor)
            assert torch.equal(loaded.full_tensor(), full[name]), name
        assert torch.equal(state["plain"], full["replicated"])
        assert state["step"] == 7
    finally:
        dist.destroy_process_group()


def process_mode_round_trip(rank: int, port: int, config: S3Config, url: str) -> None:
    """async_save in PROCESS mode: the writer is pickled into a spawned checkpoint process."""
    _init(rank, 1, port)
    try:
        full = reference_state()
        writer = S3Writer(url, config=config)
        future = dcp.async_save(
            dict(full), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )
        future.result(timeout=180)
        loaded = {k: torch.zeros_like(v) for k, v in full.items()}
        dcp.load(loaded, storage_reader=S3Reader(url, config=config))
        for name, tensor in full.items():
            assert torch.equal(loaded[name], tensor), name
    finally:
        dist.destroy_process_group()


def process_mode_sharded(rank: int, world: int, port: int, config: S3Config, url: str) -> None:
    """async_save in PROCESS mode on several ranks, each pickling its writer to its own daemon."""
    _init(rank, world, port)
    try:
        full = reference_state()
        state = _sharded(full, world, "a")
        future = dcp.async_save(
            state,
            storage_writer=S3Writer(url, config=config),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        future.result(timeout=180)
        loaded = _sharded({k: torch.zeros_like(v) for k, v in full.items()}, world, "b")
        loaded["step"] = 0
        dcp.load(loaded, storage_reader=S3Reader(url, config=config))
        for name in ("rows", "cols", "cube", "replicated"):
            assert torch.equal(loaded[name].full_tensor(), full[name]), name
        assert loaded["step"] == 7
    finally:
        dist.destroy_process_group()


def process_mode_incremental(rank: int, port: int, config: S3Config, run: str) -> None:
    """Two incremental PROCESS-mode saves (the daemon pins the base), ``rows`` changed in the
    second; the second loads back whole."""
    _init(rank, 1, port)
    try:
        state = reference_state()
        for step in (1, 2):
            state["rows"] = state["rows"] + 1
            future = dcp.async_save(
                dict(state),
                storage_writer=S3Writer(f"{run}/step-{step}", config=config, incremental=True),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            future.result(timeout=180)
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(loaded, storage_reader=S3Reader(f"{run}/step-2", config=config))
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), name
    finally:
        dist.destroy_process_group()


def save_big(config: S3Config, url: str, overwrite: bool) -> None:
    """A save slow enough to be killed in the middle of its upload."""
    generator = torch.Generator().manual_seed(99)
    state = {"big": torch.randn(48 * 1024 * 1024 // 4 * 2, generator=generator)}
    dcp.save(state, storage_writer=S3Writer(url, config=config, overwrite=overwrite))


def save_racing(config: S3Config, url: str, fill: float, barrier: Any, results: Any) -> None:
    """One of two processes saving to the same prefix at the same moment."""
    state = {"w": torch.full((1_000_000,), fill)}
    barrier.wait(timeout=60)
    try:
        dcp.save(state, storage_writer=S3Writer(url, config=config))
        results.put((fill, "committed"))
    except BaseException as e:
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else e
        results.put((fill, type(cause).__name__))


@leaves_at_once
def save_incremental(
    rank: int, world: int, port: int, config: S3Config, url: str, layout: str, bump: float
) -> None:
    """An incremental sharded save of the reference state with ``rows`` moved by ``bump``."""
    _init(rank, world, port)
    try:
        full = reference_state()
        full["rows"] = full["rows"] + bump
        state = _sharded(full, world, layout)
        dcp.save(state, storage_writer=S3Writer(url, config=config, incremental=True))
    finally:
        dist.destroy_process_group()
