"""The demo: train a small LM with async checkpoints to S3, kill it mid-upload, resume exactly.

``python -m s3ckpt.tools.demo`` (``make demo``). With no endpoint configured (``--endpoint-url`` or
``AWS_ENDPOINT_URL[_S3]``) it starts a local SeaweedFS server and stops it at the end. The story:

1. a training process (`train`) checkpoints every few steps with a `CheckpointManager`
   (``mgr.save`` in the background, the newest ``--keep-last`` kept), and is SIGKILLed while one
   of its checkpoints is uploading;
2. ``catalog.gc`` spares the killed save while its lease is live, and with ``break_leases``
   (the writer is known dead) removes what it left behind;
3. a new process restores the newest committed checkpoint (``mgr.restore``) and resumes from it;
4. the same training runs once more without interruption, as the reference;

and the two runs must agree exactly: every loss, and every checkpoint bit for bit. It prints a
table per checkpoint and writes a timeline picture. Exit status: 0 exact, 1 not exact, 2 the
demo could not stage a step (a run failed, or the kill came too late to land mid-upload).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator

from ...config import S3Config
from .child import DemoError
from .run import Demo
from .train import train

__all__ = ["main"]

# Only the local server's keys may reach the children: not a profile or token of the user's.
_FOREIGN = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m s3ckpt.tools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--endpoint-url", help="S3 endpoint (default: AWS env, else a local one)")
    parser.add_argument("--bucket", default="s3ckpt-demo", help="created if missing")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default: 60)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps (10)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    parser.add_argument(
        "--keep-last",
        type=int,
        default=3,
        help="checkpoints the manager keeps, the newest (default: 3)",
    )
    parser.add_argument(
        "--kill-at", type=int, help="the checkpoint step to kill during (default: about 2/3 in)"
    )
    parser.add_argument("--out", default="demo-timeline.png", help="the timeline picture")
    parser.add_argument(
        "--keep", action="store_true", help="keep the checkpoints on a configured endpoint"
    )
    parser.add_argument("--child", choices=["train"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The kill needs a committed checkpoint before it and must land on a save."""
    saves = args.steps // args.every if args.every > 0 else 0
    if saves < 2:
        parser.error("--steps must allow at least 2 checkpoints (--steps >= 2 x --every)")
    if args.kill_at is None:
        args.kill_at = args.every * max(2, round(saves * 2 / 3))
    if args.keep_last < 1:
        parser.error("--keep-last must be at least 1")
    if args.kill_at % args.every or not 2 * args.every <= args.kill_at <= args.steps:
        parser.error("--kill-at must be a checkpoint step after the first one")
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("the timeline needs matplotlib: pip install 's3ckpt[demo]'")


@contextlib.contextmanager
def _endpoint(args: argparse.Namespace) -> Iterator[tuple[S3Config, dict[str, str], bool]]:
    """The configured endpoint, or a local SeaweedFS started for the demo; with the environment
    the training processes get, and whether the server is the demo's own."""
    env = dict(os.environ)
    configured = args.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if configured:
        if args.endpoint_url:
            env["AWS_ENDPOINT_URL_S3"] = args.endpoint_url
        print(f"S3 endpoint: {configured}")
        yield S3Config(endpoint_url=args.endpoint_url), env, False
        return
    from ..localserver import SeaweedFS

    with (
        tempfile.TemporaryDirectory(prefix="s3ckpt-demo-") as workdir,
        SeaweedFS(workdir) as server,
    ):
        local = server.endpoint
        print(f"S3 endpoint: {local.endpoint_url}, a local SeaweedFS started for the demo")
        for name in _FOREIGN:
            env.pop(name, None)
        env["AWS_ENDPOINT_URL_S3"] = local.endpoint_url
        env["AWS_ACCESS_KEY_ID"] = local.access_key_id
        env["AWS_SECRET_ACCESS_KEY"] = local.secret_access_key
        env["AWS_REGION"] = local.region
        config = S3Config(
            endpoint_url=local.endpoint_url,
            access_key_id=local.access_key_id,
            secret_access_key=local.secret_access_key,
            region=local.region,
        )
        yield config, env, True


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child == "train":
        train(args.url, args.steps, args.every, args.batch, args.keep_last)
        return 0
    _check(parser, args)
    print(
        f"s3ckpt demo: {args.steps} steps of a small transformer LM on the CPU, a background "
        f"checkpoint every {args.every} (the newest {args.keep_last} kept), a kill during the "
        f"checkpoint of step {args.kill_at}"
    )
    with _endpoint(args) as (config, env, local):
        try:
            return Demo(args, config, env, local).run()
        except DemoError as e:
            print(f"demo failed: {e}")
            return 2
