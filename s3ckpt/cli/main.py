"""The ``s3ckpt`` command line: serve a local S3 server, make buckets, list, inspect, export and
clean up checkpoints, and measure the endpoint (see `s3ckpt.tools.catalog`).

Exit codes: 0 ok, 1 a storage or runtime error (its message on stderr) or a declined prompt,
2 a usage error, 3 no (committed) checkpoint where one was asked for. Results go to stdout (JSON
with ``--json``); prompts, progress bars and errors go to stderr, so pipes carry only results.
With ``--json`` an error is a JSON object on stdout instead (`base.fail`). s3ckpt's log (each
retry is at INFO) reaches stderr with ``-v``; without it only warnings and the final error do.

The subcommands live in `manage` (ls, latest, info, rm, prune, gc), `data` (export, verify,
bench) and `serve` (serve, mb), registered with `command` as they are imported; `main` parses,
checks --yes, builds the config and maps errors to exit codes. Registering imports no torch:
the commands that need it import it when they run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from .. import __version__
from ..config import MiB, S3Config
from ..errors import CheckpointNotFound, ConfigError, IncompleteCheckpoint, S3CkptError
from . import data, local, manage  # noqa: F401  (importing them registers their subcommands)
from .base import (
    COMMANDS,
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    URL,
    Session,
    arg,
    command,
    errors_as_json,
    fail,
    reporting_json,
)

__all__ = ["URL", "Session", "arg", "build_parser", "command", "main"]

# The retry window until the store first answers: a refused or silent endpoint (a typo, a
# server not started) fails an interactive command in seconds; --retry-timeout replaces it.
FIRST_CONTACT_S = 5.0


def _add_connection_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """On the main parser and on each subcommand, so options go before or after it. The
    subcommands' default is SUPPRESS, or they would reset what was given before the command."""
    group = parser.add_argument_group("connection and output")
    unset: dict[str, Any] = {"default": default}
    group.add_argument("--endpoint-url", help="S3 endpoint (else AWS_ENDPOINT_URL...)", **unset)
    group.add_argument("--profile", help="AWS profile", **unset)
    group.add_argument("--region", help="region (else AWS_REGION..., us-east-1)", **unset)
    group.add_argument("--ca-bundle", metavar="PEM", help="CA certificates to trust", **unset)
    group.add_argument(
        "--part-size",
        type=int,
        metavar="MIB",
        help="part size, and the size above which objects are split (default 16)",
        **unset,
    )
    group.add_argument(
        "--max-concurrency", type=int, metavar="N", help="requests in flight (default 16)", **unset
    )
    group.add_argument(
        "--retry-timeout",
        type=float,
        metavar="SECONDS",
        help="how long to retry a store that fails transiently (default 60, and 5 until the "
        "store first answers: a refused endpoint fails within seconds); then one error says "
        "why, and -v shows each retry",
        **unset,
    )
    flag: dict[str, Any] = {"action": "store_true", "default": default is not None and default}
    group.add_argument("--no-verify-ssl", help="do not verify TLS certificates", **flag)
    group.add_argument("--json", help="print results, and errors, as JSON on stdout", **flag)
    group.add_argument(
        "--verbose", "-v", help="log what s3ckpt does, retries included, on stderr", **flag
    )
    group.add_argument("--yes", "-y", help="do not ask before deleting", **flag)


class _Parser(argparse.ArgumentParser):
    """Under --json a usage error is a JSON object on stdout too; otherwise argparse's usage and
    message on stderr."""

    def error(self, message: str) -> NoReturn:
        if not reporting_json():
            super().error(message)
        self.exit(fail(f"{self.prog}: {message}", EXIT_USAGE))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="s3ckpt", description="Inspect, export and clean up s3ckpt checkpoints on S3."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_connection_options(parser, None)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for spec in COMMANDS.values():
        sub = subparsers.add_parser(spec.name, help=spec.help, description=spec.help)
        for flags, options in spec.arguments:
            sub.add_argument(*flags, **options)
        _add_connection_options(sub, argparse.SUPPRESS)
    return parser


def _config(args: argparse.Namespace) -> S3Config:
    tuning: dict[str, Any] = {}
    if args.part_size is not None:
        tuning["part_size"] = tuning["multipart_threshold"] = args.part_size * MiB
    if args.max_concurrency is not None:
        tuning["max_concurrency"] = args.max_concurrency
    if args.retry_timeout is not None:
        tuning["retry_timeout"] = args.retry_timeout
    else:  # a dead or mistyped endpoint fails a command within seconds, not after a minute
        tuning["first_contact_timeout"] = FIRST_CONTACT_S
    return S3Config(
        endpoint_url=args.endpoint_url,
        region=args.region,
        profile=args.profile,
        verify=not args.no_verify_ssl,
        ca_bundle=args.ca_bundle,
        **tuning,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code instead of exiting, so it can be called."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Before parsing, "--json" among the words decides how a usage error is reported.
    with errors_as_json("--json" in argv):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help or --version (0), or a usage error reported (2)
            return e.code if isinstance(e.code, int) else EXIT_USAGE
    with errors_as_json(args.json, getattr(args, "url", None)), _log_to_stderr(args.verbose):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    spec = COMMANDS[args.command]
    if spec.destructive(args) and not args.yes and not (sys.stdin and sys.stdin.isatty()):
        return fail(
            f"{spec.name}: stdin is not a terminal to confirm the deletion on; "
            "pass --yes to delete without asking",
            EXIT_USAGE,
        )
    try:
        return spec.run(Session(args, _config(args)))
    except ConfigError as e:
        return fail(e, EXIT_USAGE)
    except (CheckpointNotFound, IncompleteCheckpoint) as e:
        return fail(e, EXIT_NOT_FOUND)
    except (S3CkptError, OSError) as e:  # OSError: a local file (export's OUT, say)
        return fail(e, EXIT_ERROR)
    except KeyboardInterrupt:
        return fail("interrupted", 130)


@contextlib.contextmanager
def _log_to_stderr(verbose: bool) -> Iterator[None]:
    """s3ckpt's log on stderr for one command: INFO and up with -v (every retry), else
    warnings only, so that a store that stays down reads as one error, not tens of retries."""
    logger = logging.getLogger("s3ckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormat())
    level = logger.level
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _LogFormat(logging.Formatter):
    """``s3ckpt: info: ...``, like the CLI's ``s3ckpt: error: ...``."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return f"s3ckpt: {record.levelname.lower()}: {record.message}"
