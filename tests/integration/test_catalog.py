"""`s3ckpt.tools.catalog` on real servers: listing, latest, rm, prune, gc, refused deletes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import (
    AccessDenied,
    CheckpointNotFound,
    ConfigError,
    IncompleteCheckpoint,
    S3Reader,
    S3Writer,
)
from s3ckpt.tools import catalog
from s3ckpt.tools.localserver import SeaweedFS
from tests.conftest import S3Env, make_env
from tests.helpers import listing, uploads_in_progress

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

# Saved in this order, so step order (1, 2, 10) differs from creation order and from text order.
COMMITTED_STEPS = (10, 1, 2)
INCOMPLETE = "run/step-11"
# A failed save's object beside a committed one.
LEFTOVER = "run/step-2/data-deaddeaddeaddeaddeaddead/00000-000"


def save(s3: S3Env, bucket: str, prefix: str, state: dict[str, Any]) -> None:
    writer = S3Writer(f"s3://{bucket}/{prefix}", config=s3.config())
    dcp.save(state, storage_writer=writer)


def load(s3: S3Env, bucket: str, prefix: str, like: dict[str, torch.Tensor]) -> dict[str, Any]:
    loaded = {name: torch.zeros_like(value) for name, value in like.items()}
    dcp.load(loaded, storage_reader=S3Reader(f"s3://{bucket}/{prefix}", config=s3.config()))
    return loaded


def build_run(s3: S3Env, bucket: str) -> dict[int, dict[str, torch.Tensor]]:
    """Committed run/step-{10,1,2}; run/step-11 with only a data object and an upload (a save
    that died); a failed save's object and upload inside step-2; a non-checkpoint run/logs/."""
    states = {}
    for step in COMMITTED_STEPS:
        states[step] = {"w": torch.randn(8, 4), "b": torch.arange(step + 3)}
        save(s3, bucket, f"run/step-{step}", states[step])
    s3.client.put_object(
        Bucket=bucket, Key=f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000", Body=b"x" * 100
    )
    s3.client.create_multipart_upload(
        Bucket=bucket, Key=f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00001-000"
    )
    s3.client.put_object(Bucket=bucket, Key=LEFTOVER, Body=b"y" * 50)
    s3.client.create_multipart_upload(
        Bucket=bucket, Key="run/step-2/data-deaddeaddeaddeaddeaddead/00001-000"
    )
    s3.client.put_object(Bucket=bucket, Key="run/logs/train.txt", Body=b"loss 0.1")
    return states


def referenced(s3: S3Env, bucket: str, prefix: str) -> dict[str, int]:
    """``.metadata`` and the objects it names, with their sizes as stored."""
    raw = s3.client.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    stored = listing(s3.client, bucket, f"{prefix}/")
    keys = [f"{prefix}/.metadata"] + [f"{prefix}/{k}" for k in json.loads(raw)["objects"]]
    return {key: stored[key] for key in keys}


@pytest.fixture
def run(s3: S3Env, bucket: str) -> dict[int, dict[str, torch.Tensor]]:
    return build_run(s3, bucket)


def test_list_shows_committed_and_incomplete_checkpoints(s3: S3Env, bucket: str, run: Any) -> None:
    infos = catalog.list_checkpoints(f"s3://{bucket}/run", s3.config())
    assert [(i.prefix, i.committed, i.step) for i in infos] == [
        ("run/step-1", True, 1),
        ("run/step-2", True, 2),
        ("run/step-10", True, 10),
        ("run/step-11", False, 11),
    ]
    for info in infos[:3]:
        stored = referenced(s3, bucket, info.prefix)
        assert (info.total_bytes, info.num_objects) == (sum(stored.values()), len(stored))
        record = json.loads(
            s3.client.get_object(Bucket=bucket, Key=f"{info.prefix}/.metadata")["Body"].read()
        )
        assert info.save_id == record["save_id"] and info.world_size == 1
        assert info.created.timestamp() == pytest.approx(record["created"])
        assert info.url == f"s3://{bucket}/{info.prefix}" and info.compression is None
    incomplete = infos[3]
    assert (incomplete.total_bytes, incomplete.num_objects, incomplete.save_id) == (
        100,
        1,
        "feed" * 6,
    )
    assert isinstance(incomplete.created, datetime) and incomplete.world_size is None


