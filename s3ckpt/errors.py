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
        ├── StateDictMismatch     the state to load into does not fit the checkpoint
        └── MetadataError         ``.metadata`` is truncated, garbled or from a newer format
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

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
    "StateDictMismatch",
    "StorageError",
    "UnsafeCheckpoint",
]


_E = TypeVar("_E", bound="S3CkptError")
_S = TypeVar("_S", bound="StorageError")


class S3CkptError(Exception):
    """Base class. ``str(e)`` is the whole message; the context is in typed attributes."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only context does not survive the default Exception pickling.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def __str__(self) -> str:
        return self.message

    def reworded(self: _E, message: str) -> _E:
        """The same error (type and context) with another message: one that says how far an
        operation got, or how many such failures there were."""
        error = copy.copy(self)
        Exception.__init__(error, message)
        error.message = message
        return error


def _rebuild(cls: type[S3CkptError], message: str, state: dict[str, Any]) -> S3CkptError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ConfigError(S3CkptError, ValueError):
    """A setting is invalid; raised before any request is made."""


class StorageError(S3CkptError):
    """A request to the object store failed.

    ``operation`` is the S3 call, ``code`` the S3 error code or the client-side failure (an
    exception class, or one of s3ckpt's: ``ResponseTimeout``, ``Truncated``, ``TooSlow``,
    ``SizeMismatch``, ``ChecksumMismatch``, ``Undecodable``), ``status`` the HTTP status if there
    was an answer.
    """

    def __init__(
        self,
        message: str,
        *,
        endpoint: str | None = None,
        bucket: str | None = None,
        key: str | None = None,
        operation: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.bucket = bucket
        self.key = key
        self.operation = operation
        self.code = code
        self.status = status

    def retyped(self, kind: type[_S], message: str) -> _S:
        """This failure as the more specific ``kind`` with another message, its fields kept
        for scripts."""
        return kind(
            message,
            endpoint=self.endpoint,
            bucket=self.bucket,
            key=self.key,
            operation=self.operation,
            code=self.code,
            status=self.status,
        )


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
    """Bytes read from an object do not match their CRC32C in the commit record: bytes
    ``start``-``end`` (exclusive) should have ``expected`` and have ``actual``.
    Retried like a transient failure (damage in transit); raised if it persists (damage at rest).
    """

    def __init__(
        self,
        message: str,
        *,
        endpoint: str | None,
        bucket: str,
        key: str,
        start: int,
        end: int,
        expected: int,
        actual: int,
    ) -> None:
        super().__init__(
            message,
            endpoint=endpoint,
            bucket=bucket,
            key=key,
            operation="get_object",
            code="ChecksumMismatch",
        )
        self.start, self.end, self.expected, self.actual = start, end, expected, actual


class CheckpointError(S3CkptError):
    """The checkpoint at ``url`` is missing, incomplete, or unusable."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class CheckpointNotFound(CheckpointError):
    """No object at all exists under the checkpoint prefix."""


class IncompleteCheckpoint(CheckpointError):
    """Objects exist under the prefix but no ``.metadata``: a save failed or is still running."""


class CheckpointReplaced(CheckpointError):
    """The record at the prefix changed while a load read it: an ``overwrite=True`` save (or a
    removal) deleted the objects the load had planned. ``save_id`` is what the load began on,
    ``new_save_id`` what the prefix holds now (``None`` if nothing). Loading again reads the new
    record."""

    def __init__(
        self, message: str, *, url: str, save_id: str | None, new_save_id: str | None
    ) -> None:
        super().__init__(message, url=url)
        self.save_id, self.new_save_id = save_id, new_save_id


class CommitOutcomeUnknown(CheckpointError):
    """The commit PUT may have been applied, but no answer says so and the record could not be
    read back. Nothing was deleted. If ``s3ckpt info`` shows ``save_id`` at ``url``, the save
    committed; otherwise its objects are garbage for ``s3ckpt gc``."""

    def __init__(self, message: str, *, url: str, save_id: str) -> None:
        super().__init__(message, url=url)
        self.save_id = save_id


class CheckpointExists(CheckpointError):
    """A committed checkpoint is already at the prefix and ``overwrite`` is off."""


class UnsafeCheckpoint(CheckpointError):
    """A non-tensor value is a pickle that torch's ``weights_only`` unpickler refuses: loading it
    could run code that whoever wrote the bucket chose. ``fqn`` is the value, ``bucket`` and
    ``key`` the object holding it, ``cause`` what the check refused. Raised unless the reader was
    given ``trust_pickles=True``."""

    def __init__(
        self, message: str, *, url: str, fqn: str, bucket: str, key: str, cause: str
    ) -> None:
        super().__init__(message, url=url)
        self.fqn, self.bucket, self.key, self.cause = fqn, bucket, key, cause


class StateDictMismatch(CheckpointError):
    """The state to load into does not fit the checkpoint at ``url``: ``mismatches`` lists, per
    key, a tensor whose shape differs (both shapes) or a key the checkpoint lacks."""

    def __init__(self, message: str, *, url: str, mismatches: list[str]) -> None:
        super().__init__(message, url=url)
        self.mismatches = mismatches


class MetadataError(CheckpointError):
    """``.metadata`` cannot be decoded: truncated, garbled, or written by a newer s3ckpt."""
