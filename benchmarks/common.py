"""Pieces every benchmark needs: a server to talk to, RSS sampling, machine facts, a table.

Kept free of any one benchmark's logic so later benchmarks can reuse it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import http.client
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from s3ckpt.config import MiB, S3Config
from s3ckpt.tools.localserver import SeaweedFS, find_weed

__all__ = [
    "GB",
    "RESULTS",
    "ROOT",
    "CountingProxy",
    "Endpoint",
    "MiB",
    "RssSampler",
    "counts_delta",
    "cpu_since",
    "cpu_times",
    "format_table",
    "machine_info",
    "median",
    "proxy_counts",
    "s3_endpoint",
    "server_cpu_seconds",
    "write_json",
]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"  # JSON, charts and caches every benchmark writes
GB = 1e9  # throughput is reported in decimal GB/s, as storage vendors quote it
_SAMPLE_INTERVAL_S = 0.01


@dataclass(frozen=True)
class Endpoint:
    """Where the benchmark talks to, and (for a local server) the process serving it."""

    url: str
    access_key_id: str
    secret_access_key: str
    region: str | None
    server: str
    server_pid: int | None = None

    def config(self, *, part_size: int, max_concurrency: int) -> S3Config:
        """The one `S3Config` every case uses, so raw and s3ckpt clients are configured alike."""
        return S3Config(
            endpoint_url=self.url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            part_size=part_size,
            max_concurrency=max_concurrency,
        )


@contextlib.contextmanager
def s3_endpoint(
    url: str | None, access_key: str | None, secret_key: str | None, region: str | None
) -> Iterator[Endpoint]:
    """The given endpoint, or a throwaway SeaweedFS in a temp dir, stopped on exit."""
    if url is not None:
        if access_key is None or secret_key is None:
            raise SystemExit("--endpoint-url needs --access-key and --secret-key")
        yield Endpoint(url, access_key, secret_key, region, server=url)
        return
    with tempfile.TemporaryDirectory(prefix="s3ckpt-bench-") as workdir, SeaweedFS(workdir) as weed:
        local = weed.endpoint
        yield Endpoint(
            local.endpoint_url,
            local.access_key_id,
            local.secret_access_key,
            region or local.region,
            server=_weed_version(),
            server_pid=_weed_pid(),
        )


def _weed_version() -> str:
    try:
        out = subprocess.run(
            [find_weed(), "version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    first = out.splitlines()[0].split() if out.strip() else []
    version = " ".join(first[1:]) if len(first) > 1 else "(unknown version)"
    return f"SeaweedFS {version} (local weed mini)"


def _weed_pid() -> int | None:
    """SeaweedFS runs as our child; its CPU time tells how much of the 2 cores it takes."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() == "weed":
                return int(child.pid)
    return None


def pin_threads(pid: int | None, core: int) -> bool:
    """Every thread of ``pid`` (0: this process) on ``core``; threads started later inherit
    it. False where it cannot be done (no pid, or no ``sched_setaffinity``)."""
    if pid is None or not hasattr(os, "sched_setaffinity"):
        return False
    for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})
    return True


def server_cpu_seconds(pid: int | None) -> float | None:
    """user+sys CPU of the local server (and its children) so far; None for a remote one."""
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
        return total
    except psutil.Error:
        return None


def cpu_times() -> tuple[float, float]:
    """(user, sys) CPU of this process, all threads (the I/O thread and executors included)."""
    times = psutil.Process().cpu_times()
    return float(times.user), float(times.system)


def cpu_since(before: tuple[float, float]) -> dict[str, float]:
    """CPU used since ``before``; sys apart, as page faults on fresh buffers show up there."""
    user, system = cpu_times()
    user, system = user - before[0], system - before[1]
    return {"cpu_s": user + system, "cpu_user_s": user, "cpu_sys_s": system}


