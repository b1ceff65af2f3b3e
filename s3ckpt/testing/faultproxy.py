"""A fault-injecting reverse proxy in front of a real S3 server, optionally terminating TLS.

Faults injected at the HTTP/TCP level (S3 errors, resets, truncated, corrupted or trickling
bodies, stalls; for a number of requests or for a time window) exercise the whole client stack —
aiohttp, aiobotocore's retries, s3ckpt's error mapping — the way a flaky network or an overloaded
store does, which mocking botocore cannot.

Requests are forwarded byte for byte apart from ``Expect: 100-continue``, which the proxy answers
itself (SigV4 does not sign it); the Host header is kept as the client sent it, so signatures
made for the proxy's address still verify upstream. Each client connection gets its own upstream
connection, kept alive as long as both sides allow; bodies are streamed, never held whole.

    with FaultProxy(s3.endpoint_url) as proxy:
        rule = proxy.add_rule(Status(503, "SlowDown"), op="UploadPart", times=2)
        ...  # a client with endpoint_url=proxy.endpoint_url
        assert rule.fired == 2
        proxy.add_rule(Status(503, "SlowDown"), for_seconds=5)  # a brownout: 5 s, then healthy
        proxy.add_rule(RateLimit(20))  # a store admitting 20 requests/s, SlowDown beyond

Limits: operations are inferred from path-style requests only (all a 127.0.0.1 endpoint gets);
the upstream must be plain HTTP; a response-body fault on a response without a body (HEAD, most
PUTs) only closes the connection after a complete answer (use `ResetAfter` there); on a body
delimited by closing the connection, `Truncate` is indistinguishable from a complete body; an
unreachable upstream closes the client connection instead of answering 502.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import http
import ipaddress
import random
import shutil
import socket
import ssl
import struct
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, cast
from urllib.parse import parse_qsl, unquote, urlsplit
from xml.sax.saxutils import escape

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "OPERATIONS",
    "Action",
    "Corrupt",
    "Delay",
    "Fault",
    "FaultProxy",
    "LateApply",
    "RateLimit",
    "ResetAfter",
    "ResetBefore",
    "ResetMidBody",
    "Rule",
    "Status",
    "Trickle",
    "TrickleHead",
    "Truncate",
    "classify",
    "make_tls_files",
]

_PIECE = 1024 * 1024  # bytes moved per read: big enough for tens of MiB, small enough to stream
_HEAD_LIMIT = 256 * 1024  # longest request/response head accepted
_STOP_TIMEOUT_S = 10.0
_TICK_S = 0.05  # a trickle sends a piece this often, so no read on the client side waits long


# --- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Status:
    """Answer with an S3 error instead of forwarding, as an overloaded or failing store does.

    The request body is read and discarded first, so the connection stays usable.
    """

    code: int
    error_code: str
    message: str = "Injected by FaultProxy"


@dataclass(frozen=True)
class ResetBefore:
    """Reset the connection (TCP RST) once the request head arrived: nothing is forwarded."""


@dataclass(frozen=True)
class ResetAfter:
    """Forward, wait for the server's answer, then reset without relaying any of it: the server
    acted but the client cannot know (a commit that may or may not have happened)."""


@dataclass(frozen=True)
class ResetMidBody:
    """Forward, send the response head and ``keep`` of its body, then reset the connection."""

    keep: float = 0.5


@dataclass(frozen=True)
class Truncate:
    """Forward, send the response head (Content-Length intact) and ``keep`` of the body, then
    close the connection cleanly (FIN): the client must notice the short body itself."""

    keep: float = 0.5


@dataclass(frozen=True)
class Delay:
    """Stall ``seconds`` before forwarding (``request``) or before relaying the answer
    (``response``: the server already acted, as when a request that timed out succeeded anyway).

    A delayed request is still forwarded if its client gave up meanwhile but all of its bytes had
    arrived, as a slow server would still execute it. With ``until``, the stall ends as soon as
    that event is set (at most ``seconds``): a test that races something against the held
    request waits for it, not for a guess at how long it takes on a busy machine.
    """

    seconds: float
    where: Literal["request", "response"] = "request"
    until: threading.Event | None = None

    async def wait(self) -> None:
        if self.until is None:
            await asyncio.sleep(self.seconds)
            return
        deadline = time.monotonic() + self.seconds
        while not self.until.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


@dataclass(frozen=True)
class Corrupt:
    """Flip every bit of the middle byte of the request body going upstream (server-side checks
    must reject it) or of the response body coming back (client-side checks must)."""

    where: Literal["request", "response"] = "request"


@dataclass(frozen=True)
class Trickle:
    """Forward, then relay the response body at ``rate`` bytes/s in small pieces sent every few
    tens of milliseconds: each read on the client gets bytes soon, so no read timeout fires, but
    the whole body takes ``size / rate`` seconds (a failing disk or a congested path)."""

    rate: float

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {self.rate}")


@dataclass(frozen=True)
class LateApply:
    """Answer ``status`` at once, then forward the request ``seconds`` later (its answer
    dropped): a balancer that says 503 after it handed the request on, applied late."""

    status: Status
    seconds: float


@dataclass(frozen=True)
class TrickleHead:
    """Forward, then relay the response head (status line and headers) at ``rate`` bytes/s,
    its body as it comes: a server that starts answering and never finishes its head."""

    rate: float

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {self.rate}")


@dataclass(frozen=True)
class RateLimit:
    """Forward at most ``rate`` of the matching requests a second and answer the rest
    ``status``, as a store that admits a fixed request rate does (AWS S3 per key prefix): a token
    bucket over all of them, holding ``burst`` tokens (default: one second's worth), full when
    the first one arrives. The rule's ``fired`` counts the refusals."""

    rate: float
    burst: float | None = None
    status: Status = Status(503, "SlowDown", "Please reduce your request rate.")

    def __post_init__(self) -> None:
        if self.rate <= 0 or (self.burst is not None and self.burst < 1):
            raise ValueError(f"rate must be > 0 and burst >= 1, got {self.rate}, {self.burst}")


Action = (
    Status
    | ResetBefore
    | ResetAfter
    | ResetMidBody
    | Truncate
    | Delay
    | Corrupt
    | Trickle
    | LateApply
    | TrickleHead
    | RateLimit
)


@dataclass
class Rule:
    """When to inject ``action``; ``matched`` and ``fired`` count what it saw and did.
    ``until``: the `time.monotonic` time after which it no longer fires (None: never expires)."""

    action: Action
    ops: frozenset[str] | None
    key: str | None
    probability: float
    times: int | None
    after: int
    until: float | None = None
    matched: int = 0
    fired: int = 0
    tokens: float | None = None  # a `RateLimit`'s bucket; None until its first request
    filled: float = 0.0

    def matches(self, op: str, key: str) -> bool:
        return (self.ops is None or op in self.ops) and (self.key is None or self.key in key)

    def admits(self, limit: RateLimit, now: float) -> bool:
        """Whether ``limit``'s bucket has a token for a request arriving at ``now`` (taken)."""
        burst = limit.rate if limit.burst is None else limit.burst
        if self.tokens is None:
            self.tokens = burst
        self.tokens = min(burst, self.tokens + (now - self.filled) * limit.rate)
        self.filled = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(frozen=True)
class Fault:
    """One injected fault, for assertions."""

    op: str
    key: str
    action: Action


# --- S3 operations -------------------------------------------------------------------------------

# (method, query parameter that must be present or None, operation); the first match wins.
_BUCKET_OPS = (
    ("GET", "uploads", "ListMultipartUploads"),
    ("GET", "versions", "ListObjectVersions"),
    ("GET", "location", "GetBucketLocation"),
    ("GET", "versioning", "GetBucketVersioning"),
    ("GET", "list-type", "ListObjectsV2"),
    ("GET", None, "ListObjects"),
    ("HEAD", None, "HeadBucket"),
    ("PUT", "versioning", "PutBucketVersioning"),
    ("PUT", None, "CreateBucket"),
    ("POST", "delete", "DeleteObjects"),
    ("DELETE", None, "DeleteBucket"),
)
_OBJECT_OPS = (
    ("GET", "uploadId", "ListParts"),
    ("GET", "tagging", "GetObjectTagging"),
    ("GET", None, "GetObject"),
    ("HEAD", None, "HeadObject"),
    ("PUT", "uploadId", "UploadPart"),
    ("PUT", "tagging", "PutObjectTagging"),
    ("PUT", None, "PutObject"),
    ("POST", "uploads", "CreateMultipartUpload"),
    ("POST", "uploadId", "CompleteMultipartUpload"),
    ("DELETE", "uploadId", "AbortMultipartUpload"),
    ("DELETE", "tagging", "DeleteObjectTagging"),
    ("DELETE", None, "DeleteObject"),
)
_COPIES = {"PutObject": "CopyObject", "UploadPart": "UploadPartCopy"}
OPERATIONS = frozenset(
    [op for _, _, op in _BUCKET_OPS + _OBJECT_OPS]
    + list(_COPIES.values())
    + ["ListBuckets", "Unknown"]
)


def classify(method: str, target: str, copy_source: bool = False) -> tuple[str, str]:
    """``(operation, key)`` of a path-style request; rules match on these.

    ``copy_source``: the request has ``x-amz-copy-source`` (a copy, not an upload). Unlisted
    sub-resources (``?acl``, ``?policy`` …) fall back to the plain operation of their method.
    """
    split = urlsplit(target)
    bucket, _, key = unquote(split.path).lstrip("/").partition("/")
    present = {name for name, _ in parse_qsl(split.query, keep_blank_values=True)}
    if not bucket:
        return ("ListBuckets" if method == "GET" else "Unknown"), ""
    for op_method, param, op in _OBJECT_OPS if key else _BUCKET_OPS:
        if method == op_method and (param is None or param in present):
            return (_COPIES.get(op, op) if copy_source else op), key
    return "Unknown", key


# --- HTTP/1.1 plumbing ---------------------------------------------------------------------------


@dataclass
class _Head:
    """A request or response head: its first line and header fields, in the order received."""

    start: str
    fields: list[tuple[str, str]]

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        start, *lines = raw.decode("latin-1").rstrip("\r\n").split("\r\n")
        fields = []
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"malformed header line {line!r}")
            fields.append((name, value.strip()))
        return cls(start, fields)

    def get(self, name: str) -> str:
        return next((v for n, v in self.fields if n.lower() == name), "")

    def pop(self, name: str) -> str:
        value = self.get(name)
        self.fields = [(n, v) for n, v in self.fields if n.lower() != name]
        return value

    def encode(self) -> bytes:
        lines = [self.start, *(f"{n}: {v}" for n, v in self.fields), "", ""]
        return "\r\n".join(lines).encode("latin-1")

    def keeps_alive(self, version: str) -> bool:
        tokens = {t.strip().lower() for t in self.get("connection").split(",")}
        if "close" in tokens:
            return False
        return version != "HTTP/1.0" or "keep-alive" in tokens


