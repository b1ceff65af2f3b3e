"""A real training job: torchrun, FSDP2 on a CPU mesh (gloo), async_save to SeaweedFS on a
dedicated gloo group, and loads resharded onto 4, 2 and 1 ranks (tests/torchrun_worker.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from s3ckpt import S3Reader
from s3ckpt.format.packing import ALIGN
from tests import torchrun_worker
from tests.helpers import listing, uploads_in_progress

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)]

WORKER = Path(torchrun_worker.__file__)
LAUNCH_TIMEOUT_S = 240.0


def torchrun(s3: Any, nproc: int, mode: str, url: str, out: Path) -> None:
    """Run the worker on ``nproc`` ranks; on a timeout or interrupt kill every rank, not only
    torchrun, so no orphan keeps a port or the server busy."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), str(WORKER), mode, url, str(out)]
    command += ["--endpoint-url", s3.endpoint_url]
    env = os.environ | {
        "AWS_ACCESS_KEY_ID": s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
        "AWS_REGION": s3.region,
    }
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    text = output.decode(errors="replace")
    assert proc.returncode == 0, f"torchrun {mode} on {nproc} ranks failed:\n{text[-6000:]}"


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Bit-exact equality of nested state: tensors by dtype and ``torch.equal``, the rest by ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and actual.keys() == expected.keys(), where
        for name, value in expected.items():
            assert_same(actual[name], value, f"{where}/{name}")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}/{i}")
    else:
        assert actual == expected, where


def saved(out: Path, name: str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(out / f"{name}.pt", weights_only=True)
    return state


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_fsdp2_async_save_on_4_ranks_then_load_on_4_2_and_1(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/ck"
    torchrun(s3, 4, "save", url, tmp_path)
    reference = saved(tmp_path, "reference")
    assert reference["optim"]["state"], "the optimizer has state to restore"

    # Every rank writes its own objects in parallel; replicated tensors are stored once.
    stored = {k: n for k, n in listing(s3.client, bucket, "ck/").items() if "/data-" in k}
    assert {key.rsplit("/", 1)[1][:5] for key in stored} == {f"{r:05d}" for r in range(4)}
    reader = S3Reader(url, config=s3.config())
    reader.read_metadata()
    assert reader.checkpoint is not None
    locators = reader.checkpoint.locators
    item_bytes = sum(loc.length for loc in locators.values())
    padding = (ALIGN - 1) * len(locators)  # items start at multiples of ALIGN
    assert item_bytes <= sum(stored.values()) <= item_bytes + padding, (
        "no item is stored by more than one rank"
    )
    single: set[str] = set()
    for fqn, entry in reader.checkpoint.metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunk_bytes = sum(locators[MetadataIndex(fqn, c.offsets)].length for c in entry.chunks)
            assert chunk_bytes == entry.size.numel() * entry.properties.dtype.itemsize, fqn
            if len(entry.chunks) == 1:
                single.add(fqn)
    params = [name for name, _ in torchrun_worker.Net().named_parameters()]
    assert single == {"model.scale"} | {f"optim.state.{p}.step" for p in params}, (
        "replicated tensors (the buffer, each step) are one chunk; every parameter is sharded"
    )
    assert uploads_in_progress(s3.client, bucket) == []

    for nproc in (4, 2):
        torchrun(s3, nproc, "load", url, tmp_path)
        assert_same(saved(tmp_path, f"loaded-{nproc}"), reference, f"{nproc} ranks")

    # One plain process, no process group: a model that was never sharded takes the state.
    model, optimizer = torchrun_worker.build(1, None)
    torchrun_worker.load(url, s3.config(), model, optimizer)
    assert_same(torchrun_worker.full_state(model, optimizer), reference, "1 process")


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_training_collectives_while_an_async_save_uploads(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    """The worker asserts every all_reduce; here: both finished, they overlapped, and the
    checkpoint holds the state as of ``async_save``."""
    torchrun(s3, 4, "overlap", f"s3://{bucket}/ck", tmp_path)
    reports = [json.loads((tmp_path / f"overlap-{r}.json").read_text()) for r in range(4)]
    assert all(r["steps"] == torchrun_worker.OVERLAP_STEPS for r in reports)
    assert any(r["steps_while_saving"] > 0 for r in reports), reports
    reference = saved(tmp_path, "reference")
    assert_same(saved(tmp_path, "loaded-4"), reference)
    later = saved(tmp_path, "trained-on")["model"]
    assert not torch.equal(later["out.weight"], reference["model"]["out.weight"])
    assert "ck/.metadata" in listing(s3.client, bucket, "ck/")
    assert uploads_in_progress(s3.client, bucket) == []
