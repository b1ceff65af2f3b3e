"""What a newcomer hit in the CLI: ``prune --dry-run``, ``rm`` of a run, one shape of ``--json``
errors, natural order in ``ls``, and ``latest`` saying when runs tie."""

from __future__ import annotations

import json

import pytest
import torch

from s3ckpt.tools.search import tree_order
from tests.conftest import Cli, S3Env
from tests.helpers import listing
from tests.integration.test_catalog import save

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


def small() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4.0)}


def test_prune_dry_run_lists_and_deletes_nothing(cli: Cli, s3: S3Env, bucket: str) -> None:
    for step in (1, 2, 3):
        save(s3, bucket, f"run/step-{step}", small())
    before = listing(s3.client, bucket)
    code, out, err = cli("prune", f"s3://{bucket}/run", "--keep-last", "1", "--dry-run")
    assert code == 0, err
    named = sorted(line.split()[2] for line in out.splitlines())
    assert named == [f"s3://{bucket}/run/step-1", f"s3://{bucket}/run/step-2"], out
    assert all(line.startswith("would delete ") for line in out.splitlines())
    assert listing(s3.client, bucket) == before
    code, out, _ = cli("--json", "prune", f"s3://{bucket}/run", "--keep-last", "2", "--dry-run")
    assert code == 0 and [c["step"] for c in json.loads(out)] == [1]


def test_rm_of_a_run_says_it_is_one_and_names_its_latest(cli: Cli, s3: S3Env, bucket: str) -> None:
    for step in (1, 2):
        save(s3, bucket, f"run/step-{step}", small())
    code, _, err = cli("--yes", "rm", f"s3://{bucket}/run")
    assert code == 3, err
    assert f"s3://{bucket}/run is a run with 2 checkpoints" in err
    assert f"s3://{bucket}/run/step-2" in err and "s3ckpt prune" in err


def test_json_errors_always_carry_a_class_name_and_the_url(cli: Cli, bucket: str) -> None:
    code, out, _ = cli("--json", "latest", f"s3://{bucket}/empty")
    error = json.loads(out)
    assert code == 3 and set(error) == {"error", "message", "url"}
    assert (error["error"], error["url"]) == ("CheckpointNotFound", f"s3://{bucket}/empty")


def test_ls_orders_numbers_by_value_decimals_included(cli: Cli, s3: S3Env, bucket: str) -> None:
    for name in ("kill0.1", "kill0.03", "kill2", "kill10"):
        save(s3, bucket, f"runs/{name}", small())
    code, out, _ = cli("ls", f"s3://{bucket}/runs")
    assert code == 0
    names = [row.split()[0] for row in out.splitlines()[1:]]
    assert names == ["kill0.03", "kill0.1", "kill2", "kill10"], out
    assert sorted(["step-1", "step-01"], key=tree_order) == ["step-01", "step-1"]


def test_latest_says_when_runs_tie_at_the_highest_step(cli: Cli, s3: S3Env, bucket: str) -> None:
    save(s3, bucket, "a/step-5", small())
    save(s3, bucket, "b/step-5", small())
    save(s3, bucket, "c/step-4", small())
    code, out, err = cli("latest", f"s3://{bucket}")
    assert code == 0 and out == f"s3://{bucket}/b/step-5\n"  # the newest of the tie
    assert "2 checkpoints have the highest step, 5" in err and f"s3://{bucket}/a/step-5" in err


def test_gc_names_the_reason_for_each_object_it_keeps(cli: Cli, s3: S3Env, bucket: str) -> None:
    running = [  # a save with a live lease: running, whatever its age
        "ck/data-0123456789abcdef01234567/00000-000-abcdef",
        "ck/data-0123456789abcdef01234567/.lease",
    ]
    recent = "ck/data-fedcba9876543210fedcba98/00000-000-abcdef"  # no lease, just written
    for key in [*running, recent]:
        s3.client.put_object(Bucket=bucket, Key=key, Body=b"x" * 100)
    code, out, err = cli("gc", f"s3://{bucket}/ck", "--older-than", "1h", "--dry-run")
    assert code == 0, err
    reasons = {
        line.split(": ", 1)[0].split("/", 3)[-1]: line.split(": ", 1)[1]
        for line in out.splitlines()
        if line.startswith("  kept s3://")
    }
    assert set(reasons) == {*running, recent}, out
    assert all("its lease is live" in reasons[key] for key in running), reasons
    assert "wrote within --older-than (1:00:00)" in reasons[recent], reasons
    code, out, _ = cli("--json", "gc", f"s3://{bucket}/ck", "--older-than", "1h", "--dry-run")
    assert {key for key, _ in json.loads(out)["reasons"]} == {*running, recent}
