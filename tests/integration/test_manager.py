"""`CheckpointManager` against real servers: retention, the fallback past damaged checkpoints,
retention racing a reader, errors of background saves, the continuous policy, and (slow) resuming
on another world size and saving on SIGTERM."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import set_state_dict

from s3ckpt import (
    CheckpointError,
    CheckpointExists,
    CheckpointManager,
    CheckpointReplaced,
    ChecksumMismatch,
    Retention,
    S3Reader,
    S3Writer,
    SavePolicy,
)
from s3ckpt.format import layout
from s3ckpt.format.layout import step_name
from s3ckpt.tools.catalog import delete, gc
from tests import manager_workers
from tests.helpers import listing, raised, spawn

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

RUN = "run"


def state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(5000, generator=generator), "b": torch.full((7,), step), "step": step}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(5000), "b": torch.zeros(7, dtype=torch.int64), "step": -1}


def assert_state(loaded: dict[str, Any], step: int) -> None:
    expected = state(step)
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])
    assert loaded["step"] == step


def manager(s3: Any, bucket: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(f"s3://{bucket}/{RUN}", config=s3.config(), **kwargs)


def prefix(step: int) -> str:
    return f"{RUN}/{step_name(step)}"


def stored_steps(s3: Any, bucket: str) -> set[str]:
    """The checkpoint names that hold any object at all."""
    return {key.split("/")[1] for key in listing(s3.client, bucket, f"{RUN}/")}


def data_keys(s3: Any, bucket: str, step: int) -> list[str]:
    start = len(prefix(step)) + 1
    keys = listing(s3.client, bucket, f"{prefix(step)}/data-")
    return sorted(k for k in keys if layout.rank_of(k[start:]) is not None)


class Interrupting(DefaultLoadPlanner):
    """Runs ``act`` once a load has read its record and planned, before it fetches any data."""

    def __init__(self, act: Callable[[], Any]) -> None:
        super().__init__()
        self.act: Callable[[], Any] | None = act

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        act, self.act = self.act, None
        if act is not None:
            act()
        return super().resolve_tensor(read_item)


# ----------------------------------------------------------------------------- retention

POLICIES = {
    "keep_last=3": ({"keep_last": 3}, [18, 19, 20]),
    "keep_every=6": ({"retention": Retention(keep_every=6)}, [6, 12, 18, 20]),
    "keep_last=2,keep_every=7": (
        {"retention": Retention(keep_last=2, keep_every=7)},
        [7, 14, 19, 20],
    ),
    "keep=odd,keep_last=1": (
        {"retention": Retention(keep_last=1, keep=lambda s: s % 2 == 1)},
        [*range(1, 20, 2), 20],
    ),
    "none": ({}, list(range(1, 21))),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_retention_over_twenty_saves(s3: Any, bucket: str, policy: str) -> None:
    settings, kept = POLICIES[policy]
    with manager(s3, bucket, **settings) as mgr:
        for step in range(1, 21):
            assert mgr.save(step, state(step))
    assert mgr.steps() == kept
    assert stored_steps(s3, bucket) == {step_name(s) for s in kept}, "deletes leave nothing"
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 20 and mgr.latest_step() == 20
    assert_state(loaded, 20)


def test_continuous_policy_saves_whenever_none_is_in_flight(s3: Any, bucket: str) -> None:
    started = []
    with manager(s3, bucket, saving=SavePolicy(every=10, continuous=True), keep_last=2) as mgr:
        for step in range(1, 31):
            if mgr.save(step, state(step)):
                started.append(step)
            if step % 4 == 0:
                mgr.wait()  # then nothing is in flight at the next step
    assert {10, 20, 30} | set(range(1, 31, 4)) <= set(started)
    assert len(started) > 30 // 10
    # The extra saves are kept only while one is the newest: 29 went when 30 committed.
    assert mgr.steps() == [20, 30]
    assert stored_steps(s3, bucket) == {step_name(20), step_name(30)}


def test_should_save_follows_the_schedule_and_sync_saves_commit_at_once(
    s3: Any, bucket: str
) -> None:
    mgr = manager(s3, bucket, saving=SavePolicy(every=5, sync=True))
    assert [s for s in range(1, 11) if mgr.should_save(s)] == [5, 10]
    assert not mgr.save(4, state(4))
    assert mgr.save(5, state(5)) and mgr.steps() == [5]  # sync: committed on return
    assert mgr.save(7, state(7), force=True, sync=False)
    assert not mgr.save(7, state(7), force=True), "a step committed here is not saved again"
    mgr.close()
    assert mgr.steps() == [5, 7]
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(10, state(10))


# ----------------------------------------------------------------------------- restore


def damage(s3: Any, bucket: str, step: int, how: str) -> None:
    key = data_keys(s3, bucket, step)[0]
    if how == "corrupt":
        body = bytearray(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[len(body) // 2] ^= 0xFF
        s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    elif how == "missing-object":
        s3.client.delete_object(Bucket=bucket, Key=key)
    else:
        s3.client.put_object(Bucket=bucket, Key=f"{prefix(step)}/.metadata", Body=b"{garbage")


@pytest.mark.parametrize(
    ("how", "error"),
    [
        ("corrupt", "ChecksumMismatch"),
        ("missing-object", "ObjectNotFound"),
        ("unreadable-record", "MetadataError"),
    ],
)
def test_restore_falls_back_past_a_damaged_newest_checkpoint(
    s3: Any, bucket: str, how: str, error: str, caplog: pytest.LogCaptureFixture
) -> None:
    with manager(s3, bucket) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    damage(s3, bucket, 3, how)
    caplog.set_level(logging.INFO, logger="s3ckpt")
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 2
        assert_state(loaded, 2)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(prefix(3) in m and error in m for m in warnings), warnings
        infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert any(m.startswith(f"restored step 2 from s3://{bucket}/{prefix(2)}") for m in infos)
        # The resumed run's own save of step 3 replaces the damaged one.
        assert mgr.save(3, state(3))
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 3
    assert_state(loaded, 3)


def test_a_resumed_run_saves_over_the_damaged_step_alone(s3: Any, bucket: str) -> None:
    """Replacing is decided per save: right after replacing damaged step 3, the same manager
    (and writer) still refuses to save over step 4, a checkpoint it did not find damaged."""
    with manager(s3, bucket) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    damage(s3, bucket, 3, "corrupt")
    with manager(s3, bucket) as mgr:
        assert mgr.restore(blank()) == 2
        dcp.save(state(40), storage_writer=S3Writer(bucket, prefix(4), config=s3.config()))
        assert mgr.save(3, state(3)) and mgr.save(4, state(4))
        with pytest.raises(CheckpointExists, match="step 4"):
            mgr.wait()
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded, step=3) == 3
        assert_state(loaded, 3)
        assert mgr.restore(loaded, step=4) == 4
    assert_state(loaded, 40)


def test_retention_never_trades_the_loadable_checkpoints_for_a_damaged_newer_one(
    s3: Any, bucket: str
) -> None:
    with manager(s3, bucket) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, state(step), force=True)
    damage(s3, bucket, 300, "corrupt")
    loaded = blank()
    with manager(s3, bucket, keep_last=1) as mgr:
        assert mgr.restore(loaded) == 200
        assert mgr.save(250, state(250), force=True)  # e.g. the save a SIGTERM forces
        mgr.wait()
    # Counted as the newest, the damaged 300 would have made 250 retention's victim.
    assert stored_steps(s3, bucket) == {step_name(250), step_name(300)}
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 250
    assert_state(loaded, 250)


def unreadable(s3: Any, bucket: str, step: int, how: str) -> bytes:
    """Make step's record one this s3ckpt cannot read: garbled, or from a newer format."""
    key = f"{prefix(step)}/.metadata"
    if how == "garbled":
        body = b"{garbage"
    else:
        record = json.loads(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body = json.dumps(record | {"version": 99}).encode()
    s3.client.put_object(Bucket=bucket, Key=key, Body=body)
    return body


@pytest.mark.parametrize("how", ["garbled", "newer-version"])
def test_retention_never_deletes_a_record_it_cannot_read(s3: Any, bucket: str, how: str) -> None:
    """As `s3ckpt prune` does: an unreadable record is kept and counts for nothing, so a newer
    job's checkpoint (here the newest step) neither goes nor makes the loadable ones victims."""
    with manager(s3, bucket) as mgr:
        for step in (1, 2, 3, 9):
            mgr.save(step, state(step), force=True)
    bodies = {step: unreadable(s3, bucket, step, how) for step in (1, 9)}
    with manager(s3, bucket, keep_last=1) as mgr:
        assert mgr.save(4, state(4), force=True)
        mgr.wait()
    for step, body in bodies.items():
        key = f"{prefix(step)}/.metadata"
        assert s3.client.get_object(Bucket=bucket, Key=key)["Body"].read() == body
        assert data_keys(s3, bucket, step), "its data stays too"
    records = {k.split("/")[1] for k in listing(s3.client, bucket) if k.endswith("/.metadata")}
    assert records == {step_name(s) for s in (1, 4, 9)}
    # What the unreadable records reference is unknown, so the victims' data stays for now.
    assert data_keys(s3, bucket, 2) and data_keys(s3, bucket, 3)
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 4
    assert_state(loaded, 4)


def test_restore_with_verify_checks_before_it_loads(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    with manager(s3, bucket) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    damage(s3, bucket, 2, "corrupt")
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded, verify=True) == 1
    assert_state(loaded, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("damaged range(s)" in m and prefix(2) in m for m in warnings), warnings


def test_restore_of_a_given_step_raises_and_a_run_that_never_loads_says_why(
    s3: Any, bucket: str
) -> None:
    with manager(s3, bucket) as mgr:
        assert mgr.restore(blank()) is None and mgr.steps() == [] and mgr.latest_step() is None
        for step in (1, 2):
            mgr.save(step, state(step))
    damage(s3, bucket, 2, "corrupt")
    with manager(s3, bucket) as mgr:
        with pytest.raises(ChecksumMismatch):
            mgr.restore(blank(), step=2)
        loaded = blank()
        assert mgr.restore(loaded, step=1) == 1
        assert_state(loaded, 1)
    damage(s3, bucket, 1, "missing-object")
    with manager(s3, bucket) as mgr, pytest.raises(CheckpointError) as info:
        mgr.restore(blank())
    assert "step 2: " in str(info.value) and "step 1: " in str(info.value)


# ----------------------------------------------------------------------------- racing readers


def test_retention_spares_the_data_a_manager_is_reading(s3: Any, bucket: str) -> None:
    writer = manager(s3, bucket, keep_last=1, saving=SavePolicy(sync=True))
    for step in (1, 2):
        writer.save(step, state(step))
    assert writer.steps() == [2]
    loaded = blank()
    with manager(s3, bucket) as reader:
        # Step 3 commits while step 2 loads: retention would delete 2, but a reader holds it.
        planner = Interrupting(lambda: writer.save(3, state(3)))
        assert reader.restore(loaded, planner=planner) == 2
    assert_state(loaded, 2)
    assert writer.steps() == [3], "the record goes at once: a pin holds objects, not records"
    assert data_keys(s3, bucket, 2), "its data stayed while the reader held its lease"
    writer.save(4, state(4))  # the reader is gone: the next pass deletes what it kept
    assert writer.steps() == [4]
    assert stored_steps(s3, bucket) == {step_name(4)}
    writer.close()


def test_a_removal_while_a_manager_reads_spares_the_data_until_it_is_done(
    s3: Any, bucket: str
) -> None:
    with manager(s3, bucket) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    url = f"s3://{bucket}/{prefix(1)}"
    loaded = blank()
    with manager(s3, bucket) as reader:
        planner = Interrupting(lambda: delete(url, s3.config()))  # `s3ckpt rm`: no waiting
        assert reader.restore(loaded, step=1, planner=planner) == 1
        assert reader.steps() == [2], "the record went at once"
    assert_state(loaded, 1)
    assert data_keys(s3, bucket, 1), "the data stayed while the reader held its lease"
    gc(f"s3://{bucket}/{RUN}", older_than=timedelta(0), config=s3.config())
    assert stored_steps(s3, bucket) == {step_name(2)}
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 2
    assert_state(loaded, 2)


def test_a_reader_without_a_lease_fails_cleanly_when_its_step_is_deleted(
    s3: Any, bucket: str
) -> None:
    with manager(s3, bucket) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
    url = f"s3://{bucket}/{prefix(1)}"
    reader = S3Reader(url, config=s3.config())
    planner = Interrupting(lambda: delete(url, s3.config()))
    error = raised(lambda: dcp.load(blank(), storage_reader=reader, planner=planner))
    assert isinstance(error, CheckpointReplaced) and error.new_save_id is None, error
    assert stored_steps(s3, bucket) == {step_name(2)}, "nothing else was touched"
    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded) == 2
    assert_state(loaded, 2)


def test_restore_falls_back_when_its_step_is_deleted_under_it(s3: Any, bucket: str) -> None:
    with manager(s3, bucket) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))

    def remove_behind_the_lease() -> None:  # a removal that planned before the lease was written
        keys = list(listing(s3.client, bucket, f"{prefix(2)}/"))
        s3.client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})

    loaded = blank()
    with manager(s3, bucket) as mgr:
        assert mgr.restore(loaded, planner=Interrupting(remove_behind_the_lease)) == 1
    assert_state(loaded, 1)


