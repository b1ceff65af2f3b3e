"""Subcommands that move bytes: ``export`` (a torch.save file or safetensors), ``verify``
checksums, ``bench``.

Each imports what moves the bytes (the engine, the read runner, torch) when it runs, not when it
is registered: registering every command is part of ``s3ckpt --version`` and ``s3ckpt ls``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import MiB
from ..errors import ConfigError
from .base import EXIT_OK, URL, Bar, Session, arg, command, human_size

if TYPE_CHECKING:
    pass

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
    from ..tools.probe import probe  # the engine (aiohttp, botocore) only when it runs

    config, size = session.config, session.args.size * MiB
    found = probe(session.args.url, size, config, session.progress, announce=_announce)
    settings = {
        "endpoint": found.endpoint,
        "part_size": config.part_size,
        "multipart_threshold": config.multipart_threshold,
        "max_concurrency": config.max_concurrency,
        "bytes": size,
        "object": found.url,
    }
    lines = [
        f"endpoint:  {found.endpoint}",
        f"settings:  part size {human_size(config.part_size)}, max concurrency "
        f"{config.max_concurrency}, multipart threshold {human_size(config.multipart_threshold)}",
    ]
    for name, unit in (("upload", "parts"), ("download", "ranged GETs")):
        phase = found.phases[name]
        lines.append(
            f"{name + ':':<10} {human_size(size)} as {phase['requests']} {unit}: "
            f"{phase['seconds']:.2f} s, {phase['mb_per_s']:.1f} MB/s"
        )
    session.emit({"settings": settings, **found.phases}, "\n".join(lines))
    return EXIT_OK


def _announce(where: str, size: int) -> None:
    print(f"bench: writing {human_size(size)} to {where}, then reading it back", file=sys.stderr)
