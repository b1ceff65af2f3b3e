"""The ``s3ckpt`` command line: list, inspect and clean up checkpoints (see `s3ckpt.catalog`).

Exit codes: 0 ok, 1 a storage or runtime error (its message on stderr) or a declined prompt,
2 a usage error, 3 no (committed) checkpoint where one was asked for. Results go to stdout (JSON
with ``--json``); prompts, progress bars and errors go to stderr, so pipes carry only results.

A subcommand is one function taking a `Session`, registered with `command` (its arguments
declared with `arg`); `main` parses, checks --yes, builds the config and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from tqdm import tqdm

from . import __version__, catalog
from .catalog import CheckpointInfo, GcReport, Progress, Removal
from .config import S3Config
from .errors import CheckpointNotFound, ConfigError, IncompleteCheckpoint, S3CkptError

__all__ = ["URL", "Session", "arg", "build_parser", "command", "main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3

_Arg = tuple[tuple[str, ...], dict[str, Any]]
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_RANK = re.compile(r"data-[^/]+/(\d+)-\d+")


def arg(*flags: str, **options: Any) -> _Arg:
    """One ``add_argument`` call, declared next to the command that takes it."""
    return flags, options


URL = arg("url", metavar="URL", help="s3://bucket/prefix")


@dataclass(frozen=True)
class _Command:
    name: str
    help: str
    arguments: tuple[_Arg, ...]
    run: Callable[[Session], int]
    destructive: Callable[[argparse.Namespace], bool]


_COMMANDS: dict[str, _Command] = {}


def command(
    name: str,
    help: str,
    *arguments: _Arg,
    destructive: Callable[[argparse.Namespace], bool] = lambda _: False,
) -> Callable[[Callable[[Session], int]], Callable[[Session], int]]:
    """Register a subcommand; ``destructive`` says when it needs --yes or a terminal to ask on."""

    def register(run: Callable[[Session], int]) -> Callable[[Session], int]:
        _COMMANDS[name] = _Command(name, help, arguments, run, destructive)
        return run

    return register


@dataclass
class Session:
    """One invocation: its arguments, connection settings and ways to talk to the user."""

    args: argparse.Namespace
    config: S3Config

    def emit(self, data: Any, text: str) -> None:
        """``data`` as JSON with --json, else ``text`` (nothing if empty)."""
        if self.args.json:
            print(json.dumps(data, default=_json_default, indent=2))
        elif text:
            print(text)

    def confirm(self, question: str) -> bool:
        """Ask on the terminal; `main` has made sure there is one unless --yes was given."""
        if self.args.yes:
            return True
        sys.stderr.write(f"{question} [y/N] ")
        sys.stderr.flush()
        return sys.stdin.readline().strip().lower() in ("y", "yes")

    @contextlib.contextmanager
    def progress(self) -> Iterator[Progress | None]:
        """A bar on stderr while objects are deleted; none with --json or off a terminal."""
        if self.args.json or not sys.stderr.isatty():
            yield None
            return
        with tqdm(total=0, unit="obj", desc=self.args.command, file=sys.stderr) as bar:

            def update(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            yield update


# ------------------------------------------------------------------------------- commands


@command("ls", "list the checkpoints at URL and directly under it", URL)
def _ls(session: Session) -> int:
    infos = catalog.list_checkpoints(session.args.url, session.config)
    rows = [
        [
            i.prefix or "/",
            "committed" if i.committed else "incomplete",
            _text(i.step),
            _size(i.total_bytes),
            str(i.num_objects),
            _when(i.created),
        ]
        for i in infos
    ]
    header = ["PREFIX", "STATUS", "STEP", "SIZE", "OBJECTS", "CREATED (UTC)"]
    session.emit([_plain(i) for i in infos], _table(header, rows, right={2, 3, 4}))
    if not infos and not session.args.json:
        print(f"no checkpoints at or under {session.args.url}", file=sys.stderr)
    return EXIT_OK


@command("latest", "print the newest committed checkpoint (highest step) under URL", URL)
def _latest(session: Session) -> int:
    info = catalog.latest(session.args.url, session.config)
    if info is None:
        return _fail(f"no committed checkpoint at or under {session.args.url}", EXIT_NOT_FOUND)
    session.emit(_plain(info), info.url)
    return EXIT_OK


@command("info", "show a committed checkpoint: tensors, objects per rank, totals", URL)
def _info(session: Session) -> int:
    info, checkpoint = catalog.describe(session.args.url, session.config)
    items = []
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
        match = _RANK.fullmatch(key)
        rank = int(match.group(1)) if match else None
        entry = ranks.setdefault(rank, {"rank": rank, "objects": 0, "bytes": 0})
        entry["objects"] += 1
        entry["bytes"] += size
    by_rank = sorted(ranks.values(), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    summary = [
        ("checkpoint", info.url),
        ("step", _text(info.step)),
        ("save id", _text(info.save_id)),
        ("world size", _text(info.world_size)),
        ("created", f"{_when(info.created)} UTC"),
        ("compression", _text(info.compression)),
        ("total", f"{_size(info.total_bytes)} in {info.num_objects} objects (with .metadata)"),
    ]
    tensors = [[i["name"], i["dtype"], _shape(i["shape"]), _size(i["bytes"])] for i in items]
    per_rank = [[_text(r["rank"]), str(r["objects"]), _size(r["bytes"])] for r in by_rank]
    text = "\n\n".join(
        [
            "\n".join(f"{name + ':':<12} {value}" for name, value in summary),
            _table(["ITEM", "DTYPE", "SHAPE", "SIZE"], tensors, right={3}),
            _table(["RANK", "OBJECTS", "SIZE"], per_rank, right={0, 1, 2}),
        ]
    )
    session.emit({"checkpoint": _plain(info), "items": items, "ranks": by_rank}, text)
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
        declined = not session.confirm(f"Delete {url}: {_removed(plan)}?")
        return not declined

    with session.progress() as progress:
        removal = catalog.delete(url, session.config, confirm=ask, progress=progress)
    if declined:
        return _fail("not confirmed; nothing was deleted", EXIT_ERROR)
    session.emit(_plain(removal), f"deleted {url}: {_removed(removal)}")
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
        listing = "\n".join(f"  {v.url}  ({_size(v.total_bytes)})" for v in victims)
        question = f"Delete these {len(victims)} checkpoints, keeping {args.keep}?\n{listing}\n"
        declined = not session.confirm(question)
        return not declined

    with session.progress() as progress:
        deleted = catalog.prune(args.url, args.keep, session.config, confirm=ask, progress=progress)
    if declined:
        return _fail("not confirmed; nothing was deleted", EXIT_ERROR)
    text = "\n".join(f"deleted {i.url}" for i in deleted) or "nothing to prune"
    session.emit([_plain(i) for i in deleted], text)
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
    destructive=lambda args: not args.dry_run,
)
def _gc(session: Session) -> int:
    args, declined = session.args, False

    def ask(plan: GcReport) -> bool:
        nonlocal declined
        if plan.deleted or plan.aborted:
            declined = not session.confirm(f"Under {args.url}: delete {_removed(plan)}?")
        return not declined

    with session.progress() as progress:
        report = catalog.gc(
            args.url, args.older_than, session.config, args.dry_run, confirm=ask, progress=progress
        )
    if declined:
        return _fail("not confirmed; nothing was deleted", EXIT_ERROR)
    lines = [f"{'would delete' if report.dry_run else 'deleted'} {_removed(report)}"]
    if args.dry_run:
        lines += [f"  s3://{report.bucket}/{key}" for key in report.deleted]
        lines += [f"  upload s3://{report.bucket}/{u.key}" for u in report.aborted]
    if report.skipped or report.skipped_uploads:
        young = f"{len(report.skipped)} objects and {len(report.skipped_uploads)} uploads"
        lines.append(f"kept {young} younger than {args.older_than}")
    session.emit(_plain(report), "\n".join(lines))
    return EXIT_OK


# ------------------------------------------------------------------------------- main


def _add_connection_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """On the main parser and on each subcommand, so options go before or after it. The
    subcommands' default is SUPPRESS, or they would reset what was given before the command."""
    group = parser.add_argument_group("connection and output")
    unset = {"default": default}
    group.add_argument("--endpoint-url", help="S3 endpoint (else AWS_ENDPOINT_URL...)", **unset)
    group.add_argument("--profile", help="AWS profile", **unset)
    group.add_argument("--region", help="region (else AWS_REGION..., us-east-1)", **unset)
    group.add_argument("--ca-bundle", metavar="PEM", help="CA certificates to trust", **unset)
    flag = {"action": "store_true", "default": False if default is None else default}
    group.add_argument("--no-verify-ssl", help="do not verify TLS certificates", **flag)
    group.add_argument("--json", help="print results as JSON", **flag)
    group.add_argument("--yes", "-y", help="do not ask before deleting", **flag)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s3ckpt", description="Inspect and clean up s3ckpt checkpoints on S3."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_connection_options(parser, None)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for spec in _COMMANDS.values():
        sub = subparsers.add_parser(spec.name, help=spec.help, description=spec.help)
        for flags, options in spec.arguments:
            sub.add_argument(*flags, **options)
        _add_connection_options(sub, argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code instead of exiting, so it can be called."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or --version (0), or a usage error argparse printed (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    spec = _COMMANDS[args.command]
    if spec.destructive(args) and not args.yes and not (sys.stdin and sys.stdin.isatty()):
        print(
            f"s3ckpt {spec.name}: stdin is not a terminal to confirm the deletion on; "
            "pass --yes to delete without asking",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        config = S3Config(
            endpoint_url=args.endpoint_url,
            region=args.region,
            profile=args.profile,
            verify=not args.no_verify_ssl,
            ca_bundle=args.ca_bundle,
        )
        return spec.run(Session(args, config))
    except ConfigError as e:
        return _fail(e, EXIT_USAGE)
    except (CheckpointNotFound, IncompleteCheckpoint) as e:
        return _fail(e, EXIT_NOT_FOUND)
    except S3CkptError as e:
        return _fail(e, EXIT_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(error: Exception | str, code: int) -> int:
    print(f"s3ckpt: error: {error}", file=sys.stderr)
    return code


# ------------------------------------------------------------------------------- formatting


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _plain(value: Any) -> dict[str, Any]:
    return dataclasses.asdict(value)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def _when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _shape(shape: list[int] | None) -> str:
    return "-" if shape is None else str(shape)


def _size(count: int) -> str:
    value = float(count)
    for unit in _UNITS[:-1]:
        if value < 1024:
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_UNITS[-1]}"


def _removed(removal: Removal) -> str:
    freed = _size(removal.bytes_freed)
    return f"{len(removal.deleted)} objects ({freed}), {len(removal.aborted)} uploads"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Columns padded to their widest cell; those in ``right`` (numbers) right-aligned."""
    if not rows:
        return ""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
