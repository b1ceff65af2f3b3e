"""The test servers themselves: reachable, SigV4 enforced by SeaweedFS, and gone after stop()."""

from __future__ import annotations

import socket
from pathlib import Path

import boto3
import psutil
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from s3ckpt.tools.localserver import SeaweedFS
from tests.conftest import S3Env


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
