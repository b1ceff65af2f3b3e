"""The commit protocol: overwrite rules, failed saves, and a commit race, on real servers."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from s3ckpt import CheckpointExists, S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.dcp import commit as commit_module
from s3ckpt.dcp import planning
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.tools.catalog import gc
from tests.helpers import listing, raised, uploads_in_progress

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 2}


def save(s3: Any, bucket: str, prefix: str, state: dict[str, Any], **kwargs: Any) -> None:
    config = s3.config(**SMALL_PARTS)
    dcp.save(state, storage_writer=S3Writer(bucket, prefix, config=config, **kwargs))


def load(
    s3: Any, bucket: str, prefix: str, like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    loaded = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=s3.config()))
    return loaded


def test_saving_over_a_committed_checkpoint_is_refused_before_upload(s3: Any, bucket: str) -> None:
    first = {"w": torch.randn(1000)}
    save(s3, bucket, "ck", first)
    before = listing(s3.client, bucket)
    error = raised(lambda: save(s3, bucket, "ck", {"w": torch.randn(1000)}))
    assert isinstance(error, CheckpointExists)
    assert f"s3://{bucket}/ck" in str(error) and "overwrite=True" in str(error)
    assert listing(s3.client, bucket) == before
    assert torch.equal(load(s3, bucket, "ck", first)["w"], first["w"])


def test_overwrite_replaces_and_deletes_the_old_objects(s3: Any, bucket: str) -> None:
    save(s3, bucket, "ck", {"w": torch.randn(1000)})
    old_data = {k for k in listing(s3.client, bucket) if "/data-" in k}
    second = {"w": torch.randn(1000)}
    save(s3, bucket, "ck", second, overwrite=True)
    keys = set(listing(s3.client, bucket))
    assert not old_data & keys
    assert len([k for k in keys if "/data-" in k]) == len(old_data)
    assert torch.equal(load(s3, bucket, "ck", second)["w"], second["w"])


def test_an_overwrite_function_decides_each_save_of_a_reused_writer(s3: Any, bucket: str) -> None:
    """What the manager relies on: one writer across checkpoints, asked per save (nothing of
    the writer is changed between saves), replaces only where the function says so."""
    old = {"w": torch.randn(1000)}
    for prefix in ("run/a", "run/b"):
        save(s3, bucket, prefix, old)
    asked: list[str] = []

    def replaceable(checkpoint_id: str) -> bool:
        asked.append(checkpoint_id)
        return checkpoint_id.endswith("/a")

    writer = S3Writer(bucket, config=s3.config(), overwrite=replaceable)
    new = {"w": torch.randn(1000)}
    dcp.save(new, checkpoint_id=f"s3://{bucket}/run/a", storage_writer=writer)
    error = raised(lambda: dcp.save(new, checkpoint_id="run/b", storage_writer=writer))
    assert isinstance(error, CheckpointExists) and "run/b" in str(error)
    assert asked == [f"s3://{bucket}/run/a", f"s3://{bucket}/run/b"], "once per save"
    assert torch.equal(load(s3, bucket, "run/a", new)["w"], new["w"])
    assert torch.equal(load(s3, bucket, "run/b", old)["w"], old["w"])


def test_a_save_failing_midway_leaves_the_previous_checkpoint_intact(s3: Any, bucket: str) -> None:
    previous = {"big": torch.randn(6 * MiB), "small": torch.randn(100)}
    save(s3, bucket, "ck", previous)
    before = listing(s3.client, bucket)
    metadata_before = s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read()
    # A meta tensor has no bytes: producing its part raises after other parts went up. The big
    # tensor spans several parts uploaded concurrently, so the failure lands mid-upload.
    failing = {
        "big": torch.randn(6 * MiB),
        "small": torch.randn(100),
        "x": torch.empty(MiB, device="meta"),
    }
    error = raised(
        lambda: save(
            s3, bucket, "ck", failing, overwrite=True, options=WriteOptions(objects_per_rank=2)
        )
    )
    assert "meta" in str(error)
    assert uploads_in_progress(s3.client, bucket) == []
    assert listing(s3.client, bucket) == before
    assert s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read() == metadata_before
    loaded = load(s3, bucket, "ck", previous)
    assert all(torch.equal(loaded[k], previous[k]) for k in previous)


def test_of_two_racing_saves_exactly_one_commits(s3: Any, bucket: str) -> None:
    winner = {"w": torch.full((64,), 1.0)}
    config = s3.config()

    class RacingPlanner(DefaultSavePlanner):
        """Lets another save commit after this one passed its existence check."""

        raced = False

        def resolve_data(self, write_item: WriteItem) -> Any:
            if not self.raced:
                self.raced = True
                dcp.save(winner, storage_writer=S3Writer(bucket, "ck", config=config))
            return super().resolve_data(write_item)

    loser = {"w": torch.full((64,), 2.0)}
    writer = S3Writer(bucket, "ck", config=config)
    error = raised(lambda: dcp.save(loser, storage_writer=writer, planner=RacingPlanner()))
    assert isinstance(error, CheckpointExists)
    assert "No data was deleted" in str(error)
    data = {k.split("/")[1] for k in listing(s3.client, bucket) if "/data-" in k}
    assert len(data) == 2, "the loser's objects wait for gc: its PUT was sent"
    gc(f"s3://{bucket}/ck", timedelta(0), config, break_leases=True)
    data = {k.split("/")[1] for k in listing(s3.client, bucket) if "/data-" in k}
    assert len(data) == 1, "gc judges them by the record: the loser's go"
    assert torch.equal(load(s3, bucket, "ck", winner)["w"], winner["w"])


def test_dcp_plan_caching_never_touches_a_committed_checkpoint(s3: Any, bucket: str) -> None:
    """Torch's cached plans carry an earlier save's id: the writer refuses them before any upload,
    so the committed checkpoint's objects are neither rewritten nor deleted."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    for cache in planning._CACHES:  # torch's cache is per class: drop earlier tests' plans
        cache.pop(type(planner).__name__, None)
    writer = S3Writer(bucket, "ck", config=s3.config(), overwrite=True)
    first = {"w": torch.full((1000,), 1.0)}
    dcp.save(first, storage_writer=writer, planner=planner)
    before = listing(s3.client, bucket)
    second = {"w": torch.full((1000,), 2.0)}
    error = raised(lambda: dcp.save(second, storage_writer=writer, planner=planner))
    assert "CachingSavePlanner" in str(error) and "earlier save" in str(error)
    assert listing(s3.client, bucket) == before
    assert torch.equal(load(s3, bucket, "ck", first)["w"], first["w"])


def test_the_commit_check_lists_a_large_save_in_ranges(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listings of a save directory, one per `_LISTED` keys and each starting after the one
    before, find every object (with strays between them) and miss none that is gone."""
    monkeypatch.setattr(commit_module, "_LISTED", 10)
    keys = [f"ck/data-{'a' * 24}/{rank:05d}-{i:03d}-abcdef" for rank in range(9) for i in range(4)]
    strays = [f"ck/data-{'a' * 24}/.lease", f"ck/data-{'a' * 24}/00004-000-zzzzzz"]
    for key in keys + strays:
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"xy")
    store = get_store(s3.config())
    expected = dict.fromkeys(keys, 2)
    assert bridge.run(commit_module._changed(store, bucket, expected)) == []
    s3.client.delete_object(Bucket=bucket, Key=keys[25])
    changed = bridge.run(commit_module._changed(store, bucket, expected | {keys[3]: 3}))
    assert changed == [(keys[3], 3, 2), (keys[25], 2, None)]
