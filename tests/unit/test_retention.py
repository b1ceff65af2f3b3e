"""The manager's pure parts: which steps retention keeps, checkpoint names, and the read lease's
key (which removals must read as the lease of the save it reads)."""

from __future__ import annotations

import pytest

from s3ckpt import ConfigError, S3Config
from s3ckpt.format import layout
from s3ckpt.format.layout import step_in, step_name
from s3ckpt.tools.retention import Retention

TWENTY = range(1, 21)


@pytest.mark.parametrize(
    ("retention", "kept"),
    [
        (Retention(), list(TWENTY)),
        (Retention(keep_last=3), [18, 19, 20]),
        (Retention(keep_last=1), [20]),
        (Retention(keep_every=6), [6, 12, 18, 20]),
        (Retention(keep_last=2, keep_every=7), [7, 14, 19, 20]),
        (Retention(keep=lambda step: step in (2, 3)), [2, 3, 20]),
        (Retention(keep_last=1, keep=lambda step: step % 10 == 5), [5, 15, 20]),
        # Continuous: only the schedule's steps count for keep_last; the newest always stays.
        (Retention(keep_last=2, schedule=5), [15, 20]),
        (Retention(keep_last=2, schedule=6), [12, 18, 20]),
        (Retention(keep_last=1, keep_every=8, schedule=3), [8, 16, 18, 20]),
    ],
    ids=repr,
)
def test_which_of_twenty_steps_stay(retention: Retention, kept: list[int]) -> None:
    assert sorted(retention.kept(TWENTY)) == kept
    assert retention.victims(TWENTY) == [s for s in TWENTY if s not in kept]


def test_the_newest_step_always_stays() -> None:
    never = Retention(keep=lambda step: False)
    assert never.kept([3, 1, 2]) == {3}
    assert never.victims([3, 1, 2]) == [1, 2]
    assert Retention(keep_last=2, schedule=10).kept([7]) == {7}
    assert Retention(keep_last=1).kept([]) == set()


def test_without_a_rule_nothing_is_deleted() -> None:
    assert not Retention().deletes
    assert Retention().victims(range(100)) == []
    assert Retention(keep_every=5).deletes


@pytest.mark.parametrize("field", ["keep_last", "keep_every", "schedule"])
def test_a_count_below_one_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Retention(**{field: 0})


def test_names_are_zero_padded_to_nine_digits_and_read_back() -> None:
    assert step_name(100) == "step-000000100"
    assert step_name(1234567890) == "step-1234567890"
    assert sorted(step_name(s) for s in (10, 9, 100)) == [step_name(s) for s in (9, 10, 100)]
    assert step_in("step-000000100") == step_in("step-00100") == 100
    assert step_in("step-12x") is None and step_in("latest") is None
    with pytest.raises(ConfigError):
        step_name(-1)


def test_a_read_lease_key_is_what_removals_read_as_a_live_save() -> None:
    from s3ckpt.dcp.commit import ReadLease
    from s3ckpt.engine.store import get_store

    location = layout.Location("bucket", "run/step-000000001")
    save_id = layout.new_save_id()
    store = get_store(S3Config(endpoint_url="http://127.0.0.1:9", region="us-east-1"))
    leases = [ReadLease(store, location, save_id) for _ in range(2)]
    assert leases[0].key != leases[1].key, "each reader releases only its own lease"
    for lease in leases:
        relative = lease.key[len(location.listing_prefix) :]
        assert layout.save_of(relative) == save_id
        assert layout.is_lease(lease.key)
        assert layout.rank_of(relative) is None, "not a data object"
