"""`serve`: a local S3 server in the foreground, kept in a directory, for a user's first steps
(``s3ckpt serve``, ``python -m s3ckpt.tools.serve``). Imports no torch.

The directory's S3 keys are made on its first start and printed that once, as ``export`` lines;
they stay in ``D/credentials`` (mode 0600, the AWS shared-credentials format), and later starts
print lines that point the AWS SDKs at that file instead, so the secret is shown once only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ..config import S3Config
from ..errors import S3CkptError
from .localserver import DEFAULT_PORT, LocalEndpoint, SeaweedFS
from .weedfiles import CREDENTIALS_FILE, CREDENTIALS_PROFILE

__all__ = ["SERVE_ARGUMENTS", "SERVE_HELP", "default_dir", "main", "serve"]


def default_dir() -> Path:
    """Under the user's cache, so a server's data outlives it and does not depend on the cwd."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "s3ckpt" / "serve"


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return port


SERVE_HELP = (
    "run a local S3 server (SeaweedFS) on 127.0.0.1 in the foreground and print the settings "
    "that reach it; Ctrl-C stops it"
)
# One declaration for `s3ckpt serve` and `python -m s3ckpt.tools.serve` (--json is the CLI's
# own option there).
SERVE_ARGUMENTS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("--dir",),
        {
            "type": Path,
            "metavar": "D",
            "help": "where the data and its S3 keys (D/credentials) are kept; a later serve of the "
            "same D finds its buckets and objects (default: $XDG_CACHE_HOME/s3ckpt/serve, else "
            "~/.cache/s3ckpt/serve)",
        },
    ),
    (
        ("--port",),
        {
            "type": _port,
            "default": DEFAULT_PORT,
            "metavar": "P",
            "help": f"S3 port (default: {DEFAULT_PORT})",
        },
    ),
    (("--bucket",), {"metavar": "B", "help": "create bucket B once the server is up (if new)"}),
)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stopped(BaseException):
    """Raised by the signal handler; a BaseException, so no ``except Exception`` swallows it."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def serve(
    workdir: str | os.PathLike[str] | None = None,
    *,
    port: int = DEFAULT_PORT,
    bucket: str | None = None,
    as_json: bool = False,
) -> None:
    """Run SeaweedFS in the foreground until SIGINT or SIGTERM, then stop it whole and return.

    Once S3 answers (and ``bucket`` exists), prints, flushed, the lines to paste, or one JSON
    object: with the keys if this start made them, else pointing at ``workdir/credentials``; how
    to stop it goes to stderr. Installs signal handlers, so only from the main thread. weed
    exiting on its own raises RuntimeError with its log.
    """
    where = Path(workdir if workdir is not None else default_dir()).expanduser().resolve()
    server = SeaweedFS(where, s3_port=port)
    previous = {sig: signal.signal(sig, _stop) for sig in _STOP_SIGNALS}
    try:
        endpoint = server.start()
        if bucket is not None:
            _create_bucket(endpoint, bucket)
        _announce(endpoint, where, bucket, made=server.made_credentials, as_json=as_json)
        status = server.wait()
        raise RuntimeError(f"SeaweedFS exited with status {status}; log tail:\n{server.log_tail()}")
    except _Stopped:
        pass
    finally:
        for sig in _STOP_SIGNALS:  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _create_bucket(endpoint: LocalEndpoint, bucket: str) -> None:
    from ..engine import bridge  # the engine only once the server is up
    from ..engine.store import get_store

    config = S3Config(
        endpoint_url=endpoint.endpoint_url,
        region=endpoint.region,
        access_key_id=endpoint.access_key_id,
        secret_access_key=endpoint.secret_access_key,
    )
    bridge.run(get_store(config).create_bucket(bucket))


def _announce(
    endpoint: LocalEndpoint, workdir: Path, bucket: str | None, *, made: bool, as_json: bool
) -> None:
    """The keys are printed by the start that made them, nowhere else (a terminal's scrollback,
    a redirected log): later starts name the file, which the SDKs read (``unset`` clears keys
    left in the shell, which they would prefer). AWS_REGION comes last in both forms."""
    credentials = workdir / CREDENTIALS_FILE
    if made:
        settings = endpoint.environment()
    else:
        settings = {
            "AWS_ENDPOINT_URL": endpoint.endpoint_url,
            "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
            "AWS_PROFILE": CREDENTIALS_PROFILE,
            "AWS_REGION": endpoint.region,
        }
    if as_json:
        where = {"dir": str(workdir), "bucket": bucket, "credentials": str(credentials)}
        print(json.dumps({**settings, **where}), flush=True)
    else:
        lines = [] if made else ["unset AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in settings.items()]
        print("\n".join(lines), flush=True)
    with_bucket = f", bucket {bucket}" if bucket is not None else ""
    keys = (
        f"new keys, printed only this once, kept in {credentials} (mode 0600); a later serve "
        "of this directory prints lines that read them from there"
        if made
        else f"keys in {credentials}"
    )
    print(
        f"serving S3 on {endpoint.endpoint_url} (data in {workdir}{with_bucket}; {keys}); "
        f"stop with Ctrl-C or `kill {os.getpid()}`",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m s3ckpt.tools.serve``: the same as ``s3ckpt serve``."""
    parser = argparse.ArgumentParser(prog="python -m s3ckpt.tools.serve", description=SERVE_HELP)
    for flags, options in SERVE_ARGUMENTS:
        parser.add_argument(*flags, **options)
    parser.add_argument("--json", action="store_true", help="print the settings as JSON")
    args = parser.parse_args(argv)
    try:
        serve(args.dir, port=args.port, bucket=args.bucket, as_json=args.json)
    except (OSError, RuntimeError, S3CkptError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