@dataclass(frozen=True)
class _Framing:
    """How a body is delimited on the wire (RFC 9112 section 6): a length, chunks, or EOF."""

    kind: Literal["length", "chunked", "eof"]
    length: int = 0


def _framing(head: _Head, *, response: bool) -> _Framing:
    if "chunked" in head.get("transfer-encoding").lower():
        return _Framing("chunked")
    if length := head.get("content-length"):
        return _Framing("length", int(length))
    return _Framing("eof") if response else _Framing("length", 0)


class _Splice:
    """Where a fault hits a body: the byte at ``fraction`` of its length (of its first chunk when
    the length is unknown) is flipped, or the body is cut there; ``rate`` (bytes/s) slows it."""

    def __init__(
        self,
        *,
        flip: bool = False,
        cut: bool = False,
        fraction: float = 0.5,
        rate: float | None = None,
    ) -> None:
        self.flip, self.cut, self.fraction, self.rate = flip, cut, fraction, rate
        self.offset = 0
        self.mark: int | None = None
        self.done = False

    def feed(self, piece: bytes, hint: int) -> bytes:
        """What of ``piece`` to pass on; ``hint`` is the length its body or chunk announced."""
        if self.mark is None:
            self.mark = int(hint * self.fraction)
        at = self.mark - self.offset
        self.offset += len(piece)
        if self.cut and at < len(piece):
            self.done = True
            return piece[:at]
        if self.flip and 0 <= at < len(piece):
            return piece[:at] + bytes([piece[at] ^ 0xFF]) + piece[at + 1 :]
        return piece

    async def send(self, dst: asyncio.StreamWriter, data: bytes) -> None:
        """Write ``data`` to ``dst``: at once, or at ``rate`` in pieces of one tick."""
        if self.rate is None:
            dst.write(data)
            await dst.drain()
            return
        step = max(1, int(self.rate * _TICK_S))
        for at in range(0, len(data), step):
            if dst.is_closing():  # the client gave up: stop dripping into a closed connection
                raise ConnectionResetError("the client closed the connection mid-trickle")
            piece = data[at : at + step]
            dst.write(piece)
            await dst.drain()
            await asyncio.sleep(len(piece) / self.rate)


