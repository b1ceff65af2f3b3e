"""The README's quick start, walked as printed: ``s3ckpt serve``, ``s3ckpt mb``, the Python
snippet, the training loop with a `CheckpointManager` (SIGKILLed midway and run again),
``s3ckpt ls`` and ``s3ckpt latest``, then a load of what the snippets saved.

The commands are the README's own lines (serve gets a temporary --dir, a free --port and --json
so that the test can read its settings); the snippets are the fenced blocks after
``<!-- quickstart -->`` and ``<!-- quickstart-manager -->``, written to files and run in fresh
interpreters. The kill comes from a wrapper that runs the loop unchanged and SIGKILLs the
process right after the save of `KILL_AT` has started: a kill mid-upload, at the same point on
any machine.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from s3ckpt import S3Config, S3Reader

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = "<!-- quickstart -->"
MANAGER_MARKER = "<!-- quickstart-manager -->"
CHECKPOINT = "run1/step-000100"
TRAIN_URL = "s3://demo/train"
LAST_STEP = "step-000000060"
KILL_AT = 30

KILLER = """
import os, runpy, signal, sys

from s3ckpt.manager import CheckpointManager

kill_at, script = int(sys.argv[1]), sys.argv[2]
save = CheckpointManager.save


def save_then_die(self, step, state_dict, *args, **kwargs):
    started = save(self, step, state_dict, *args, **kwargs)
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # while this step's save uploads
    return started


CheckpointManager.save = save_then_die
runpy.run_path(script, run_name="__main__")
"""


def quick_start() -> str:
    """The README's "Quick start" section."""
    text = README.read_text()
    match = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## Quick start' section"
    return match.group(1)


def snippet(marker: str = MARKER) -> str:
    """The fenced Python block right after ``marker``."""
    section = quick_start()
    match = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", section, re.DOTALL)
    assert match, f"no ```python block right after {marker} in the quick start"
    return match.group(1)


def commands() -> list[list[str]]:
    """The quick start's ``s3ckpt ...`` command lines, split as a shell would."""
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", quick_start(), re.DOTALL)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("s3ckpt ")]


def command(name: str) -> list[str]:
    found = [argv for argv in commands() if argv[1] == name]
    assert len(found) == 1, f"the quick start should show `s3ckpt {name}` once: {commands()}"
    return found[0]


def s3ckpt_executable() -> str:
    """The installed ``s3ckpt`` script, as a user's shell finds it."""
    script = Path(sys.executable).parent / "s3ckpt"
    assert script.is_file(), f"no s3ckpt script beside {sys.executable}: pip install -e ."
    return str(script)