class RssSampler:
    """Peak resident memory while a block runs, sampled every 10 ms on a daemon thread.

    Sampling alone can miss a short spike, so `peak` also consults ``ru_maxrss`` (the process's
    lifetime peak): if that rose during the block, the block caused it.
    """

    def __init__(self, interval_s: float = _SAMPLE_INTERVAL_S) -> None:
        self._proc = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.baseline = self.rss()
        self._maxrss_before = _ru_maxrss()
        self._sampled_peak = self.baseline
        self._maxrss_after = self._maxrss_before

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sampled_peak = max(self._sampled_peak, self.rss())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sampled_peak = max(self._sampled_peak, self.rss())
        self._maxrss_after = _ru_maxrss()

    @property
    def peak(self) -> int:
        if self._maxrss_after > self._maxrss_before:
            return max(self._sampled_peak, self._maxrss_after)
        return self._sampled_peak

    def report(self) -> dict[str, int]:
        return {
            "rss_baseline": self.baseline,
            "rss_peak": self.peak,
            "rss_peak_sampled": self._sampled_peak,
            "ru_maxrss_before": self._maxrss_before,
            "ru_maxrss_after": self._maxrss_after,
        }


def _ru_maxrss() -> int:
    """Lifetime peak RSS in bytes (Linux reports KiB, macOS bytes)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value if sys.platform == "darwin" else value * 1024)


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare runs across machines."""
    versions: dict[str, str | None] = {}
    for package in ("torch", "aiobotocore", "botocore", "aiohttp", "numpy", "s3ckpt"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total": psutil.virtual_memory().total,
        "memory_available": psutil.virtual_memory().available,
        "loadavg_at_start": load,
        "python": sys.version.split()[0],
        "versions": versions,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def write_json(path: Path, document: Any) -> None:
    """A benchmark's report as indented JSON at ``path`` (its folder made; what JSON cannot hold
    written as ``str``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; floats get 3 significant-ish decimals, None prints as '-'."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(lines)


_COUNTS_PATH = b"/__bench_counts__"  # answered by the proxy itself; no bucket can be named so
_PIPE_BYTES = 1 << 20


class CountingProxy:
    """HTTP/1.1 pass-through on 127.0.0.1 counting requests (by method) and bytes each way.

    It exists so every client (a Rust CRT, s3fs, aiobotocore) is counted alike, whatever the
    server exposes. Only request heads and body lengths (Content-Length or chunked) are parsed;
    bodies and responses move with splice(2) through a pipe, never through Python, so the relay
    costs little CPU. A thread per direction per connection; plain http only.
    ``GET /__bench_counts__`` on a fresh connection answers the counts as JSON (`proxy_counts`).
    """

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"the counting proxy relays plain http only, not {upstream_url}")
        self._upstream = (parts.hostname, parts.port or 80)
        self.counts: dict[str, int] = {"requests": 0, "bytes_up": 0, "bytes_down": 0}
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> CountingProxy:
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def _add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + amount

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        conn = _Buffered(client)
        try:
            while (head := conn.read_until(b"\r\n\r\n")) is not None:
                method, _, rest = head.partition(b" ")
                if upstream is None and rest.startswith(_COUNTS_PATH):
                    body = json.dumps(self.counts).encode()
                    client.sendall(
                        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body)
                    )
                    return
                if upstream is None:
                    upstream = socket.create_connection(self._upstream)
                    for sock in (client, upstream):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    threading.Thread(
                        target=self._relay, args=(upstream, client), daemon=True
                    ).start()
                self._add("requests")
                self._add(method.decode("latin-1"))
                self._add("bytes_up", len(head))
                upstream.sendall(head)
                self._add("bytes_up", self._body(head, conn, upstream))
        except (OSError, ValueError):
            return
        finally:
            for end in (upstream, client):
                if end is not None:
                    with contextlib.suppress(OSError):
                        end.shutdown(socket.SHUT_RDWR)
            conn.close()
            if upstream is not None:
                upstream.close()

    @staticmethod
    def _body(head: bytes, conn: _Buffered, upstream: socket.socket) -> int:
        """Forward one request body, as long as its head says; returns the bytes forwarded."""
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
        }
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            length = int(headers.get(b"content-length", b"0"))
            conn.forward(length, upstream)
            return length
        sent = 0
        while True:  # chunk-size line, data and CRLF; after the 0 chunk, trailers and CRLF
            line = conn.read_until(b"\r\n")
            if line is None:
                raise ValueError("client closed mid-body")
            upstream.sendall(line)
            size = int(line.split(b";")[0], 16)
            sent += len(line)
            if size == 0:
                while (trailer := conn.read_until(b"\r\n")) not in (None, b"\r\n"):
                    assert trailer is not None
                    upstream.sendall(trailer)
                    sent += len(trailer)
                upstream.sendall(b"\r\n")
                return sent + 2
            conn.forward(size + 2, upstream)
            sent += size + 2

    def _relay(self, upstream: socket.socket, client: socket.socket) -> None:
        """Responses go back untouched; the server closing ends the client's connection too."""
        pipe = _Pipe()
        try:
            while moved := pipe.move(upstream, client, _PIPE_BYTES):
                self._add("bytes_down", moved)
        except OSError:
            pass
        finally:
            pipe.close()
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)


