"""A load's reads run with the cyclic collector paused (a full pass over the state dict and the
plan cost a load of many small tensors a tenth of its time), and it is on again when the load
returns, whether it succeeded or not."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader, S3Writer
from s3ckpt.engine import bridge
from s3ckpt.engine.memory import MemoryStore
from s3ckpt.errors import StorageError


class Watching:
    """Forwards every call; notes whether the collector was on during each ranged read, and
    fails them if told to."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.collecting: list[bool] = []
        self.fail = False

    async def read_range(self, *args: Any, **kwargs: Any) -> Any:
        self.collecting.append(gc.isenabled())
        if self.fail:
            raise StorageError("refused for the test", code="Test")
        return await self.inner.read_range(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_reads_run_with_the_collector_paused_and_it_is_on_again_after() -> None:
    inner = MemoryStore(name="collector")
    bridge.run(inner.create_bucket("b"))
    store: Any = Watching(inner)
    saved = {f"t{i}": torch.full((100,), float(i)) for i in range(50)}
    dcp.save(saved, storage_writer=S3Writer("b", "ck", store=store))
    assert gc.isenabled()

    loaded = {name: torch.zeros(100) for name in saved}
    dcp.load(loaded, storage_reader=S3Reader("b", "ck", store=store))
    assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    assert store.collecting and not any(store.collecting)
    assert gc.isenabled()

    store.fail = True
    with pytest.raises(BaseException, match="refused for the test"):
        dcp.load(loaded, storage_reader=S3Reader("b", "ck", store=store))
    assert gc.isenabled()