# ----------------------------------------------------------------------------- failures


def test_a_failed_background_save_is_raised_by_the_next_save_and_by_wait(
    s3: Any, bucket: str
) -> None:
    # Someone else's checkpoint is at step 2: the manager's save of it fails in the background.
    theirs = S3Writer(bucket, prefix(2), config=s3.config())
    dcp.save(state(0), storage_writer=theirs)
    mgr = manager(s3, bucket)
    assert mgr.save(1, state(1)) and mgr.save(2, state(2))
    with pytest.raises(CheckpointExists, match="step 2"):
        mgr.save(3, state(3))
    assert mgr.save(3, state(3)), "reported once, the run goes on"
    mgr.wait()
    theirs = S3Writer(bucket, prefix(4), config=s3.config())
    dcp.save(state(0), storage_writer=theirs)
    assert mgr.save(4, state(4))
    with pytest.raises(CheckpointExists, match="step 4"):
        mgr.wait()
    mgr.close()
    assert mgr.steps() == [1, 2, 3, 4]
    loaded = blank()
    with manager(s3, bucket) as other:
        other.restore(loaded, step=2)
    assert_state(loaded, 0)


def test_with_raise_on_failure_off_a_failed_save_is_logged_and_the_run_goes_on(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    dcp.save(state(0), storage_writer=S3Writer(bucket, prefix(2), config=s3.config()))
    with manager(s3, bucket, raise_on_failure=False) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, state(step))
        mgr.wait()
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and r.name.startswith("s3ckpt")
    ]
    assert len(errors) == 1 and "saving step 2" in errors[0] and prefix(2) in errors[0], errors
    assert mgr.steps() == [1, 2, 3]


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.stores("moto", "seaweedfs")  # other processes: a real server
@pytest.mark.slow
def test_resume_on_two_ranks_from_one_and_back(s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/{RUN}"
    model, optimizer = manager_workers.model_and_optimizer()
    with CheckpointManager(url, config=s3.config()) as mgr:
        for step in (1, 2, 3):
            manager_workers.train_step(model, optimizer, step)
            sd = manager_workers.training_state(model, optimizer, step, manager_workers.table(step))
            mgr.save(step, sd)

    args = (2, free_port(), s3.config(), url)
    spawn(manager_workers.resume_on_ranks, args=args, nprocs=2)

    model, optimizer = manager_workers.model_and_optimizer()
    loaded = manager_workers.training_state(model, optimizer, 0, torch.zeros(64, 6))
    with CheckpointManager(url, config=s3.config()) as mgr:
        assert mgr.steps() == [4, 5], "the two-rank run's retention: keep_last=2"
        assert mgr.restore(loaded) == 5
    assert torch.equal(loaded["table"], manager_workers.table(5)) and loaded["step"] == 5
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    manager_workers.assert_model_is(model, manager_workers.reference(5))


@pytest.mark.stores("moto", "seaweedfs")  # other processes: a real server
@pytest.mark.slow
def test_sigterm_mid_training_leaves_a_checkpoint_of_the_step_it_arrived_at(
    s3: Any, bucket: str
) -> None:
    url = f"s3://{bucket}/{RUN}"
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=manager_workers.train_until_signalled, args=(s3.config(), url, sender)
    )
    process.start()
    sender.close()
    begun = [receiver.recv()]
    while begun[-1] < 3:
        begun.append(receiver.recv())
    os.kill(process.pid, signal.SIGTERM)
    try:
        while True:
            begun.append(receiver.recv())
    except EOFError:
        pass
    process.join(60)
    assert process.exitcode == -signal.SIGTERM, "the default: SIGTERM's own action, after the save"
    last = begun[-1]
    loaded = {"w": torch.zeros(1000), "step": 0}
    with CheckpointManager(url, config=s3.config()) as mgr:
        assert mgr.steps() == [last]
        assert mgr.restore(loaded) == last
    assert torch.equal(loaded["w"], torch.full((1000,), float(last))) and loaded["step"] == last
