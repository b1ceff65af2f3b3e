"""``s3ckpt prune --keep-last/--keep-every`` on a run a `CheckpointManager` saved, on real servers:
the manager's retention policy, applied from the command line."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointManager, S3Writer
from s3ckpt.tools import catalog
from tests.conftest import Cli, S3Env
from tests.helpers import listing

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

STEPS = range(1, 13)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), float(step)), "b": torch.arange(step)}


@pytest.fixture
def run(s3: S3Env, bucket: str) -> str:
    """Steps 1..12 at run/step-<9 digits>, all kept; a committed run/final without a step; an
    unrelated object under run/logs/."""
    url = f"s3://{bucket}/run"
    with CheckpointManager(url, config=s3.config()) as mgr:
        for step in STEPS:
            assert mgr.save(step, _state(step), sync=True)
        assert mgr.steps() == list(STEPS)
    dcp.save(_state(0), storage_writer=S3Writer(f"{url}/final", config=s3.config()))
    s3.client.put_object(Bucket=bucket, Key="run/logs/train.txt", Body=b"loss 0.1")
    return url


def _steps(s3: S3Env, url: str) -> list[int]:
    with CheckpointManager(url, config=s3.config()) as mgr:
        return mgr.steps()


def test_keep_last_and_keep_every_leave_the_policys_steps(
    cli: Cli, s3: S3Env, bucket: str, run: str
) -> None:
    code, out, _ = cli("--yes", "--json", "prune", run, "--keep-last", "3", "--keep-every", "5")
    assert code == 0
    deleted = [info["step"] for info in json.loads(out)]
    assert sorted(deleted) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert _steps(s3, run) == [5, 10, 11, 12]
    for step in deleted:  # nothing of a deleted checkpoint is left behind
        assert listing(s3.client, bucket, f"run/step-{step:09d}/") == {}
    assert listing(s3.client, bucket, "run/logs/")  # not a checkpoint: untouched
    # What is left still restores, from the newest.
    state = _state(0) | {"b": torch.zeros(12, dtype=torch.int64)}
    with CheckpointManager(run, config=s3.config()) as mgr:
        assert mgr.restore(state) == 12
    assert torch.equal(state["w"], torch.full((4, 4), 12.0))
    # The same policy again finds nothing more to delete.
    code, out, _ = cli("--yes", "prune", run, "--keep-last", "3", "--keep-every", "5")
    assert (code, out) == (0, "nothing to prune\n")


def test_keep_every_alone_keeps_the_multiples_and_the_newest(cli: Cli, s3: S3Env, run: str) -> None:
    code, out, _ = cli("--yes", "prune", run, "--keep-every", "4")
    assert code == 0
    assert sorted(out.splitlines()) == [
        f"deleted {run}/step-{step:09d}" for step in (1, 2, 3, 5, 6, 7, 9, 10, 11)
    ]
    assert _steps(s3, run) == [4, 8, 12]
    code, _, _ = cli("--yes", "prune", run, "--keep-every", "5")
    assert code == 0 and _steps(s3, run) == [12]  # the newest stays whatever the policy says


def test_the_older_keep_n_is_keep_last_n(cli: Cli, s3: S3Env, run: str) -> None:
    code, out, _ = cli("--yes", "--json", "prune", run, "--keep", "2")
    assert code == 0 and len(json.loads(out)) == 10
    assert _steps(s3, run) == [11, 12]
    # run/final has no step number: no step policy deletes it.
    assert catalog.latest(f"{run}/final", s3.config()) is not None


def test_prune_without_a_policy_or_with_a_bad_one_is_a_usage_error(
    cli: Cli, s3: S3Env, run: str
) -> None:
    code, _, err = cli("--yes", "prune", run)
    assert code == 2 and "--keep-last N, --keep-every K or both" in err
    assert cli("--yes", "prune", run, "--keep-every", "0")[0] == 2
    assert cli("--yes", "prune", run, "--keep-last", "-1")[0] == 2
    assert _steps(s3, run) == list(STEPS)


def test_prune_asks_with_the_policy_and_deletes_nothing_when_declined(
    cli: Cli, s3: S3Env, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    code, _, err = cli("prune", run, "--keep-last", "10", "--keep-every", "2")
    assert code == 1
    assert "Delete these 1 checkpoints, keeping the 10 newest and every step that is a " in err
    assert f"{run}/step-000000001" in err and f"{run}/step-000000003" not in err
    assert _steps(s3, run) == list(STEPS)