def test_listing_a_checkpoint_url_shows_just_that_checkpoint(
    s3: S3Env, bucket: str, run: Any
) -> None:
    (info,) = catalog.list_checkpoints(f"s3://{bucket}/run/step-2/", s3.config())
    assert (info.prefix, info.committed, info.step) == ("run/step-2", True, 2)
    assert catalog.list_checkpoints(f"s3://{bucket}/elsewhere", s3.config()) == []


def test_latest_is_the_highest_committed_step(s3: S3Env, bucket: str, run: Any) -> None:
    best = catalog.latest(f"s3://{bucket}/run", s3.config())
    assert best is not None and (best.prefix, best.committed) == ("run/step-10", True)
    assert catalog.latest(f"s3://{bucket}/nothing-here", s3.config()) is None


def test_prune_keeps_the_newest_and_never_the_incomplete(s3: S3Env, bucket: str, run: Any) -> None:
    progress: list[tuple[int, int]] = []
    deleted = catalog.prune(
        f"s3://{bucket}/run", 1, s3.config(), progress=lambda d, t: progress.append((d, t))
    )
    assert sorted(i.prefix for i in deleted) == ["run/step-1", "run/step-2"]
    keys = listing(s3.client, bucket)
    assert not [k for k in keys if k.startswith(("run/step-1/", "run/step-2/"))]
    assert (
        f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000" in keys
        and "run/logs/train.txt" in keys
    )
    assert uploads_in_progress(s3.client, bucket) == [
        f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00001-000"
    ]
    assert progress[-1][0] == progress[-1][1] > 0
    assert torch.equal(load(s3, bucket, "run/step-10", run[10])["w"], run[10]["w"])
    # Keeping more than there are deletes nothing; keeping none is refused before any request.
    assert catalog.prune(f"s3://{bucket}/run", 5, s3.config()) == []
    with pytest.raises(ConfigError, match="keep must be >= 1"):
        catalog.prune(f"s3://{bucket}/run", 0, s3.config())
    assert catalog.latest(f"s3://{bucket}/run", s3.config()) is not None


def test_prune_deletes_nothing_when_not_confirmed(s3: S3Env, bucket: str, run: Any) -> None:
    before = listing(s3.client, bucket)
    offered: list[list[str]] = []

    def decline(victims: list[catalog.CheckpointInfo]) -> bool:
        offered.append([v.prefix for v in victims])
        return False

    assert catalog.prune(f"s3://{bucket}/run", 2, s3.config(), confirm=decline) == []
    assert offered == [["run/step-1"]]
    assert listing(s3.client, bucket) == before


def test_delete_removes_every_object_and_upload(s3: S3Env, bucket: str, run: Any) -> None:
    removal = catalog.delete(f"s3://{bucket}/run/step-2", s3.config())
    assert removal.deleted[0] == "run/step-2/.metadata"
    assert LEFTOVER in removal.deleted
    assert [u.key for u in removal.aborted] == [
        "run/step-2/data-deaddeaddeaddeaddeaddead/00001-000"
    ]
    assert not [k for k in listing(s3.client, bucket) if k.startswith("run/step-2/")]
    assert "run/step-2/data-deaddeaddeaddeaddeaddead/00001-000" not in uploads_in_progress(
        s3.client, bucket
    )
    with pytest.raises(CheckpointNotFound):
        S3Reader(f"s3://{bucket}/run/step-2", config=s3.config()).read_metadata()
    with pytest.raises(CheckpointNotFound, match="no checkpoint at"):
        catalog.delete(f"s3://{bucket}/run/step-2", s3.config())
    # Neighbours are untouched, including a checkpoint whose name starts the same.
    assert torch.equal(load(s3, bucket, "run/step-1", run[1])["b"], run[1]["b"])


