"""The ``s3ckpt`` command on real servers: output, prompts, exit codes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from s3ckpt.tools import catalog
from tests.conftest import Cli, S3Env
from tests.helpers import listing, uploads_in_progress
from tests.integration.test_catalog import INCOMPLETE, LEFTOVER, build_run

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def run(s3: S3Env, bucket: str) -> dict[int, dict[str, torch.Tensor]]:
    return build_run(s3, bucket)


def test_ls_prints_an_aligned_table_and_json(cli: Cli, s3: S3Env, bucket: str, run: Any) -> None:
    code, out, _ = cli("ls", f"s3://{bucket}/run")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[:2] == ["PREFIX", "STEP"] and header.split()[-1] == "STATE"
    assert [[*r.split()[:2], r.split()[-1]] for r in rows] == [
        ["step-1", "1", "committed"],
        ["step-2", "2", "committed"],
        ["step-10", "10", "committed"],
        ["step-11", "11", "incomplete"],
    ]
    state_column = header.index("STATE")
    assert all(row[state_column - 2 : state_column] == "  " for row in rows)
    assert "100 B" in rows[3]
    # Options may also follow the subcommand.
    code, out, _ = cli("ls", f"s3://{bucket}/run", "--json")
    expected = catalog.list_checkpoints(f"s3://{bucket}/run", s3.config())
    assert code == 0
    assert [
        (c["prefix"], c["committed"], c["step"], c["total_bytes"]) for c in json.loads(out)
    ] == [(i.prefix, i.committed, i.step, i.total_bytes) for i in expected]


def test_latest_prints_the_url_or_exits_3(cli: Cli, bucket: str, run: Any) -> None:
    assert cli("latest", f"s3://{bucket}/run")[:2] == (0, f"s3://{bucket}/run/step-10\n")
    code, out, _ = cli("--json", "latest", f"s3://{bucket}/run")
    assert code == 0 and json.loads(out)["step"] == 10
    code, out, err = cli("latest", f"s3://{bucket}/empty")
    assert (code, out) == (3, "") and "no committed checkpoint" in err


def test_info_shows_tensors_ranks_and_totals(cli: Cli, s3: S3Env, bucket: str, run: Any) -> None:
    url = f"s3://{bucket}/run/step-10"
    code, out, _ = cli("--json", "info", url)
    assert code == 0
    shown = json.loads(out)
    items = {item["name"]: item for item in shown["items"]}
    assert items["w"] == {"name": "w", "dtype": "float32", "shape": [8, 4], "bytes": 128}
    assert items["b"] == {"name": "b", "dtype": "int64", "shape": [13], "bytes": 104}
    data = {k: v for k, v in listing(s3.client, bucket, "run/step-10/").items() if "/data-" in k}
    assert shown["ranks"] == [{"rank": 0, "objects": len(data), "bytes": sum(data.values())}]
    assert shown["checkpoint"]["url"] == url and shown["checkpoint"]["world_size"] == 1
    code, out, _ = cli("info", url)
    assert code == 0 and "float32" in out and "[8, 4]" in out and "step:" in out
    assert cli("info", f"s3://{bucket}/{INCOMPLETE}")[0] == 3
    assert cli("info", f"s3://{bucket}/run")[0] == 3


def test_rm_without_yes_refuses_when_stdin_is_not_a_terminal(
    cli: Cli, s3: S3Env, bucket: str, run: Any
) -> None:
    before = listing(s3.client, bucket)
    for argv in (
        ["rm", f"s3://{bucket}/run/step-1"],
        ["prune", f"s3://{bucket}/run", "--keep", "1"],
    ):
        code, _, err = cli(*argv)
        assert code == 2 and "--yes" in err
    assert cli("gc", f"s3://{bucket}/run", "--older-than", "0")[0] == 2
    assert listing(s3.client, bucket) == before


def test_rm_asks_on_a_terminal(
    cli: Cli, s3: S3Env, bucket: str, run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{bucket}/run/step-1"
    before = listing(s3.client, bucket)
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    code, _, err = cli("rm", url)
    assert code == 1 and f"Delete {url}" in err and listing(s3.client, bucket) == before
    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    code, out, _ = cli("rm", url)
    assert code == 0 and out.startswith(f"deleted {url}")
    assert not listing(s3.client, bucket, "run/step-1/")
    monkeypatch.setattr(sys, "stdin", _Terminal("no\n"))
    code, _, err = cli("prune", f"s3://{bucket}/run", "--keep", "1")
    assert code == 1 and f"s3://{bucket}/run/step-2" in err
    assert listing(s3.client, bucket, "run/step-2/")


def test_rm_yes_deletes_and_reports(cli: Cli, s3: S3Env, bucket: str, run: Any) -> None:
    code, out, _ = cli("--yes", "--json", "rm", f"s3://{bucket}/run/step-2")
    assert code == 0
    report = json.loads(out)
    assert report["deleted"][0] == "run/step-2/.metadata" and LEFTOVER in report["deleted"]
    assert [u["key"] for u in report["aborted"]] == [
        "run/step-2/data-deaddeaddeaddeaddeaddead/00001-000"
    ]
    assert not listing(s3.client, bucket, "run/step-2/")
    assert cli("--yes", "rm", f"s3://{bucket}/run/step-2")[0] == 3


def test_progress_bar_on_a_terminal(
    cli: Cli, s3: S3Env, bucket: str, run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli("--yes", "rm", f"s3://{bucket}/run/step-2")[0] == 0
    assert "100%" in terminal.getvalue() and "rm" in terminal.getvalue()
    terminal.truncate(0)
    assert cli("--yes", "--json", "rm", f"s3://{bucket}/run/step-1")[0] == 0
    assert "%" not in terminal.getvalue()


def test_prune_keeps_n(cli: Cli, s3: S3Env, bucket: str, run: Any) -> None:
    code, out, _ = cli("--yes", "--json", "prune", f"s3://{bucket}/run", "--keep", "2")
    assert code == 0 and [i["prefix"] for i in json.loads(out)] == ["run/step-1"]
    assert not listing(s3.client, bucket, "run/step-1/")
    assert listing(s3.client, bucket, "run/step-2/")
    assert cli("--yes", "prune", f"s3://{bucket}/run", "--keep", "0")[0] == 2
    assert cli("--yes", "prune", f"s3://{bucket}/run", "--keep", "5")[1] == "nothing to prune\n"


def test_gc_dry_run_then_for_real(cli: Cli, s3: S3Env, bucket: str, run: Any) -> None:
    before = listing(s3.client, bucket)
    code, out, _ = cli("gc", f"s3://{bucket}/run", "--older-than", "0s", "--dry-run")
    assert code == 0 and out.startswith("would delete 2 objects (150 B), 2 uploads")
    assert f"s3://{bucket}/{LEFTOVER}" in out and listing(s3.client, bucket) == before
    code, out, _ = cli("--yes", "--json", "gc", f"s3://{bucket}/run", "--older-than", "0")
    assert code == 0 and sorted(json.loads(out)["deleted"]) == sorted(
        [LEFTOVER, f"{INCOMPLETE}/data-feedfeedfeedfeedfeedfeed/00000-000"]
    )
    assert uploads_in_progress(s3.client, bucket) == []
    code, out, _ = cli("gc", f"s3://{bucket}/run", "--older-than", "2d", "--dry-run")
    assert code == 0 and out.startswith("would delete 0 objects")
    assert cli("gc", f"s3://{bucket}/run", "--older-than", "soon", "--dry-run")[0] == 2


def test_errors_and_their_exit_codes(cli: Cli) -> None:
    code, _, err = cli("ls", "s3://no-such-bucket-s3ckpt/run")
    assert code == 1 and "no-such-bucket-s3ckpt" in err and "does not exist" in err
    code, _, err = cli("ls", "bucket/run")
    assert code == 2 and "s3://bucket/prefix URL" in err
    assert cli("frobnicate")[0] == 2
    assert cli()[0] == 2


@pytest.mark.stores("moto", "seaweedfs")  # a subprocess: a real server
def test_python_dash_m(s3: S3Env, bucket: str, run: Any) -> None:
    env = os.environ | {
        "AWS_ACCESS_KEY_ID": s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
        "AWS_ENDPOINT_URL": s3.endpoint_url,
    }
    url = f"s3://{bucket}/run"

    def s3ckpt(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "s3ckpt", *argv]
        return subprocess.run(
            command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
        )

    listed = s3ckpt("--json", "ls", url)
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 4
    refused = s3ckpt("rm", f"{url}/step-1")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert listing(s3.client, bucket, "run/step-1/")
