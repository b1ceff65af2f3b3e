"""The commit under ambiguity: lost answers, unknown outcomes, objects that vanish before the
commit, and loads that race a replacing save (`s3ckpt.testing.faultproxy` between s3ckpt and a
server)."""

from __future__ import annotations

import json
import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from s3ckpt import (
    AccessDenied,
    CheckpointReplaced,
    CommitOutcomeUnknown,
    IncompleteCheckpoint,
    MetadataError,
    S3Reader,
    S3Writer,
    WriteOptions,
)
from s3ckpt.config import MiB
from s3ckpt.testing.faultproxy import Delay, FaultProxy, LateApply, ResetAfter, Status
from s3ckpt.tools.catalog import gc
from tests.helpers import listing, raised, uploads_in_progress

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 4}


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * MiB, generator=generator),  # 12 MiB: a multipart upload
        "small": torch.randn(1000, generator=generator),
    }


def load(bucket: str, prefix: str, like: dict[str, torch.Tensor], config: Any) -> dict[str, Any]:
    loaded = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=config))
    return loaded


def assert_loads(s3: Any, bucket: str, prefix: str, saved: dict[str, torch.Tensor]) -> None:
    loaded = load(bucket, prefix, saved, s3.config())
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def data_keys(s3: Any, bucket: str, prefix: str = "ck/") -> set[str]:
    return {k for k in listing(s3.client, bucket, prefix) if "/data-" in f"/{k}"}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    "lost", [ResetAfter(), Delay(2.0, "response")], ids=["reset-after", "slower-than-timeout"]
)
def test_a_commit_whose_every_answer_is_lost_is_read_back_not_destroyed(
    s3: Any, bucket: str, overwrite: bool, lost: Any
) -> None:
    """The server applies every attempt of the commit PUT; the client never hears back."""
    old = state(0)
    dcp.save(old, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    old_keys = data_keys(s3, bucket)
    new = state(1)
    prefix = "ck" if overwrite else "fresh"
    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(lost, op="PutObject", key=".metadata")
        config = s3.config(
            endpoint_url=proxy.endpoint_url, read_timeout=1.0, retry_timeout=4.0, **SMALL_PARTS
        )
        writer = S3Writer(bucket, prefix, config=config, overwrite=overwrite)
        dcp.save(new, storage_writer=writer)
        # Read back after the first lost answer, not resent for the whole retry window (aiohttp
        # itself may resend a PUT once on a reset reused connection).
        assert 1 <= rule.fired <= 2
    assert_loads(s3, bucket, prefix, new)
    if overwrite:  # the replaced checkpoint's objects go only once the commit is certain
        assert not old_keys & data_keys(s3, bucket)
    else:
        assert_loads(s3, bucket, "ck", old)


def test_an_unknown_outcome_deletes_nothing_and_says_how_to_check(s3: Any, bucket: str) -> None:
    saved = state(2)
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(ResetAfter(), op="PutObject", key=".metadata")
        proxy.add_rule(Status(500, "InternalError"), op="GetObject", key=".metadata")
        config = s3.config(endpoint_url=proxy.endpoint_url, retry_timeout=2.0, **SMALL_PARTS)
        error = raised(
            lambda: dcp.save(saved, storage_writer=S3Writer(bucket, "ck", config=config))
        )
    assert isinstance(error, CommitOutcomeUnknown), error
    assert "outcome is unknown" in str(error) and "s3ckpt info s3://" in str(error)
    assert error.save_id in str(error)
    assert pickle.loads(pickle.dumps(error)).save_id == error.save_id
    # The PUT did land: deleting the data would have left a record pointing at nothing.
    assert_loads(s3, bucket, "ck", saved)
    assert uploads_in_progress(s3.client, bucket) == []


def test_a_commit_refused_outright_deletes_nothing_and_leaves_it_to_gc(
    s3: Any, bucket: str
) -> None:
    """Even a 403 may come from a balancer that forwarded the PUT: the error class of one
    answer never decides that data is unreferenced; gc does, by the records."""
    with FaultProxy(s3.endpoint_url) as proxy:
        proxy.add_rule(Status(403, "AccessDenied"), op="PutObject", key=".metadata")
        config = s3.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        writer = S3Writer(bucket, "ck", config=config)
        error = raised(lambda: dcp.save(state(3), storage_writer=writer))
    assert isinstance(error, AccessDenied), error
    assert "not committed" in str(error) and "No data was deleted" in str(error)
    left = listing(s3.client, bucket)
    assert len(left) == 3 and any(k.endswith(".lease") for k in left)  # 2 objects, the lease
    report = gc(f"s3://{bucket}/ck", older_than=timedelta(0), config=s3.config())
    assert report.deleted == () and len(report.skipped) == 3  # the lease is left to expire
    gc(f"s3://{bucket}/ck", older_than=timedelta(0), config=s3.config(), break_leases=True)
    assert listing(s3.client, bucket) == {}


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_503_that_the_store_applies_later_loses_no_checkpoint(
    s3: Any, bucket: str, overwrite: bool
) -> None:
    """A balancer answers 503 to every commit PUT it forwards, and the store applies them
    seconds later: the save fails, deletes nothing, and its record lands on data that is
    there; gc, however eager, keeps it (its lease first, then its record)."""
    old, new = state(8), state(9)
    dcp.save(old, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    prefix = "ck" if overwrite else "fresh"
    with FaultProxy(s3.endpoint_url) as proxy:
        late = LateApply(Status(503, "SlowDown"), 4.0)
        rule = proxy.add_rule(late, op="PutObject", key=f"{prefix}/.metadata")
        config = s3.config(
            endpoint_url=proxy.endpoint_url, read_timeout=1.0, retry_timeout=1.5, **SMALL_PARTS
        )
        writer = S3Writer(bucket, prefix, config=config, overwrite=overwrite)
        error = raised(lambda: dcp.save(new, storage_writer=writer))
        assert isinstance(error, CommitOutcomeUnknown), error
        assert "No data was deleted" in str(error) and rule.fired >= 1
        report = gc(f"s3://{bucket}", older_than=timedelta(0), config=s3.config())
        assert not report.deleted or not overwrite  # (without: the failed save's parent run)
        assert not data_keys(s3, bucket, f"{prefix}/") & set(report.deleted)
        deadline = time.monotonic() + 30.0
        while committed_save(s3, bucket, prefix) != error.save_id:
            assert time.monotonic() < deadline, "the late PUT never landed"
            time.sleep(0.2)
    gc(f"s3://{bucket}", older_than=timedelta(0), config=s3.config(), break_leases=True)
    assert_loads(s3, bucket, prefix, new)
    if not overwrite:
        assert_loads(s3, bucket, "ck", old)


def committed_save(s3: Any, bucket: str, prefix: str) -> str | None:
    try:
        raw = s3.client.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    except s3.client.exceptions.NoSuchKey:
        return None
    return str(json.loads(raw)["save_id"])


@pytest.mark.parametrize("overwrite", [False, True])
def test_objects_deleted_while_the_commit_was_in_flight_fail_the_save(
    s3: Any, bucket: str, overwrite: bool
) -> None:
    """A removal that took the save for dead (its lease refreshes stalled past the TTL; here gc
    breaking its lease) deletes its objects while the commit PUT is held back: the save must
    not report success for a checkpoint that does not load, and a record it replaced comes
    back."""
    old = state(11)
    if overwrite:
        dcp.save(old, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    with FaultProxy(s3.endpoint_url) as proxy:
        collected_all = threading.Event()  # the commit PUT is held until gc has run
        held = proxy.add_rule(Delay(20.0, until=collected_all), op="PutObject", key="ck/.metadata")
        config = s3.config(endpoint_url=proxy.endpoint_url, read_timeout=30.0, **SMALL_PARTS)
        collected: list[Any] = []

        def collect_when_held() -> None:
            deadline = time.monotonic() + 30.0
            while held.fired == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            url = f"s3://{bucket}/ck"
            try:
                collected.append(gc(url, timedelta(0), s3.config(), break_leases=True))
            finally:
                collected_all.set()

        thread = threading.Thread(target=collect_when_held)
        thread.start()
        writer = S3Writer(bucket, "ck", config=config, overwrite=overwrite)
        error = raised(lambda: dcp.save(state(10), storage_writer=writer))
        thread.join()
    assert collected and len(collected[0].deleted) >= 2
    assert isinstance(error, IncompleteCheckpoint), error
    assert "withdrawn after the commit" in str(error) and "lapsed" in str(error)
    if overwrite:
        assert_loads(s3, bucket, "ck", old)
    else:
        assert "ck/.metadata" not in listing(s3.client, bucket)  # no record over missing data


class _Vanishing(S3Writer):
    """Deletes one uploaded object behind the writer's back before the commit, as a removal
    racing the save would."""

    def __init__(self, *args: Any, client: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client = client

    def __getstate__(self) -> dict[str, Any]:
        raise AssertionError("single process only")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        victim = sorted(k for k in data_keys_of(self.client, self.location.bucket) if "0-" in k)
        self.client.delete_object(Bucket=self.location.bucket, Key=victim[0])
        super().finish(metadata, results)


def data_keys_of(client: Any, bucket: str) -> list[str]:
    return [k for k in listing(client, bucket, "ck/data-") if not k.endswith(".lease")]


def test_a_commit_never_references_an_object_that_is_not_there(s3: Any, bucket: str) -> None:
    saved = state(4)
    with FaultProxy(s3.endpoint_url) as proxy:
        config = s3.config(endpoint_url=proxy.endpoint_url, **SMALL_PARTS)
        dcp.save(
            saved,
            storage_writer=S3Writer(
                bucket, "ok", config=config, options=WriteOptions(objects_per_rank=2)
            ),
        )
        objects = [k for k in listing(s3.client, bucket, "ok/") if "/data-" in k]
        # The save's directory listed before the commit and after it, no HEAD per object.
        assert len(objects) == 2 and proxy.requests["HeadObject"] == 1  # (the .metadata's)
        assert proxy.requests["ListObjectsV2"] == 2
        writer = _Vanishing(
            bucket, "ck", config=config, client=s3.client, options=WriteOptions(objects_per_rank=2)
        )
        error = raised(lambda: dcp.save(saved, storage_writer=writer))
    assert isinstance(error, IncompleteCheckpoint), error
    assert "not committed" in str(error) and "is missing" in str(error)
    assert listing(s3.client, bucket, "ck/") == {}  # no record, and the rest of the save is gone
    assert_loads(s3, bucket, "ok", saved)


class _RacedReader(S3Reader):
    """Lets a replacing save commit after the load read the record, before it reads data."""

    def __init__(self, *args: Any, replace: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replace = replace

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.replace()
        return super().read_data(plan, planner)


def test_a_load_that_races_an_overwrite_says_the_checkpoint_was_replaced(
    s3: Any, bucket: str
) -> None:
    first, second = state(5), state(6)
    config = s3.config()
    dcp.save(first, storage_writer=S3Writer(bucket, "ck", config=config))
    began = S3Reader(bucket, "ck", config=config)
    began.read_metadata()

    def replace() -> None:
        dcp.save(second, storage_writer=S3Writer(bucket, "ck", config=config, overwrite=True))

    loaded = {k: torch.zeros_like(v) for k, v in first.items()}
    reader = _RacedReader(bucket, "ck", config=config, replace=replace)
    error = raised(lambda: dcp.load(loaded, storage_reader=reader))
    assert isinstance(error, CheckpointReplaced), error
    now = S3Reader(bucket, "ck", config=config)
    now.read_metadata()
    assert began.checkpoint is not None and now.checkpoint is not None
    assert error.save_id == began.checkpoint.save_id
    assert error.new_save_id == now.checkpoint.save_id != error.save_id
    assert error.save_id in str(error) and error.new_save_id in str(error)
    assert_loads(s3, bucket, "ck", second)  # loading again reads the new record


def test_a_record_readers_would_refuse_is_never_committed(s3: Any, bucket: str) -> None:
    config = s3.config(max_record_size=200)
    error = raised(lambda: dcp.save(state(7), storage_writer=S3Writer(bucket, "ck", config=config)))
    assert isinstance(error, MetadataError), error
    assert "not committed" in str(error) and "max_record_size" in str(error)
    assert listing(s3.client, bucket) == {}
