"""Pieces every benchmark needs: a server to talk to, RSS sampling, machine facts, a table.

Kept free of any one benchmark's logic so later benchmarks can reuse it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import psutil

from s3ckpt.config import MiB, S3Config
from s3ckpt.localserver import SeaweedFS, find_weed

__all__ = [
    "GB",
    "Endpoint",
    "MiB",
    "RssSampler",
    "cpu_since",
    "cpu_times",
    "format_table",
    "machine_info",
    "median",
    "s3_endpoint",
    "server_cpu_seconds",
]

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
                return child.pid
    return None


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
