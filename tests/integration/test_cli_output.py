"""What the ``s3ckpt`` command shows a user: a start without torch, errors as JSON under
``--json``, one error line (not tens of retries) for a store that is down, and progress bars
only on a terminal. The commands run in subprocesses, as a user's shell runs them; a
pseudo-terminal (`pty`) stands in for the terminal."""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Sequence

import pytest

from s3ckpt.cli.base import Session
from s3ckpt.config import S3Config
from s3ckpt.tools.localserver import free_port
from tests.conftest import Cli, S3Env

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

_TIMEOUT_S = 120


def _python(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )


def _user_env(s3: S3Env | None = None) -> dict[str, str]:
    """Credentials from the environment, as a user sets them; a server's if given."""
    env = os.environ | {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    if s3 is not None:
        env |= {
            "AWS_ACCESS_KEY_ID": s3.access_key_id,
            "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
            "AWS_ENDPOINT_URL": s3.endpoint_url,
        }
    return env


def test_version_does_not_import_torch() -> None:
    shown = _python("-X", "importtime", "-m", "s3ckpt", "--version")
    assert shown.returncode == 0 and shown.stdout.startswith("s3ckpt ")
    imported = [line.rpartition("|")[2].strip() for line in shown.stderr.splitlines()]
    assert "s3ckpt.cli" in imported, "-X importtime lists what was imported"
    assert not [name for name in imported if name.split(".")[0] == "torch"]
    script = "import json, sys; from s3ckpt.cli import main; main(['--version']); "
    script += "print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(_python("-c", script).stdout.splitlines()[-1])
    assert "s3ckpt.cli.data" in modules and "torch" not in modules


def test_import_s3ckpt_is_lazy_but_complete() -> None:
    script = """
import sys
import s3ckpt
print("torch" in sys.modules, sorted(set(s3ckpt.__all__) - set(dir(s3ckpt))))
writer = s3ckpt.S3Writer
from s3ckpt import S3Reader, S3Writer, WriteOptions, BucketNotFound
print("torch" in sys.modules, writer is S3Writer, S3Reader.__module__, WriteOptions.__name__)
try:
    s3ckpt.S3Nothing
except AttributeError as e:
    print(e)
"""
    ran = _python("-c", script)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "False []",
        "True True s3ckpt.dcp.reader WriteOptions",
        "module 's3ckpt' has no attribute 'S3Nothing'",
    ]


@pytest.fixture(scope="module")
def closed_port() -> int:
    """Nothing listens there: connections are refused at once, as from a store that is down."""
    return free_port()


