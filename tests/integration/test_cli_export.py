"""``s3ckpt export`` and ``s3ckpt bench`` on real servers."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.tools import catalog
from tests.conftest import Cli, S3Env
from tests.helpers import listing, uploads_in_progress
from tests.recordshapes import edit_entries

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


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
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{path}/{i}")
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
    _assert_same(torch.load(out, weights_only=True), state)
    with zipfile.ZipFile(out) as written:
        assert written.testzip() is None  # every record's CRC32 is right
    assert [p.name for p in tmp_path.iterdir()] == ["step-42.pt"]  # no partial file left
    code, stdout, _ = cli("--json", "export", url, str(out))
    assert code == 0 and json.loads(stdout)["tensors"] == 5


@pytest.mark.parametrize(
    "option",
    [["--dtype", "bfloat16"], ["--max-shard-size", "1GB"], ["--select", "model"]],
    ids=["dtype", "max-shard-size", "select"],
)
def test_safetensors_options_are_refused_with_format_torch(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path, option: list[str]
) -> None:
    """Issue #26: options of ``--format safetensors`` beside the (default) torch format are a
    usage error, not ignored: exit 2, a message naming them, nothing written."""
    url = f"s3://{bucket}/ck"
    dcp.save(_state(), storage_writer=S3Writer(url, config=s3.config()))
    out = tmp_path / "out.pt"
    for chosen in ([], ["--format", "torch"]):
        code, stdout, stderr = cli("export", url, str(out), *chosen, *option)
        assert code == 2, (chosen, option, stderr)
        assert "--select, --dtype and --max-shard-size go with --format safetensors" in stderr
        assert stdout == "" and "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--dtype", "int8"], "expected a floating-point dtype such as bfloat16"),
        (["--dtype", "bfloat17"], "expected a floating-point dtype such as bfloat16"),
        (["--max-shard-size", "5XB"], "expected a size such as 5GB"),
        (["--max-shard-size", "0"], "expected a size such as 5GB"),
    ],
    ids=["int8", "unknown", "unit", "zero"],
)
def test_a_wrong_safetensors_option_is_a_usage_error_before_any_read(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path, option: list[str], message: str
) -> None:
    """Issue #26: exit 2 with the reason, even where no checkpoint is (not 3: not found)."""
    dest = tmp_path / "hf"
    url = f"s3://{bucket}/none"
    code, _, stderr = cli("export", url, str(dest), "--format", "safetensors", *option)
    assert code == 2 and message in stderr, (code, stderr)
    assert not dest.exists()


def test_export_writes_tensors_larger_than_its_memory_in_slabs(
    s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    """With 5 MiB of tensors at a time, tensors of up to 16 MiB (compressed and shuffled, so
    slabs end inside frames; one with rows larger than a slab) come out whole, as do tensors
    inside non-tensor values, a 0-d, an empty and a uint16 tensor."""
    generator = torch.Generator().manual_seed(8)
    state = {
        "model": {
            "w": (torch.arange(1536 * 2048) % 1000).reshape(1536, 2048).float(),
            "wide": torch.randn(2, 2 * MiB, generator=generator).to(torch.bfloat16) / 7,
            "flat": torch.arange(2 * MiB, dtype=torch.int64) // 3,
            "u16": torch.arange(3000, dtype=torch.int32).to(torch.uint16),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3),
        },
        "groups": [{"lr": 0.1, "ids": torch.arange(4)}, {"lr": 0.2, "ids": torch.arange(2)}],
        "inside": ("t", {"tensor": torch.arange(5, dtype=torch.int32)}),
        "step": 9,
    }
    url = f"s3://{bucket}/ck"
    options = WriteOptions(compression="zstd", frame_size=1 * MiB)
    dcp.save(state, storage_writer=S3Writer(url, config=s3.config(), options=options))
    out = tmp_path / "out.pt"
    config = s3.config(part_size=5 * MiB, max_concurrency=1)
    seen: list[tuple[int, int]] = []
    exported = catalog.export(
        url, out, config, progress=lambda done, total: seen.append((done, total))
    )
    assert exported.tensors == 8 and exported.tensor_bytes == seen[-1][1]
    assert seen[-1][0] == seen[-1][1] and len(seen) > 6  # more batches than tensors
    _assert_same(torch.load(out, weights_only=True), state)
    with zipfile.ZipFile(out) as written:
        assert written.testzip() is None
    _assert_same(catalog.read_state(url, config), state)


def test_export_refuses_entries_that_cannot_both_be_restored(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    """A record whose planner_data puts ``extra.lr`` inside ``extra``, which holds a value."""
    dcp.save(
        {"extra": 1, "extra.lr": 0.5}, storage_writer=S3Writer(bucket, "ck", config=s3.config())
    )
    record = json.loads(s3.client.get_object(Bucket=bucket, Key="ck/.metadata")["Body"].read())
    edit_entries(
        record, lambda entries: None, paths={"extra": ("extra",), "extra.lr": ("extra", "lr")}
    )
    s3.client.put_object(Bucket=bucket, Key="ck/.metadata", Body=json.dumps(record).encode())
    out = tmp_path / "out.pt"
    code, _, stderr = cli("export", f"s3://{bucket}/ck", str(out))
    assert code == 1, stderr
    assert "Traceback" not in stderr and "TypeError" not in stderr
    assert "'extra' and 'extra.lr' cannot both be restored" in stderr
    assert f"s3://{bucket}/ck/.metadata" in stderr
    assert list(tmp_path.iterdir()) == []


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
