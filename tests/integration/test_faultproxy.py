"""The fault proxy itself: what each fault looks like to a plain boto3 client, on both servers.

The resilience tests trust these behaviours; if one changes, they would pass for the wrong reason.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)

from s3ckpt.testing.faultproxy import (
    Corrupt,
    Delay,
    Fault,
    FaultProxy,
    LateApply,
    RateLimit,
    ResetAfter,
    ResetBefore,
    ResetMidBody,
    Status,
    TrickleHead,
    Truncate,
    classify,
)
from tests.conftest import S3Env

pytestmark = pytest.mark.stores(
    "seaweedfs"
)  # the proxy's own behaviour: one real server behind it is enough (CI time)

MiB = 1024 * 1024


def client_for(s3: S3Env, endpoint_url: str, verify: str | None = None, **config: Any) -> Any:
    """A boto3 client for the proxy that never retries, so every injected fault surfaces."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=s3.region,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret_access_key,
        verify=verify,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"total_max_attempts": 1},
            **config,
        ),
    )


def exists(client: BaseClient, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=key)
    except ClientError as error:
        if error.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return False
        raise
    return True


def differing_offsets(a: bytes, b: bytes) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def test_passthrough_streams_every_operation_and_counts_it(s3: S3Env, bucket: str) -> None:
    """SigV4 still verifies (SeaweedFS checks it) because the Host header reaches it unchanged."""
    data = os.urandom(3 * MiB)
    parts = [os.urandom(5 * MiB), os.urandom(MiB)]
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        client.put_object(Bucket=bucket, Key="a/plain", Body=data)
        assert client.get_object(Bucket=bucket, Key="a/plain")["Body"].read() == data
        upload = client.create_multipart_upload(Bucket=bucket, Key="a/multi")["UploadId"]
        etags = [
            client.upload_part(
                Bucket=bucket, Key="a/multi", UploadId=upload, PartNumber=n, Body=part
            )["ETag"]
            for n, part in enumerate(parts, start=1)
        ]
        client.complete_multipart_upload(
            Bucket=bucket,
            Key="a/multi",
            UploadId=upload,
            MultipartUpload={
                "Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, start=1)]
            },
        )
        assert client.head_object(Bucket=bucket, Key="a/multi")["ContentLength"] == 6 * MiB
        listed = client.list_objects_v2(Bucket=bucket, Prefix="a/")["Contents"]
        assert sorted(o["Key"] for o in listed) == ["a/multi", "a/plain"]
        stored = s3.client.get_object(Bucket=bucket, Key="a/multi")["Body"].read()
        assert stored == b"".join(parts)
        client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": "a/plain"}, {"Key": "a/multi"}]}
        )
        assert proxy.requests == Counter(
            PutObject=1,
            GetObject=1,
            CreateMultipartUpload=1,
            UploadPart=2,
            CompleteMultipartUpload=1,
            HeadObject=1,
            ListObjectsV2=1,
            DeleteObjects=1,
        )
        assert proxy.faults == []
        assert proxy.served["GetObject"] == len(data)  # the bodies it relayed
    assert s3.client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_status_answers_an_s3_error_without_forwarding(s3: S3Env, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(Status(503, "SlowDown"), op="PutObject", times=1)
        proxy.add_rule(Status(500, "InternalError"), op="HeadObject", times=1)
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=bucket, Key="k", Body=os.urandom(2 * MiB))
        assert info.value.response["Error"]["Code"] == "SlowDown"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert not exists(s3.client, bucket, "k")
        client.put_object(Bucket=bucket, Key="k", Body=b"x")  # same connection, still usable
        with pytest.raises(ClientError) as info:
            client.head_object(Bucket=bucket, Key="k")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500


