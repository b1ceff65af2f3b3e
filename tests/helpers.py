"""Small helpers shared by the integration tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException


def raised(call: Callable[[], Any]) -> BaseException:
    """Run ``call``; return the s3ckpt-level error, unwrapping DCP's CheckpointException."""
    with pytest.raises(BaseException) as info:  # DCP wraps failures in a BaseException
        call()
    error = info.value
    if isinstance(error, CheckpointException):
        (error, _trace), *_ = error.failures.values()
    return error


def listing(client: Any, bucket: str, prefix: str = "") -> dict[str, int]:
    """``key -> size`` of every object under ``prefix``, through the backdoor client."""
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return found


def uploads_in_progress(client: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