async def _copy(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter | None,
    size: int,
    splice: _Splice,
) -> None:
    """Move exactly ``size`` bytes, or fewer if the splice cuts; ``dst=None`` discards them."""
    while size and not splice.done:
        piece = await src.read(min(_PIECE, size))
        if not piece:
            raise asyncio.IncompleteReadError(b"", size)
        data = splice.feed(piece, size)
        size -= len(piece)
        if dst is not None:
            await splice.send(dst, data)


async def _relay_body(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter | None,
    framing: _Framing,
    splice: _Splice | None = None,
) -> None:
    """Copy one body keeping its framing (chunk sizes and trailers included)."""
    splice = splice or _Splice()
    if framing.kind == "length":
        await _copy(src, dst, framing.length, splice)
    elif framing.kind == "eof":
        while not splice.done and (piece := await src.read(_PIECE)):
            data = splice.feed(piece, len(piece))
            if dst is not None:
                await splice.send(dst, data)
    else:
        while not splice.done:
            line = await src.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0], 16)
            if dst is not None:
                dst.write(line)
            if size == 0:  # last chunk: trailer fields, then an empty line
                while line != b"\r\n":
                    line = await src.readuntil(b"\r\n")
                    if dst is not None:
                        dst.write(line)
                return
            await _copy(src, dst, size, splice)
            if not splice.done:
                crlf = await src.readexactly(2)
                if dst is not None:
                    dst.write(crlf)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0) rather than a FIN: what a crashed peer looks like."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _error_response(status: Status, method: str, target: str, keep_alive: bool) -> bytes:
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(status.error_code)}</Code>"
        f"<Message>{escape(status.message)}</Message>"
        f"<Resource>{escape(urlsplit(target).path)}</Resource>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    try:
        reason = http.HTTPStatus(status.code).phrase
    except ValueError:
        reason = "Injected"
    head = _Head(
        f"HTTP/1.1 {status.code} {reason}",
        [
            ("Content-Type", "application/xml"),
            ("Content-Length", str(len(body))),
            ("x-amz-request-id", request_id),
            ("Connection", "keep-alive" if keep_alive else "close"),
        ],
    )
    return head.encode() + (b"" if method == "HEAD" else body)