def test_late_apply_answers_an_error_and_applies_the_request_later(s3: S3Env, bucket: str) -> None:
    """The client sees a 503; the request reaches the server a second later all the same."""
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(LateApply(Status(503, "SlowDown"), 1.0), op="PutObject", times=1)
        body = os.urandom(2 * MiB)
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=bucket, Key="k", Body=body)
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert not exists(s3.client, bucket, "k")
        deadline = time.monotonic() + 10.0
        while not exists(s3.client, bucket, "k"):
            assert time.monotonic() < deadline, "the held request was never applied"
            time.sleep(0.05)
        assert s3.client.get_object(Bucket=bucket, Key="k")["Body"].read() == body


def test_rate_limit_forwards_its_rate_and_refuses_the_rest_with_slowdown(
    s3: S3Env, bucket: str
) -> None:
    """A burst of 5, then 20 requests/s: of 60 HEADs sent back to back, the first 5 and about
    one per 50 ms pass; after a pause of half a second the bucket is full again: 5, not 10. A
    refused PUT (at 1/s, so that a slow machine's pauses refill nothing) is never forwarded."""
    s3.client.put_object(Bucket=bucket, Key="k", Body=b"x")
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        rule = proxy.add_rule(RateLimit(20, burst=5), op="HeadObject")
        proxy.add_rule(RateLimit(1, burst=1), op="PutObject")

        def head() -> int:
            try:
                return int(client.head_object(Bucket=bucket, Key="k")["ContentLength"])
            except ClientError as error:
                assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 503
                return -1

        began = time.monotonic()
        answers = [head() for _ in range(60)]
        elapsed = time.monotonic() - began
        admitted = answers.count(1)
        assert answers[:5] == [1] * 5 and answers.count(-1) == rule.fired
        assert 5 <= admitted <= 5 + 20 * elapsed + 1, (admitted, elapsed)
        assert rule.fired > 0 and rule.matched == 60 == proxy.requests["HeadObject"]
        time.sleep(0.5)  # ten tokens' worth, of which the bucket holds five
        began = time.monotonic()
        answers = [head() for _ in range(10)]
        refilled = 20 * (time.monotonic() - began)
        assert answers[:5] == [1] * 5 and answers.count(1) <= 5 + refilled + 1, refilled
        client.put_object(Bucket=bucket, Key="first", Body=b"y")
        with pytest.raises(ClientError) as info:  # a refused PUT is not forwarded
            client.put_object(Bucket=bucket, Key="refused", Body=b"y")
        assert info.value.response["Error"]["Code"] == "SlowDown"
        assert exists(s3.client, bucket, "first") and not exists(s3.client, bucket, "refused")
        time.sleep(1.1)  # a token again: the next PUT is forwarded
        client.put_object(Bucket=bucket, Key="admitted", Body=b"y")
        assert exists(s3.client, bucket, "admitted")


def test_trickle_head_sends_the_response_head_slowly(s3: S3Env, bucket: str) -> None:
    """The status line arrives at once; the rest of the head takes seconds, so every read gets
    bytes well within the read timeout."""
    s3.client.put_object(Bucket=bucket, Key="k", Body=b"x")
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url, read_timeout=1.0)
        proxy.add_rule(TrickleHead(100), op="HeadObject", times=1)
        began = time.monotonic()
        assert client.head_object(Bucket=bucket, Key="k")["ContentLength"] == 1
        assert time.monotonic() - began > 1.5  # a head of a few hundred bytes at 100 B/s


