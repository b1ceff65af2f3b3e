"""``s3ckpt export`` and ``s3ckpt bench`` on real servers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Writer
from tests.conftest import Cli, S3Env
from tests.helpers import listing, uploads_in_progress


def _state() -> dict[str, Any]:
    """Nested like a training state: a module, an optimizer, plain values."""
    generator = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=generator),
            "b": torch.arange(7, dtype=torch.int64),
            "h": torch.randn(5, generator=generator).to(torch.bfloat16),
        },
        "optim": {
            "state": {"w": {"step": torch.tensor(4.0), "exp_avg": torch.ones(64, 32)}},
            "param_groups": [{"lr": 0.01, "params": ["w"]}],
        },
        "step": 42,
        "note": "resumable",
    }


def _assert_same(actual: Any, expected: Any, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for key in expected:
            _assert_same(actual[key], expected[key], f"{path}/{key}")
    else:
        assert actual == expected, path


def test_export_writes_a_torch_save_file_equal_to_the_saved_state(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    state = _state()
    url = f"s3://{bucket}/run/step-42"
    dcp.save(state, storage_writer=S3Writer(url, config=s3.config()))
    out = tmp_path / "step-42.pt"
    code, stdout, stderr = cli("export", url, str(out))
    assert code == 0, stderr
    assert f"wrote {out}" in stdout and "export: reading" in stderr
    _assert_same(torch.load(out, weights_only=False), state)
    assert [p.name for p in tmp_path.iterdir()] == ["step-42.pt"]  # no partial file left
    code, stdout, _ = cli("--json", "export", url, str(out))
    assert code == 0 and json.loads(stdout)["tensors"] == 5


def test_export_of_an_incomplete_checkpoint_exits_3_and_writes_nothing(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    s3.client.put_object(
        Bucket=bucket, Key="run/step-1/data-0a0a0a0a0a0a0a0a0a0a0a0a/00000-000", Body=b"z"
    )
    out = tmp_path / "out.pt"
    code, _, stderr = cli("export", f"s3://{bucket}/run/step-1", str(out))
    assert code == 3 and "incomplete" in stderr
    assert not out.exists()


def test_bench_reports_positive_throughputs_and_leaves_nothing_behind(
    cli: Cli, s3: S3Env, bucket: str
) -> None:
    code, stdout, stderr = cli(
        "bench", f"s3://{bucket}/probe", "--size", "12", "--part-size", "5", "--json"
    )
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["settings"]["part_size"] == 5 * 1024 * 1024
    assert report["upload"]["requests"] == 3 and report["download"]["requests"] == 3
    assert report["upload"]["mb_per_s"] > 0 and report["download"]["mb_per_s"] > 0
    assert listing(s3.client, bucket) == {}
    assert uploads_in_progress(s3.client, bucket) == []


def test_bench_without_url_uses_a_temporary_bucket_and_removes_it(cli: Cli, s3: S3Env) -> None:
    before = {b["Name"] for b in s3.client.list_buckets()["Buckets"]}
    code, stdout, stderr = cli("bench", "--size", "1")
    assert code == 0, stderr
    upload, download = (line.split() for line in stdout.splitlines()[2:4])
    assert upload[0] == "upload:" and float(upload[-2]) > 0
    assert download[0] == "download:" and float(download[-2]) > 0
    assert {b["Name"] for b in s3.client.list_buckets()["Buckets"]} == before
