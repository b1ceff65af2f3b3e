"""Small helpers shared by the integration tests."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt.config import S3Config

# What every rank imports: the fork server imports it once, and each rank starts with it.
_RANKS_IMPORT = [
    "torch",
    "torch.distributed.checkpoint",
    "s3ckpt",
    "s3ckpt.dcp.reader",
    "s3ckpt.dcp.writer",
    "s3ckpt.manager",
    "tests.dist_workers",
    "tests.manager_workers",
    "tests.safetensors_workers",
    "tests.share_workers",
]


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``mp.spawn``, with ranks forked from a server process that imported torch and s3ckpt once
    (and nothing else: no thread, no store). A spawned rank imports them itself, 4 s of CPU
    each on this machine: a quarter of the whole suite's CPU went to that."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(_RANKS_IMPORT)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def raised(call: Callable[[], Any]) -> BaseException:
    """Run ``call``; return the s3ckpt-level error, unwrapping DCP's CheckpointException."""
    with pytest.raises(BaseException) as info:  # DCP wraps failures in a BaseException
        call()
    error = info.value
    if isinstance(error, CheckpointException):
        (error, _trace), *_ = error.failures.values()
    return error


def listing(client: Any, bucket: str, prefix: str = "") -> dict[str, int]:
    """``key -> size`` of every object under ``prefix``, through the backdoor client."""
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return found


def uploads_in_progress(client: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@dataclass(frozen=True)
class Peak:
    """What `peak_growth` measured: the peak RSS above the RSS before the code ran, in bytes,
    and the error it raised (``"Type: message"``, DCP's wrapper removed), if any."""

    growth: int
    error: str | None


_CHILD = """
import json, sys
from s3ckpt import S3Config
config = S3Config(**json.loads(sys.argv[1]))
{setup}
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM, the peak RSS, starts again from here
error = None
try:
{code}
except BaseException as e:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException
    e = next(iter(failures.values()))[0] if failures else e
    error = f"{{type(e).__name__}}: {{e}}"
print(json.dumps({{"growth": status("VmHWM") - before, "error": error}}))
"""


def peak_growth(config: S3Config, code: str, setup: str = "") -> Peak:
    """Run ``setup``, then ``code``, in a new Python process (``config`` is there as
    ``config``) and measure how far ``code`` raised its peak RSS: in this process, the peak
    counts what earlier tests left behind, and a child's ``ru_maxrss`` starts at the RSS of
    the parent that forked it."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("measuring a peak RSS needs Linux's /proc/self/clear_refs")
    names = ["endpoint_url", "region", "access_key_id", "secret_access_key"]
    names += ["part_size", "max_concurrency", "max_record_size"]
    settings = {name: getattr(config, name) for name in names}
    program = _CHILD.format(setup=setup, code=textwrap.indent(code, "    "))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", program, json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Peak(result["growth"], result["error"])
