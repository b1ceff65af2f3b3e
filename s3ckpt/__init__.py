"""s3ckpt: torch.distributed.checkpoint storage on S3-compatible object stores.

fut = dcp.async_save(state_dict, storage_writer=S3Writer("bucket", prefix="run7/step-1000"))
S3Writer("bucket", prefix="run7/step-1000", options=WriteOptions(compression="zstd"))
dcp.load(state_dict, storage_reader=S3Reader("bucket", prefix="run7/step-1000"))
"""

from .config import S3Config, WriteOptions
from .dcp.reader import S3Reader
from .dcp.writer import S3Writer
from .errors import (
    AccessDenied,
    BucketNotFound,
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    CheckpointReplaced,
    ChecksumMismatch,
    CommitOutcomeUnknown,
    ConfigError,
    EndpointUnreachable,
    IncompleteCheckpoint,
    MetadataError,
    ObjectNotFound,
    PreconditionFailed,
    S3CkptError,
    StorageError,
    UnsafeCheckpoint,
)

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
    "S3Config",
    "S3Reader",
    "S3Writer",
    "StorageError",
    "UnsafeCheckpoint",
    "WriteOptions",
]

__version__ = "0.1.0"
