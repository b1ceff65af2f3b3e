"""Workers of the SafetensorsReader tests (spawned: they live at module level): an FSDP2 model
loads its shards from a safetensors file and checks them against the reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from s3ckpt import S3Config, SafetensorsReader
from tests.dist_workers import _init, leaves_at_once


def model() -> torch.nn.Module:
    """Two layers, 12 MiB of weights; their parameters are the reference's names."""
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False), torch.nn.Linear(2048, 512))


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return {name: value.detach().clone() for name, value in model().state_dict().items()}


@leaves_at_once
def load_fsdp(rank: int, world: int, port: int, configs: list[S3Config], url: str) -> None:
    """Rank ``r`` reads through ``configs[r]`` (its own counting proxy)."""
    _init(rank, world, port)
    try:
        with torch.device("meta"):
            sharded = model()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
        sharded.to_empty(device="cpu")
        state = sharded.state_dict()
        dcp.load(state, storage_reader=SafetensorsReader(url, config=configs[rank]))
        for name, expected in reference().items():
            loaded = sharded.state_dict()[name]
            assert isinstance(loaded, DTensor), name
            assert torch.equal(loaded.full_tensor(), expected), name
    finally:
        dist.destroy_process_group()
