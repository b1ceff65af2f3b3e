"""The errors a read raises when the bytes are wrong (too few, damaged), worded once for every
store: `Downloads` over the wire and `MemoryStore` say the same, so tests read the same on both.
No I/O."""

from __future__ import annotations

from ..crc32c import StreamCheck
from ..errors import ChecksumMismatch, StorageError

__all__ = ["checksum_mismatch", "failed_get", "wrong_size"]


def failed_get(endpoint: str, bucket: str, key: str, code: str, what: str) -> StorageError:
    """A GET whose answer is wrong in a way the client sees (``code`` says how it is retried,
    see `s3ckpt.engine.retry`)."""
    return StorageError(
        f"get_object s3://{bucket}/{key} at {endpoint}: {what}",
        endpoint=endpoint,
        bucket=bucket,
        key=key,
        operation="get_object",
        code=code,
        status=None,
    )


def wrong_size(
    endpoint: str, bucket: str, key: str, start: int, end: int, size: int | None, stored: int | None
) -> StorageError:
    """An object of another size than the read wanted (code ``SizeMismatch``, never retried)."""
    holds = "too few bytes" if stored is None else f"{stored} bytes"
    recorded = "" if size is None else f" of the {size} the commit recorded"
    what = (
        f"the object holds {holds}, the read wanted bytes {start}-{end - 1}{recorded}; it was "
        "truncated or replaced after it was written"
    )
    return failed_get(endpoint, bucket, key, "SizeMismatch", what)


def checksum_mismatch(
    endpoint: str, bucket: str, key: str, m: StreamCheck.Mismatch
) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"s3://{bucket}/{key} bytes {m.start}-{m.end - 1} at {endpoint}: CRC32C "
        f"{m.actual:#010x}, the commit recorded {m.expected:#010x}; the stored object is "
        "damaged (or was damaged in transit)",
        endpoint=endpoint,
        bucket=bucket,
        key=key,
        start=m.start,
        end=m.end,
        expected=m.expected,
        actual=m.actual,
    )