def test_delete_of_an_incomplete_checkpoint(s3: S3Env, bucket: str, run: Any) -> None:
    removal = catalog.delete(f"s3://{bucket}/{INCOMPLETE}", s3.config())
    assert removal.deleted == (f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000",)
    assert removal.bytes_freed == 100 and len(removal.aborted) == 1
    assert not listing(s3.client, bucket, f"{INCOMPLETE}/")


def test_gc_removes_only_what_no_metadata_references(s3: S3Env, bucket: str, run: Any) -> None:
    kept = {
        k: v
        for step in COMMITTED_STEPS
        for k, v in referenced(s3, bucket, f"run/step-{step}").items()
    }
    report = catalog.gc(f"s3://{bucket}/run", timedelta(0), s3.config())
    assert sorted(report.deleted) == sorted(
        [LEFTOVER, f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000"]
    )
    assert sorted(u.key for u in report.aborted) == sorted(
        [
            "run/step-2/data-deaddeaddeaddeaddeaddead/00001-000",
            f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00001-000",
        ]
    )
    assert report.bytes_freed == 150 and not report.dry_run and not report.skipped
    assert listing(s3.client, bucket) == kept | {"run/logs/train.txt": 8}
    assert uploads_in_progress(s3.client, bucket) == []
    for step in COMMITTED_STEPS:
        loaded = load(s3, bucket, f"run/step-{step}", run[step])
        assert all(torch.equal(loaded[name], run[step][name]) for name in run[step])


def test_gc_skips_saves_that_wrote_recently(s3: S3Env, bucket: str, run: Any) -> None:
    before = listing(s3.client, bucket)
    report = catalog.gc(f"s3://{bucket}/run", timedelta(hours=1), s3.config())
    assert report.deleted == () and report.aborted == () and report.bytes_freed == 0
    assert sorted(report.skipped) == sorted(
        [LEFTOVER, f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000"]
    )
    assert len(report.skipped_uploads) == 2
    assert listing(s3.client, bucket) == before
    assert len(uploads_in_progress(s3.client, bucket)) == 2


def test_a_save_killed_before_any_object_completed(s3: S3Env, bucket: str) -> None:
    key = "run/step-7/data-abcabcabcabcabcabcabcabc/00000-000"
    s3.client.create_multipart_upload(Bucket=bucket, Key=key)
    (info,) = catalog.list_checkpoints(f"s3://{bucket}/run", s3.config())
    assert (info.prefix, info.committed, info.step) == ("run/step-7", False, 7)
    assert (info.num_objects, info.total_bytes, info.save_id) == (0, 0, "abc" * 8)
    removal = catalog.delete(f"s3://{bucket}/run/step-7", s3.config())
    assert removal.deleted == () and [u.key for u in removal.aborted] == [key]
    assert uploads_in_progress(s3.client, bucket) == []


# moto lists every upload as initiated on 2010-11-10: just what a long-running upload looks like.
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_gc_keeps_an_old_upload_that_still_receives_parts(s3: S3Env, bucket: str) -> None:
    key = "run/step-3/data-100910091009100910091009/00000-000"
    upload = s3.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    s3.client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"z" * 10)
    report = catalog.gc(f"s3://{bucket}/run", timedelta(hours=1), s3.config())
    assert report.aborted == () and [u.key for u in report.skipped_uploads] == [key]
    report = catalog.gc(f"s3://{bucket}/run", timedelta(0), s3.config())
    assert [u.key for u in report.aborted] == [key]
    assert uploads_in_progress(s3.client, bucket) == []


def test_gc_dry_run_and_gc_of_one_checkpoint(s3: S3Env, bucket: str, run: Any) -> None:
    before = listing(s3.client, bucket)
    dry = catalog.gc(f"s3://{bucket}/run", timedelta(0), s3.config(), dry_run=True)
    assert dry.dry_run and len(dry.deleted) == 2 and len(dry.aborted) == 2
    assert listing(s3.client, bucket) == before
    one = catalog.gc(f"s3://{bucket}/run/step-2", timedelta(0), s3.config())
    assert one.deleted == (LEFTOVER,) and [u.key for u in one.aborted] == [
        "run/step-2/data-deaddeaddeaddeaddeaddead/00001-000"
    ]
    assert f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000" in listing(s3.client, bucket)


def _deny_deletes(s3: S3Env, bucket: str, keys: str = "*") -> None:
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Deny",
                "Principal": "*",
                "Action": ["s3:DeleteObject"],
                "Resource": [f"arn:aws:s3:::{bucket}/{keys}"],
            }
        ],
    }
    s3.client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))


