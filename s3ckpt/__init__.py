"""s3ckpt: torch.distributed.checkpoint storage on S3-compatible object stores.

mgr = CheckpointManager("s3://bucket/run7", every=100, keep_last=3)  # a run's checkpoints
CheckpointManager("s3://bucket/run7", saving=SavePolicy(every=100, save_on=signal.SIGTERM),
                  retention=Retention(keep_last=3, keep_every=1000))  # the policies in full
fut = dcp.async_save(state_dict, storage_writer=S3Writer("bucket", prefix="run7/step-1000"))
S3Writer("bucket", prefix="run7/step-1000", options=WriteOptions(compression="zstd"))
dcp.load(state_dict, storage_reader=S3Reader("bucket", prefix="run7/step-1000"))
dcp.load(model.state_dict(), storage_reader=SafetensorsReader("bucket", "hf/llama-8b"))
export_safetensors("s3://bucket/run7/step-1000", "s3://bucket/hf/run7", select="model")

The manager, writers, readers and export are imported on first use (PEP 562), because they
import torch, which takes seconds: ``import s3ckpt`` and the CLI's light commands stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import S3Config, WriteOptions
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
    StateDictMismatch,
    StorageError,
    UnsafeCheckpoint,
)
from .tools.retention import Retention

if TYPE_CHECKING:
    from .dcp.hfreader import SafetensorsReader
    from .dcp.reader import S3Reader
    from .dcp.writer import S3Writer
    from .manager import CheckpointManager, SavePolicy
    from .tools.hfexport import export_safetensors

__all__ = [
    "AccessDenied",
    "BucketNotFound",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointManager",
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
    "Retention",
    "S3CkptError",
    "S3Config",
    "S3Reader",
    "S3Writer",
    "SafetensorsReader",
    "SavePolicy",
    "StateDictMismatch",
    "StorageError",
    "UnsafeCheckpoint",
    "WriteOptions",
    "export_safetensors",
]

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "s3ckpt.manager",
    "S3Reader": "s3ckpt.dcp.reader",
    "S3Writer": "s3ckpt.dcp.writer",
    "SafetensorsReader": "s3ckpt.dcp.hfreader",
    "SavePolicy": "s3ckpt.manager",
    "export_safetensors": "s3ckpt.tools.hfexport",
}


def __getattr__(name: str) -> Any:
    """Imports the manager, a writer, a reader or the export (and so torch) when first asked
    for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 's3ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
