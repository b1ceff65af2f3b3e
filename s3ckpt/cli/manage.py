"""The subcommands that find, inspect and clean up checkpoints (see `s3ckpt.tools.catalog`).

None of them imports torch (records are read into the format's own model), and each imports the
catalog, and with it the engine, when it runs: registering them is part of ``s3ckpt --version``.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..format import layout
from ..format.record import Checkpoint, TensorEntry
from .base import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
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

if TYPE_CHECKING:
    from ..tools.catalog import CheckpointInfo, GcReport, Removal
    from ..tools.retention import Retention

_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_REASONS_SHOWN = 20  # gc's kept objects listed with their reason; --json has all


@command(
    "ls",
    "list the checkpoints at URL and at every depth below it, as a tree (one LIST request per "
    "1000 keys under URL, then one GET per checkpoint)",
    URL,
)
def _ls(session: Session) -> int:
    from ..tools import catalog

    url = session.args.url
    infos = catalog.list_checkpoints(url, session.config)
    header = ["PREFIX", "STEP", "COMMITTED (UTC)", "SIZE", "OBJECTS", "COMPRESSION", "STATE"]
    rows = _tree(layout.Location.of(url).prefix, infos)
    session.emit([as_plain(i) for i in infos], format_table(header, rows, right={1, 3, 4}))
    if not infos and not session.args.json:
        print(f"no checkpoints at or under {url}", file=sys.stderr)
    return EXIT_OK


def _tree(base: str, infos: list[CheckpointInfo]) -> list[list[str]]:
    """One row per checkpoint, named by its last component and indented by its depth below
    ``base``, under a row for each prefix between them (``infos`` are in tree order)."""
    rows: list[list[str]] = []
    shown: set[str] = set()
    for info in infos:
        relative = info.prefix[len(base) :].strip("/") if base else info.prefix
        parts = relative.split("/") if relative else []
        for depth in range(len(parts) - 1):
            group = "/".join(parts[: depth + 1])
            if group not in shown:
                shown.add(group)
                rows.append(["  " * depth + parts[depth] + "/"] + [""] * 6)
        shown.add(relative)
        name = parts[-1] if parts else base.rpartition("/")[2] or "/"
        rows.append(
            [
                "  " * max(len(parts) - 1, 0) + name,
                or_dash(info.step),
                utc_text(info.created) if info.committed else "-",
                human_size(info.total_bytes),
                f"{info.num_objects} + {info.uploads} uploads"
                if info.uploads
                else str(info.num_objects),
                _compression(info, short=True),
                info.state,
            ]
        )
    return rows


def _compression(info: CheckpointInfo, *, short: bool = False) -> str:
    """The codec and level; "none" when the record says so, "-" when it does not say (records
    from before writers recorded it, and checkpoints without a readable record)."""
    if info.compression is None:
        return "none" if info.torch_version is not None else "-"
    if info.compression_level is None:
        return info.compression
    if short:
        return f"{info.compression}:{info.compression_level}"
    return f"{info.compression} (level {info.compression_level})"


@command(
    "latest",
    "print the committed checkpoint with the highest step at or below URL, at any depth (one "
    "LIST request per 1000 keys under URL)",
    URL,
)
def _latest(session: Session) -> int:
    from ..tools import catalog

    tied = catalog.highest(session.args.url, session.config)
    if not tied:
        return fail(f"no committed checkpoint at or under {session.args.url}", EXIT_NOT_FOUND)
    info, others = tied[0], tied[1:]
    if others:
        print(
            f"s3ckpt: note: {len(tied)} checkpoints have the highest step, {info.step}: this is "
            f"the newest; also {', '.join(o.url for o in others)}",
            file=sys.stderr,
        )
    session.emit(as_plain(info), info.url)
    return EXIT_OK


@command(
    "info",
    "show a committed checkpoint: how it was saved, its tensors, objects per rank, totals",
    URL,
)
def _info(session: Session) -> int:
    from ..tools import catalog

    info, checkpoint = catalog.describe(session.args.url, session.config)
    items: list[dict[str, Any]] = []
    for fqn, entry in checkpoint.entries.items():
        if isinstance(entry, TensorEntry):
            item = {"name": fqn, "dtype": entry.dtype, "shape": entry.size, "bytes": entry.nbytes}
        else:
            item = {"name": fqn, "dtype": "bytes", "shape": None, "bytes": entry.locator.length}
        items.append(item)
    ranks: dict[int | None, dict[str, Any]] = {}
    for key, size in sorted(checkpoint.objects.items()):
        if layout.is_reference(key):
            continue  # shown as "referenced"
        rank = layout.rank_of(key)
        counts = ranks.setdefault(rank, {"rank": rank, "objects": 0, "bytes": 0})
        counts["objects"] += 1
        counts["bytes"] += size
    by_rank = sorted(ranks.values(), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    tensors = [[i["name"], i["dtype"], or_dash(i["shape"]), human_size(i["bytes"])] for i in items]
    per_rank = [[or_dash(r["rank"]), str(r["objects"]), human_size(r["bytes"])] for r in by_rank]
    text = "\n\n".join(
        [
            "\n".join(f"{name + ':':<12} {value}" for name, value in _summary(info, checkpoint)),
            format_table(["ITEM", "DTYPE", "SHAPE", "SIZE"], tensors, right={3}),
            format_table(["RANK", "OBJECTS", "SIZE"], per_rank, right={0, 1, 2}),
        ]
    )
    record = {"bytes": checkpoint.record_size, "version": checkpoint.version}
    shown = {"checkpoint": as_plain(info), "record": record, "items": items, "ranks": by_rank}
    session.emit(shown, text)
    return EXIT_OK


def _summary(info: CheckpointInfo, checkpoint: Checkpoint) -> list[tuple[str, str]]:
    stored, logical = info.stored_bytes, info.logical_bytes
    ratio = f" ({stored / logical:.0%} of logical)" if logical else ""
    frames = None if info.frame_size is None else human_size(info.frame_size)
    return [
        ("checkpoint", info.url),
        ("state", info.state),
        ("step", or_dash(info.step)),
        ("save id", or_dash(info.save_id)),
        ("created", f"{utc_text(info.created)} UTC"),
        ("world size", f"{or_dash(info.world_size)} (ranks)"),
        ("tensors", or_dash(info.tensors)),
        ("logical", or_dash(None if logical is None else human_size(logical))),
        ("stored", f"{human_size(stored)}{ratio}, in this checkpoint's own objects"),
        ("referenced", _referenced(info)),
        ("compression", _compression(info)),
        ("frame size", or_dash(frames)),
        ("s3ckpt", or_dash(info.s3ckpt_version)),
        ("torch", or_dash(info.torch_version)),
        ("total", f"{human_size(info.total_bytes)} in {info.num_objects} objects (with .metadata)"),
        (
            "record",
            f"{checkpoint.record_size:,} bytes (.metadata, format version {checkpoint.version})",
        ),
    ]


def _referenced(info: CheckpointInfo) -> str:
    if not info.references:
        return "-"
    names = ", ".join(info.references)
    return (
        f"{human_size(info.referenced_bytes)} of the state, stored by earlier checkpoints ({names})"
    )


def _always(_: argparse.Namespace) -> bool:
    return True


@command(
    "rm", "delete the checkpoint at URL (.metadata first, then its data)", URL, destructive=_always
)
def _rm(session: Session) -> int:
    from ..tools import catalog

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
    "delete the committed checkpoints under URL that a run's retention policy (CheckpointManager's)"
    " does not keep: the newest N, and every step that is a multiple of K; the newest is always "
    "kept, checkpoints without a step number too, and incomplete ones are gc's",
    URL,
    arg(
        "--keep-last",
        "--keep",
        type=_at_least_one,
        metavar="N",
        help="keep the N newest checkpoints (--keep is the older spelling)",
    ),
    arg("--keep-every", type=_at_least_one, metavar="K", help="also keep every K-th step"),
    arg("--dry-run", action="store_true", help="only list what would be deleted"),
    destructive=lambda args: not args.dry_run,
)
def _prune(session: Session) -> int:
    from ..tools import catalog
    from ..tools.retention import Retention

    args, declined = session.args, False
    if args.keep_last is None and args.keep_every is None:
        return fail("prune: say what to keep: --keep-last N, --keep-every K or both", EXIT_USAGE)
    retention = Retention(keep_last=args.keep_last, keep_every=args.keep_every)

    would: list[CheckpointInfo] = []

    def ask(victims: list[CheckpointInfo]) -> bool:
        nonlocal declined
        if args.dry_run:
            would.extend(victims)
            return False
        listing = "\n".join(f"  {v.url}  ({human_size(v.total_bytes)})" for v in victims)
        question = f"Delete these {len(victims)} checkpoints, keeping {_kept(retention)}?"
        declined = not session.confirm(f"{question}\n{listing}\n")
        return not declined

    with session.progress() as progress:
        deleted = catalog.prune(
            args.url, retention.kept, session.config, confirm=ask, progress=progress
        )
    if declined:
        return fail("not confirmed; nothing was deleted", EXIT_ERROR)
    if args.dry_run:
        lines = [f"would delete {v.url}  ({human_size(v.total_bytes)})" for v in would]
        session.emit([as_plain(v) for v in would], "\n".join(lines) or "nothing to prune")
        return EXIT_OK
    text = "\n".join(f"deleted {i.url}" for i in deleted) or "nothing to prune"
    session.emit([as_plain(i) for i in deleted], text)
    return EXIT_OK


def _kept(retention: Retention) -> str:
    """The policy in words, for the prompt."""
    rules = ["the newest"] if retention.keep_last is None else [f"the {retention.keep_last} newest"]
    if retention.keep_every is not None:
        rules.append(f"every step that is a multiple of {retention.keep_every}")
    return " and ".join(rules)


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
        help="also collect saves whose lease is live: only when their writers are known dead "
        "(readers' and incremental saves' pins are never broken)",
    ),
    destructive=lambda args: not args.dry_run,
)
def _gc(session: Session) -> int:
    from ..tools import catalog

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
        lines.append(f"kept {young}, each for the reason given:")
    shown = report.reasons[:_REASONS_SHOWN]
    lines += [f"  kept s3://{report.bucket}/{key}: {reason}" for key, reason in shown]
    if len(report.reasons) > len(shown):
        lines.append(f"  and {len(report.reasons) - len(shown)} more (--json lists them all)")
    session.emit(as_plain(report), "\n".join(lines))
    return EXIT_OK
