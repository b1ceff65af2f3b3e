"""A prune of an incremental save's base, raced against the save at each of its phases: never a
committed record that points at a deleted object."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt import AccessDenied, IncompleteCheckpoint, S3Writer
from s3ckpt.dcp.incremental import Pins
from s3ckpt.manager.restore import s3ckpt_error
from s3ckpt.testing.faultproxy import Delay, FaultProxy, Status
from s3ckpt.tools.catalog import describe, gc, prune
from tests.helpers import listing
from tests.integration.test_incremental import (
    PARTS,
    dangling,
    frozen_objects,
    load,
    model,
    same,
    save,
    trained,
)

# Where the proxy holds the save back while the prune runs: (operations, key fragment).
PHASES: dict[str, tuple[str | list[str], str]] = {
    "before its pins land": ("PutObject", "run/step-000001/data-"),
    "while it uploads": (["PutObject", "CreateMultipartUpload"], "run/step-000003/data-"),
    "as it commits": ("PutObject", "run/step-000003/.metadata"),
}


def held_back(
    s3: Any,
    bucket: str,
    prefix: str,
    saved: dict[str, Any],
    where: tuple[str | list[str], str],
    act: Callable[[], Any],
    seconds: float,
) -> BaseException | None:
    """Run ``act`` while an incremental save of ``saved`` to ``prefix`` is held back for
    ``seconds`` by the proxy at its first request matching ``where`` (operations, key
    fragment); returns the save's error, if any."""
    errors: list[BaseException] = []
    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(Delay(seconds), op=where[0], key=where[1], times=1)
        config = s3.config(endpoint_url=proxy.endpoint_url, **PARTS)
        writer = S3Writer(bucket, prefix, config=config, incremental=True)

        def run() -> None:
            try:
                dcp.save(saved, storage_writer=writer)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while rule.fired == 0 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rule.fired == 1, f"the save never reached {where}"
        act()
        thread.join(60)
    return s3ckpt_error(errors[0]) if errors else None


def race(s3: Any, bucket: str, phase: str) -> tuple[dict[str, Any], BaseException | None]:
    """Step 1 (the base: nothing else references it) and step 5 (newest, unrelated) committed;
    an incremental save of step 3 held back at ``phase`` while ``prune --keep-last 1`` deletes
    step 1. Returns the state saved at step 3 and the save's error, if any."""
    state = model()
    save(s3, bucket, state, 1)
    save(s3, bucket, model(7), 5, incremental=False)
    saved = trained(state, 3)

    def prune_the_base() -> None:
        pruned = prune(f"s3://{bucket}/run", 1, config=s3.config())
        assert [info.step for info in pruned] == [1]

    # Long enough for the prune to finish while the request waits.
    error = held_back(s3, bucket, "run/step-000003", saved, PHASES[phase], prune_the_base, 4.0)
    assert dangling(s3, bucket, "run") == []
    return saved, error


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_prune_of_the_base_never_leaves_a_dangling_reference(
    s3: Any, bucket: str, phase: str
) -> None:
    saved, error = race(s3, bucket, phase)
    assert error is None
    info, _ = describe(f"s3://{bucket}/run/step-000003", s3.config())
    # Before the pins the prune wins and the save finds no base; after, the pins keep its objects.
    assert info.references == (() if phase == "before its pins land" else ("step-000001",))
    assert ("run/step-000001/.metadata" in listing(s3.client, bucket, "run/")) is False
    assert same(load(s3, bucket, "run/step-000003", saved), saved)
    gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert dangling(s3, bucket, "run") == []
    assert same(load(s3, bucket, "run/step-000003", saved), saved)


def test_without_its_pins_the_save_fails_rather_than_dangle(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_pins(self: Pins) -> None:
        return None

    monkeypatch.setattr(Pins, "hold", no_pins)
    _, error = race(s3, bucket, "while it uploads")
    # The prune deleted the base's objects; the save's last check before its commit saw it.
    assert isinstance(error, IncompleteCheckpoint), error
    assert "run/step-000003/.metadata" not in listing(s3.client, bucket, "run/")
    assert not frozen_objects(s3, bucket, "run/step-000001")


def pins(s3: Any, bucket: str, prefix: str) -> list[str]:
    """Read leases in ``prefix``'s save directories: ``data-<id>/<token>/.lease``."""
    return [
        k
        for k in listing(s3.client, bucket, prefix + "/")
        if k.count("/") == 4 and k.endswith(".lease")
    ]


def test_a_failed_save_releases_its_pins_and_a_committed_one_leaves_them(
    s3: Any, bucket: str
) -> None:
    state = model()
    save(s3, bucket, state, 1)
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Status(403, "AccessDenied"), op="PutObject", key="run/step-000002/data-")
        config = s3.config(endpoint_url=proxy.endpoint_url, **PARTS)
        writer = S3Writer(bucket, "run/step-000002", config=config, incremental=True)
        with pytest.raises(CheckpointException) as failed:
            dcp.save(trained(state, 2), storage_writer=writer)
        assert isinstance(s3ckpt_error(failed.value), AccessDenied)
        (stale,) = pins(s3, bucket, "run/step-000001")  # DCP never calls finish()
        proxy.clear_rules()
        dcp.save(trained(state, 3), checkpoint_id="run/step-000003", storage_writer=writer)
        # The failed save's pin is gone; the committed save's is left to expire (LEASE_TTL).
        (left,) = pins(s3, bucket, "run/step-000001")
        assert left != stale
        proxy.add_rule(Status(403, "AccessDenied"), op="PutObject", key="run/step-000004/data-")
        with pytest.raises(CheckpointException):
            dcp.save(trained(state, 4), checkpoint_id="run/step-000004", storage_writer=writer)
        assert len(pins(s3, bucket, "run/step-000003")) == 1
        writer.close()
        assert pins(s3, bucket, "run/step-000003") == []  # close() released them


def test_overwriting_the_base_while_a_save_references_it(s3: Any, bucket: str) -> None:
    state = model()
    save(s3, bucket, state, 10)
    saved = trained(state, 11)

    def overwrite() -> None:
        # The replacement deletes the old objects it can: not those the running save pinned.
        save(s3, bucket, model(9), 10, incremental=False, overwrite=True)

    where = ("PutObject", "run/step-000011/data-")
    error = held_back(s3, bucket, "run/step-000011", saved, where, overwrite, 2.0)
    assert error is None
    assert dangling(s3, bucket, "run") == []
    assert describe(f"s3://{bucket}/run/step-000011", s3.config())[0].references == ("step-000010",)
    assert same(load(s3, bucket, "run/step-000011", saved), saved)
    assert same(load(s3, bucket, "run/step-000010", model(9)), model(9))
