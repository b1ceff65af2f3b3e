"""What every subcommand is built from: the registry, the `Session` and the output helpers.

A subcommand is one function taking a `Session`, registered with `command` (its arguments
declared with `arg`). Results go to stdout (JSON with ``--json``); prompts, progress and errors
go to stderr, so pipes carry only results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tqdm import tqdm

from ..config import S3Config
from ..tools.catalog import Progress, Removal

__all__ = [
    "COMMANDS",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "URL",
    "Session",
    "arg",
    "as_plain",
    "command",
    "fail",
    "format_table",
    "human_size",
    "or_dash",
    "removed_text",
    "utc_text",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3

Arg = tuple[tuple[str, ...], dict[str, Any]]
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


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
    def progress(self, unit: str = "obj") -> Iterator[Progress | None]:
        """A bar on stderr counting ``unit`` (objects, or bytes: "B"); none with --json or off a
        terminal."""
        if self.args.json or not sys.stderr.isatty():
            yield None
            return
        scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
        with tqdm(total=0, unit=unit, desc=self.args.command, file=sys.stderr, **scaled) as bar:

            def update(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            yield update


def fail(error: Exception | str, code: int) -> int:
    print(f"s3ckpt: error: {error}", file=sys.stderr)
    return code


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
    freed = human_size(removal.bytes_freed)
    return f"{len(removal.deleted)} objects ({freed}), {len(removal.aborted)} uploads"


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