def _down(closed_port: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """The window (1.5 s) holds several attempts even when creating the client is slow."""
    endpoint = f"http://127.0.0.1:{closed_port}"
    command = ["-m", "s3ckpt", "--endpoint-url", endpoint, "--retry-timeout", "1.5", *argv]
    return _python(*command, env=_user_env())


def test_a_store_that_is_down_is_one_warning_one_error_and_retries_only_with_verbose(
    closed_port: int,
) -> None:
    quiet = _down(closed_port, "ls", "s3://down-bucket/run")
    assert quiet.returncode == 1 and quiet.stdout == ""
    warning, line = quiet.stderr.splitlines()  # the window's one warning, then the error
    assert warning.startswith("s3ckpt: warning: ") and "retrying for up to 1.5 s" in warning
    assert f"127.0.0.1:{closed_port}" in warning
    assert line.startswith("s3ckpt: error: ") and "down-bucket" in line
    assert f"127.0.0.1:{closed_port}" in line
    verbose = _down(closed_port, "-v", "ls", "s3://down-bucket/run")
    assert verbose.returncode == 1 and verbose.stdout == ""
    warning, *retries, last = verbose.stderr.splitlines()
    assert warning.startswith("s3ckpt: warning: ")
    assert retries and all("retrying in" in r and r.startswith("s3ckpt: info: ") for r in retries)
    assert last.startswith("s3ckpt: error: ") and "down-bucket" in last


def test_json_errors_go_to_stdout_with_type_message_and_url(closed_port: int) -> None:
    down = _down(closed_port, "--json", "ls", "s3://down-bucket/run")
    assert down.returncode == 1
    assert all(line.startswith("s3ckpt: warning: ") for line in down.stderr.splitlines())
    error = json.loads(down.stdout)
    assert error["error"] == "EndpointUnreachable"
    assert error["url"].startswith("s3://down-bucket") and "down-bucket" in error["message"]
    usage = _down(closed_port, "--json", "frobnicate")
    assert usage.returncode == 2 and usage.stderr == ""
    assert json.loads(usage.stdout)["error"] == "UsageError"
    plain = _down(closed_port, "frobnicate")
    assert plain.returncode == 2 and plain.stdout == "" and "invalid choice" in plain.stderr


def test_json_errors_keep_their_exit_codes(cli: Cli, bucket: str) -> None:
    code, out, err = cli("--json", "ls", "s3://no-such-bucket-s3ckpt/run")
    error = json.loads(out)
    assert (code, err, error["error"]) == (1, "", "BucketNotFound")
    assert error["url"].startswith("s3://no-such-bucket-s3ckpt") and "exist" in error["message"]
    code, out, _ = cli("ls", "bucket/run", "--json")
    assert (code, json.loads(out)["error"], json.loads(out)["url"]) == (2, "ConfigError", None)
    code, out, _ = cli("--json", "export", f"s3://{bucket}/nothing", "out.pt")
    error = json.loads(out)
    assert (code, error["error"], error["url"]) == (
        3,
        "CheckpointNotFound",
        f"s3://{bucket}/nothing",
    )
    code, out, _ = cli("--json", "rm", f"s3://{bucket}/nothing")
    assert (code, json.loads(out)["error"]) == (2, "UsageError")
    code, out, err = cli("ls", "s3://no-such-bucket-s3ckpt/run")
    assert code == 1 and out == "" and err.startswith("s3ckpt: error: ")


def _on_terminal(argv: Sequence[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal of 100 columns: (exit code, stdout, terminal)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    ) as proc:
        os.close(follower)
        shown = bytearray()
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            shown += chunk
        os.close(leader)
        out, _ = proc.communicate(timeout=_TIMEOUT_S)
    return proc.returncode, out, shown.decode(errors="replace")


_BENCH = ("-m", "s3ckpt", "bench", "--size", "15", "--part-size", "5")


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_bench_draws_bars_of_bytes_and_requests_on_a_terminal(s3: S3Env, bucket: str) -> None:
    code, out, terminal = _on_terminal([*_BENCH, f"s3://{bucket}/probe"], _user_env(s3))
    assert code == 0, terminal
    assert out.splitlines()[0] == f"endpoint:  {s3.endpoint_url}"
    for phase, unit in (("upload", "parts"), ("download", "GETs")):
        final = [line for line in terminal.split("\r") if f"bench: {phase}: 100%" in line]
        assert final and f"3/3 {unit}" in final[-1] and "15.0M/15.0M" in final[-1], terminal
        assert "B/s" in final[-1]
    code, out, terminal = _on_terminal([*_BENCH, f"s3://{bucket}/probe", "--json"], _user_env(s3))
    assert code == 0 and json.loads(out)["upload"]["requests"] == 3
    assert "%" not in terminal and "\r" not in terminal.replace("\r\n", "\n")


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_off_a_terminal_only_the_result_and_one_note(s3: S3Env, bucket: str) -> None:
    ran = _python(*_BENCH, f"s3://{bucket}/probe", env=_user_env(s3))
    assert ran.returncode == 0, ran.stderr
    (note,) = ran.stderr.splitlines()
    assert note.startswith("bench: writing 15.0 MiB to ") and "\r" not in ran.stderr
    assert [line.split(":")[0] for line in ran.stdout.splitlines()] == [
        "endpoint",
        "settings",
        "upload",
        "download",
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_counts_bytes_and_shows_objects_and_keeps_two_argument_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    session = Session(argparse.Namespace(json=False, command="rm"), S3Config())
    with session.progress() as bar:
        assert bar is not None
        bar(4, 4, 3 * 1024 * 1024, 3 * 1024 * 1024)
    assert "4/4 obj" in terminal.getvalue() and "3.00M/3.00M" in terminal.getvalue()
    terminal.truncate(0)
    with session.progress() as bar:
        assert bar is not None
        bar(2, 5)
    assert "2/5" in terminal.getvalue() and "obj/s" in terminal.getvalue()
    quiet = Session(argparse.Namespace(json=True, command="rm"), S3Config())
    with quiet.progress() as bar:
        assert bar is None


def test_a_bar_is_drawn_at_its_first_count_not_before(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    session = Session(argparse.Namespace(json=False, command="prune", yes=True), S3Config())
    with session.progress() as bar:
        assert bar is not None
        assert terminal.getvalue() == ""  # a prompt written now stands alone on its line
        bar(1, 2)
    assert "1/2" in terminal.getvalue()
