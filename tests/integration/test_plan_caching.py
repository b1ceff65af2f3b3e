"""Repeated saves with `CachingSavePlanner`: each save its own directory, and a state whose
structure changed between saves planned afresh, never from the cached plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner

from s3ckpt import CheckpointManager, S3Reader, S3Writer, SavePolicy
from s3ckpt.dcp.planning import CachingSavePlanner
from s3ckpt.format import layout
from tests.helpers import listing

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


def load(s3: Any, bucket: str, prefix: str, like: dict[str, Any]) -> dict[str, Any]:
    loaded = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()
    }
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=s3.config()))
    return loaded


def assert_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def save_dirs(s3: Any, bucket: str, prefix: str) -> set[str]:
    return {layout.save_dir(k) for k in listing(s3.client, bucket, f"{prefix}/data-")}


@pytest.fixture
def planner() -> Any:
    planner = CachingSavePlanner()
    yield planner
    planner.forget()


def test_an_unchanged_state_reuses_the_plan_and_still_saves_afresh(
    s3: Any, bucket: str, planner: CachingSavePlanner
) -> None:
    writer = S3Writer(bucket, "ck", config=s3.config(), overwrite=True)
    for value in (1.0, 2.0, 3.0):
        state = {"w": torch.full((1000,), value), "step": int(value)}
        dcp.save(state, storage_writer=writer, planner=planner)
        assert_equal(load(s3, bucket, "ck", state), state)
    assert planner._cached_plans_key in SavePlanner._cached_final_save_plan, "the cache was used"
    assert len(save_dirs(s3, bucket, "ck")) == 1, "each save in its own directory, old ones gone"


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s | {"new": torch.arange(5)},  # a new key
        lambda s: {k: v for k, v in s.items() if k != "b"},  # a key gone
        lambda s: s | {"w": s["w"].to(torch.float64)},  # a dtype: torch's check misses it
        lambda s: s | {"w": torch.ones(2000)},  # a shape
    ],
    ids=["new-key", "key-gone", "dtype", "shape"],
)
def test_a_state_whose_structure_changed_is_planned_afresh(
    s3: Any, bucket: str, planner: CachingSavePlanner, change: Any
) -> None:
    writer = S3Writer(bucket, "ck", config=s3.config(), overwrite=True)
    first = {"w": torch.full((1000,), 1.0), "b": torch.arange(7)}
    dcp.save(first, storage_writer=writer, planner=planner)
    dcp.save(first, storage_writer=writer, planner=planner)  # cached from here on
    changed = change({k: v.clone() for k, v in first.items()})
    dcp.save(changed, storage_writer=writer, planner=planner)
    assert_equal(load(s3, bucket, "ck", changed), changed)
    dcp.save(changed, storage_writer=writer, planner=planner)  # and cached again
    assert_equal(load(s3, bucket, "ck", changed), changed)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_repeated_manager_saves_load_when_the_state_changes(
    s3: Any, bucket: str, sync: bool
) -> None:
    saving = SavePolicy(sync=sync)
    with CheckpointManager(f"s3://{bucket}/run", saving=saving, config=s3.config()) as mgr:
        states = []
        for step in range(4):
            state: dict[str, Any] = {"w": torch.full((500,), float(step)), "step": step}
            if step >= 2:
                state["extra"] = torch.arange(step)  # a new key, then a new shape
            mgr.save(step, state)
            states.append(state)
        for step, state in enumerate(states):
            like = {
                k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
                for k, v in state.items()
            }
            assert mgr.restore(like, step=step) == step
            assert_equal(like, state)
        dirs = {layout.save_dir(k) for k in listing(s3.client, bucket, "run/") if "/data-" in k}
        assert len(dirs) == 4, "every save wrote its own directory"
