"""The subcommands that find, inspect and clean up checkpoints (see `s3ckpt.tools.catalog`)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from datetime import timedelta
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from ..format import layout
from ..tools import catalog
from ..tools.catalog import CheckpointInfo, GcReport, Removal
from .base import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    URL,
    Session,
    arg,
    as_plain,
    command,
    fail,
    format_table,
    human_size,
    or_dash,
    removed_text,
    utc_text,
)

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@command("ls", "list the checkpoints at URL and directly under it", URL)
def _ls(session: Session) -> int:
    infos = catalog.list_checkpoints(session.args.url, session.config)
    rows = [
        [
            i.prefix or "/",
            _status(i),
            or_dash(i.step),
            human_size(i.total_bytes),
            str(i.num_objects),
            utc_text(i.created),
        ]
        for i in infos
    ]
    header = ["PREFIX", "STATUS", "STEP", "SIZE", "OBJECTS", "CREATED (UTC)"]
    session.emit([as_plain(i) for i in infos], format_table(header, rows, right={2, 3, 4}))
    if not infos and not session.args.json:
        print(f"no checkpoints at or under {session.args.url}", file=sys.stderr)
    return EXIT_OK


def _status(info: CheckpointInfo) -> str:
    if info.unreadable is not None:
        return "unreadable"
    return "committed" if info.committed else "incomplete"


@command("latest", "print the newest committed checkpoint (highest step) under URL", URL)
def _latest(session: Session) -> int:
    info = catalog.latest(session.args.url, session.config)
    if info is None:
        return fail(f"no committed checkpoint at or under {session.args.url}", EXIT_NOT_FOUND)
    session.emit(as_plain(info), info.url)
    return EXIT_OK


@command("info", "show a committed checkpoint: tensors, objects per rank, totals", URL)
def _info(session: Session) -> int:
    info, checkpoint = catalog.describe(session.args.url, session.config)
    items: list[dict[str, Any]] = []
    for fqn, entry in checkpoint.metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype, shape = str(entry.properties.dtype).removeprefix("torch."), list(entry.size)
            size = math.prod(shape) * entry.properties.dtype.itemsize
            items.append({"name": fqn, "dtype": dtype, "shape": shape, "bytes": size})
        else:
            size = checkpoint.locators[MetadataIndex(fqn)].length
            items.append({"name": fqn, "dtype": "bytes", "shape": None, "bytes": size})
    ranks: dict[int | None, dict[str, Any]] = {}
    for key, size in sorted(checkpoint.objects.items()):
        rank = layout.rank_of(key)
        counts = ranks.setdefault(rank, {"rank": rank, "objects": 0, "bytes": 0})
        counts["objects"] += 1
        counts["bytes"] += size
    by_rank = sorted(ranks.values(), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    summary = [
        ("checkpoint", info.url),
        ("step", or_dash(info.step)),
        ("save id", or_dash(info.save_id)),
        ("world size", or_dash(info.world_size)),
        ("created", f"{utc_text(info.created)} UTC"),
        ("compression", or_dash(info.compression)),
        ("total", f"{human_size(info.total_bytes)} in {info.num_objects} objects (with .metadata)"),
    ]
    tensors = [[i["name"], i["dtype"], or_dash(i["shape"]), human_size(i["bytes"])] for i in items]
    per_rank = [[or_dash(r["rank"]), str(r["objects"]), human_size(r["bytes"])] for r in by_rank]
    text = "\n\n".join(
        [
            "\n".join(f"{name + ':':<12} {value}" for name, value in summary),
            format_table(["ITEM", "DTYPE", "SHAPE", "SIZE"], tensors, right={3}),
            format_table(["RANK", "OBJECTS", "SIZE"], per_rank, right={0, 1, 2}),
        ]
    )
    session.emit({"checkpoint": as_plain(info), "items": items, "ranks": by_rank}, text)
    return EXIT_OK


def _always(_: argparse.Namespace) -> bool:
    return True


@command(
    "rm", "delete the checkpoint at URL (.metadata first, then its data)", URL, destructive=_always
)
def _rm(session: Session) -> int:
    url, declined = session.args.url, False

    def ask(plan: Removal) -> bool:
        nonlocal declined
        declined = not session.confirm(f"Delete {url}: {removed_text(plan)}?")
        return not declined

    with session.progress() as progress:
        removal = catalog.delete(url, session.config, confirm=ask, progress=progress)
    if declined:
        return fail("not confirmed; nothing was deleted", EXIT_ERROR)
    session.emit(as_plain(removal), f"deleted {url}: {removed_text(removal)}")
    return EXIT_OK


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (the latest is always kept): {text}")
    return value


@command(
    "prune",
    "delete all but the newest N committed checkpoints under URL (incomplete ones: see gc)",
    URL,
    arg("--keep", type=_at_least_one, required=True, metavar="N", help="how many to keep"),
    destructive=_always,
)
def _prune(session: Session) -> int:
    args, declined = session.args, False

    def ask(victims: list[CheckpointInfo]) -> bool:
        nonlocal declined
        listing = "\n".join(f"  {v.url}  ({human_size(v.total_bytes)})" for v in victims)
        question = f"Delete these {len(victims)} checkpoints, keeping {args.keep}?\n{listing}\n"
        declined = not session.confirm(question)
        return not declined

    with session.progress() as progress:
        deleted = catalog.prune(args.url, args.keep, session.config, confirm=ask, progress=progress)
    if declined:
        return fail("not confirmed; nothing was deleted", EXIT_ERROR)
    text = "\n".join(f"deleted {i.url}" for i in deleted) or "nothing to prune"
    session.emit([as_plain(i) for i in deleted], text)
    return EXIT_OK


def _duration(text: str) -> timedelta:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 90s, 30m, 1h or 2d: {text!r}"
        )
    return timedelta(seconds=float(match.group(1)) * _SECONDS[match.group(2) or "s"])


@command(
    "gc",
    "delete data objects no .metadata references and abort stale uploads, at or under URL",
    URL,
    arg(
        "--older-than",
        type=_duration,
        default=timedelta(hours=1),
        metavar="AGE",
        help="only what is at least this old, so running saves are safe (default: 1h)",
    ),
    arg("--dry-run", action="store_true", help="only report what would be deleted"),
    arg(
        "--break-leases",
        action="store_true",
        help="also collect saves whose lease is live: only when their writers are known dead",
    ),
    destructive=lambda args: not args.dry_run,
)
def _gc(session: Session) -> int:
    args, declined = session.args, False

    def ask(plan: GcReport) -> bool:
        nonlocal declined
        if plan.deleted or plan.aborted:
            declined = not session.confirm(f"Under {args.url}: delete {removed_text(plan)}?")
        return not declined

    with session.progress() as progress:
        report = catalog.gc(
            args.url,
            args.older_than,
            session.config,
            args.dry_run,
            break_leases=args.break_leases,
            confirm=ask,
            progress=progress,
        )
    if declined:
        return fail("not confirmed; nothing was deleted", EXIT_ERROR)
    lines = [f"{'would delete' if report.dry_run else 'deleted'} {removed_text(report)}"]
    if args.dry_run:
        lines += [f"  s3://{report.bucket}/{key}" for key in report.deleted]
        lines += [f"  upload s3://{report.bucket}/{u.key}" for u in report.aborted]
    if report.skipped or report.skipped_uploads:
        young = f"{len(report.skipped)} objects and {len(report.skipped_uploads)} uploads"
        lines.append(
            f"kept {young}: younger than {args.older_than}, of a running save (its lease is "
            "live) or of a checkpoint whose record cannot be read"
        )
    session.emit(as_plain(report), "\n".join(lines))
    return EXIT_OK
