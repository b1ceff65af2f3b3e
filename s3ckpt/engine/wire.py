"""Checksums on the wire, so that the server refuses bytes damaged on their way up.

Servers differ: SeaweedFS and AWS validate ``x-amz-checksum-crc32c``; Ceph RGW ignores it (and
rejects a Complete that lists part checksums) but validates Content-MD5; moto validates nothing.
Accepting a header is not validating it, so mode ``auto`` asks each bucket once: a tiny PUT with a
deliberately wrong CRC32C must be refused, else one with a wrong Content-MD5, else checksums are
off for that bucket (the frame checksums of the commit record still catch damage on read).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..crc32c import checksum
from ..errors import StorageError

__all__ = ["MODES", "REFUSED", "crc32c_digest", "digest", "probe"]

MODES = ("auto", "crc32c", "md5", "off")
_PROBE_BODY = b"s3ckpt checksum probe"
REFUSED = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidRequest"})


def digest(body: Sequence[bytes | bytearray | memoryview], mode: str) -> dict[str, Any]:
    """Request parameters that carry the checksum, in ``mode`` ("crc32c", "md5", "off"), of
    the body made of the buffers ``body``."""
    if mode == "crc32c":
        crc = 0
        for buffer in body:
            crc = checksum(buffer, crc)
        return crc32c_digest(crc)
    if mode == "md5":
        md5 = hashlib.md5(usedforsecurity=False)
        for buffer in body:
            md5.update(buffer)
        return {"ContentMD5": base64.b64encode(md5.digest()).decode()}
    return {}


def crc32c_digest(crc: int) -> dict[str, Any]:
    """Request parameters that carry the CRC32C ``crc`` of the body."""
    return {"ChecksumCRC32C": base64.b64encode(crc.to_bytes(4, "big")).decode()}


async def probe(
    put: Callable[..., Awaitable[None]], delete: Callable[[str], Awaitable[None]], prefix: str
) -> str:
    """Which checksum the server behind ``put`` validates: "crc32c", "md5" or "off".

    ``put(key, body, **params)`` stores an object and ``delete(key)`` removes it; the probe
    object lives next to the checkpoint (``prefix``) and is removed afterwards.
    """
    key = f"{prefix}.s3ckpt-probe-{secrets.token_hex(6)}"
    wrong = {
        "crc32c": {"ChecksumCRC32C": base64.b64encode(b"\0\0\0\0").decode()},
        "md5": {"ContentMD5": base64.b64encode(b"\0" * 16).decode()},
    }
    try:
        for mode, params in wrong.items():
            try:
                await put(key, _PROBE_BODY, **params)
            except StorageError as e:
                if e.code in REFUSED:
                    return mode
                raise
        return "off"
    finally:
        await delete(key)
