"""The direct DCP path's errors read as s3ckpt's: ``S3Reader.check(state_dict)`` names a state
that does not fit the checkpoint, and a failed metadata read is not preceded by torch's
"Falling back to rank local metadata" traceback."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader, S3Writer, StateDictMismatch

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


def saved(s3: Any, bucket: str) -> S3Reader:
    state = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
    dcp.save(
        state,
        checkpoint_id=f"s3://{bucket}/ckpt",
        storage_writer=S3Writer(bucket, config=s3.config()),
    )
    return S3Reader(bucket, "ckpt", config=s3.config())


def test_check_names_each_key_that_does_not_fit(s3: Any, bucket: str) -> None:
    reader = saved(s3, bucket)
    reader.check({"w": torch.zeros(4, 3), "b": torch.zeros(3)})
    with pytest.raises(StateDictMismatch) as info:
        reader.check({"w": torch.zeros(5, 3), "b": torch.zeros(3), "extra": torch.zeros(1)})
    assert info.value.mismatches == [
        "extra: not in the checkpoint",
        "w: saved with shape (4, 3), loading into (5, 3)",
    ]
    assert f"s3://{bucket}/ckpt" in str(info.value) and "partial=True" in str(info.value)
    with pytest.raises(StateDictMismatch, match="w: saved with shape"):
        reader.check({"w": torch.zeros(5, 3), "extra": torch.zeros(1)}, partial=True)
    reader.check({"w": torch.zeros(4, 3), "extra": torch.zeros(1)}, partial=True)


def test_a_failed_metadata_read_logs_no_torch_traceback(
    s3: Any, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    reader = S3Reader(bucket, "nothing-here", config=s3.config())
    with caplog.at_level(logging.WARNING), pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(1)}, storage_reader=reader, no_dist=True)
    assert "nothing-here" in str(info.value)  # s3ckpt's message, inside DCP's wrapping
    assert not [r for r in caplog.records if "Falling back" in r.getMessage()], caplog.text
