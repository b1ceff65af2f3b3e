"""Worker functions for the manager's multi-process tests (spawned: they live at module level),
and the small training run they share with the tests."""

from __future__ import annotations

import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from s3ckpt import CheckpointManager, S3Config, SavePolicy
from tests.dist_workers import _init, leaves_at_once


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One deterministic step: the same batch for ``step`` in every process."""
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    optimizer.step()


def table(step: int) -> torch.Tensor:
    """A tensor that the multi-rank side shards by rows: its value says the step."""
    return torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) + step


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, sharded: Any
) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "table": sharded, "step": step}


def reference(steps: int) -> nn.Module:
    """The model after ``steps`` uninterrupted steps."""
    model, optimizer = model_and_optimizer()
    for step in range(1, steps + 1):
        train_step(model, optimizer, step)
    return model


def assert_model_is(model: nn.Module, expected: nn.Module) -> None:
    pairs = zip(model.state_dict().items(), expected.state_dict().values(), strict=True)
    for (name, got), want in pairs:
        torch.testing.assert_close(got, want, msg=name)


@leaves_at_once
def resume_on_ranks(rank: int, world: int, port: int, config: S3Config, url: str) -> None:
    """Resume a 1-rank run at step 3 on ``world`` ranks (the table sharded by rows), train steps
    4 and 5, save 4 on schedule and 5 because rank 1 alone receives SIGUSR1 before it."""
    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model, optimizer = model_and_optimizer()
        for parameter in model.parameters():
            parameter.data.zero_()  # nothing of the fresh model may survive the restore
        sharded = distribute_tensor(torch.zeros(64, 6), mesh, [Shard(0)])
        state = training_state(model, optimizer, 0, sharded)
        saving = SavePolicy(every=2, save_on=signal.SIGUSR1, on_signal="return")
        manager = CheckpointManager(url, keep_last=2, saving=saving, config=config)
        assert manager.restore(state) == 3
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        assert_model_is(model, reference(3))
        assert isinstance(state["table"], DTensor) and state["step"] == 3
        assert torch.equal(state["table"].full_tensor(), table(3))
        for step in (4, 5):
            train_step(model, optimizer, step)
            sharded = distribute_tensor(table(step), mesh, [Shard(0)])
            if step == 5 and rank == 1:
                signal.raise_signal(signal.SIGUSR1)
            saved = manager.save(step, training_state(model, optimizer, step, sharded))
            assert saved, f"rank {rank} did not save step {step}"
        assert manager.signal_received == signal.SIGUSR1, "every rank learns of the signal"
        manager.close()
    finally:
        dist.destroy_process_group()


def train_until_signalled(config: S3Config, url: str, steps: Any) -> None:
    """Train, telling ``steps`` (a Pipe) each step as it begins, with no save on schedule; a
    SIGTERM makes the next save() save that step, then ends the process (the default)."""
    saving = SavePolicy(every=1_000_000, save_on=signal.SIGTERM)
    manager = CheckpointManager(url, saving=saving, config=config)
    weights = torch.zeros(1000)
    for step in range(1, 1_000_000):
        steps.send(step)
        weights += 1
        time.sleep(0.05)  # a step's work, during which the signal may arrive
        manager.save(step, {"w": weights, "step": step})


@leaves_at_once
def save_fsdp2_objects(rank: int, world: int, port: int, config: S3Config, url: str) -> None:
    """Train the shared model for 3 steps as FSDP2 (``fully_shard``) on ``world`` ranks and save
    step 3 giving the manager the module and optimizer themselves."""
    _init(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model, _ = model_and_optimizer()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert isinstance(next(model.parameters()), DTensor)
        for step in (1, 2, 3):
            train_step(model, optimizer, step)
        with CheckpointManager(url, config=config) as manager:
            assert manager.save(3, {"model": model, "optim": optimizer}, sync=True)
    finally:
        dist.destroy_process_group()
