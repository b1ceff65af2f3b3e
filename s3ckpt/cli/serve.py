"""A user's first steps: ``serve`` a local S3 server to try s3ckpt on, ``mb`` a bucket to save to.

Neither imports torch: both run before a user has anything to load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import parse_s3_url
from ..errors import AccessDenied, BucketNotFound, ConfigError, StorageError
from ..tools import serve
from .base import EXIT_ERROR, EXIT_OK, Session, arg, command, fail

if TYPE_CHECKING:
    from ..engine.contract import ObjectStore


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
    from ..engine import bridge  # the engine (aiohttp, botocore) only when a command runs
    from ..engine.store import get_store

    created = bridge.run(make_bucket(get_store(session.config), bucket))
    url = f"s3://{bucket}"
    result = {"bucket": bucket, "url": url, "created": created}
    session.emit(result, f"created {url}" if created else f"{url} exists")
    return EXIT_OK


async def make_bucket(store: ObjectStore, bucket: str) -> bool:
    """Create ``bucket``; False if it was there already and ours.

    A one-key listing decides first, not `ObjectStore.check_bucket`, which lets AccessDenied
    pass (prefix-scoped credentials): a bucket we may not list is someone else's or denied to
    us, and must not be reported as ready to save to.
    """
    try:
        await store.list_objects(bucket, "", limit=1)
        return False
    except BucketNotFound:
        pass
    except AccessDenied as e:
        advice = "it belongs to someone else, or these credentials or a policy do not allow it"
        raise e.retyped(AccessDenied, f"cannot use bucket s3://{bucket} ({advice}): {e}") from e
    try:
        await store.create_bucket(bucket)
    except StorageError as e:
        if e.code == "BucketAlreadyOwnedByYou":  # a racing mb, or a listing not yet consistent
            return False
        if e.code == "BucketAlreadyExists":
            taken = f"bucket s3://{bucket} belongs to someone else (names are global): {e}"
            raise e.retyped(StorageError, taken) from e
        raise
    return True