def twin_free_port() -> int:
    """A port p with p + 10000 free too (SeaweedFS serves gRPC there), below the ephemeral
    range so that no outgoing connection takes it meanwhile."""
    rng = random.SystemRandom()

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for _ in range(1000):
        port = rng.randrange(12000, 22000)
        if free(port) and free(port + 10000):
            return port
    raise RuntimeError("no free port pair (p, p + 10000) in 12000..22000")


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option``'s value replaced, or the option added."""
    if option in argv:
        at = argv.index(option)
        return [*argv[: at + 1], value, *argv[at + 2 :]]
    return [*argv, option, value]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The README's ``s3ckpt serve`` line, running; yields the settings it printed."""
    argv = command("serve")
    argv = with_option(argv, "--dir", str(tmp_path / "data"))
    argv = with_option(argv, "--port", str(twin_free_port()))
    argv = [s3ckpt_executable(), *argv[1:], "--json"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # serve prints one line when it is ready
        assert line, f"s3ckpt serve exited ({proc.wait()}) before it was ready:\n{log.read_text()}"
        yield json.loads(line)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as the README says
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, f"s3ckpt serve exited {code} after Ctrl-C:\n{log.read_text()}"


def environment(settings: dict[str, Any]) -> dict[str, str]:
    """This process's environment plus what serve told the user to export."""
    env = dict(os.environ)
    env.update({k: str(v) for k, v in settings.items() if k.startswith("AWS_")})
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [s3ckpt_executable(), *argv[1:]], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def test_readme_quick_start_as_printed(served: dict[str, Any], tmp_path: Path) -> None:
    env = environment(served)
    bucket = served["bucket"]
    assert command("mb") == ["s3ckpt", "mb", f"s3://{bucket}"]
    run(command("mb"), env, tmp_path)
    run(command("mb"), env, tmp_path)  # idempotent: the bucket exists now

    script = tmp_path / "quickstart.py"
    script.write_text(snippet())
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, f"the README snippet failed:\n{done.stdout}\n{done.stderr}"
    assert not done.stderr.strip(), f"the README snippet printed warnings:\n{done.stderr}"

    walk_the_training_loop(env, tmp_path, served)

    listed = run(command("ls"), env, tmp_path)  # a tree: run1/, then step-000100 under it
    run_name, step_name = CHECKPOINT.split("/")
    assert f"{run_name}/" in listed and step_name in listed and "committed" in listed, listed
    latest = run(command("latest"), env, tmp_path)
    assert f"s3://{bucket}/{CHECKPOINT}" in latest, latest

    tensors = every_tensor(served, bucket, CHECKPOINT)
    assert tensors, "the snippet's checkpoint holds no tensors"
    assert any(bool(t.any()) for t in tensors.values()), "every loaded tensor is zero"


def every_tensor(served: dict[str, Any], bucket: str, prefix: str) -> dict[str, torch.Tensor]:
    """Each tensor of the checkpoint at ``prefix``, loaded by name as the record lists them."""
    config = S3Config(
        endpoint_url=served["AWS_ENDPOINT_URL"],
        access_key_id=served["AWS_ACCESS_KEY_ID"],
        secret_access_key=served["AWS_SECRET_ACCESS_KEY"],
        region=served["AWS_REGION"],
    )
    reader = S3Reader(bucket, prefix, config=config)
    reader.check()
    tensors = {
        fqn: torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        for fqn, entry in reader.read_metadata().state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def python(script: Path, env: dict[str, str], cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def walk_the_training_loop(env: dict[str, str], tmp_path: Path, served: dict[str, Any]) -> None:
    """The manager snippet: SIGKILLed mid-upload and run again, then compared tensor by tensor
    with the same snippet run once, uninterrupted, into another run."""
    code = snippet(MANAGER_MARKER)
    assert TRAIN_URL in code, f"the manager snippet should save to {TRAIN_URL}"
    script, reference = tmp_path / "train.py", tmp_path / "reference.py"
    script.write_text(code)
    reference.write_text(code.replace(TRAIN_URL, TRAIN_URL.replace("train", "reference")))
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)

    status, _, err = finished(python(killer, env, tmp_path, str(KILL_AT), str(script)))
    assert status == -signal.SIGKILL, f"the first run was not killed ({status}):\n{err}"
    notices = [line for line in err.splitlines() if line.strip()]
    said = f"{TRAIN_URL} holds no checkpoint: starting from scratch (other runs beside it: run1)"
    assert notices == [said], notices  # the one line the README announces, and no warnings

    status, out, err = finished(python(script, env, tmp_path))
    assert status == 0, f"the restarted run failed:\n{out}\n{err}"
    assert not err.strip(), f"the restarted run printed warnings:\n{err}"
    resumed = re.search(r"resumed after step (\d+)", out)
    assert resumed and int(resumed.group(1)) in (KILL_AT - 10, KILL_AT), out

    status, out, err = finished(python(reference, env, tmp_path))
    assert status == 0 and "resumed after step None" in out, f"{out}\n{err}"

    bucket = TRAIN_URL.split("/")[2]
    killed = every_tensor(served, bucket, f"train/{LAST_STEP}")
    whole = every_tensor(served, bucket, f"reference/{LAST_STEP}")
    assert killed.keys() == whole.keys()
    assert any(".exp_avg" in fqn for fqn in whole), f"no optimizer moments saved: {list(whole)}"
    differing = [fqn for fqn in whole if not torch.equal(killed[fqn], whole[fqn])]
    assert not differing, f"the resumed run differs from the uninterrupted one in {differing}"
