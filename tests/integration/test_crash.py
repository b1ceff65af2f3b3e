"""Killed saves, garbage collection, and two processes racing to commit the same prefix."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import IncompleteCheckpoint, S3Reader, S3Writer
from s3ckpt.config import MiB
from s3ckpt.format import layout
from s3ckpt.tools.catalog import gc, list_checkpoints
from tests import dist_workers
from tests.helpers import listing, uploads_in_progress

pytestmark = pytest.mark.slow
SLOW_UPLOAD = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 2}


def referenced(s3: Any, bucket: str, prefix: str) -> set[str]:
    """Keys that the committed .metadata under ``prefix`` references (and itself)."""
    reader = S3Reader(bucket, prefix, config=s3.config())
    reader.read_metadata()
    assert reader.checkpoint is not None
    return {f"{prefix}/{key}" for key in reader.checkpoint.objects} | {f"{prefix}/.metadata"}


def kill_mid_upload(s3: Any, bucket: str, url: str, overwrite: bool) -> None:
    """Start a saving process and SIGKILL it once a multipart upload has parts on the server."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=dist_workers.save_big, args=(s3.config(**SLOW_UPLOAD), url, overwrite)
    )
    process.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.is_alive():
            uploads = s3.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
            parts = [
                s3.client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                for u in uploads
            ]
            if any(p.get("Parts") for p in parts):
                break
            time.sleep(0.02)
        assert process.is_alive(), "the save finished before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.join(timeout=30)
    assert process.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("same_prefix", [False, True], ids=["new-prefix", "overwrite"])
def test_killed_save_then_gc(
    s3: Any, bucket: str, same_prefix: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = {"w": torch.randn(100_000)}
    dcp.save(previous, storage_writer=S3Writer(bucket, "run/step-1", config=s3.config()))
    killed = "run/step-1" if same_prefix else "run/step-2"
    kill_mid_upload(s3, bucket, f"s3://{bucket}/{killed}", overwrite=same_prefix)

    loaded = {"w": torch.zeros(100_000)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "run/step-1", config=s3.config()))
    assert torch.equal(loaded["w"], previous["w"])
    assert uploads_in_progress(s3.client, bucket), "the kill left an upload behind"
    if not same_prefix:
        with pytest.raises(IncompleteCheckpoint):
            S3Reader(bucket, killed, config=s3.config()).read_metadata()
        status = {
            info.prefix: info.committed
            for info in list_checkpoints(f"s3://{bucket}/run", config=s3.config())
        }
        assert status == {"run/step-1": True, "run/step-2": False}

    # A young leftover may belong to a save still running elsewhere: gc leaves it alone.
    gc(f"s3://{bucket}/run", older_than=timedelta(hours=1), config=s3.config())
    assert uploads_in_progress(s3.client, bucket)

    # So does its lease, whatever the age threshold, until the lease expires.
    gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert uploads_in_progress(s3.client, bucket)
    monkeypatch.setattr(layout, "LEASE_TTL", 0.0)
    gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert uploads_in_progress(s3.client, bucket) == []
    assert set(listing(s3.client, bucket)) == referenced(s3, bucket, "run/step-1")
    loaded = {"w": torch.zeros(100_000)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "run/step-1", config=s3.config()))
    assert torch.equal(loaded["w"], previous["w"])


def test_two_processes_racing_to_one_prefix_commit_exactly_once(s3: Any, bucket: str) -> None:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    url = f"s3://{bucket}/race"
    processes = [
        context.Process(
            target=dist_workers.save_racing, args=(s3.config(), url, fill, barrier, results)
        )
        for fill in (1.0, 2.0)
    ]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    assert sorted(outcomes.values()) == ["CheckpointExists", "committed"], outcomes
    winner = next(fill for fill, outcome in outcomes.items() if outcome == "committed")
    loaded = {"w": torch.zeros(1_000_000)}
    dcp.load(loaded, storage_reader=S3Reader(url, config=s3.config()))
    assert torch.equal(loaded["w"], torch.full((1_000_000,), winner))
    assert uploads_in_progress(s3.client, bucket) == []
    # A loser that lost at its commit PUT (not at the check before uploading) leaves its objects
    # for gc, which judges them by the record.
    left = set(listing(s3.client, bucket)) - referenced(s3, bucket, "race")
    assert len({key.split("/")[1] for key in left}) <= 1, left
    gc(url, timedelta(0), s3.config(), break_leases=True)
    assert set(listing(s3.client, bucket)) == referenced(s3, bucket, "race")