class _Collect:
    """A stand-in for a StreamWriter that keeps what is written (a request held back)."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._pieces.append(data)

    async def drain(self) -> None:
        return None

    def is_closing(self) -> bool:
        return False

    def data(self) -> bytes:
        return b"".join(self._pieces)


class _Upstream:
    """The upstream connection of one client connection: never shared, reopened when closed."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is not None and self.reader.at_eof():  # the server closed it while idle
            self.close()
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=_HEAD_LIMIT
            )
        return self.reader, self.writer

    def close(self, *, abort: bool = False) -> None:
        if self.writer is not None:
            if abort:
                self.writer.transport.abort()
            self.writer.close()
        self.reader = self.writer = None


_EXPECTED_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


# --- TLS -----------------------------------------------------------------------------------------


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """``(ca.pem, server.pem, server-key.pem)``: a fresh CA and a certificate for 127.0.0.1 it
    signed, as a private store presents; the extensions satisfy Python's strict X.509 checks."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "s3ckpt test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "server.pem", directory / "server-key.pem"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


# --- the proxy -----------------------------------------------------------------------------------


class FaultProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream_url`` (plain HTTP), injecting faults.

    It runs its own asyncio loop on a daemon thread, so blocking clients (boto3) and clients on
    other loops (s3ckpt's) can both use it. With ``tls=True`` it serves HTTPS with a certificate
    from a fresh CA whose PEM file is `ca_bundle`. ``rng`` decides probabilistic rules (seeded
    by default, so a failing run repeats).
    """

    def __init__(
        self, upstream_url: str, *, tls: bool = False, rng: random.Random | None = None
    ) -> None:
        upstream = urlsplit(upstream_url)
        if upstream.scheme != "http" or upstream.hostname is None or upstream.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream_url!r}")
        self._upstream = (upstream.hostname, upstream.port)
        self._tls = tls
        self._rng = rng if rng is not None else random.Random(0)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._requests: Counter[str] = Counter()
        self._served: Counter[str] = Counter()
        self._faults: list[Fault] = []
        self._tls_dir: Path | None = None
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._late: set[asyncio.Task[None]] = set()

    # -- lifecycle --

    def start(self) -> FaultProxy:
        """Listen on a free port of 127.0.0.1; returns at once, ready for connections."""
        if self._loop is not None:
            raise RuntimeError("FaultProxy is already running")
        context = self._server_context() if self._tls else None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound here, so the port is known before the loop runs
        self._port = int(sock.getsockname()[1])
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"FaultProxy:{self._port}", daemon=True
        )
        self._thread.start()
        serving = asyncio.start_server(
            self._accept, sock=sock, ssl=context, limit=_HEAD_LIMIT, backlog=512
        )
        self._server = asyncio.run_coroutine_threadsafe(serving, loop).result()
        return self

    def stop(self) -> None:
        """Stop listening, drop every connection, end the thread; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(_STOP_TIMEOUT_S)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_STOP_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()
        self._loop = self._thread = self._server = None
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        if self._port is None:
            raise RuntimeError("FaultProxy is not running; call start() first")
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self._port}"

    @property
    def ca_bundle(self) -> str:
        """The CA certificate (PEM) clients must trust to reach a ``tls=True`` proxy."""
        if self._tls_dir is None:
            raise RuntimeError("only a running FaultProxy(tls=True) has a CA bundle")
        return str(self._tls_dir / "ca.pem")

    # -- rules and counters --

    def add_rule(
        self,
        action: Action,
        *,
        op: str | Iterable[str] | None = None,
        key: str | None = None,
        probability: float = 1.0,
        times: int | None = None,
        after: int = 0,
        for_seconds: float | None = None,
    ) -> Rule:
        """Inject ``action`` into requests for ``op`` (one or several operation names, see
        `classify`) whose object key contains ``key``; None matches any.

        Of the matching requests the first ``after`` pass untouched; then each is hit with
        ``probability`` until the rule has fired ``times`` times (never stops when None) or
        ``for_seconds`` have passed since it was added (an outage that ends). Rules are tried
        in the order added; the first that fires decides.
        """
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        if for_seconds is not None and for_seconds < 0:
            raise ValueError(f"for_seconds must be >= 0, got {for_seconds}")
        ops = frozenset([op] if isinstance(op, str) else op) if op is not None else None
        if ops is not None and not ops <= OPERATIONS:  # a typo would silently never fire
            raise ValueError(f"unknown operations {sorted(ops - OPERATIONS)}; see OPERATIONS")
        until = None if for_seconds is None else time.monotonic() + for_seconds
        rule = Rule(action, ops, key, probability, times, after, until)
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        with self._lock:
            self._rules.remove(rule)

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def retarget(self, upstream_url: str) -> None:
        """Forward new connections to ``upstream_url`` (a restarted server on a new port);
        connections to the old one break as the old server's would."""
        upstream = urlsplit(upstream_url)
        with self._lock:
            self._upstream = (upstream.hostname or "127.0.0.1", upstream.port or 80)

    @property
    def requests(self) -> Counter[str]:
        """Requests received per operation, faulted or not (a copy)."""
        with self._lock:
            return Counter(self._requests)

    @property
    def served(self) -> Counter[str]:
        """Response body bytes relayed per operation (a copy): what the server served through
        the proxy, e.g. ``served["GetObject"]``."""
        with self._lock:
            return Counter(self._served)

    @property
    def faults(self) -> list[Fault]:
        """Every fault injected so far, in order (a copy)."""
        with self._lock:
            return list(self._faults)

    def _decide(self, op: str, key: str) -> Action | None:
        with self._lock:
            self._requests[op] += 1
            for rule in self._rules:
                if not rule.matches(op, key):
                    continue
                rule.matched += 1
                if (
                    rule.matched <= rule.after
                    or (rule.times is not None and rule.fired >= rule.times)
                    or (rule.until is not None and time.monotonic() >= rule.until)
                ):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                limit = rule.action if isinstance(rule.action, RateLimit) else None
                if limit is not None and rule.admits(limit, time.monotonic()):
                    continue
                rule.fired += 1
                self._faults.append(Fault(op, key, rule.action))
                return rule.action if limit is None else limit.status
        return None

    # -- serving (on the proxy's loop) --

    def _server_context(self) -> ssl.SSLContext:
        self._tls_dir = Path(tempfile.mkdtemp(prefix="s3ckpt-tls-"))
        _, cert, key = make_tls_files(self._tls_dir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        return context

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for late in list(self._late):
            late.cancel()
        for task, writer in list(self._connections.items()):
            writer.transport.abort()  # no goodbyes; also for a task that never got to run
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await asyncio.sleep(0)  # let the aborted transports finish closing

    async def _apply_late(self, request: bytes, seconds: float) -> None:
        """Send a held request upstream on a connection of its own; its answer is dropped."""
        await asyncio.sleep(seconds)
        up_reader, up_writer = await asyncio.open_connection(*self._upstream, limit=_HEAD_LIMIT)
        try:
            up_writer.write(request)
            await up_writer.drain()
            response = _Head.parse(await up_reader.readuntil(b"\r\n\r\n"))
            await _relay_body(up_reader, None, _framing(response, response=True))
        except _EXPECTED_ERRORS:
            pass
        finally:
            up_writer.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Track each connection from its first moment, so `stop` can end it even before its
        task has started."""
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._connections[task] = writer
        task.add_done_callback(lambda done: self._connections.pop(done, None))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = _Upstream(*self._upstream)
        try:
            while await self._exchange(reader, writer, upstream):
                pass
        except _EXPECTED_ERRORS:
            pass  # either peer went away mid-exchange: drop both connections, as a proxy does
        finally:
            upstream.close()
            writer.close()

    async def _exchange(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: _Upstream,
    ) -> bool:
        """Serve one request; whether the client connection may carry another."""
        try:
            request = _Head.parse(await reader.readuntil(b"\r\n\r\n"))
        except asyncio.IncompleteReadError as eof:
            if eof.partial:
                raise
            return False  # the client closed an idle connection
        method, target, version = request.start.split(" ", 2)
        op, key = classify(method, target, bool(request.get("x-amz-copy-source")))
        action = self._decide(op, key)
        if isinstance(action, ResetBefore):
            _reset(writer)
            return False
        if request.pop("expect").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if isinstance(action, Delay) and action.where == "request":
            # After the 100 Continue, so the client sends its body and then waits on its read
            # timeout (botocore sends the body anyway after waiting 1 s for a 100 Continue).
            await action.wait()
        body = _framing(request, response=False)
        keep_alive = request.keeps_alive(version)
        if isinstance(action, Status):
            await _relay_body(reader, None, body)
            writer.write(_error_response(action, method, target, keep_alive))
            await writer.drain()
            return keep_alive
        if isinstance(action, LateApply):
            held = _Collect()
            await _relay_body(reader, cast(asyncio.StreamWriter, held), body)  # a stand-in
            writer.write(_error_response(action.status, method, target, keep_alive))
            await writer.drain()
            late = asyncio.ensure_future(
                self._apply_late(request.encode() + held.data(), action.seconds)
            )
            self._late.add(late)
            late.add_done_callback(self._late.discard)
            return keep_alive

        up_reader, up_writer = await upstream.connect()
        up_writer.write(request.encode())
        flip = isinstance(action, Corrupt) and action.where == "request"
        await _relay_body(reader, up_writer, body, _Splice(flip=flip))
        await up_writer.drain()
        response = _Head.parse(await up_reader.readuntil(b"\r\n\r\n"))
        while response.start.split(" ", 2)[1].startswith("1"):  # 100 Continue and friends
            response = _Head.parse(await up_reader.readuntil(b"\r\n\r\n"))
        if isinstance(action, ResetAfter):
            upstream.close(abort=True)
            _reset(writer)
            return False
        if isinstance(action, Delay) and action.where == "response":
            await action.wait()
        resp_version, status = response.start.split(" ", 2)[:2]
        bodiless = method == "HEAD" or status in ("204", "304")
        answer = _Framing("length", 0) if bodiless else _framing(response, response=True)
        if isinstance(action, TrickleHead):
            await _Splice(rate=action.rate).send(writer, response.encode())
        else:
            writer.write(response.encode())

        if isinstance(action, ResetMidBody | Truncate):
            await _relay_body(up_reader, writer, answer, _Splice(cut=True, fraction=action.keep))
            await writer.drain()
            upstream.close(abort=True)  # the rest of the body is still coming
            if isinstance(action, ResetMidBody):
                _reset(writer)
            else:
                writer.close()
            return False
        flip = isinstance(action, Corrupt) and action.where == "response"
        rate = action.rate if isinstance(action, Trickle) else None
        splice = _Splice(flip=flip, rate=rate)
        await _relay_body(up_reader, writer, answer, splice)
        await writer.drain()
        with self._lock:
            self._served[op] += splice.offset
        reusable = response.keeps_alive(resp_version) and answer.kind != "eof"
        if not reusable:
            upstream.close()
        return reusable and keep_alive
