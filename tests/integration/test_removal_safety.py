"""Removals never break what they cannot see: a running save (its lease), and a checkpoint whose
record cannot be read (damaged, or from a newer s3ckpt)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointNotFound, S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.format import layout
from s3ckpt.testing.faultproxy import Delay, FaultProxy
from s3ckpt.tools.catalog import delete, gc, latest, list_checkpoints, prune
from tests.helpers import listing

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 4}


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB, generator=generator),  # 12 MiB: a slow multipart upload
        "small": torch.randn(1000, generator=generator),  # its own object: done first
    }


def assert_loads(s3: Any, bucket: str, prefix: str, saved: dict[str, torch.Tensor]) -> None:
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=s3.config()))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def save(s3: Any, bucket: str, prefix: str, sd: dict[str, torch.Tensor], **kwargs: Any) -> None:
    dcp.save(sd, storage_writer=S3Writer(bucket, prefix, config=s3.config(), **kwargs))


def during_a_slow_save(
    s3: Any, bucket: str, prefix: str, saved: dict[str, torch.Tensor], act: Callable[[], Any]
) -> Any:
    """Run ``act`` once while a save to ``prefix`` has a finished object but is still uploading
    (its parts are held back by the proxy); returns what ``act`` returned."""
    errors: list[BaseException] = []
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Delay(3.0), op="UploadPart")
        config = s3.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        writer = S3Writer(
            bucket, prefix, config=config, overwrite=True, options=WriteOptions(objects_per_rank=2)
        )

        def run() -> None:
            try:
                dcp.save(saved, storage_writer=writer)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                errors.append(e)

        before = set(listing(s3.client, bucket, f"{prefix}/data-"))
        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            keys = set(listing(s3.client, bucket, f"{prefix}/data-")) - before
            # A data object, not the lease or the checksum probe the first upload makes there.
            if any(layout.rank_of(k[len(prefix) + 1 :]) is not None for k in keys):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the save never finished an object")
        result = act()
        thread.join(60)
    assert not errors, errors
    return result


@pytest.mark.stores("moto", "seaweedfs")  # through the fault proxy
def test_gc_during_a_save_leaves_it_alone(s3: Any, bucket: str) -> None:
    saved = state(1)
    url = f"s3://{bucket}/ck"
    report = during_a_slow_save(
        s3, bucket, "ck", saved, lambda: gc(url, older_than=timedelta(0), config=s3.config())
    )
    assert report.deleted == () and report.aborted == ()
    assert report.skipped and report.skipped_uploads  # it saw the running save and spared it
    assert_loads(s3, bucket, "ck", saved)
    assert not [k for k in listing(s3.client, bucket) if k.endswith(".lease")]
    after = gc(url, older_than=timedelta(0), config=s3.config())
    assert after.deleted == () and after.skipped == ()


@pytest.mark.stores("moto", "seaweedfs")  # through the fault proxy
def test_prune_during_an_overwriting_save_leaves_the_save_alone(s3: Any, bucket: str) -> None:
    save(s3, bucket, "run/step-1", state(1))
    save(s3, bucket, "run/step-2", state(2))
    new = state(3)
    pruned = during_a_slow_save(
        s3, bucket, "run/step-1", new, lambda: prune(f"s3://{bucket}/run", 1, config=s3.config())
    )
    assert [info.prefix for info in pruned] == ["run/step-1"]  # the record it replaces
    assert_loads(s3, bucket, "run/step-1", new)
    assert_loads(s3, bucket, "run/step-2", state(2))


def test_the_lease_of_a_dead_save_expires(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = [
        "ck/data-0123456789abcdef01234567/00000-000-abcdef",
        "ck/data-0123456789abcdef01234567/.lease",
    ]
    for key in dead:
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"x" * 100)
    url = f"s3://{bucket}/ck"
    report = gc(url, older_than=timedelta(0), config=s3.config())
    assert report.deleted == () and sorted(report.skipped) == sorted(dead)
    monkeypatch.setattr(layout, "LEASE_TTL", 0.0)
    report = gc(url, older_than=timedelta(0), config=s3.config())
    assert sorted(report.deleted) == sorted(dead)
    assert listing(s3.client, bucket) == {}


def unreadable_run(s3: Any, bucket: str) -> None:
    """run/step-0 and step-1 fine; step-2's record from a newer s3ckpt; step-3's garbled."""
    for step in range(4):
        save(s3, bucket, f"run/step-{step}", state(step))
    key = "run/step-2/.metadata"
    record = json.loads(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    s3.client.put_object(Bucket=bucket, Key=key, Body=json.dumps(record | {"version": 99}))
    s3.client.put_object(Bucket=bucket, Key="run/step-3/.metadata", Body=b'{"format": "s3ck')


def test_listing_and_latest_skip_an_unreadable_record(s3: Any, bucket: str, cli: Any) -> None:
    unreadable_run(s3, bucket)
    infos = {info.step: info for info in list_checkpoints(f"s3://{bucket}/run", s3.config())}
    assert sorted(infos) == [0, 1, 2, 3]
    assert infos[1].committed and infos[1].unreadable is None
    assert not infos[2].committed and "newer s3ckpt" in (infos[2].unreadable or "")
    assert not infos[3].committed and "JSON" in (infos[3].unreadable or "")
    found = latest(f"s3://{bucket}/run", s3.config())
    assert found is not None and found.step == 1
    code, out, _ = cli("--json", "ls", f"s3://{bucket}/run")
    assert code == 0
    entries = {entry["step"]: entry for entry in json.loads(out)}
    assert entries[2]["unreadable"] and entries[1]["unreadable"] is None
    code, out, _ = cli("ls", f"s3://{bucket}/run")
    assert code == 0 and out.count("unreadable") == 2
    code, out, _ = cli("latest", f"s3://{bucket}/run")
    assert code == 0 and out.strip() == f"s3://{bucket}/run/step-1"


def test_gc_and_prune_never_delete_what_they_cannot_read(s3: Any, bucket: str) -> None:
    unreadable_run(s3, bucket)
    kept = {k: v for k, v in listing(s3.client, bucket, "run/step-2/").items()}
    report = gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert report.deleted == ()
    assert set(kept) - {"run/step-2/.metadata"} <= set(report.skipped)
    pruned = prune(f"s3://{bucket}/run", 1, config=s3.config())
    assert [info.step for info in pruned] == [0]  # step-1 is the newest readable one
    assert listing(s3.client, bucket, "run/step-2/") == kept
    assert "run/step-3/.metadata" in listing(s3.client, bucket, "run/step-3/")
    assert_loads(s3, bucket, "run/step-1", state(1))


@pytest.mark.stores("moto", "seaweedfs")  # through the fault proxy
def test_rm_during_a_save_leaves_it_alone(s3: Any, bucket: str) -> None:
    saved = state(4)
    url = f"s3://{bucket}/ck"

    def remove() -> BaseException:
        with pytest.raises(CheckpointNotFound) as info:
            delete(url, config=s3.config())
        return info.value

    error = during_a_slow_save(s3, bucket, "ck", saved, remove)
    assert "running save" in str(error)
    assert_loads(s3, bucket, "ck", saved)
