"""Several ranks (gloo on 127.0.0.1): sharded saves, resharded loads, PROCESS-mode async_save."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader
from tests import dist_workers
from tests.helpers import listing, spawn

pytestmark = [pytest.mark.slow, pytest.mark.stores("seaweedfs")]  # ranks: not the wire


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_ranks_save_and_load_on_two_and_on_one(s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/sharded"
    config = s3.config()
    spawn(dist_workers.save_sharded, args=(2, free_port(), config, url), nprocs=2)

    ranks = {key.split("/")[-1][:5] for key in listing(s3.client, bucket) if "/data-" in key}
    assert ranks == {"00000", "00001"}, "every rank writes its own objects"
    data_bytes = sum(size for key, size in listing(s3.client, bucket).items() if "/data-" in key)
    full = dist_workers.reference_state()
    tensor_bytes = sum(t.numel() * t.element_size() for t in full.values())
    plain_bytes = full["replicated"].numel() * 4
    assert tensor_bytes + plain_bytes <= data_bytes < tensor_bytes + plain_bytes + 4096, (
        "replicated tensors are stored once"
    )

    # Two ranks with other placements: every read is a sub-rectangle of a saved shard.
    spawn(dist_workers.load_sharded, args=(2, free_port(), config, url), nprocs=2)

    # One process, no process group: each saved shard lands in a slice of a whole tensor.
    loaded: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
    loaded.update(plain=torch.zeros_like(full["replicated"]), step=0)
    dcp.load(loaded, storage_reader=S3Reader(url, config=config))
    for name, tensor in full.items():
        assert torch.equal(loaded[name], tensor), name
    assert loaded["step"] == 7


def test_async_save_process_mode(s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/process-mode"
    spawn(dist_workers.process_mode_round_trip, args=(free_port(), s3.config(), url), nprocs=1)
    assert "process-mode/.metadata" in listing(s3.client, bucket)


def test_async_save_process_mode_on_two_ranks(s3: Any, bucket: str) -> None:
    url = f"s3://{bucket}/process-2"
    args = (2, free_port(), s3.config(), url)
    spawn(dist_workers.process_mode_sharded, args=args, nprocs=2)
    ranks = {k.split("/")[-1][:5] for k in listing(s3.client, bucket) if "process-2/data-" in k}
    assert ranks == {"00000", "00001"}


def test_incremental_async_save_in_process_mode(s3: Any, bucket: str) -> None:
    from s3ckpt.tools.catalog import describe

    config, run = s3.config(), f"s3://{bucket}/run"
    spawn(dist_workers.process_mode_incremental, args=(free_port(), config, run), nprocs=1)
    second, _ = describe(f"{run}/step-2", config)
    full = dist_workers.reference_state()
    moved = full["rows"].numel() * full["rows"].element_size()
    unchanged = sum(t.numel() * t.element_size() for n, t in full.items() if n != "rows")
    assert second.references == ("step-1",)
    assert second.referenced_bytes == unchanged
    assert moved <= second.stored_bytes < moved + unchanged


def test_incremental_saves_on_two_ranks_reference_each_ranks_unchanged_shards(
    s3: Any, bucket: str
) -> None:
    from s3ckpt.tools.catalog import describe

    config, run = s3.config(), f"s3://{bucket}/run"
    for step, layout, bump in ((1, "a", 0.0), (2, "a", 1.0), (3, "b", 1.0)):
        args = (2, free_port(), config, f"{run}/step-{step}", layout, bump)
        spawn(dist_workers.save_incremental, args=args, nprocs=2)
    full = dist_workers.reference_state()
    second, _ = describe(f"{run}/step-2", config)
    moved = full["rows"].numel() * full["rows"].element_size()
    plain = full["replicated"].numel() * 4  # "plain": a copy of it, not a DTensor
    unchanged = sum(t.numel() * t.element_size() for n, t in full.items() if n != "rows") + plain
    # Both ranks referenced their unchanged shards (replicated tensors are saved once).
    assert second.references == ("step-1",)
    assert second.referenced_bytes == unchanged
    assert moved <= second.stored_bytes < moved + unchanged
    # Resharded: only the chunks at the same offsets (the replicated tensors) are referenced.
    third, _ = describe(f"{run}/step-3", config)
    assert third.referenced_bytes == 2 * plain
    for url in (f"{run}/step-2", f"{run}/step-3"):
        loaded: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items()}
        loaded.update(plain=torch.zeros_like(full["replicated"]), step=0)
        dcp.load(loaded, storage_reader=S3Reader(url, config=config))
        assert torch.equal(loaded["rows"], full["rows"] + 1)
        for name in ("cols", "cube", "replicated"):
            assert torch.equal(loaded[name], full[name]), name
