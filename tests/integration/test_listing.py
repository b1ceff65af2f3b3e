"""Listing a bucket as a new user does (issue 14): every depth, a tree, what ``info`` shows of a
save, the bytes of killed saves, progress bars, and a CLI that starts without torch."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from importlib import metadata
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointNotFound, S3Reader, S3Writer, WriteOptions
from s3ckpt.cli.base import human_size
from s3ckpt.format.record import BytesEntry, decode
from s3ckpt.tools import catalog
from tests.conftest import Cli, S3Env
from tests.helpers import listing, raised
from tests.integration.test_crash import kill_mid_upload

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

STEPS = (100, 300, 200)  # saved in this order: the latest is not the last written
RUN = "run7"
NESTED = "team/run8/step-5"


def save(s3: S3Env, bucket: str, prefix: str, state: dict[str, Any], **options: Any) -> None:
    writer = S3Writer(
        f"s3://{bucket}/{prefix}", config=s3.config(), options=WriteOptions(**options)
    )
    dcp.save(state, storage_writer=writer)


def state() -> dict[str, Any]:
    """Compressible tensors (zeros, a ramp) and a non-tensor value."""
    return {"w": torch.zeros(64, 256), "b": torch.arange(1000, dtype=torch.int64), "step": 7}


def tensor_bytes(saved: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in saved.values() if isinstance(v, torch.Tensor))


@pytest.fixture
def runs(s3: S3Env, bucket: str) -> None:
    """run7/step-000{100,300,200} committed, team/run8/step-5 committed (deeper, lower step),
    run7/step-000400 incomplete (a data object, no record), and a non-checkpoint run7/logs/."""
    for step in STEPS:
        save(s3, bucket, f"{RUN}/step-{step:06d}", state())
    save(s3, bucket, NESTED, state(), compression="zstd")
    key = f"{RUN}/step-000400/data-deaddeaddeaddeaddeaddead/00000-000"
    s3.client.put_object(Bucket=bucket, Key=key, Body=b"x" * 100)
    s3.client.put_object(Bucket=bucket, Key=f"{RUN}/logs/train.txt", Body=b"loss 0.1")


def test_ls_and_latest_search_every_depth(s3: S3Env, bucket: str, runs: None, cli: Cli) -> None:
    infos = catalog.list_checkpoints(f"s3://{bucket}", s3.config())
    assert [(i.prefix, i.step, i.state) for i in infos] == [
        (f"{RUN}/step-000100", 100, "committed"),
        (f"{RUN}/step-000200", 200, "committed"),
        (f"{RUN}/step-000300", 300, "committed"),
        (f"{RUN}/step-000400", 400, "incomplete"),
        (NESTED, 5, "committed"),
    ]
    best = catalog.latest(f"s3://{bucket}", s3.config())
    assert best is not None and best.prefix == f"{RUN}/step-000300"
    assert cli("latest", f"s3://{bucket}/team")[1] == f"s3://{bucket}/{NESTED}\n"

    code, out, _ = cli("ls", f"s3://{bucket}")
    assert code == 0
    header, *rows = out.splitlines()
    columns = ["PREFIX", "STEP", "COMMITTED", "(UTC)", "SIZE", "OBJECTS", "COMPRESSION"]
    assert header.split() == [*columns, "STATE"]
    names = "run7/ step-000100 step-000200 step-000300 step-000400 team/ run8/ step-5"
    assert [row.split()[0] for row in rows] == names.split()
    indents = [len(row) - len(row.lstrip()) for row in rows]
    assert indents == [0, 2, 2, 2, 2, 0, 2, 4]
    assert rows[1].split()[-2:] == ["none", "committed"] and rows[-1].split()[-2:] == [
        "zstd:1",
        "committed",
    ]
    assert rows[4].split()[1:] == ["400", "-", "100", "B", "1", "-", "incomplete"]
    code, out, _ = cli("--json", "ls", f"s3://{bucket}/{RUN}")
    assert [entry["prefix"] for entry in json.loads(out)] == [i.prefix for i in infos[:4]]


def test_a_run_prefix_names_its_latest_checkpoint(s3: S3Env, bucket: str, runs: None) -> None:
    url = f"s3://{bucket}/{RUN}"
    expected = (
        f"{url} is a run with 3 checkpoints, not a checkpoint; the latest is {url}/step-000300"
    )
    with pytest.raises(CheckpointNotFound) as caught:
        S3Reader(url, config=s3.config()).read_metadata()
    assert expected in str(caught.value) and caught.value.url == url
    loaded = state()
    error = raised(lambda: dcp.load(loaded, storage_reader=S3Reader(url, config=s3.config())))
    assert expected in str(error)
    with pytest.raises(CheckpointNotFound, match="nothing is stored at this prefix"):
        catalog.describe(f"s3://{bucket}/elsewhere", s3.config())


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_info_shows_how_the_checkpoint_was_saved(
    s3: S3Env, bucket: str, cli: Cli, compression: str | None
) -> None:
    saved = state()
    save(s3, bucket, "ck/step-9", saved, compression=compression, frame_size=64 * 1024)
    code, out, _ = cli("--json", "info", f"s3://{bucket}/ck/step-9")
    assert code == 0
    shown = json.loads(out)["checkpoint"]
    raw = s3.client.get_object(Bucket=bucket, Key="ck/step-9/.metadata")["Body"].read()
    record = json.loads(raw)
    assert json.loads(out)["record"] == {"bytes": len(raw), "version": 4}
    data = {k: v for k, v in listing(s3.client, bucket, "ck/step-9/").items() if "/data-" in k}
    assert shown["state"] == "committed" and shown["save_id"] == record["save_id"]
    assert shown["world_size"] == 1 and shown["tensors"] == 2
    step = decode(raw, url="s3://b/ck/.metadata").entries["step"]
    assert isinstance(step, BytesEntry)
    assert shown["logical_bytes"] == tensor_bytes(saved) + step.locator.length
    assert shown["stored_bytes"] == sum(data.values())
    assert shown["frame_size"] == 64 * 1024
    assert shown["s3ckpt_version"] == metadata.version("s3ckpt")
    assert shown["torch_version"] == torch.__version__
    assert shown["compression"] == compression
    assert shown["compression_level"] == (1 if compression else None)
    code, text, _ = cli("info", f"s3://{bucket}/ck/step-9")
    lines = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines())
    assert lines["compression"].strip() == ("zstd (level 1)" if compression else "none")
    assert lines["frame size"].strip() == "64.0 KiB"
    assert lines["world size"].strip() == "1 (ranks)" and lines["tensors"].strip() == "2"
    assert lines["torch"].strip() == torch.__version__
    assert lines["record"].strip() == f"{len(raw):,} bytes (.metadata, format version 4)"
    if compression:
        assert shown["stored_bytes"] < shown["logical_bytes"] / 4  # zeros and a ramp
        assert "% of logical)" in lines["stored"]


def test_a_record_from_an_older_writer_lists_and_shows_dashes(
    s3: S3Env, bucket: str, cli: Cli
) -> None:
    save(s3, bucket, "old/step-1", state())
    key = "old/step-1/.metadata"
    record = json.loads(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    record["extra"] = {"world_size": 1}  # all that writers recorded before
    s3.client.put_object(Bucket=bucket, Key=key, Body=json.dumps(record).encode())
    code, text, _ = cli("info", f"s3://{bucket}/old/step-1")
    assert code == 0
    lines = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines())
    assert [lines[name].strip() for name in ("compression", "s3ckpt", "torch")] == ["-"] * 3
    assert lines["tensors"].strip() == "2"  # what the record itself says
    code, out, _ = cli("ls", f"s3://{bucket}/old")
    assert code == 0 and out.splitlines()[1].split()[-2:] == ["-", "committed"]


@pytest.mark.stores("moto", "seaweedfs")  # other processes: a real server
@pytest.mark.slow
def test_a_killed_save_counts_the_bytes_of_its_uploads(s3: S3Env, bucket: str, cli: Cli) -> None:
    url = f"s3://{bucket}/run/step-2"
    kill_mid_upload(s3, bucket, url, overwrite=False)

    def in_uploads() -> tuple[list[dict[str, Any]], int]:
        uploads = s3.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        parts = (
            s3.client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
            for u in uploads
        )
        return uploads, sum(part["Size"] for reply in parts for part in reply.get("Parts", []))

    # A part whose body had fully arrived when the writer was killed may still land: wait
    # until the server's uploads stop changing.
    uploads, in_parts = in_uploads()
    for _ in range(40):
        time.sleep(0.5)
        previous, (uploads, in_parts) = in_parts, in_uploads()
        if in_parts == previous:
            break
    objects = listing(s3.client, bucket, "run/step-2/")
    assert in_parts > 0

    (info,) = catalog.list_checkpoints(f"s3://{bucket}/run", s3.config())
    assert (info.state, info.uploads, info.upload_bytes) == ("incomplete", len(uploads), in_parts)
    assert info.total_bytes == sum(objects.values()) + in_parts
    assert info.num_objects == len(objects)
    code, _, err = cli("info", url)
    assert code == 3 and f"({in_parts} bytes in parts so far)" in err

    # The lease of the killed save is still live: only break_leases collects it now.
    report = catalog.gc(
        f"s3://{bucket}/run", timedelta(0), s3.config(), dry_run=True, break_leases=True
    )
    assert report.upload_bytes == in_parts and len(report.aborted) == len(uploads)
    assert report.bytes_freed == sum(objects.values()) + in_parts
    code, out, _ = cli("--yes", "gc", f"s3://{bucket}/run", "--older-than", "0", "--break-leases")
    assert code == 0
    assert f"{len(uploads)} uploads ({human_size(in_parts)})" in out.splitlines()[0]
    assert listing(s3.client, bucket) == {}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_verify_prune_and_gc_show_progress_on_a_terminal(
    s3: S3Env, bucket: str, runs: None, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli("verify", f"s3://{bucket}/{NESTED}")[0] == 0
    assert "100%" in terminal.getvalue() and "objects" in terminal.getvalue()
    for argv in (
        ["prune", f"s3://{bucket}/{RUN}", "--keep", "2"],
        ["gc", f"s3://{bucket}/{RUN}", "--older-than", "0"],
    ):
        terminal.seek(0)
        terminal.truncate(0)
        code, out, _ = cli("--yes", *argv)
        assert code == 0 and out and "100%" in terminal.getvalue(), argv
    terminal.seek(0)
    terminal.truncate(0)
    assert cli("--json", "verify", f"s3://{bucket}/{NESTED}")[0] == 0
    assert "%" not in terminal.getvalue()


@pytest.mark.stores("moto", "seaweedfs")  # a subprocess: a real server
def test_the_light_commands_import_no_torch(s3: S3Env, bucket: str, runs: None) -> None:
    url = f"s3://{bucket}/{NESTED}"
    commands = [
        ["ls", f"s3://{bucket}"],
        ["latest", f"s3://{bucket}"],
        ["info", url],
        ["verify", url],
        ["gc", f"s3://{bucket}", "--dry-run"],
        ["prune", f"s3://{bucket}/{NESTED.rpartition('/')[0]}", "--keep-last", "5", "--yes"],
    ]
    script = (
        "import json, sys\n"
        "from s3ckpt.cli import main\n"
        f"codes = [main(['--endpoint-url', {s3.endpoint_url!r}, *argv]) for argv in {commands!r}]\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}), file=sys.stderr)\n"
    )
    env = os.environ | {
        "AWS_ACCESS_KEY_ID": s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result == {"codes": [0] * len(commands), "torch": False}
