"""Workers of the safetensors tests (spawned: they live at module level): an FSDP2 model loads
its shards from a safetensors file and checks them against the reference; two ranks save
tensors sharded unevenly and on later dims, or restore such a checkpoint resharded and save it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from s3ckpt import S3Config, S3Reader, S3Writer, SafetensorsReader
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


def uneven_reference() -> dict[str, torch.Tensor]:
    """Tensors that two ranks shard unevenly or on a later dim (issue #26's resharded export)."""
    generator = torch.Generator().manual_seed(26)
    return {
        "wide": torch.randn(6, 10, generator=generator),  # Shard(1): columns 0-4 and 5-9
        "odd": torch.randn(7, 5, generator=generator).bfloat16(),  # Shard(0): 4 rows and 3
        "middle": torch.arange(3 * 7 * 4, dtype=torch.int32).reshape(3, 7, 4),  # Shard(1): 4, 3
        "one_row": torch.randn(1, 6, generator=generator, dtype=torch.float64),  # 1 row and 0
    }


def _uneven(full: dict[str, torch.Tensor], world: int, layout: str) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    dims = {"wide": 1, "odd": 0, "middle": 1, "one_row": 0}
    if layout == "b":  # the other dim of each (placed anew when restored)
        dims = {"wide": 0, "odd": 1, "middle": 2, "one_row": 1}
    return {name: distribute_tensor(full[name], mesh, [Shard(dims[name])]) for name in full}


@leaves_at_once
def save_uneven(
    rank: int, world: int, port: int, config: S3Config, url: str, source: str | None
) -> None:
    """Save `uneven_reference` sharded over the ranks to ``url``; with ``source``, first
    restore it from the checkpoint there into other placements (resharding) and save that."""
    _init(rank, world, port)
    try:
        full = uneven_reference()
        if source is None:
            state = _uneven(full, world, "a")
        else:
            state = _uneven({k: torch.zeros_like(v) for k, v in full.items()}, world, "b")
            dcp.load(state, storage_reader=S3Reader(source, config=config))
            for name, tensor in full.items():
                assert torch.equal(state[name].full_tensor(), tensor), name
        dcp.save(state, storage_writer=S3Writer(url, config=config))
    finally:
        dist.destroy_process_group()
