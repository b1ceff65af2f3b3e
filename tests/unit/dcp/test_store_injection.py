"""A store passed in (``store=``) is the one the adapters use: a wrapper sees every call."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader, S3Writer
from s3ckpt.engine import bridge
from s3ckpt.engine.memory import MemoryStore
from s3ckpt.errors import ConfigError


class Counting:
    """Any `ObjectStore` can be wrapped: this one counts the calls it forwards."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if callable(attribute):
            self.calls[name] = self.calls.get(name, 0) + 1
        return attribute


def test_a_wrapped_store_carries_a_save_and_a_load() -> None:
    inner = MemoryStore(name="injected")
    bridge.run(inner.create_bucket("b"))
    store: Any = Counting(inner)
    saved = {"w": torch.arange(1000.0), "step": 3}
    dcp.save(saved, storage_writer=S3Writer("b", "run/step-3", store=store))
    assert "run/step-3/.metadata" in inner.objects("b")
    assert store.calls.get("upload", 0) >= 1 and store.calls.get("put", 0) >= 1
    loaded = {"w": torch.zeros(1000), "step": 0}
    dcp.load(loaded, storage_reader=S3Reader("b", "run/step-3", store=store))
    assert torch.equal(loaded["w"], saved["w"]) and loaded["step"] == 3
    assert store.calls.get("get", 0) >= 1


def test_a_given_store_does_not_travel_to_another_process() -> None:
    writer = S3Writer("b", "ck", store=MemoryStore(name="local"))
    assert writer.config.endpoint_url == "memory://local"
    copy = pickle.loads(pickle.dumps(writer))  # as a PROCESS-mode checkpointer receives it
    with pytest.raises(ConfigError, match="works only in the process that made it"):
        copy._store  # noqa: B018  (resolving the store is what refuses)
