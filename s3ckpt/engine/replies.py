"""What S3's replies say, read one way by every operation that needs it: ETags, times in UTC,
and the server's clock. No I/O."""

from __future__ import annotations

import email.utils
from datetime import datetime, timezone
from typing import Any

__all__ = ["etag_of", "server_time", "utc"]


def etag_of(reply: dict[str, Any]) -> str | None:
    etag = reply.get("ETag")
    return None if etag is None else str(etag)


def utc(when: datetime) -> datetime:
    return when.astimezone(timezone.utc)


def server_time(reply: dict[str, Any]) -> datetime:
    """The reply's Date, so that ages do not depend on this machine's clock."""
    date = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return datetime.now(timezone.utc)