class _Pipe:
    """A kernel pipe that splices bytes from one socket to another without copying to Python."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        with contextlib.suppress(OSError):  # a larger pipe moves more per call
            fcntl.fcntl(self.write_fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)

    def move(self, source: socket.socket, sink: socket.socket, most: int) -> int:
        """Up to ``most`` bytes (whatever arrives first); 0 at end of stream."""
        got = os.splice(source.fileno(), self.write_fd, most)
        left = got
        while left:
            left -= os.splice(self.read_fd, sink.fileno(), left)
        return got

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


class _Buffered:
    """The client side of a connection: heads read through a small buffer, bodies spliced."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self._pipe: _Pipe | None = None

    def read_until(self, marker: bytes) -> bytes | None:
        """Bytes up to and including ``marker``; None at a clean end of stream."""
        while (at := self.buffer.find(marker)) < 0:
            if len(self.buffer) > _PIPE_BYTES:
                raise ValueError("request head too long")
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer[: at + len(marker)], self.buffer[at + len(marker) :]
        return line

    def forward(self, count: int, sink: socket.socket) -> None:
        """Send exactly ``count`` body bytes on: what was buffered, then the rest by splice."""
        early, self.buffer = self.buffer[:count], self.buffer[count:]
        sink.sendall(early)
        left = count - len(early)
        if left and self._pipe is None:
            self._pipe = _Pipe()
        while left > 0:
            assert self._pipe is not None
            moved = self._pipe.move(self.sock, sink, min(left, _PIPE_BYTES))
            if not moved:
                raise ValueError("client closed mid-body")
            left -= moved

    def close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        self.sock.close()


def proxy_counts(url: str | None) -> dict[str, int] | None:
    """A `CountingProxy`'s counts so far (from any process); None without a proxy."""
    if not url:
        return None
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        conn.request("GET", _COUNTS_PATH.decode())
        counts: dict[str, int] = json.loads(conn.getresponse().read())
        return counts
    finally:
        conn.close()


def counts_delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int]:
    """What a block of code sent through the proxy: every counter's increase."""
    if after is None or before is None:
        return {}
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def rank_process(
    rank: int, world: int, port: int, out_dir: str, timeout_s: float, run: Callable[[], Any]
) -> None:
    """The body of one spawned rank: join a gloo group of ``world`` on ``port``, ``run()``, and
    write its result (or the traceback) to ``out_dir/rank-<rank>.json`` for the parent."""
    import torch.distributed as dist

    out = Path(out_dir) / f"rank-{rank}.json"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            result = run()
        finally:
            dist.destroy_process_group()
        out.write_text(json.dumps(result))
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()[-4000:]}))
        raise