def test_reset_before_drops_the_connection_unforwarded(s3: S3Env, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(ResetBefore(), op="PutObject", times=1)
        with pytest.raises(ConnectionClosedError):
            client.put_object(Bucket=bucket, Key="k", Body=os.urandom(MiB))
        assert not exists(s3.client, bucket, "k")
        assert proxy.faults == [Fault("PutObject", "k", ResetBefore())]


def test_reset_after_the_server_acted(s3: S3Env, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(ResetAfter(), op="PutObject", times=1)
        with pytest.raises(ConnectionClosedError):
            client.put_object(Bucket=bucket, Key="k", Body=b"done")
        assert exists(s3.client, bucket, "k")


@pytest.mark.parametrize(
    ("action", "symptom"),
    [(ResetMidBody(), "Connection reset"), (Truncate(), "IncompleteRead")],
    ids=["reset_mid_body", "truncate"],
)
def test_broken_response_body(s3: S3Env, bucket: str, action: Any, symptom: str) -> None:
    """The head arrives intact, so the failure surfaces only while reading the body."""
    s3.client.put_object(Bucket=bucket, Key="k", Body=os.urandom(2 * MiB))
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(action, op="GetObject", times=1)
        response = client.get_object(Bucket=bucket, Key="k")
        assert response["ContentLength"] == 2 * MiB
        with pytest.raises(ResponseStreamingError, match=symptom):
            response["Body"].read()
        assert len(client.get_object(Bucket=bucket, Key="k")["Body"].read()) == 2 * MiB


def test_delay_before_forwarding(s3: S3Env, bucket: str) -> None:
    """The client times out before the server sees anything; the request still lands later."""
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url, read_timeout=0.2)
        proxy.add_rule(Delay(0.8), op="PutObject", times=1)
        with pytest.raises(ReadTimeoutError):
            client.put_object(Bucket=bucket, Key="k", Body=b"late")
        assert not exists(s3.client, bucket, "k")
        deadline = time.monotonic() + 5.0
        while not exists(s3.client, bucket, "k"):
            assert time.monotonic() < deadline, "the delayed request was never forwarded"
            time.sleep(0.05)


def test_delay_after_the_server_answered(s3: S3Env, bucket: str) -> None:
    """The client times out, yet the server already executed the request."""
    s3.client.put_object(Bucket=bucket, Key="warm-up", Body=b"")  # a fresh bucket's first write
    with FaultProxy(s3.endpoint_url) as proxy:  # can take SeaweedFS longer than the timeout
        client = client_for(s3, proxy.endpoint_url, read_timeout=0.3)
        proxy.add_rule(Delay(1.0, where="response"), op="PutObject", times=1)
        with pytest.raises(ReadTimeoutError):
            client.put_object(Bucket=bucket, Key="k", Body=b"done")
        assert exists(s3.client, bucket, "k")


def test_corrupt_response_flips_the_middle_byte(s3: S3Env, bucket: str) -> None:
    data = os.urandom(MiB + 3)
    s3.client.put_object(Bucket=bucket, Key="k", Body=data)
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(Corrupt("response"), op="GetObject", times=1)
        got = client.get_object(Bucket=bucket, Key="k")["Body"].read()
        assert differing_offsets(got, data) == [len(data) // 2]
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == data


def test_corrupt_request_reaches_the_server(s3: S3Env, bucket: str) -> None:
    """Without Content-MD5 or x-amz-checksum-* both servers store the damaged body; SeaweedFS
    does not even check the body against the signed x-amz-content-sha256."""
    data = os.urandom(MiB + 3)
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(Corrupt("request"), op="PutObject", times=1)
        client.put_object(Bucket=bucket, Key="k", Body=data)
    stored = s3.client.get_object(Bucket=bucket, Key="k")["Body"].read()
    assert differing_offsets(stored, data) == [len(data) // 2]


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
@pytest.mark.parametrize("checksum", ["Content-MD5", "CRC32"])
def test_seaweedfs_rejects_a_corrupt_body_with_a_checksum(
    s3: S3Env, bucket: str, checksum: str
) -> None:
    """moto accepts both silently."""
    data = os.urandom(MiB)
    extra: dict[str, str] = (
        {"ContentMD5": base64.b64encode(hashlib.md5(data).digest()).decode()}
        if checksum == "Content-MD5"
        else {"ChecksumAlgorithm": "CRC32"}
    )
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(Corrupt("request"), op="PutObject", times=1)
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=bucket, Key="k", Body=data, **extra)
    assert info.value.response["Error"]["Code"] == "BadDigest"
    assert not exists(s3.client, bucket, "k")


def test_count_rule_fires_exactly_n_times_after_skipping(s3: S3Env, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        rule = proxy.add_rule(
            Status(500, "InternalError"), op="PutObject", key="victim", times=3, after=1
        )
        outcomes = []
        for _ in range(5):
            client.put_object(Bucket=bucket, Key="bystander", Body=b"x")
            try:
                client.put_object(Bucket=bucket, Key="dir/victim-1", Body=b"x")
            except ClientError:
                outcomes.append("fail")
            else:
                outcomes.append("ok")
        assert outcomes == ["ok", "fail", "fail", "fail", "ok"]
        assert (rule.matched, rule.fired) == (5, 3)
        assert [f.key for f in proxy.faults] == ["dir/victim-1"] * 3
        assert proxy.requests["PutObject"] == 10


def test_removed_rule_stops_firing(s3: S3Env, bucket: str) -> None:
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        rule = proxy.add_rule(Status(500, "InternalError"), op=["PutObject", "GetObject"])
        with pytest.raises(ClientError):
            client.put_object(Bucket=bucket, Key="k", Body=b"x")
        proxy.remove_rule(rule)
        client.put_object(Bucket=bucket, Key="k", Body=b"x")
        assert rule.fired == 1


def test_probability_follows_the_injected_rng(s3: S3Env, bucket: str) -> None:
    s3.client.put_object(Bucket=bucket, Key="k", Body=b"x")
    with FaultProxy(s3.endpoint_url, rng=random.Random(7)) as proxy:
        client = client_for(s3, proxy.endpoint_url)
        proxy.add_rule(Status(503, "SlowDown"), op="HeadObject", probability=0.5)
        failed = []
        for _ in range(20):
            try:
                client.head_object(Bucket=bucket, Key="k")
            except ClientError:
                failed.append(True)
            else:
                failed.append(False)
    expected_rng = random.Random(7)
    assert failed == [expected_rng.random() < 0.5 for _ in range(20)]
    assert 0 < sum(failed) < 20


def test_many_concurrent_connections(s3: S3Env, bucket: str) -> None:
    """Reads only: a burst of concurrent writes can leave SeaweedFS slow to stop (10 s)."""
    data = os.urandom(MiB)
    s3.client.put_object(Bucket=bucket, Key="k", Body=data)
    with FaultProxy(s3.endpoint_url) as proxy:
        client = client_for(s3, proxy.endpoint_url, max_pool_connections=48)

        def read(_: int) -> bool:
            return bool(client.get_object(Bucket=bucket, Key="k")["Body"].read() == data)

        with ThreadPoolExecutor(48) as pool:
            assert all(pool.map(read, range(144)))
        assert proxy.requests == Counter(GetObject=144)


def test_tls_proxy_needs_its_ca(s3: S3Env, bucket: str) -> None:
    data = os.urandom(MiB)
    with FaultProxy(s3.endpoint_url, tls=True) as proxy:
        assert proxy.endpoint_url.startswith("https://127.0.0.1:")
        ca = Path(proxy.ca_bundle)
        trusting = client_for(s3, proxy.endpoint_url, verify=str(ca))
        trusting.put_object(Bucket=bucket, Key="k", Body=data)
        assert trusting.get_object(Bucket=bucket, Key="k")["Body"].read() == data
        with pytest.raises(SSLError):
            client_for(s3, proxy.endpoint_url).head_object(Bucket=bucket, Key="k")
    assert not ca.exists()


def test_stop_releases_the_port() -> None:
    proxy = FaultProxy("http://127.0.0.1:9")
    with proxy:
        port = int(proxy.endpoint_url.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    proxy.stop()  # twice is harmless


PIECES = [os.urandom(1000), os.urandom(70_000), os.urandom(5)]


class _Framings(BaseHTTPRequestHandler):
    """An upstream using the framings S3 servers rarely do: a chunked answer (GET .../chunked),
    one delimited by closing (other GETs), and an echo of a chunked request body (PUT)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path.endswith("/chunked"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in PIECES:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\nx-trailer: kept\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"".join(PIECES))
            self.close_connection = True

    def do_PUT(self) -> None:
        body = b""
        while size := int(self.rfile.readline().split(b";")[0], 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        while self.rfile.readline() != b"\r\n":
            pass
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: pytest shows stderr of failing tests."""


class _ResetTolerantServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """The proxy resets upstream connections on purpose; anything else is still reported."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def framings() -> Iterator[str]:
    server = _ResetTolerantServer(("127.0.0.1", 0), _Framings)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def fetch(proxy: FaultProxy, method: str, path: str, body: Any = None) -> bytes:
    port = int(proxy.endpoint_url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, encode_chunked=body is not None)
        return conn.getresponse().read()
    finally:
        conn.close()


def test_chunked_and_close_delimited_bodies_pass_through(framings: str) -> None:
    with FaultProxy(framings) as proxy:
        assert fetch(proxy, "GET", "/b/chunked") == b"".join(PIECES)
        assert fetch(proxy, "GET", "/b/eof") == b"".join(PIECES)
        assert fetch(proxy, "PUT", "/b/echo", iter(PIECES)) == b"".join(PIECES)


def test_faults_on_chunked_and_close_delimited_bodies(framings: str) -> None:
    """Without a length the fault hits the middle of the first chunk (or first read)."""
    with FaultProxy(framings) as proxy:
        proxy.add_rule(Truncate(), op="GetObject", key="chunked", times=1)
        with pytest.raises(http.client.IncompleteRead):
            fetch(proxy, "GET", "/b/chunked")
        proxy.add_rule(Corrupt("request"), op="PutObject", times=1)
        echoed = fetch(proxy, "PUT", "/b/echo", iter(PIECES))
        assert differing_offsets(echoed, b"".join(PIECES)) == [len(PIECES[0]) // 2]
        proxy.add_rule(Corrupt("response"), op="GetObject", key="eof", times=1)
        assert len(differing_offsets(fetch(proxy, "GET", "/b/eof"), b"".join(PIECES))) == 1


@pytest.mark.parametrize(
    ("method", "target", "copy", "expected"),
    [
        ("GET", "/", False, ("ListBuckets", "")),
        ("PUT", "/b", False, ("CreateBucket", "")),
        ("GET", "/b?list-type=2&prefix=a%2F", False, ("ListObjectsV2", "")),
        ("GET", "/b?uploads", False, ("ListMultipartUploads", "")),
        ("POST", "/b?delete", False, ("DeleteObjects", "")),
        ("PUT", "/b/dir/k%20x", False, ("PutObject", "dir/k x")),
        ("PUT", "/b/k", True, ("CopyObject", "k")),
        ("PUT", "/b/k?partNumber=2&uploadId=u", False, ("UploadPart", "k")),
        ("PUT", "/b/k?partNumber=2&uploadId=u", True, ("UploadPartCopy", "k")),
        ("POST", "/b/k?uploads", False, ("CreateMultipartUpload", "k")),
        ("POST", "/b/k?uploadId=u", False, ("CompleteMultipartUpload", "k")),
        ("DELETE", "/b/k?uploadId=u", False, ("AbortMultipartUpload", "k")),
        ("GET", "/b/k?uploadId=u", False, ("ListParts", "k")),
        ("GET", "/b/k", False, ("GetObject", "k")),
        ("HEAD", "/b/k", False, ("HeadObject", "k")),
        ("DELETE", "/b/k", False, ("DeleteObject", "k")),
        ("PATCH", "/b/k", False, ("Unknown", "k")),
    ],
)
def test_classify(method: str, target: str, copy: bool, expected: tuple[str, str]) -> None:
    assert classify(method, target, copy) == expected


def test_unknown_operation_names_are_refused() -> None:
    with pytest.raises(ValueError, match="PutObjects"):
        FaultProxy("http://127.0.0.1:9").add_rule(ResetBefore(), op=["PutObject", "PutObjects"])
