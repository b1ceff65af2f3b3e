"""A torchrun rank for tests/integration/test_torchrun.py: FSDP2 on CPU (gloo), DCP to S3.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/torchrun_worker.py \
        save s3://bucket/ck OUT_DIR --endpoint-url http://127.0.0.1:PORT

Credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (not the command line,
where ``ps`` would show them). Rank 0 writes the full (unsharded) state it saved or loaded to
``OUT_DIR/<name>.pt`` so the test compares it with ``torch.equal`` in its own process; assertions
about collectives stay here, where the ranks are.

Modes: ``save`` trains and async-saves on a dedicated gloo group; ``load`` loads into a model
sharded for this world size; ``overlap`` async-saves while training and all-reducing on the
default group, then loads the checkpoint back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from s3ckpt import S3Config, S3Reader, S3Writer

LR = 1e-2
TRAIN_STEPS = 3
OVERLAP_STEPS = 20
SAVE_TIMEOUT_S = 120.0
# Uneven on purpose: 10 and 30 rows split into unequal shards on 4 ranks (and differently on 2).
IN, HIDDEN, OUT = 12, 30, 10


class Net(nn.Module):
    """A small MLP with a LayerNorm and a buffer: FSDP2 shards the parameters, while the buffer
    (like each optimizer ``step``) stays a whole tensor on every rank, i.e. replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.inp(x)))
        return self.out(torch.relu(self.hidden(x))) * self.scale


def build(seed: int, mesh: DeviceMesh | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (sharded over ``mesh`` if given) and its optimizer; ``seed`` sets the weights."""
    torch.manual_seed(seed)
    model = Net()
    if mesh is not None:
        for layer in (model.inp, model.hidden, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One step on this rank's own batch (FSDP all-gathers and reduce-scatters on the way)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    batch = torch.randn(8, IN, generator=generator)
    target = torch.randn(8, OUT, generator=generator)
    nn.functional.mse_loss(model(batch), target).backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state with whole tensors (on rank 0; a collective when sharded)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves and loads: each rank's shards, keyed by parameter name."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def load(url: str, config: S3Config, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP's load recipe: shaped state from the live objects, filled from S3, then applied."""
    state = sharded_state(model, optimizer)
    dcp.load(state, storage_reader=S3Reader(url, config=config))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def _trained(mesh: DeviceMesh, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = build(0, mesh)
    for step in range(TRAIN_STEPS):
        train_step(model, optimizer, step, rank)
    for group in optimizer.param_groups:  # as a scheduler would: a load must restore it
        group["lr"] = LR / 2
    return model, optimizer


def _save(url: str, config: S3Config, state: dict[str, Any]) -> Any:
    """async_save on a gloo group of its own, so its collectives never meet the training's."""
    group = dist.new_group(backend="gloo")
    writer = S3Writer(url, config=config, overwrite=True)
    return dcp.async_save(state, storage_writer=writer, process_group=group)


def _write(out: Path, name: str, state: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        torch.save(state, out / f"{name}.pt")


def save(url: str, config: S3Config, out: Path, mesh: DeviceMesh, rank: int) -> None:
    model, optimizer = _trained(mesh, rank)
    _write(out, "reference", full_state(model, optimizer))
    _save(url, config, sharded_state(model, optimizer)).result(timeout=SAVE_TIMEOUT_S)


def load_mode(url: str, config: S3Config, out: Path, mesh: DeviceMesh, rank: int) -> None:
    model, optimizer = build(1, mesh)  # other weights: the load must replace all of them
    load(url, config, model, optimizer)
    _write(out, f"loaded-{dist.get_world_size()}", full_state(model, optimizer))


def overlap(url: str, config: S3Config, out: Path, mesh: DeviceMesh, rank: int) -> None:
    """Training collectives on the default group while the save's run on its own group: both
    must finish, every all_reduce must be right, and the checkpoint must hold the state at
    ``async_save`` time (the staged copy), not the state training moved on to."""
    world = dist.get_world_size()
    model, optimizer = _trained(mesh, rank)
    _write(out, "reference", full_state(model, optimizer))
    future = _save(url, config, sharded_state(model, optimizer))
    in_flight = 0
    for step in range(OVERLAP_STEPS):
        in_flight += not future.done()
        train_step(model, optimizer, TRAIN_STEPS + step, rank)
        value = torch.full((4096,), float(rank + step))
        dist.all_reduce(value)
        expected = float(world * step + world * (world - 1) // 2)
        assert torch.equal(value, torch.full((4096,), expected)), (step, value[:4])
    future.result(timeout=SAVE_TIMEOUT_S)
    report = {"rank": rank, "steps": OVERLAP_STEPS, "steps_while_saving": in_flight}
    (out / f"overlap-{rank}.json").write_text(json.dumps(report))
    _write(out, "trained-on", full_state(model, optimizer))

    fresh, fresh_optimizer = build(1, mesh)
    load(url, config, fresh, fresh_optimizer)
    _write(out, f"loaded-{world}", full_state(fresh, fresh_optimizer))


MODES = {"save": save, "load": load_mode, "overlap": overlap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("url", help="s3://bucket/prefix of the checkpoint")
    parser.add_argument("out", type=Path, help="directory for rank 0's full-state files")
    parser.add_argument("--endpoint-url", required=True)
    args = parser.parse_args()
    config = S3Config(endpoint_url=args.endpoint_url)  # credentials: the AWS_* environment
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        MODES[args.mode](args.url, config, args.out, mesh, int(os.environ["RANK"]))
        dist.barrier()  # nobody leaves while another rank may still need it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Past finalization a gloo thread may abort the process: see tests/dist_workers.leaves_at_once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
