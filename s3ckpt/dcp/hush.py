"""Torch's ``dcp.load`` logs a failed ``read_metadata`` on the root logger, with its traceback
("Global metadata is not found. Falling back to rank local metadata."), before it re-raises
the failure as an ``AssertionError``. When the failure is s3ckpt's own typed error, that
traceback is noise in front of the message that matters: this filter drops just those records.
"""

from __future__ import annotations

import logging

from ..errors import S3CkptError

__all__ = ["install"]

_FALLBACK = "Global metadata is not found"


class _OwnErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, S3CkptError) and str(record.msg).startswith(_FALLBACK))


_FILTER = _OwnErrors()


def install() -> None:
    """Add the filter to the root logger, where torch 2.13's loader logs (idempotent)."""
    root = logging.getLogger()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)
