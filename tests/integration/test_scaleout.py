"""Scale-out options: keys spread over many key ranges, and several endpoints for one store."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Config, S3Reader, S3Writer, WriteOptions
from s3ckpt.testing.faultproxy import FaultProxy, ResetBefore
from s3ckpt.tools.catalog import gc
from tests.helpers import listing


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {f"w{i}": torch.randn(768 * 1024, generator=generator) for i in range(8)}  # 24 MiB


def round_trip(config: S3Config, url: str, **writer: Any) -> None:
    saved = state()
    dcp.save(saved, storage_writer=S3Writer(url, config=config, **writer))
    loaded = {name: torch.zeros_like(t) for name, t in saved.items()}
    dcp.load(loaded, storage_reader=S3Reader(url, config=config))
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_spread_keys_put_a_hash_first_and_everything_else_still_works(s3: Any, bucket: str) -> None:
    config = s3.config(part_size=5 * 1024 * 1024, multipart_threshold=5 * 1024 * 1024)
    round_trip(
        config, f"s3://{bucket}/ck", options=WriteOptions(spread_keys=True, objects_per_rank=4)
    )
    data = [key for key in listing(s3.client, bucket) if "/data-" in key]
    assert len(data) == 4
    assert all(
        re.fullmatch(r"ck/data-[0-9a-f]{24}/[0-9a-f]{2}/00000-00\d-[0-9a-f]{6}", k) for k in data
    )
    assert len({k.split("/")[2] for k in data}) > 1, "the hash spreads the names"
    report = gc(f"s3://{bucket}/ck", older_than=timedelta(0), config=s3.config())
    assert not report.deleted and set(data) <= set(listing(s3.client, bucket))


def test_requests_rotate_over_several_endpoints(s3: Any, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as first, FaultProxy(s3.endpoint_url) as second:
        config = s3.config(endpoint_url=[first.endpoint_url, second.endpoint_url])
        assert config.resolve({}).endpoint_name == f"{first.endpoint_url}, {second.endpoint_url}"
        round_trip(config, f"s3://{bucket}/two")
        assert sum(first.requests.values()) > 3 and sum(second.requests.values()) > 3


def test_a_dead_endpoint_is_survived_by_retrying_on_another(s3: Any, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as good, FaultProxy(s3.endpoint_url) as dead:
        dead.add_rule(ResetBefore())
        config = s3.config(endpoint_url=[good.endpoint_url, dead.endpoint_url], max_attempts=6)
        round_trip(config, f"s3://{bucket}/failover")
        assert dead.faults and sum(good.requests.values()) > 3
