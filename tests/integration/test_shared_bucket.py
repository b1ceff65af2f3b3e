"""A bucket shared with datasets and logs: removals and overwrites touch only what s3ckpt's writer
names (`layout.save_of`), whatever a directory is called or a record lists."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointNotFound, S3Reader, S3Writer
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.record import decode
from s3ckpt.tools.catalog import delete, gc
from tests.helpers import listing
from tests.recordshapes import inline

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

# Someone else's files: in directories that start with "data-", and one inside a committed
# checkpoint's folder.
FOREIGN = [
    "datasets/data-2024/train.csv",
    "logs/data-eval/results.json",
    "data-raw/a.bin",
    "run/step-1/data-notes/README",
    "run/step-1/data-0123456789abcdef01234567/notes.txt",
]
DEAD = "run/step-1/data-deaddeaddeaddeaddeaddead/00000-000"  # a failed save's object: s3ckpt's


def plant(s3: Any, bucket: str) -> dict[str, torch.Tensor]:
    saved = {"w": torch.arange(10.0)}
    dcp.save(saved, storage_writer=S3Writer(bucket, "run/step-1", config=s3.config()))
    for key in [*FOREIGN, DEAD]:
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"not a checkpoint")
    return saved


def loads(s3: Any, bucket: str, prefix: str, saved: dict[str, torch.Tensor]) -> bool:
    loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=s3.config()))
    return all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_gc_of_a_shared_bucket_deletes_only_s3ckpts_leftovers(s3: Any, bucket: str) -> None:
    saved = plant(s3, bucket)
    report = gc(f"s3://{bucket}", older_than=timedelta(0), config=s3.config())
    assert report.deleted == ()
    # data-raw/ is no save's directory, so the root holds no checkpoint to collect.
    assert sorted(report.left_alone) == sorted(FOREIGN[:2])
    report = gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert report.deleted == (DEAD,)
    assert sorted(report.left_alone) == sorted(FOREIGN[3:])
    stored = listing(s3.client, bucket)
    assert all(key in stored for key in FOREIGN)
    assert DEAD not in stored
    assert loads(s3, bucket, "run/step-1", saved)


def test_gc_says_what_it_left_alone(s3: Any, bucket: str, cli: Any) -> None:
    plant(s3, bucket)
    code, out, _ = cli("gc", f"s3://{bucket}/run", "--older-than", "0", "--yes")
    assert code == 0, out
    assert "1 objects (" in out and "2 objects left alone" in out, out
    assert "not written by s3ckpt" in out
    code, out, _ = cli("--json", "gc", f"s3://{bucket}/run", "--older-than", "0", "--yes")
    assert sorted(json.loads(out)["left_alone"]) == sorted(FOREIGN[3:])


def test_rm_deletes_the_checkpoint_and_leaves_files_in_its_folder(s3: Any, bucket: str) -> None:
    plant(s3, bucket)
    removal = delete(f"s3://{bucket}/run/step-1", s3.config())
    assert "run/step-1/.metadata" in removal.deleted and DEAD in removal.deleted
    assert sorted(removal.left_alone) == sorted(FOREIGN[3:])
    assert sorted(listing(s3.client, bucket, "run/")) == sorted(FOREIGN[3:])
    with pytest.raises(CheckpointNotFound, match="not s3ckpt's and were left alone"):
        delete(f"s3://{bucket}/run/step-1", s3.config())
    with pytest.raises(CheckpointNotFound):
        delete(f"s3://{bucket}/datasets", s3.config())
    assert sorted(listing(s3.client, bucket)) == sorted(FOREIGN)


def test_an_overwrite_deletes_only_the_old_saves_data_objects(s3: Any, bucket: str) -> None:
    """A record listing other keys (crafted, or damaged) does not make an overwrite delete
    them: only data objects by the writer's naming are the old checkpoint's to delete."""
    plant(s3, bucket)
    for key in ("run/step-1/nested/.metadata", "run/step-1/notes.txt"):
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"x")
    raw = s3.client.get_object(Bucket=bucket, Key="run/step-1/.metadata")["Body"].read()
    record = json.loads(inline(raw))  # the shape of versions 1-2, which lists bytes inline
    old = sorted(record["objects"])
    for n, key in enumerate(("nested/.metadata", "notes.txt", "data-notes/README")):
        record["objects"][key] = 1
        record["frames"][key] = FrameTable.raw(1024, [0], 1).to_json()
        # Each object a record lists holds an item of it; a bytes item each here.
        locator = {"key": key, "offset": 0, "length": 1}
        record["state_dict"][f"crafted{n}"] = {"type": "bytes", "locator": locator}
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    assert "nested/.metadata" in decode(body, url="crafted").objects  # a record s3ckpt reads
    s3.client.put_object(Bucket=bucket, Key="run/step-1/.metadata", Body=body)
    new = {"w": torch.arange(10.0) * 2}
    writer = S3Writer(bucket, "run/step-1", config=s3.config(), overwrite=True)
    dcp.save(new, storage_writer=writer)
    stored = listing(s3.client, bucket, "run/step-1/")
    assert "run/step-1/nested/.metadata" in stored and "run/step-1/notes.txt" in stored
    assert "run/step-1/data-notes/README" in stored
    assert not any(f"run/step-1/{key}" in stored for key in old)  # the old data objects went
    assert loads(s3, bucket, "run/step-1", new)
