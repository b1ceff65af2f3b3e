"""Subcommands that move bytes: ``export`` (a torch.save file or safetensors), ``verify``
checksums, ``bench``.

Each imports what moves the bytes (the engine, the read runner, torch) when it runs, not when it
is registered: registering every command is part of ``s3ckpt --version`` and ``s3ckpt ls``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import secrets
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checksums import checksum
from ..config import MiB, parse_s3_url
from ..errors import ConfigError, S3CkptError
from .base import EXIT_OK, URL, Bar, Session, arg, command, human_size

if TYPE_CHECKING:
    from ..engine.contract import ObjectStore, Stats
    from ..format.readplan import Fetch

_MB = 1e6  # throughput in decimal MB/s, as storage vendors quote it
_TICK_S = 0.2  # how often the upload bar reads the bytes sent so far
Bars = Callable[[str, str], contextlib.AbstractContextManager[Bar | None]]


@command(
    "export",
    "write the committed checkpoint at URL to DEST: one local torch.save file, or (--format "
    "safetensors) Hugging Face safetensors files in a directory or under an s3:// prefix",
    URL,
    arg(
        "out",
        metavar="DEST",
        help="torch: the file to write (replaced only when complete); safetensors: a local "
        "directory or s3://bucket/prefix (each file appears only when complete, the index last)",
    ),
    arg(
        "--format",
        choices=("torch", "safetensors"),
        default="torch",
        help="torch (default): the whole state as saved; safetensors: its tensors, for "
        "transformers, vLLM and other Hugging Face readers",
    ),
    arg(
        "--select",
        metavar="PREFIX",
        help="safetensors: only the entries under PREFIX (say, model), named without it",
    ),
    arg("--dtype", help="safetensors: convert floating-point tensors to DTYPE (bfloat16, ...)"),
    arg(
        "--max-shard-size",
        metavar="SIZE",
        help="safetensors: files of at most SIZE of tensors (default 5GB, as save_pretrained)",
    ),
    arg(
        "--trust-pickles",
        action="store_true",
        help="unpickle non-tensor values that torch's weights_only loader refuses; they can run "
        "code, so only for checkpoints whose writers you trust",
    ),
)
def _export(session: Session) -> int:
    args = session.args
    if args.format == "safetensors":
        return _export_safetensors(session)
    if args.select or args.dtype or args.max_shard_size:
        raise ConfigError("--select, --dtype and --max-shard-size go with --format safetensors")
    from ..tools import catalog

    url, out = args.url, Path(args.out)
    print(f"export: reading {url} into {out}", file=sys.stderr)
    started = time.perf_counter()
    with session.progress("B") as progress:
        exported = catalog.export(
            url, out, session.config, progress=progress, trust_pickles=args.trust_pickles
        )
    took = time.perf_counter() - started
    tensors, nbytes = exported.tensors, exported.tensor_bytes
    print(f"export: wrote {human_size(nbytes)} in {took:.1f} s", file=sys.stderr)
    result = {"checkpoint": url, "path": str(out), "tensors": tensors, "tensor_bytes": nbytes}
    session.emit(result, f"wrote {out}: {tensors} tensors, {human_size(nbytes)}, from {url}")
    return EXIT_OK


def _export_safetensors(session: Session) -> int:
    from ..tools.hfexport import DEFAULT_SHARD_SIZE, export_safetensors

    args = session.args
    url, dest = args.url, args.out
    print(f"export: reading {url} into safetensors at {dest}", file=sys.stderr)
    started = time.perf_counter()
    with session.progress("B") as progress:
        done = export_safetensors(
            url,
            dest,
            session.config,
            select=args.select,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size or DEFAULT_SHARD_SIZE,
            progress=progress,
        )
    took = time.perf_counter() - started
    print(f"export: wrote {human_size(done.tensor_bytes)} in {took:.1f} s", file=sys.stderr)
    if done.skipped:
        left = ", ".join(done.skipped[:5]) + (" ..." if len(done.skipped) > 5 else "")
        print(f"export: left out {len(done.skipped)} non-tensor value(s): {left}", file=sys.stderr)
    result = {"checkpoint": url, **dataclasses.asdict(done)}
    text = (
        f"wrote {len(done.files)} file(s) to {dest}: {done.tensors} tensors, "
        f"{human_size(done.tensor_bytes)}, from {url}"
    )
    session.emit(result, text)
    return EXIT_OK


@command(
    "verify",
    "read every stored byte of the committed checkpoint at URL and check its checksums",
    URL,
)
def _verify(session: Session) -> int:
    from ..tools.verify import verify

    with session.progress("objects") as progress:
        report = verify(session.args.url, session.config, progress=progress)
    text = (
        f"ok: {report.url}: {report.frames} frames in {report.objects} objects, "
        f"{human_size(report.bytes)} read and checked"
    )
    session.emit(dataclasses.asdict(report), text)
    return EXIT_OK


def _mib(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB, at least 1: {text!r}")
    return int(text)


@command(
    "bench",
    "measure upload and ranged-download throughput with these settings, on a temporary object",
    arg(
        "url",
        metavar="URL",
        nargs="?",
        help="s3://bucket[/prefix] to write the object under (default: a temporary bucket)",
    ),
    arg("--size", type=_mib, default=256, metavar="MIB", help="object size (default: 256 MiB)"),
)
def _bench(session: Session) -> int:
    from ..engine import bridge
    from ..engine.store import get_store

    config, size = session.config, session.args.size * MiB
    store = get_store(config)
    token = secrets.token_hex(6)
    if session.args.url is None:
        bucket, prefix, temporary = f"s3ckpt-bench-{token}", "", True
    else:
        (bucket, prefix), temporary = parse_s3_url(session.args.url), False
    key = f"{prefix}/s3ckpt-bench-{token}" if prefix else f"s3ckpt-bench-{token}"
    where = f"s3://{bucket}/{key} at {store.endpoint}"
    print(f"bench: writing {human_size(size)} to {where}, then reading it back", file=sys.stderr)
    payload = _Random(os.urandom(size))
    result = bridge.run(_measure(store, bucket, key, payload, temporary, session.progress))
    settings = {
        "endpoint": store.endpoint,
        "part_size": config.part_size,
        "multipart_threshold": config.multipart_threshold,
        "max_concurrency": config.max_concurrency,
        "bytes": size,
        "object": f"s3://{bucket}/{key}",
    }
    lines = [
        f"endpoint:  {store.endpoint}",
        f"settings:  part size {human_size(config.part_size)}, max concurrency "
        f"{config.max_concurrency}, multipart threshold {human_size(config.multipart_threshold)}",
    ]
    for name, unit in (("upload", "parts"), ("download", "ranged GETs")):
        phase = result[name]
        lines.append(
            f"{name + ':':<10} {human_size(size)} as {phase['requests']} {unit}: "
            f"{phase['seconds']:.2f} s, {phase['mb_per_s']:.1f} MB/s"
        )
    session.emit({"settings": settings, **result}, "\n".join(lines))
    return EXIT_OK


@dataclass(frozen=True)
class _Random:
    """Random bytes (no store can compress or deduplicate them), served as `Payload` views."""

    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    def views(self, start: int, end: int) -> list[memoryview]:
        return [memoryview(self.data)[start:end]]

    def read(self, start: int, end: int, scratch: memoryview) -> memoryview:
        return memoryview(self.data)[start:end]

    def checksum(self, start: int, end: int) -> int:
        return checksum(memoryview(self.data)[start:end])


async def _measure(
    store: ObjectStore, bucket: str, key: str, payload: _Random, temporary: bool, bars: Bars
) -> dict[str, dict[str, float]]:
    """Upload, then read back with one ranged GET per part (as loads do), checking the bytes;
    ``bars(unit, title)`` shows each phase's progress. The object, and a temporary bucket, are
    deleted whatever happens."""
    from ..dcp.reads import run_all
    from ..format.readplan import Fetch, Target

    step = store.config.part_size
    ranges = [(at, min(at + step, payload.size)) for at in range(0, payload.size, step)]
    parts = len(ranges) if payload.size > store.config.multipart_threshold else 1
    if temporary:
        await store.create_bucket(bucket)
    try:
        with bars("parts", "bench: upload") as bar:
            started = time.perf_counter()
            await _watched(
                store.upload(bucket, key, payload), store.stats, payload.size, parts, bar
            )
            upload_s = time.perf_counter() - started
        sink = memoryview(bytearray(payload.size))
        plan = [Fetch(key, s, e, [Target(0, key, s, e, sink=sink[s:e])]) for s, e in ranges]
        with bars("GETs", "bench: download") as bar:
            started = time.perf_counter()
            await run_all(store, bucket, plan, {}, _counter(len(plan), payload.size, bar))
            download_s = time.perf_counter() - started
        if sink != payload.data:
            raise S3CkptError(f"s3://{bucket}/{key}: the bytes read back differ from those sent")
    finally:
        await asyncio.shield(_clean_up(store, bucket, key, temporary))
    return {
        "upload": _phase(payload.size, upload_s, parts),
        "download": _phase(payload.size, download_s, len(ranges)),
    }


async def _watched(
    upload: Coroutine[Any, Any, None], stats: Stats, size: int, parts: int, bar: Bar | None
) -> None:
    """Run ``upload`` of ``size`` bytes in ``parts``, showing the bytes acknowledged so far on
    ``bar``: the store reports nothing until the whole object is up, so its byte counter is read
    every tick (the parts done are estimated from it)."""
    if bar is None:
        await upload
        return
    base = stats.bytes_sent

    async def tick() -> None:
        while True:
            sent = stats.bytes_sent - base
            bar(sent * parts // size, parts, sent, size)
            await asyncio.sleep(_TICK_S)

    ticker = asyncio.ensure_future(tick())
    try:
        await upload
    finally:
        ticker.cancel()
    bar(parts, parts, size, size)


def _counter(fetches: int, size: int, bar: Bar | None) -> Callable[[Fetch], None] | None:
    """``run_all``'s ``done`` callback counting GETs and bytes into ``bar``."""
    if bar is None:
        return None
    done = [0, 0]

    def count(fetch: Fetch) -> None:
        done[0] += 1
        done[1] += fetch.end - fetch.start
        bar(done[0], fetches, done[1], size)

    return count


def _phase(size: int, seconds: float, requests: int) -> dict[str, float]:
    return {"seconds": seconds, "mb_per_s": size / _MB / seconds, "requests": requests}


async def _clean_up(store: ObjectStore, bucket: str, key: str, temporary: bool) -> None:
    await store.delete(bucket, [key])
    if temporary:
        await store.delete_bucket(bucket)