# moto enforces a bucket policy on DeleteObjects; SeaweedFS 4.48 enforces it on DeleteObject only
# (a batch delete goes through), so SeaweedFS is tested with a read-only identity below.
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_deletes_refused_by_a_bucket_policy_raise_naming_the_key(
    s3: S3Env, bucket: str, run: Any
) -> None:
    before = listing(s3.client, bucket)
    _deny_deletes(s3, bucket)
    try:
        with pytest.raises(AccessDenied) as refused:
            catalog.delete(f"s3://{bucket}/run/step-1", s3.config())
        assert "run/step-1/.metadata" in str(refused.value) and "AccessDenied" in str(refused.value)
        with pytest.raises(AccessDenied, match="data-"):
            catalog.gc(f"s3://{bucket}/run", timedelta(0), s3.config())
        assert listing(s3.client, bucket) == before
    finally:
        s3.client.delete_bucket_policy(Bucket=bucket)
    assert torch.equal(load(s3, bucket, "run/step-1", run[1])["w"], run[1]["w"])


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_metadata_goes_first_and_a_refused_data_delete_says_so(
    s3: S3Env, bucket: str, run: Any
) -> None:
    _deny_deletes(s3, bucket, "run/step-1/data-*")
    try:
        with pytest.raises(AccessDenied, match="no longer load") as refused:
            catalog.delete(f"s3://{bucket}/run/step-1", s3.config())
        assert "run/step-1/data-" in str(refused.value)
    finally:
        s3.client.delete_bucket_policy(Bucket=bucket)
    left = listing(s3.client, bucket, "run/step-1/")
    assert left and "run/step-1/.metadata" not in left
    with pytest.raises(IncompleteCheckpoint):
        S3Reader(f"s3://{bucket}/run/step-1", config=s3.config()).read_metadata()
    catalog.delete(f"s3://{bucket}/run/step-1", s3.config())  # what the message advises
    assert not listing(s3.client, bucket, "run/step-1/")


class _TwoIdentities(SeaweedFS):
    """SeaweedFS with a second, read-only identity besides the default admin one."""

    def _identities(self) -> dict[str, object]:
        identities = super()._identities()
        reader = {"accessKey": "reader", "secretKey": "reader-secret-key"}
        identities["identities"].append(  # type: ignore[attr-defined]
            {"name": "reader", "credentials": [reader], "actions": ["Read", "List"]}
        )
        return identities


@pytest.fixture(scope="module")
def read_only() -> Iterator[tuple[S3Env, S3Env]]:
    """(admin, read-only) views of one SeaweedFS server."""
    with _TwoIdentities() as server:
        endpoint = server.endpoint
        url = endpoint.endpoint_url
        admin = make_env("seaweedfs", url, endpoint.access_key_id, endpoint.secret_access_key)
        yield admin, make_env("seaweedfs-reader", url, "reader", "reader-secret-key")


def test_deletes_refused_to_a_read_only_identity(read_only: tuple[S3Env, S3Env]) -> None:
    admin, reader = read_only
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    admin.client.create_bucket(Bucket=bucket)
    run = build_run(admin, bucket)
    before = listing(admin.client, bucket)
    url = f"s3://{bucket}/run"
    assert len(catalog.list_checkpoints(url, reader.config())) == 4
    with pytest.raises(AccessDenied) as refused:
        catalog.delete(f"{url}/step-1", reader.config())
    assert "run/step-1/.metadata" in str(refused.value)
    with pytest.raises(AccessDenied, match="data-"):
        catalog.gc(url, timedelta(0), reader.config())
    with pytest.raises(AccessDenied):
        catalog.prune(url, 1, reader.config())
    assert listing(admin.client, bucket) == before
    assert torch.equal(load(admin, bucket, "run/step-1", run[1])["w"], run[1]["w"])
