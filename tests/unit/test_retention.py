"""The manager's pure parts: which steps retention keeps, what a save policy refuses, checkpoint
names, and the read lease's key (which removals must read as the lease of the save it reads)."""

from __future__ import annotations

import re
import signal
from typing import Any

import pytest

from s3ckpt import CheckpointManager, ConfigError, Retention, S3Config, SavePolicy
from s3ckpt.format import layout
from s3ckpt.format.layout import step_in, step_name

TWENTY = range(1, 21)


@pytest.mark.parametrize(
    ("retention", "schedule", "kept"),
    [
        (Retention(), None, list(TWENTY)),
        (Retention(keep_last=3), None, [18, 19, 20]),
        (Retention(keep_last=1), None, [20]),
        (Retention(keep_every=6), None, [6, 12, 18, 20]),
        (Retention(keep_last=2, keep_every=7), None, [7, 14, 19, 20]),
        (Retention(keep=lambda step: step in (2, 3)), None, [2, 3, 20]),
        (Retention(keep_last=1, keep=lambda step: step % 10 == 5), None, [5, 15, 20]),
        # Continuous: only the schedule's steps count for keep_last; the newest always stays.
        (Retention(keep_last=2), 5, [15, 20]),
        (Retention(keep_last=2), 6, [12, 18, 20]),
        (Retention(keep_last=1, keep_every=8), 3, [8, 16, 18, 20]),
    ],
    ids=lambda value: re.sub(r" at 0x[0-9a-f]+", "", repr(value)),  # the same on every worker
)
def test_which_of_twenty_steps_stay(
    retention: Retention, schedule: int | None, kept: list[int]
) -> None:
    assert sorted(retention.kept(TWENTY, schedule)) == kept
    assert retention.victims(TWENTY, schedule) == [s for s in TWENTY if s not in kept]


def test_the_newest_step_always_stays() -> None:
    never = Retention(keep=lambda step: False)
    assert never.kept([3, 1, 2]) == {3}
    assert never.victims([3, 1, 2]) == [1, 2]
    assert Retention(keep_last=2).kept([7], schedule=10) == {7}
    assert Retention(keep_last=1).kept([]) == set()


def test_without_a_rule_nothing_is_deleted() -> None:
    assert not Retention().deletes
    assert Retention().victims(range(100)) == []
    assert Retention(keep_every=5).deletes


@pytest.mark.parametrize("field", ["keep_last", "keep_every"])
def test_a_count_below_one_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Retention(**{field: 0})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every": 0}, "every must be >= 1"),
        ({"on_signal": "exit"}, "on_signal='exit' needs save_on"),
        ({"save_on": signal.SIGTERM, "on_signal": "die"}, "on_signal must be"),
        ({"save_on": signal.SIGKILL}, "SIGKILL cannot be caught"),
        ({"save_on": [signal.SIGTERM, 999]}, "999 is not a signal"),
        ({"continuous": True, "sync": True}, "every step would save and wait"),
        ({"full_every": 5}, "full_every=5 needs incremental=True"),
        ({"incremental": True, "full_every": 0}, "full_every must be >= 1"),
        ({"every": 100, "incremental": True, "full_every": 100}, "none would be incremental"),
    ],
    ids=repr,
)
def test_a_save_policy_that_cannot_work_is_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SavePolicy(**settings)


def test_a_save_policy_holds_its_signals_as_a_tuple_and_tells_retention_its_schedule() -> None:
    listed = SavePolicy(save_on=[signal.SIGTERM, signal.SIGUSR1])
    assert listed.signals == listed.save_on == (signal.SIGTERM, signal.SIGUSR1)
    assert hash(listed) == hash(SavePolicy(save_on=(signal.SIGTERM, signal.SIGUSR1)))
    assert SavePolicy(save_on=signal.SIGTERM).signals == (signal.SIGTERM,)
    assert SavePolicy(every=10, continuous=True).schedule == 10
    assert SavePolicy(every=10).schedule is None
    # Continuous saves fall between the scheduled ones: a window as long as `every` still pays.
    assert SavePolicy(every=10, continuous=True, incremental=True, full_every=10).full_every == 10


def test_the_managers_shorthands_are_refused_beside_their_policy() -> None:
    url, config = "s3://bucket/run", S3Config(endpoint_url="memory://shorthands")
    with pytest.raises(ConfigError, match=r"every=5 beside saving=.*SavePolicy\(every=5"):
        CheckpointManager(url, every=5, saving=SavePolicy(sync=True), config=config)
    with pytest.raises(ConfigError, match=r"keep_last=2 beside retention=.*keep_last=2"):
        CheckpointManager(url, keep_last=2, retention=Retention(keep_every=10), config=config)
    with CheckpointManager(url, every=5, keep_last=2, config=config) as mgr:
        assert mgr.saving == SavePolicy(every=5) and mgr.retention == Retention(keep_last=2)


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
