"""Key layout: data keys (spread or not), leases, and reading the save and rank back. No server."""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import pytest

from s3ckpt.format.layout import (
    data_key,
    is_data_object,
    is_lease,
    is_pin,
    is_save_dir,
    lease_key,
    new_save_id,
    rank_of,
    save_dir,
    save_of,
    spread_digits,
)

ID = "0123456789abcdef01234567"  # a save id as `new_save_id` draws them
OTHER = "fedcba9876543210fedcba98"


def test_spread_width_grows_with_the_number_of_objects() -> None:
    assert [spread_digits(n) for n in (1, 256, 257, 4096, 4097, 10**9)] == [2, 2, 3, 3, 4, 4]
    assert data_key(ID, 3, 1) == f"data-{ID}/00003-001"
    assert re.fullmatch(rf"data-{ID}/[0-9a-f]{{3}}/00003-001", data_key(ID, 3, 1, spread=3))


def test_an_objects_hash_is_the_same_in_every_save() -> None:
    """Of the rank and index, not of the per-save nonce: rank 3's object 1 takes the same key
    range of its save's directory save after save, and the directory is still the save's."""
    keys = [data_key(save, 3, 1, spread=3, nonce=n) for save in (ID, OTHER) for n in ("", "ab12cd")]
    assert len({k.split("/")[1] for k in keys}) == 1
    assert len(set(keys)) == 4, "still a key of its own per save and nonce"
    for key in keys:
        assert save_dir(f"run/step-1/{key}") == f"run/step-1/data-{save_of(key)}/"


def test_the_hash_spreads_a_saves_objects_over_its_key_ranges() -> None:
    """4,096 objects (1,024 ranks x 4) over 4,096 ranges: as a random draw would, about 63% of
    the ranges used, none holding many."""
    ranges = Counter(
        data_key(ID, rank, index, spread=3, nonce="ab12cd").split("/")[1]
        for rank in range(1024)
        for index in range(4)
    )
    assert len(ranges) > 2400 and max(ranges.values()) <= 8, (len(ranges), max(ranges.values()))


def test_keys_spread_by_the_earlier_hash_of_the_whole_name_still_are_a_saves() -> None:
    """Objects written before the hash left the nonce out: removals must still know them."""
    name = "00003-001-ab12cd"
    old = f"data-{ID}/{hashlib.blake2b(name.encode(), digest_size=8).hexdigest()[:3]}/{name}"
    assert old != data_key(ID, 3, 1, spread=3, nonce="ab12cd")
    assert save_of(old) == ID and rank_of(old) == 3 and is_data_object(old)


def test_the_rank_is_read_back_from_every_data_key_form() -> None:
    assert rank_of(data_key(ID, 3, 1)) == 3
    assert rank_of(data_key(ID, 3, 1, spread=3, nonce="ab12cd")) == 3
    assert rank_of(data_key(ID, 12, 0, spread=2)) == 12
    assert rank_of(".metadata") is None and rank_of(f"data-{ID}/notes.txt") is None


@pytest.mark.parametrize(
    ("spread", "nonce"), [(0, ""), (0, "ab12cd"), (2, ""), (3, "ab12cd"), (4, "0f12ab")]
)
def test_the_save_and_rank_are_read_back_from_a_data_key(spread: int, nonce: str) -> None:
    save = new_save_id()
    key = data_key(save, 17, 2, spread=spread, nonce=nonce)
    assert save_of(key) == save and is_data_object(key)
    assert rank_of(key) == 17
    assert not is_lease(key)


def test_a_lease_belongs_to_its_save_and_no_rank() -> None:
    key = lease_key(ID)
    assert key == f"data-{ID}/.lease"
    assert save_of(key) == ID
    assert rank_of(key) is None and not is_data_object(key)
    assert is_lease(key) and not is_pin(key)
    assert is_lease(f"ckpt/step-1/{key}"), "also under a checkpoint prefix"
    pin = f"data-{ID}/0123456789abcdef/.lease"
    assert save_of(pin) == ID and is_pin(pin) and not is_data_object(pin)


@pytest.mark.parametrize(
    "key",
    [
        ".metadata",
        "data-x",
        "other/obj",
        "",
        "data-/00001-000",
        # Someone else's files in directories that merely start with "data-" (a bucket shared
        # with datasets and logs) and in a save's own directory:
        "data-2024/train.csv",
        "data-raw/a.bin",
        "data-notes/README",
        f"data-{ID}/README",
        f"data-{ID}/nested/00000-000",
        f"data-{ID}/00000-000.bak",
        f"data-{ID}/00000-000-ZZZZZZ",
        f"data-{ID}/sub/.lease",
        f"data-{ID[:-1]}/00000-000",  # a save id one digit short
        f"data-{ID.upper()}/00000-000",
    ],
)
def test_keys_that_are_not_a_saves_have_no_save_or_rank(key: str) -> None:
    assert save_of(key) is None
    assert rank_of(key) is None and not is_data_object(key)
    assert not is_pin(key)


def test_only_a_save_id_makes_a_save_directory() -> None:
    assert is_save_dir(f"data-{ID}") and is_save_dir(f"data-{new_save_id()}")
    assert not any(map(is_save_dir, ["data-2024", "data-raw", "data-", "data", f"data-{ID}x"]))


def test_another_rank_or_save_reads_back_differently() -> None:
    assert rank_of(data_key(ID, 0, 0)) == 0
    assert rank_of(data_key(ID, 123_456, 999, spread=2)) == 123_456
    assert save_of(data_key(ID, 1, 0)) != save_of(data_key(OTHER, 1, 0))


def test_a_reference_names_a_siblings_object_from_any_sibling() -> None:
    from s3ckpt.format.layout import Location, is_reference, reference, referenced_save

    own = data_key(ID, 0, 1)
    ref = reference("step-1", own)
    assert ref == f"../step-1/{own}" and is_reference(ref) and not is_reference(own)
    assert reference("step-2", ref) == ref  # never a chain
    assert referenced_save(ref) == ("step-1", ID)
    assert Location("b", "run/step-3").key(ref) == f"run/step-1/{own}"
    assert Location("b", "step-3").key(ref) == f"step-1/{own}"
    assert Location("b", "run/step-3").parent == Location("b", "run")
    assert Location("b", "run/step-3").name == "step-3"


@pytest.mark.parametrize(
    "key",
    [
        "../x",
        "../data/0.bin",
        "../../run/step-1/data-a/0",
        "../step-1/.metadata",
        "../../x/data-a/0",
        f"../step-1/data-{ID}/.lease",  # a save's directory, but not a data object
        f"../step-1/data-{ID}/notes.txt",
    ],
)
def test_a_reference_goes_to_a_siblings_data_and_no_further(key: str) -> None:
    from s3ckpt.format.layout import referenced_save
    from s3ckpt.format.record.model import is_valid_key

    assert referenced_save(key) is None
    assert not is_valid_key(key)
