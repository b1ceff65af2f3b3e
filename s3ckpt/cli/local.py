"""A user's first steps: ``serve`` a local S3 server to try s3ckpt on, ``mb`` a bucket to save to.

Neither imports torch: both run before a user has anything to load.
"""

from __future__ import annotations

from ..config import parse_s3_url
from ..errors import ConfigError
from ..tools import serve
from .base import EXIT_ERROR, EXIT_OK, Session, arg, command, fail


@command("serve", serve.SERVE_HELP, *serve.SERVE_ARGUMENTS)
def _serve(session: Session) -> int:
    args = session.args
    try:
        serve.serve(args.dir, port=args.port, bucket=args.bucket, as_json=args.json)
    except (OSError, RuntimeError) as e:  # weed missing, its port taken, or it failed to start
        return fail(e, EXIT_ERROR)
    return EXIT_OK


@command(
    "mb",
    "create a bucket; succeeds, saying so, if it exists already and these credentials may use it",
    arg("url", metavar="s3://BUCKET", help="the bucket to create"),
)
def _mb(session: Session) -> int:
    bucket, prefix = parse_s3_url(session.args.url)
    if prefix:
        raise ConfigError(f"mb creates a bucket, not a prefix: use s3://{bucket}")
    from ..tools.catalog import make_bucket  # the engine (aiohttp, botocore) only when it runs

    created = make_bucket(bucket, session.config)
    url = f"s3://{bucket}"
    result = {"bucket": bucket, "url": url, "created": created}
    session.emit(result, f"created {url}" if created else f"{url} exists")
    return EXIT_OK
