"""Key layout: data keys (spread or not), leases, and reading the save and rank back. No server."""

from __future__ import annotations

import re

import pytest

from s3ckpt.format.layout import data_key, is_lease, lease_key, rank_of, save_of, spread_digits


def test_spread_width_grows_with_the_number_of_objects() -> None:
    assert [spread_digits(n) for n in (1, 256, 257, 4096, 4097, 10**9)] == [2, 2, 3, 3, 4, 4]
    assert data_key("id", 3, 1) == "data-id/00003-001"
    assert re.fullmatch(r"data-id/[0-9a-f]{3}/00003-001", data_key("id", 3, 1, spread=3))


def test_the_rank_is_read_back_from_every_data_key_form() -> None:
    assert rank_of(data_key("id", 3, 1)) == 3
    assert rank_of(data_key("id", 3, 1, spread=3, nonce="ab12cd")) == 3
    assert rank_of(data_key("id", 12, 0, spread=2)) == 12
    assert rank_of(".metadata") is None and rank_of("data-id/notes.txt") is None


@pytest.mark.parametrize(
    ("spread", "nonce"), [(0, ""), (0, "ab12cd"), (2, ""), (3, "ab12cd"), (4, "0f")]
)
def test_the_save_and_rank_are_read_back_from_a_data_key(spread: int, nonce: str) -> None:
    key = data_key("5e1f00d", 17, 2, spread=spread, nonce=nonce)
    assert save_of(key) == "5e1f00d"
    assert rank_of(key) == 17
    assert not is_lease(key)


def test_a_lease_belongs_to_its_save_and_no_rank() -> None:
    key = lease_key("5e1f00d")
    assert key == "data-5e1f00d/.lease"
    assert save_of(key) == "5e1f00d"
    assert rank_of(key) is None
    assert is_lease(key)
    assert is_lease(f"ckpt/step-1/{key}"), "also under a checkpoint prefix"


@pytest.mark.parametrize("key", [".metadata", "data-x", "other/obj", "", "data-/00001-000"])
def test_keys_that_are_not_a_saves_have_no_save_or_rank(key: str) -> None:
    assert save_of(key) is None
    assert rank_of(key) is None
    assert not is_lease(key)


def test_another_rank_or_save_reads_back_differently() -> None:
    assert rank_of(data_key("a", 0, 0)) == 0
    assert rank_of(data_key("a", 123_456, 999, spread=2)) == 123_456
    assert save_of(data_key("a", 1, 0)) != save_of(data_key("b", 1, 0))
