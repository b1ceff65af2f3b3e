"""The private loop's thread runs below training's priority. No server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import asyncio, os, threading
from s3ckpt.engine import bridge

def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

async def probe():
    worker = await asyncio.get_running_loop().run_in_executor(None, nice)
    return nice(), worker

print(nice(), *bridge.run(probe()))
"""


def _priorities(extra: dict[str, str]) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3CKPT_IO_")} | extra
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return [int(v) for v in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_io_thread_and_its_workers_run_at_a_lower_priority() -> None:
    main, loop, worker = _priorities({})
    assert loop == worker == min(19, main + 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_s3ckpt_io_nice_changes_or_disables_it() -> None:
    main, loop, worker = _priorities({"S3CKPT_IO_NICE": "0"})
    assert main == loop == worker
    main, loop, worker = _priorities({"S3CKPT_IO_NICE": "3"})
    assert loop == worker == min(19, main + 3)


def test_a_bad_s3ckpt_io_nice_fails_the_call_instead_of_hanging_it() -> None:
    env = os.environ | {"S3CKPT_IO_NICE": "ten"}
    probe = "from s3ckpt.engine import bridge\nimport asyncio\nbridge.run(asyncio.sleep(0))"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "ConfigError: S3CKPT_IO_NICE must be an integer" in done.stderr


_AFFINITY = """
import asyncio, os
from s3ckpt.engine import bridge

async def probe():
    def cores():
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return cores(), await asyncio.get_running_loop().run_in_executor(None, cores)

print(",".join(str(c) for c in sorted(os.sched_getaffinity(0))), *bridge.run(probe()))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")
def test_io_cpus_pin_the_io_thread_and_its_workers_and_leave_the_caller_alone() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("S3CKPT_IO_")}
    env["S3CKPT_IO_CPUS"] = str(allowed[-1])
    done = subprocess.run(
        [sys.executable, "-c", _AFFINITY], env=env, capture_output=True, text=True, check=True
    )
    main, loop, worker = done.stdout.split()
    assert main == ",".join(str(c) for c in allowed)
    assert loop == worker == str(allowed[-1])
