"""Workers of the shared-read tests (spawned: they live at module level): each rank loads a
checkpoint in one layout and checks every tensor it holds against the reference."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from s3ckpt import S3Config, S3Reader
from tests.dist_workers import _init, leaves_at_once


def reference() -> dict[str, torch.Tensor]:
    """Eight tensors of 1.5 MiB each, two of them bf16: several per frame, some across frames."""
    generator = torch.Generator().manual_seed(77)
    state = {f"t{i}": torch.randn(384, 1024, generator=generator) for i in range(6)}
    state.update(
        {f"h{i}": torch.randn(768, 1024, generator=generator).bfloat16() for i in range(2)}
    )
    return state


def partial(full: dict[str, torch.Tensor]) -> list[str]:
    """The tensors a partial load asks for: half of them."""
    return sorted(full)[: len(full) // 2]


def _placed(full: torch.Tensor, layout: str, world: int) -> tuple[torch.Tensor, Any]:
    """The destination a rank loads into, and the mesh and placements it was made with."""
    if layout in ("replicated", "partial"):
        return torch.zeros_like(full), None
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replica", "shard"))
        placements: list[Any] = [Replicate(), Shard(0)]
    else:  # resharded: column shards of row-major chunks, so the ranks' ranges overlap
        mesh = init_device_mesh("cpu", (world,))
        placements = [Shard(1)]
    return distribute_tensor(torch.zeros_like(full), mesh, placements), (mesh, placements)


class _Failing(DefaultLoadPlanner):
    """A planner that fails on one rank, after the plans were exchanged."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        raise ValueError("this rank's planner gives up")


@leaves_at_once
def fail_one(rank: int, world: int, port: int, config: S3Config, url: str) -> None:
    """Rank 1 fails to plan its reads; every rank's load must fail, none wait for the others."""
    _init(rank, world, port)
    state = {name: torch.zeros_like(t) for name, t in reference().items()}
    planner = _Failing() if rank == 1 else DefaultLoadPlanner()
    try:
        dcp.load(state, storage_reader=S3Reader(url, config=config), planner=planner)
    except CheckpointException as e:
        reasons = [str(error) for error, _ in e.failures.values()]
        assert any("gives up" in r for r in reasons), reasons
        if rank != 1:
            assert any("another rank could not plan" in r for r in reasons), reasons
    else:
        raise AssertionError(f"rank {rank}: the load succeeded")
    dist.destroy_process_group()


@leaves_at_once
def load(
    rank: int, world: int, port: int, config: S3Config, url: str, layout: str, share: bool
) -> None:
    _init(rank, world, port)
    full = reference()
    names = partial(full) if layout == "partial" else sorted(full)
    made = {name: _placed(full[name], layout, world) for name in names}
    state = {name: dest for name, (dest, _) in made.items()}
    dcp.load(state, storage_reader=S3Reader(url, config=config, share_reads=share))
    for name, (dest, placed) in made.items():
        if isinstance(dest, DTensor):
            mesh, placements = placed
            expected = distribute_tensor(full[name], mesh, placements).to_local()
            assert torch.equal(dest.to_local(), expected), f"rank {rank}: {name}"
        else:
            assert torch.equal(dest, full[name]), f"rank {rank}: {name}"
    dist.barrier()
    dist.destroy_process_group()
