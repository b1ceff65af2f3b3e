"""Real S3 servers for the tests: one moto and one SeaweedFS per session, both on 127.0.0.1.

Tests take ``s3`` (run once per server) or ``moto`` / ``seaweedfs`` (one server), plus ``bucket``
for a fresh, emptied-afterwards bucket on the server ``s3`` names. ``S3Env.client`` is a plain
boto3 client: a backdoor to look at or tamper with what s3ckpt stored. For a ``bucket`` on one
server only: ``@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from s3ckpt.config import S3Config
from s3ckpt.tools.localserver import SeaweedFS, free_port

SERVERS = ["moto", "seaweedfs"]
REGION = "us-east-1"
_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Env:
    """One server as the tests see it: where it is, who to be, and a backdoor client."""

    name: str
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str
    client: BaseClient = field(repr=False, compare=False)

    def config(self, **overrides: Any) -> S3Config:
        """An `S3Config` for this server; ``overrides`` may replace the connection fields too."""
        settings: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }
        return S3Config(**(settings | overrides))


def make_env(name: str, endpoint_url: str, access_key_id: str, secret_access_key: str) -> S3Env:
    """The backdoor computes checksums only where S3 requires them, as the servers expect."""
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )
    return S3Env(name, endpoint_url, access_key_id, secret_access_key, REGION, client)


@pytest.fixture(scope="session", autouse=True)
def _isolated_aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The developer's AWS profile, keys, endpoint or proxy must not reach any test."""
    nowhere = tmp_path_factory.mktemp("aws-home")
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("AWS_"):
                patch.delenv(name)
        patch.setenv("AWS_CONFIG_FILE", str(nowhere / "config"))
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere / "credentials"))
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credentials: fail fast, not IMDS
        for name in ("NO_PROXY", "no_proxy"):
            patch.setenv(name, "127.0.0.1,localhost")
        yield


def _answers_http(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
    except OSError:
        return False
    finally:
        conn.close()
    return True


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """End the whole process group, forcefully if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


@pytest.fixture(scope="session")
def moto(_isolated_aws_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Env]:
    """A moto server in its own process: in-process mocks don't work with aiobotocore 3."""
    port = free_port()
    log_path: Path = tmp_path_factory.mktemp("moto") / "moto.log"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not _answers_http(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"moto server on port {port} did not start; log tail:\n{tail}")
            time.sleep(0.05)
        yield make_env("moto", f"http://127.0.0.1:{port}", "testing", "testing")
    finally:
        _terminate(proc)


@pytest.fixture(scope="session")
def seaweedfs(_isolated_aws_env: None) -> Iterator[S3Env]:
    """SeaweedFS checks SigV4 and checksums, which moto accepts blindly."""
    with SeaweedFS(startup_timeout=_STARTUP_TIMEOUT_S) as server:
        endpoint = server.endpoint
        yield make_env(
            "seaweedfs",
            endpoint.endpoint_url,
            endpoint.access_key_id,
            endpoint.secret_access_key,
        )


@pytest.fixture(scope="session")
def memory() -> S3Env:
    """s3ckpt's `MemoryStore` (``memory://tests``): for what does not test the wire. Its
    backdoor client answers the boto3 calls the tests make from the store's own state."""
    from s3ckpt.engine.memory import MemoryStore
    from s3ckpt.engine.store import get_store
    from tests.memclient import MemoryClient

    url = "memory://tests"
    store = get_store(S3Config(endpoint_url=url))
    assert isinstance(store, MemoryStore)
    return S3Env("memory", url, "memory", "memory", REGION, MemoryClient(store))  # type: ignore[arg-type]


@pytest.hookimpl(tryfirst=True)  # before the fixture's own params are applied
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.stores("memory")`` runs a test's ``s3`` on those stores instead of the
    servers: tests of s3ckpt's logic, not of the wire, run on the memory store alone (the
    conformance suite holds it to the servers' behaviour)."""
    marker = metafunc.definition.get_closest_marker("stores")
    if marker is None or "s3" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        if "s3" in (names.split(",") if isinstance(names, str) else names):
            return  # the test names its own servers
    # As a marker, so that pytest's own hooks see a direct parametrization of ``s3``.
    names = list(marker.args)
    metafunc.definition.add_marker(pytest.mark.parametrize("s3", names, indirect=True, ids=names))


@pytest.fixture(scope="session", params=SERVERS, ids=SERVERS)
def s3(request: pytest.FixtureRequest) -> S3Env:
    """Each test using it runs once per server (or per store its ``stores`` marker names); a
    server starts only when first needed."""
    env: S3Env = request.getfixturevalue(request.param)
    return env


def _delete_bucket(client: BaseClient, bucket: str) -> None:
    """Best effort, so a teardown never hides the failure that left things behind."""
    with contextlib.suppress(BotoCoreError, ClientError):
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
    with contextlib.suppress(BotoCoreError, ClientError):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    with contextlib.suppress(BotoCoreError, ClientError):
        client.delete_bucket(Bucket=bucket)


@pytest.fixture
def bucket(s3: S3Env) -> Iterator[str]:
    """A new bucket on the ``s3`` server, emptied and deleted after the test."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3.client.create_bucket(Bucket=name)
    yield name
    _delete_bucket(s3.client, name)


Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(s3: S3Env, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    """Runs the ``s3ckpt`` CLI in-process as a user would: credentials from the environment."""
    from s3ckpt.cli import main

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--endpoint-url", s3.endpoint_url, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run
