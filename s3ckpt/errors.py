"""The exceptions s3ckpt raises.

Every error names where it happened (``s3://bucket/key`` and, where it matters, the endpoint) and
why. All of them pickle, because DCP ships a failing rank's exception to the coordinator::

    S3CkptError
    ├── ConfigError               invalid settings, found before any request
    ├── StorageError              a request failed; carries endpoint, bucket, key, cause
    │   ├── EndpointUnreachable   no connection, DNS, TLS handshake or timeout
    │   ├── AccessDenied          bad or missing credentials, or a policy refused the request
    │   ├── BucketNotFound
    │   ├── ObjectNotFound
    │   ├── PreconditionFailed    a conditional write lost (the object exists)
    │   └── ChecksumMismatch      stored bytes differ from the checksum the commit recorded
    └── CheckpointError           the checkpoint itself is wrong
        ├── CheckpointNotFound    nothing at all under the prefix
        ├── IncompleteCheckpoint  objects but no committed ``.metadata``
        ├── CheckpointReplaced    a load met objects deleted by a save that replaced the record
        ├── CommitOutcomeUnknown  every answer to the commit was lost: it may or may not exist
        ├── CheckpointExists      saving over a committed checkpoint without ``overwrite=True``
        ├── UnsafeCheckpoint      a non-tensor value would run code when unpickled
        └── MetadataError         ``.metadata`` is truncated, garbled or from a newer format
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccessDenied",
    "BucketNotFound",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointNotFound",
    "CheckpointReplaced",
    "ChecksumMismatch",
    "CommitOutcomeUnknown",
    "ConfigError",
    "EndpointUnreachable",
    "IncompleteCheckpoint",
    "MetadataError",
    "ObjectNotFound",
    "PreconditionFailed",
    "S3CkptError",
    "StorageError",
    "UnsafeCheckpoint",
]


class S3CkptError(Exception):
    """Base class. ``str(e)`` is the whole message; extra context lives in attributes."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        for name, value in context.items():
            setattr(self, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only context does not survive the default Exception pickling.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[S3CkptError], message: str, state: dict[str, Any]) -> S3CkptError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ConfigError(S3CkptError, ValueError):
    """A setting is invalid; raised before any request is made."""


class StorageError(S3CkptError):
    """A request to the object store failed.

    Attributes: ``endpoint``, ``bucket``, ``key`` (may be ``None``), ``operation``, ``code`` (the S3
    error code or exception class) and ``status`` (HTTP status or ``None``).
    """


class EndpointUnreachable(StorageError):
    """The endpoint could not be reached (refused, DNS, TLS, timeout)."""


class AccessDenied(StorageError):
    """Credentials are missing, wrong or not allowed to do this."""


class BucketNotFound(StorageError):
    """The bucket does not exist."""


class ObjectNotFound(StorageError):
    """The object does not exist."""


class PreconditionFailed(StorageError):
    """A conditional request (``If-None-Match: *``) found the object already there."""


class ChecksumMismatch(StorageError):
    """Bytes read from an object do not match their CRC32C in the commit record.

    Attributes ``start`` and ``end`` (the byte range checked), ``expected`` and ``actual``.
    Retried like a transient failure (damage in transit); raised if it persists (damage at rest).
    """


class CheckpointError(S3CkptError):
    """The checkpoint at ``url`` is missing, incomplete, or unusable."""


class CheckpointNotFound(CheckpointError):
    """No object at all exists under the checkpoint prefix."""


class IncompleteCheckpoint(CheckpointError):
    """Objects exist under the prefix but no ``.metadata``: a save failed or is still running."""


class CheckpointReplaced(CheckpointError):
    """The record at the prefix changed while a load read it: an ``overwrite=True`` save (or a
    removal) deleted the objects the load had planned. Attributes ``save_id`` (what the load
    began on) and ``new_save_id`` (what the prefix holds now; ``None`` if nothing). Loading again
    reads the new record."""


class CommitOutcomeUnknown(CheckpointError):
    """The commit PUT may have been applied, but no answer says so and the record could not be
    read back. Nothing was deleted. Attribute ``save_id``: if ``s3ckpt info`` shows it at
    ``url``, the save committed; otherwise its objects are garbage for ``s3ckpt gc``."""


class CheckpointExists(CheckpointError):
    """A committed checkpoint is already at the prefix and ``overwrite`` is off."""


class UnsafeCheckpoint(CheckpointError):
    """A non-tensor value is a pickle that torch's ``weights_only`` unpickler refuses: loading it
    could run code that whoever wrote the bucket chose. Attributes ``fqn`` (the value), ``bucket``
    and ``key`` (the object holding it) and ``cause`` (what the check refused). Raised unless the
    reader was given ``trust_pickles=True``."""


class MetadataError(CheckpointError):
    """``.metadata`` cannot be decoded: truncated, garbled, or written by a newer s3ckpt."""
