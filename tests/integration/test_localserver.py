"""The test servers themselves: reachable, SigV4 enforced by SeaweedFS, and gone after stop();
to other local users, nothing but S3."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import stat
import uuid
from pathlib import Path

import boto3
import psutil
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from s3ckpt.tools.localserver import SeaweedFS, free_port
from tests.conftest import S3Env, make_env


def test_put_and_get_through_the_backdoor(s3: S3Env, bucket: str) -> None:
    s3.client.put_object(Bucket=bucket, Key="a/b", Body=b"hello")
    assert s3.client.get_object(Bucket=bucket, Key="a/b")["Body"].read() == b"hello"
    listed = s3.client.list_objects_v2(Bucket=bucket)["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [("a/b", 5)]


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
@pytest.mark.parametrize(
    ("access_key", "code"),
    [(None, "SignatureDoesNotMatch"), ("nobody", "InvalidAccessKeyId")],
)
def test_seaweedfs_refuses_bad_credentials(
    s3: S3Env, bucket: str, access_key: str | None, code: str
) -> None:
    impostor = boto3.session.Session().client(
        "s3",
        endpoint_url=s3.endpoint_url,
        region_name=s3.region,
        aws_access_key_id=access_key or s3.access_key_id,
        aws_secret_access_key="not-the-secret",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    with pytest.raises(ClientError) as info:
        impostor.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert info.value.response["Error"]["Code"] == code
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert s3.client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def _weed_processes(workdir: Path) -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if f"-dir={workdir / 'data'}" in child.cmdline():
                found.append(child)
        except psutil.Error:  # exited meanwhile
            continue
    return found


def test_seaweedfs_stop_ends_the_process_and_frees_the_port(tmp_path: Path) -> None:
    server = SeaweedFS(tmp_path)
    port = int(server.start().endpoint_url.rsplit(":", 1)[1])
    assert server.start() == server.endpoint  # a second start() keeps the running server
    (process,) = _weed_processes(tmp_path)
    server.stop()
    assert not psutil.pid_exists(process.pid)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    assert (tmp_path / "weed.log").is_file()  # a workdir the caller chose is kept
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.endpoint


def test_seaweedfs_that_is_not_ready_in_time_is_killed_with_its_log(tmp_path: Path) -> None:
    server = SeaweedFS(tmp_path, startup_timeout=0.01)
    with pytest.raises(RuntimeError, match="did not become ready") as info:
        server.start()
    assert "log tail" in str(info.value)
    assert _weed_processes(tmp_path) == []


def _status(port: int, method: str, path: str, tls: ssl.SSLContext | None) -> int | None:
    """What an HTTP request without credentials gets: its status, None if it got no answer."""
    conn = (
        http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        if tls is None
        else http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls)
    )
    try:
        conn.request(method, path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):  # ssl.SSLError is an OSError
        return None
    finally:
        conn.close()


def _stored(server: SeaweedFS, body: bytes) -> tuple[S3Env, str, str]:
    endpoint = server.endpoint
    env = make_env(
        "seaweedfs", endpoint.endpoint_url, endpoint.access_key_id, endpoint.secret_access_key
    )
    bucket, key = f"t-{uuid.uuid4().hex[:12]}", "run/step-1/.metadata"
    env.client.create_bucket(Bucket=bucket)
    env.client.put_object(Bucket=bucket, Key=key, Body=body)
    return env, bucket, key


def test_only_s3_is_open_to_other_local_users(tmp_path: Path) -> None:
    """What any local user did before: GET and DELETE of an object through the filer's HTTP
    port, no credentials needed. Every port but S3 (master, volume, filer, admin; HTTP and gRPC)
    now answers neither plain HTTP nor TLS without the server's client certificate, and weed's
    unix sockets are its user's alone."""
    body = os.urandom(1 << 20)
    no_certificate = ssl.create_default_context()
    no_certificate.check_hostname = False
    no_certificate.verify_mode = ssl.CERT_NONE
    with SeaweedFS(tmp_path) as server:
        env, bucket, key = _stored(server, body)
        (weed,) = _weed_processes(tmp_path)
        s3_port = int(server.endpoint.endpoint_url.rsplit(":", 1)[1])
        listening = {c.laddr.port for c in weed.net_connections("inet") if c.status == "LISTEN"}
        others = sorted(listening - {s3_port})
        assert len(others) >= 8, others  # master, volume, filer, admin: HTTP and gRPC each
        for port in others:
            for method in ("GET", "DELETE"):
                for path in (f"/buckets/{bucket}/{key}", "/"):
                    answered = _status(port, method, path, tls=None)
                    assert answered is None or answered >= 400, (port, method, path, answered)
                    assert _status(port, method, path, no_certificate) is None, (port, method)
        assert env.client.get_object(Bucket=bucket, Key=key)["Body"].read() == body
        sockets = {c.laddr for c in weed.net_connections("unix") if c.laddr}
        assert sockets
        for path in sockets:
            assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0, path


def test_flags_left_in_the_data_dir_do_not_apply(tmp_path: Path) -> None:
    """weed mini applies data/mini.options to every flag left at its default: this one would
    open a filer port that serves every object without TLS."""
    public = free_port()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mini.options").write_text(f"filer.port.public={public}\n")
    with SeaweedFS(tmp_path) as server:
        env, bucket, key = _stored(server, b"private")
        assert _status(public, "GET", f"/buckets/{bucket}/{key}", tls=None) is None
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", public)):
            pass
        assert env.client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"private"
