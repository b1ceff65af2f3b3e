"""A whole checkpoint read into memory, as nested CPU tensors: what ``s3ckpt export`` writes and
the demo compares. The one tool that needs torch (and DCP's planner): `catalog.read_state`
imports it when it is called."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..config import S3Config
from ..dcp.reader import S3Reader
from ..errors import S3CkptError
from .scan import Progress

__all__ = ["read_state"]


def read_state(
    url: str,
    config: S3Config | None = None,
    *,
    progress: Progress | None = None,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """See `catalog.read_state`; the checkpoint is known to be committed and readable."""
    state: dict[str, Any] = {}
    # What DCP's own format_utils.dcp_to_torch_save does, with S3Reader for FileSystemReader.
    try:
        _load_state_dict(
            state,
            storage_reader=S3Reader(url, config=config, trust_pickles=trust_pickles),
            planner=_CountingPlanner(progress),
            no_dist=True,
        )
    except CheckpointException as e:
        # DCP wraps what the reader raised; unwrapped, callers (the CLI) see s3ckpt's own error.
        errors = [error for error, _ in e.failures.values() if isinstance(error, S3CkptError)]
        if not errors:
            raise
        raise errors[0] from None
    return state


class _CountingPlanner(_EmptyStateDictLoadPlanner):
    """Reports tensor bytes as the reader commits them (from its I/O thread)."""

    def __init__(self, progress: Progress | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._progress = progress
        self._done = 0
        self._total = 0

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        entries = [] if metadata is None else metadata.state_dict_metadata.values()
        self._total = sum(
            entry.size.numel() * entry.properties.dtype.itemsize
            for entry in entries
            if isinstance(entry, TensorStorageMetadata)
        )
        self._report(0)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self._report(tensor.numel() * tensor.element_size())

    def _report(self, count: int) -> None:
        self._done += count
        if self._progress is not None:
            self._progress(self._done, self._total)
