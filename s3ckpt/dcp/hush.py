"""Noise torch prints around s3ckpt's calls, filtered once an `S3Writer` or `S3Reader` exists.

- ``dcp.save``/``dcp.load`` without an initialised process group warn, at every call, that
  torch.distributed is disabled and that one process is assumed (also with ``no_dist=True``):
  a single-process save to s3ckpt is that by design, and a quick start should print nothing.
  The filter is on that message only, and process-wide: a background save warns from its own
  thread.
- ``dcp.load`` logs a failed ``read_metadata`` on the root logger, with its traceback ("Global
  metadata is not found. Falling back to rank local metadata."), before it re-raises the
  failure as an ``AssertionError``. When the failure is s3ckpt's own typed error, that traceback
  is noise in front of the message that matters: the filter drops just those records.
"""

from __future__ import annotations

import logging
import warnings

from ..errors import S3CkptError

__all__ = ["install"]

_FALLBACK = "Global metadata is not found"
_SINGLE_PROCESS = (
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    "(save|load) in a single process"
)


class _OwnErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, S3CkptError) and str(record.msg).startswith(_FALLBACK))


_FILTER = _OwnErrors()


def install() -> None:
    """Both filters (idempotent): the warning's, and the root logger's, where torch 2.13's
    loader logs."""
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
    root = logging.getLogger()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)
