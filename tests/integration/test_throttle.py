"""A store that admits a fixed request rate (AWS S3 per key prefix) and answers SlowDown beyond:
a save and a load of many objects run near that rate instead of drawing a storm of refusals.

A `RateLimit` proxy admits 20 requests a second. Without the adaptive limits
(``adapt_to_throttling=False``: backoff alone) most of what is sent is refused (measured, moto
and SeaweedFS alike: 58-59% of the save's requests, 68-70% of the load's); with them 9-22% and
2-3% (7 runs on a quiet box), mostly the requests in flight when the first refusal comes back and
one per probe above the rate. Counted, not timed; but the proxy is a thread of this process, so
a busy box bunches the arrivals it rates (27% of a save once on CI, on moto): the bound leaves
room for that and still tells the adaptive limits from backoff alone. SeaweedFS alone: the
limits are the client's and the refusals the proxy's, whatever store is behind them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.engine.store import get_store
from s3ckpt.testing.faultproxy import FaultProxy, RateLimit
from tests.integration.test_faults import assert_equal, zeros

OBJECTS = 48
RATE = 20.0
# The save's first requests outrun a few tokens however slowly a loaded machine compresses (a
# second's worth it did not always outrun); the load, paced at the rate the save learned, is
# admitted at half of it.
BURST = 4
LOAD_RATE = RATE / 2
BOUND = 0.4  # refused / received, for the save and for the load

pytestmark = pytest.mark.stores("seaweedfs")


def many_objects() -> dict[str, torch.Tensor]:
    """An object each (objects are at least ``part_size``, 5 MiB), compressing to a few KiB: a
    save of many requests that moves few bytes, so that the rate is what bounds it."""
    return {f"w{i:02d}": torch.full((5 * MiB // 4,), float(i)) for i in range(OBJECTS)}


def test_a_save_and_a_load_through_a_rate_limited_store_are_mostly_admitted(
    s3: Any, bucket: str
) -> None:
    saved = many_objects()
    with FaultProxy(s3.endpoint_url) as proxy:
        config = s3.config(endpoint_url=proxy.endpoint_url, part_size=5 * MiB)
        limit = proxy.add_rule(RateLimit(RATE, burst=BURST))
        options = WriteOptions(objects_per_rank=OBJECTS, compression="zstd")
        writer = S3Writer(bucket, "ck", config=config, options=options)
        dcp.save(saved, storage_writer=writer)
        save_received, save_refused = limit.matched, limit.fired
        assert proxy.requests["PutObject"] >= OBJECTS, "one PUT per object"
        proxy.remove_rule(limit)
        limit = proxy.add_rule(RateLimit(LOAD_RATE))
        loaded = zeros(saved)
        dcp.load(loaded, storage_reader=S3Reader(bucket, "ck", config=config))
        load_received, load_refused = limit.matched, limit.fired
    assert_equal(loaded, saved)
    assert save_refused and load_refused, "the rate was exceeded: the test tests something"
    assert save_refused / save_received <= BOUND, (save_refused, save_received)
    assert load_refused / load_received <= BOUND, (load_refused, load_received)
    assert get_store(config).stats.throttled == save_refused + load_refused
