"""``s3ckpt serve`` and ``s3ckpt mb``, a user's first steps: the server runs as its own process,
and what it prints is used from others, as a user pastes it."""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from botocore.config import Config
from botocore.exceptions import ClientError

from s3ckpt import BucketNotFound, S3Writer
from s3ckpt.cli import main
from s3ckpt.tools.localserver import SeaweedFS, free_port
from tests.conftest import Cli, S3Env, make_env
from tests.helpers import raised

_SETTINGS = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}
# What a later start of a --dir prints instead of the keys.
_POINTERS = {"AWS_ENDPOINT_URL", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE", "AWS_REGION"}
_SERVE = [sys.executable, "-m", "s3ckpt", "serve"]
_STOP_WAIT_S = 30


@contextlib.contextmanager
def serving(
    workdir: Path, port: int, *extra: str
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """``s3ckpt serve --json`` and the settings it printed; SIGTERM at the end if still up."""
    command = [*_SERVE, "--dir", str(workdir), "--port", str(port), "--json", *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line, f"serve exited with {proc.wait()}: {proc.stderr.read()}"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(_STOP_WAIT_S)


def printed_lines(proc: subprocess.Popen[str]) -> list[str]:
    """What serve (without --json) prints when it is ready: AWS_REGION's line comes last."""
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith("export AWS_REGION="):
        line = proc.stdout.readline()
        assert line, f"serve exited with {proc.wait()}: {proc.stderr.read()}"
        lines.append(line.rstrip("\n"))
    return lines


def client(settings: dict[str, Any]) -> Any:
    """A plain boto3 client configured from nothing but what serve printed: the keys, or the
    credentials file and profile that a later start points at."""
    session = botocore.session.Session()
    if "AWS_SHARED_CREDENTIALS_FILE" in settings:
        session.set_config_variable("credentials_file", settings["AWS_SHARED_CREDENTIALS_FILE"])
        session.set_config_variable("profile", settings["AWS_PROFILE"])
    else:
        session.set_credentials(settings["AWS_ACCESS_KEY_ID"], settings["AWS_SECRET_ACCESS_KEY"])
    return boto3.session.Session(botocore_session=session).client(
        "s3",
        endpoint_url=settings["AWS_ENDPOINT_URL"],
        region_name=settings["AWS_REGION"],
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def s3ckpt_with(settings: dict[str, Any], *argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in another process, its environment set as by pasting serve's export lines."""
    env = os.environ | {k: v for k, v in settings.items() if k in _SETTINGS | _POINTERS}
    command = [sys.executable, "-m", "s3ckpt", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def stop(proc: subprocess.Popen[str], sig: signal.Signals, port: int) -> None:
    """Signal serve; it must exit 0 with weed gone and the S3 port free again."""
    weeds = psutil.Process(proc.pid).children(recursive=True)
    assert [p.name() for p in weeds] == ["weed"]
    proc.send_signal(sig)
    assert proc.wait(_STOP_WAIT_S) == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in weeds)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
    with socket.socket() as sock:  # as a server binds it (Go sets SO_REUSEADDR too)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_serve_prints_settings_that_work_elsewhere_and_stops_cleanly(tmp_path: Path) -> None:
    port, bucket, workdir = free_port(), f"t-{uuid.uuid4().hex[:12]}", tmp_path / "data"
    with serving(workdir, port, "--bucket", bucket) as (proc, settings):
        assert settings["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
        assert set(settings) == {*_SETTINGS, "dir", "bucket", "credentials"}
        assert (settings["dir"], settings["bucket"]) == (str(workdir), bucket)
        assert settings["credentials"] == str(workdir / "credentials")
        made = s3ckpt_with(settings, "--json", "mb", f"s3://{bucket}")
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["created"] is False  # serve made it
        client(settings).put_object(Bucket=bucket, Key="run/a", Body=b"kept")
        stop(proc, signal.SIGINT, port)
    assert proc.stderr is not None and "Ctrl-C" in proc.stderr.read()

    # The same --dir again, stopped by SIGTERM this time: the bucket and object are still there,
    # reached through the credentials file that this start points at.
    with serving(workdir, port) as (proc, later):
        assert set(later) == {*_POINTERS, "dir", "bucket", "credentials"}
        assert later["bucket"] is None
        assert later["AWS_SHARED_CREDENTIALS_FILE"] == str(workdir / "credentials")
        assert client(later).get_object(Bucket=bucket, Key="run/a")["Body"].read() == b"kept"
        listed = s3ckpt_with(later, "--json", "mb", f"s3://{bucket}")
        assert listed.returncode == 0, listed.stderr
        stop(proc, signal.SIGTERM, port)


def test_each_data_dir_has_its_own_keys_printed_by_its_first_start_only(tmp_path: Path) -> None:
    """Random keys per --dir, kept private there and reused; a later start points at the file,
    and its lines work pasted into a shell that holds other keys."""
    dir_a, dir_b, port_a, port_b = tmp_path / "a", tmp_path / "b", free_port(), free_port()
    with serving(dir_a, port_a) as (proc_a, first), serving(dir_b, port_b) as (proc_b, other):
        keys = (first["AWS_ACCESS_KEY_ID"], first["AWS_SECRET_ACCESS_KEY"])
        assert keys != (other["AWS_ACCESS_KEY_ID"], other["AWS_SECRET_ACCESS_KEY"])
        with pytest.raises(ClientError) as refused:  # b's keys at a's server
            client({**other, "AWS_ENDPOINT_URL": first["AWS_ENDPOINT_URL"]}).list_buckets()
        assert refused.value.response["Error"]["Code"] == "InvalidAccessKeyId"
        for path, mode in ((dir_a, 0o700), (dir_a / "data", 0o700), (dir_a / "credentials", 0o600)):
            assert stat.S_IMODE(path.stat().st_mode) == mode, path
        stop(proc_a, signal.SIGTERM, port_a)
        stop(proc_b, signal.SIGTERM, port_b)
    assert proc_a.stderr is not None and keys[1] not in proc_a.stderr.read()
    stored = configparser.ConfigParser(interpolation=None)
    stored.read(dir_a / "credentials")
    assert tuple(stored["s3ckpt-local"].values()) == keys

    proc = subprocess.Popen(
        [*_SERVE, "--dir", str(dir_a), "--port", str(port_a)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = printed_lines(proc)
        assert lines[0] == "unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN"
        assert all(keys[1] not in line for line in lines)
        bucket = f"t-{uuid.uuid4().hex[:12]}"
        pasted = "\n".join([*lines, f"exec {sys.executable} -m s3ckpt --json mb s3://{bucket}"])
        stale = os.environ | {"AWS_ACCESS_KEY_ID": "stale", "AWS_SECRET_ACCESS_KEY": "stale-key"}
        done = subprocess.run(
            ["bash", "-c", pasted], env=stale, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["created"] is True
        stop(proc, signal.SIGINT, port_a)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(_STOP_WAIT_S)
    assert proc.stderr is not None and keys[1] not in proc.stderr.read()
    assert keys[1] not in (dir_a / "weed.log").read_text()


def test_serve_refuses_keys_that_others_may_know(tmp_path: Path) -> None:
    """A credentials file another user could read, or have written (a directory they can
    write to): its keys would open the server to them."""
    (tmp_path / "credentials").write_text(
        "[s3ckpt-local]\naws_access_key_id = known\naws_secret_access_key = known-secret-key\n"
    )
    (tmp_path / "credentials").chmod(0o644)
    command = [*_SERVE, "--dir", str(tmp_path), "--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"{tmp_path / 'credentials'} is not private to you (mode 0644" in done.stderr
    assert "known-secret-key" not in done.stderr and done.stdout == ""
    assert not (tmp_path / "weed.log").exists()


@pytest.mark.parametrize("planted", ["filer.toml", ".seaweedfs/filer.toml", "security.toml"])
def test_serve_refuses_a_dir_holding_seaweedfs_config(tmp_path: Path, planted: str) -> None:
    """weed used to run in --dir with HOME there, and so applied such files: this filer.toml
    would have moved the filer's store (every bucket and key) to another directory."""
    workdir, elsewhere = tmp_path / "d", tmp_path / "elsewhere"
    (workdir / planted).parent.mkdir(parents=True)
    (workdir / planted).write_text(f'[leveldb2]\nenabled = true\ndir = "{elsewhere}"\n')
    command = [*_SERVE, "--dir", str(workdir), "--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert str(workdir / planted) in done.stderr and "does not apply" in done.stderr
    assert done.stdout == ""
    assert not elsewhere.exists() and not (workdir / "weed.log").exists()


@pytest.mark.parametrize(
    "entry",
    [_SERVE, [sys.executable, "-m", "s3ckpt.tools.serve"]],
    ids=["s3ckpt-serve", "python-m-serve"],
)
def test_serve_on_a_taken_port_fails_naming_it(tmp_path: Path, entry: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [*entry, "--dir", str(tmp_path), "--port", str(port)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"port {port} " in done.stderr and "--port" in done.stderr
    assert done.stdout == ""
    assert not (tmp_path / "weed.log").exists()  # weed was never started
    assert not (tmp_path / "credentials").exists()  # keys of a failed start are not kept


def test_the_local_server_module_does_not_import_torch() -> None:
    probe = "import sys, s3ckpt.tools.serve; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout == "False\n", done.stderr


def test_mb_creates_the_bucket_and_again_says_it_exists(s3: S3Env, cli: Cli) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    try:
        assert cli("mb", f"s3://{name}")[:2] == (0, f"created s3://{name}\n")
        s3.client.head_bucket(Bucket=name)
        assert cli("mb", f"s3://{name}/")[:2] == (0, f"s3://{name} exists\n")
        code, out, _ = cli("--json", "mb", f"s3://{name}")
        assert code == 0
        assert json.loads(out) == {"bucket": name, "url": f"s3://{name}", "created": False}
    finally:
        s3.client.delete_bucket(Bucket=name)
    code, out, _ = cli("--json", "mb", f"s3://{name}")
    assert code == 0 and json.loads(out)["created"] is True
    s3.client.delete_bucket(Bucket=name)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_mb_takes_a_bucket_not_a_prefix(cli: Cli) -> None:
    code, _, err = cli("mb", "s3://some-bucket/run7")
    assert code == 2 and "s3://some-bucket" in err and "not a prefix" in err


class _WithStranger(SeaweedFS):
    """SeaweedFS with a second identity allowed only its own bucket."""

    def _identities(self) -> dict[str, object]:
        identities = super()._identities()
        stranger = {"accessKey": "stranger", "secretKey": "stranger-secret-key"}
        actions = [f"{a}:stranger-own" for a in ("Read", "Write", "List", "Admin")]
        identities["identities"].append(  # type: ignore[attr-defined]
            {"name": "stranger", "credentials": [stranger], "actions": actions}
        )
        return identities


def test_mb_of_a_bucket_someone_else_owns_fails_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with _WithStranger(tmp_path) as server:
        admin = server.endpoint
        theirs = f"t-{uuid.uuid4().hex[:12]}"
        owner = make_env(
            "seaweedfs", admin.endpoint_url, admin.access_key_id, admin.secret_access_key
        )
        owner.client.create_bucket(Bucket=theirs)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "stranger")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "stranger-secret-key")
        code = main(["--endpoint-url", admin.endpoint_url, "mb", f"s3://{theirs}"])
        _, err = capsys.readouterr()
        assert code == 1
        assert f"cannot use bucket s3://{theirs}" in err and "someone else" in err
        assert "stranger-secret-key" not in err
        # Its own bucket it may create, and make again.
        assert main(["--endpoint-url", admin.endpoint_url, "mb", "s3://stranger-own"]) == 0
        assert main(["--endpoint-url", admin.endpoint_url, "mb", "s3://stranger-own"]) == 0
        assert capsys.readouterr().out.splitlines() == [
            "created s3://stranger-own",
            "s3://stranger-own exists",
        ]


def test_a_save_to_a_missing_bucket_says_how_to_create_it(s3: S3Env, cli: Cli) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    state = {"w": torch.arange(6.0)}

    def save() -> None:
        dcp.save(state, storage_writer=S3Writer(f"s3://{name}/run/step-1", config=s3.config()))

    error = raised(save)
    assert isinstance(error, BucketNotFound), error
    assert f"create it with `s3ckpt mb s3://{name}`" in str(error)
    # Following the advice is enough.
    try:
        assert cli("mb", f"s3://{name}")[0] == 0
        save()
        keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=name)["Contents"]]
        assert "run/step-1/.metadata" in keys
    finally:
        for key in [o["Key"] for o in s3.client.list_objects_v2(Bucket=name).get("Contents", [])]:
            s3.client.delete_object(Bucket=name, Key=key)
        s3.client.delete_bucket(Bucket=name)
