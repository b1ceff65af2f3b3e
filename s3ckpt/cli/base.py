"""What every subcommand is built from: the registry, the `Session` and the output helpers.

A subcommand is one function taking a `Session`, registered with `command` (its arguments
declared with `arg`). Results go to stdout (JSON with ``--json``); prompts, progress and errors
go to stderr, so pipes carry only results. With ``--json`` an error is a JSON object on stdout
instead (`fail`), so a script reads one answer from one place either way.

Nothing here imports torch: ``s3ckpt --version`` and the commands that only list or delete
objects start in a fraction of torch's import time.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from tqdm import tqdm

from ..config import S3Config
from ..errors import CheckpointError, StorageError

if TYPE_CHECKING:
    from ..tools.catalog import Removal

__all__ = [
    "COMMANDS",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "URL",
    "Bar",
    "Session",
    "arg",
    "as_plain",
    "command",
    "error_url",
    "errors_as_json",
    "fail",
    "format_table",
    "human_size",
    "or_dash",
    "removed_text",
    "reporting_json",
    "utc_text",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3

Arg = tuple[tuple[str, ...], dict[str, Any]]
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# What a failure is called in --json output when it is a message, not an exception.
_KINDS = {
    EXIT_ERROR: "Error",
    EXIT_USAGE: "UsageError",
    EXIT_NOT_FOUND: "CheckpointNotFound",
    130: "KeyboardInterrupt",
}
_json_errors = contextvars.ContextVar("s3ckpt_json_errors", default=False)
_command_url: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "s3ckpt_command_url", default=None
)


def arg(*flags: str, **options: Any) -> Arg:
    """One ``add_argument`` call, declared next to the command that takes it."""
    return flags, options


URL = arg("url", metavar="URL", help="s3://bucket/prefix")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: tuple[Arg, ...]
    run: Callable[[Session], int]
    destructive: Callable[[argparse.Namespace], bool]


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    help: str,
    *arguments: Arg,
    destructive: Callable[[argparse.Namespace], bool] = lambda _: False,
) -> Callable[[Callable[[Session], int]], Callable[[Session], int]]:
    """Register a subcommand; ``destructive`` says when it needs --yes or a terminal to ask on."""

    def register(run: Callable[[Session], int]) -> Callable[[Session], int]:
        COMMANDS[name] = Command(name, help, arguments, run, destructive)
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
    def progress(self, unit: str = "obj", desc: str | None = None) -> Iterator[Bar | None]:
        """A bar on stderr (titled ``desc``, default the command) counting ``unit`` (objects, or
        bytes: "B"), with rate and ETA; none with --json or off a terminal, so that pipes and
        logs get only results. Called with bytes as well, the bar counts bytes and shows the
        objects beside it: bytes say how far a transfer got better than objects of any size."""
        if self.args.json or not sys.stderr.isatty():
            yield None
            return
        title = desc or self.args.command
        # Drawn at the first count, not before: a command that asks first (rm, prune, gc)
        # counts only once the answer is in, so the bar never collides with the question.
        bars: list[tqdm[Any]] = []

        def update(
            done: int, total: int, done_bytes: int | None = None, total_bytes: int | None = None
        ) -> None:
            if not bars:
                bars.append(tqdm(total=0, unit=unit, desc=title, file=sys.stderr, **_scaled(unit)))
            bar = bars[0]
            if done_bytes is not None and total_bytes is not None:
                if bar.unit != "B":
                    bar.unit, bar.unit_scale, bar.unit_divisor = "B", True, 1024
                bar.set_postfix_str(f"{done}/{total} {unit}", refresh=False)
                done, total = done_bytes, total_bytes
            bar.total = total
            bar.update(done - bar.n)

        try:
            yield update
        finally:
            for bar in bars:
                bar.close()


class Bar(Protocol):
    """What `Session.progress` yields: ``bar(done, total)`` in its unit, or ``bar(done, total,
    done_bytes, total_bytes)``. It is also a `tools.catalog.Progress`, for the tools' callbacks."""

    def __call__(
        self, done: int, total: int, done_bytes: int | None = None, total_bytes: int | None = None
    ) -> None: ...


def _scaled(unit: str) -> dict[str, Any]:
    return {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}


@contextlib.contextmanager
def errors_as_json(on: bool, url: str | None = None) -> Iterator[None]:
    """While it is open, `fail` reports as JSON on stdout (``--json``), not on stderr, with
    ``url`` (the command's, when it is an ``s3://`` URL) unless the error names a more precise
    one. Context variables rather than arguments, so that every command's `fail` calls follow."""
    token = _json_errors.set(on)
    url_token = _command_url.set(url if url and url.startswith("s3://") else None)
    try:
        yield
    finally:
        _json_errors.reset(token)
        _command_url.reset(url_token)


def reporting_json() -> bool:
    """Whether `fail` reports as JSON now (inside ``errors_as_json(True)``)."""
    return _json_errors.get()


def fail(error: Exception | str, code: int, *, url: str | None = None) -> int:
    """Report a failure and return ``code``: ``s3ckpt: error: ...`` on stderr, or with --json
    ``{"error": type, "message": ..., "url": ...}`` on stdout, always these three keys
    (``url`` defaults to what ``error`` knows, `error_url`, then to the command's URL)."""
    if not _json_errors.get():
        print(f"s3ckpt: error: {error}", file=sys.stderr)
        return code
    if isinstance(error, Exception):
        kind, url = type(error).__name__, url or error_url(error)
    else:
        kind = _KINDS.get(code, "Error")
    url = url or _command_url.get()
    print(json.dumps({"error": kind, "message": str(error), "url": url}, indent=2))
    return code


def error_url(error: Exception) -> str | None:
    """The ``s3://`` URL of the checkpoint, object or bucket an error is about, if it says."""
    if isinstance(error, CheckpointError) and error.url is not None:
        return error.url
    if isinstance(error, StorageError) and error.bucket:
        return f"s3://{error.bucket}/{error.key}" if error.key else f"s3://{error.bucket}"
    return None


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def as_plain(value: Any) -> dict[str, Any]:
    return dataclasses.asdict(value)


def or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def utc_text(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S")


def human_size(count: int) -> str:
    value = float(count)
    for unit in _UNITS[:-1]:
        if value < 1024:
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} {_UNITS[-1]}"


def removed_text(removal: Removal) -> str:
    """Objects and uploads with their bytes: a killed save's uploads hold its bytes in parts."""
    freed = human_size(removal.bytes_freed - removal.upload_bytes)
    uploads = f" ({human_size(removal.upload_bytes)})" if removal.aborted else ""
    text = f"{len(removal.deleted)} objects ({freed}), {len(removal.aborted)} uploads{uploads}"
    if removal.kept:
        text += (
            f"; {len(removal.kept)} objects kept: later checkpoints of the run reference them, "
            "or a reader or a running save holds them (for a later pass, or gc)"
        )
    if removal.left_alone:
        example = f"s3://{removal.bucket}/{removal.left_alone[0]}"
        text += (
            f"; {len(removal.left_alone)} objects left alone: in data-* directories but not "
            f"written by s3ckpt (e.g. {example})"
        )
    return text


def format_table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
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
