"""`CheckpointManager` given the training objects (a module, an optimizer) rather than state dicts:
the optimizer's moments survive a restore into a fresh one, a background save holds the state of
its call, the stale ``opt.state_dict()`` snapshot is warned about, and what a restore says when
there is nothing to load, when only part of the state is wanted, or when the state does not fit."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
import torch
from torch import nn

from s3ckpt import CheckpointManager, CheckpointNotFound, ConfigError, StateDictMismatch
from tests import manager_workers
from tests.helpers import spawn

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

RUN = "run"


def manager(s3: Any, bucket: str, run: str = RUN, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(f"s3://{bucket}/{run}", config=s3.config(), **kwargs)


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(batch).square().mean().backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return model, optimizer


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)  # other weights than trained()'s
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for group in optimizer.param_groups
        for p in group["params"]
        for value in optimizer.state[p].values()
    ]


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_a_never_stepped_optimizer_gets_its_moments_back(s3: Any, bucket: str) -> None:
    model, optimizer = trained(3)
    with manager(s3, bucket) as mgr:
        assert mgr.save(3, {"model": model, "optim": optimizer}, sync=True)

    model2, optimizer2 = fresh()
    assert not optimizer2.state
    with manager(s3, bucket) as mgr:
        assert mgr.restore({"model": model2, "optim": optimizer2}) == 3
    assert_same(model2, model)
    expected, loaded = moments(optimizer), moments(optimizer2)
    assert len(loaded) == len(expected) == 3 * 4  # exp_avg, exp_avg_sq and step per parameter
    assert all(torch.equal(x, y) for x, y in zip(loaded, expected, strict=True))


def test_a_background_save_holds_the_state_of_its_call(s3: Any, bucket: str) -> None:
    model, optimizer = trained(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with manager(s3, bucket) as mgr:
        assert mgr.save(2, {"model": model, "optim": optimizer})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)  # training goes on while the upload runs
    model2, optimizer2 = fresh()
    with manager(s3, bucket) as mgr:
        assert mgr.restore({"model": model2, "optim": optimizer2}) == 2
    for name, value in model2.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_snapshot_of_an_optimizer_before_its_first_step_is_warned_about(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = trained(0)
    snapshot = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    model, optimizer = trained(2)  # the loop steps; the snapshot's "state" stays empty
    with caplog.at_level(logging.WARNING), manager(s3, bucket) as mgr:
        mgr.save(1, snapshot, sync=True)
        mgr.save(2, snapshot, sync=True)
        mgr.save(3, {"model": model, "optim": optimizer}, sync=True)
    warned = [r.getMessage() for r in caplog.records if "no state" in r.getMessage()]
    assert len(warned) == 1, warned  # once per key, and not for the objects
    assert "'optim'" in warned[0] and "Pass the optimizer itself" in warned[0]


def test_an_optimizer_without_its_model_is_refused(s3: Any, bucket: str) -> None:
    _, optimizer = trained(1)
    with manager(s3, bucket) as mgr, pytest.raises(ConfigError, match="'optim'"):
        mgr.save(1, {"optim": optimizer}, sync=True)


def test_nothing_to_restore_is_said_and_can_be_an_error(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = trained(1)
    with manager(s3, bucket, run="runs/train-a") as mgr:
        mgr.save(1, {"model": model, "optim": optimizer}, sync=True)
    url = f"s3://{bucket}/runs/train-b"
    with caplog.at_level(logging.WARNING), manager(s3, bucket, run="runs/train-b") as mgr:
        assert mgr.restore({"model": model}) is None
        with pytest.raises(CheckpointNotFound) as info:
            mgr.restore({"model": model}, required=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(url in m and "train-a" in m for m in warned), warned
    assert url in str(info.value) and "train-a" in str(info.value)


def test_a_model_alone_restores_from_a_training_checkpoint(s3: Any, bucket: str) -> None:
    model, optimizer = trained(2)
    with manager(s3, bucket) as mgr:
        mgr.save(2, {"model": model, "optim": optimizer, "epoch": 7}, sync=True)
    evaluated, _ = fresh()
    with manager(s3, bucket) as mgr:
        assert mgr.restore({"model": evaluated}) == 2
    assert_same(evaluated, model)


def test_a_partial_restore_keeps_what_the_checkpoint_lacks(s3: Any, bucket: str) -> None:
    model, _ = trained(2)
    with manager(s3, bucket) as mgr:
        mgr.save(2, {"model": model}, sync=True)
    grown, _ = fresh()
    head = nn.Linear(2, 3)
    head_before = {k: v.clone() for k, v in head.state_dict().items()}
    state = {"model": grown, "head": head}
    with manager(s3, bucket) as mgr:
        with pytest.raises(StateDictMismatch, match=r"head\.weight: not in the checkpoint"):
            mgr.restore(state)
        assert mgr.restore(state, partial=True) == 2
    assert_same(grown, model)
    assert all(torch.equal(head.state_dict()[k], v) for k, v in head_before.items())


def test_a_shape_mismatch_names_the_key_and_both_shapes(s3: Any, bucket: str) -> None:
    model, _ = trained(1)
    with manager(s3, bucket) as mgr:
        mgr.save(1, {"model": model}, sync=True)
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    with manager(s3, bucket) as mgr, pytest.raises(StateDictMismatch) as info:
        mgr.restore({"model": wider})
    message = str(info.value)
    assert "model.0.weight: saved with shape (16, 8), loading into (32, 8)" in message
    assert f"s3://{bucket}/{RUN}/step-000000001" in message
    assert info.value.url == f"s3://{bucket}/{RUN}/step-000000001"


def test_saving_the_restored_step_again_says_the_loop_repeats_it(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = trained(1)
    state = {"model": model, "optim": optimizer}
    with manager(s3, bucket) as mgr:
        mgr.save(1, state, sync=True)
    with caplog.at_level(logging.WARNING), manager(s3, bucket) as mgr:
        start = mgr.restore(state)
        assert not mgr.save(start or 0, state, sync=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("the step restore() loaded" in m for m in warned), warned


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.stores("moto")  # other processes: a real server
def test_fsdp2_objects_saved_on_two_ranks_restore_on_one_with_their_moments(
    s3: Any, bucket: str
) -> None:
    url = f"s3://{bucket}/{RUN}"
    args = (2, free_port(), s3.config(), url)
    spawn(manager_workers.save_fsdp2_objects, args=args, nprocs=2)

    model, optimizer = manager_workers.model_and_optimizer()
    with manager(s3, bucket) as mgr:
        assert mgr.restore({"model": model, "optim": optimizer}) == 3
    expected, expected_optimizer = manager_workers.model_and_optimizer()
    for step in (1, 2, 3):
        manager_workers.train_step(expected, expected_optimizer, step)
    manager_workers.assert_model_is(model, expected)
    for got, want in zip(moments(optimizer), moments(expected_optimizer), strict=True):
        torch.testing.assert_close(got, want)


def test_restore_stages_the_first_save_s_buffers_before_training(s3: Any, bucket: str) -> None:
    """Nothing to restore or not, the first background save stages into buffers that restore
    allocated and touched (the memory a first save takes, taken before training)."""
    model, optimizer = fresh()
    state = {"model": model, "optim": optimizer}
    with manager(s3, bucket, every=1) as mgr:
        assert mgr.restore(state) is None
        staging = mgr._writer._staging
        weight = staging._buffers["model"]["0.weight"]  # type: ignore[index]
        assert staging.nbytes >= 3 * weight.numel() * weight.element_size(), "moments too"
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        assert mgr.save(1, state)
        mgr.wait()
        assert staging._buffers["model"]["0.weight"].data_ptr() == weight.data_ptr()  # type: ignore[index]
