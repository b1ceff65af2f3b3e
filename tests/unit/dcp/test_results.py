"""`RankResults`: one rank's write results as columns, as DCP pickles them to the coordinator."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from s3ckpt.dcp.results import RankResults, Stored
from s3ckpt.format.record import Locator


def filled() -> RankResults:
    results = RankResults()
    results.add(MetadataIndex("a", [0, 0]), Locator("data-x/00000-000-aa", 0, 64))
    results.add(MetadataIndex("b", [4]), Locator("data-x/00000-001-aa", 0, 8), "f" * 32)
    results.add(MetadataIndex("step"), Locator("data-x/00000-000-aa", 64, 5))
    return results


def test_the_coordinator_reads_back_every_item_where_it_is() -> None:
    back = pickle.loads(pickle.dumps(filled()))
    assert list(back.located()) == [
        ("a", (0, 0), "data-x/00000-000-aa", 0, 64, None),
        ("b", (4,), "data-x/00000-001-aa", 0, 8, "f" * 32),
        ("step", None, "data-x/00000-000-aa", 64, 5, None),
    ]
    assert back.keys == ["data-x/00000-000-aa", "data-x/00000-001-aa"], "each key stored once"


def test_items_added_after_unpickling_reuse_the_keys() -> None:
    back = pickle.loads(pickle.dumps(filled()))
    back.add(MetadataIndex("c", [1]), Locator("data-x/00000-001-aa", 8, 8))
    assert len(back.keys) == 2 and list(back.located())[-1][2] == "data-x/00000-001-aa"


def test_it_is_a_sequence_of_write_results() -> None:
    results = filled()
    assert len(results) == 3
    second = results[1]
    assert second.index == MetadataIndex("b", torch.Size([4])) and second.size_in_bytes == 8
    assert second.storage_data == Stored(Locator("data-x/00000-001-aa", 0, 8), "f" * 32)
    assert [r.index.fqn for r in results[::2]] == ["a", "step"]


def test_pickled_it_is_smaller_than_write_results() -> None:
    results = RankResults()
    for i in range(1000):
        results.add(MetadataIndex(f"layer.{i}.weight", [i * 16, 0]), Locator("k", i * 64, 64))
    columns, objects = len(pickle.dumps(results)), len(pickle.dumps(list(results)))
    assert columns * 2 < objects
