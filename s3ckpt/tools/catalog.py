"""Find, inspect, read and clean up checkpoints under a prefix: what the ``s3ckpt`` command does.

Listing and ``latest`` go one level deep (see `scan`); the removals (``delete``, ``prune``,
``gc``) live in `removal` and are importable from here. The functions are synchronous; the I/O
runs on the `bridge` loop through the process's `ObjectStore`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..config import S3Config
from ..dcp.prefix import read_prefix
from ..dcp.reader import S3Reader
from ..engine import bridge
from ..engine.contract import ObjectStore, Upload
from ..engine.store import get_store
from ..errors import S3CkptError
from ..format.layout import Location
from ..format.record import Checkpoint
from . import scan
from .removal import GcReport, Removal, delete, gc, prune
from .scan import CheckpointInfo, Progress

__all__ = [
    "CheckpointInfo",
    "GcReport",
    "Progress",
    "Removal",
    "Upload",
    "delete",
    "describe",
    "gc",
    "latest",
    "list_checkpoints",
    "prune",
    "read_state",
]


def list_checkpoints(url: str, config: S3Config | None = None) -> list[CheckpointInfo]:
    """Checkpoints at ``url`` and directly under it, oldest first (by step, then creation)."""
    found = bridge.run(scan.survey(get_store(config), scan.location_of(url)))
    return [f.info for f in found]


def latest(url: str, config: S3Config | None = None) -> CheckpointInfo | None:
    """The committed checkpoint with the highest step (then the newest), or None."""
    return bridge.run(_latest(get_store(config), scan.location_of(url)))


def describe(url: str, config: S3Config | None = None) -> tuple[CheckpointInfo, Checkpoint]:
    """The committed checkpoint at ``url`` and its record; else CheckpointNotFound or
    IncompleteCheckpoint."""
    return bridge.run(_describe(get_store(config), scan.location_of(url)))


def read_state(
    url: str,
    config: S3Config | None = None,
    *,
    progress: Progress | None = None,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """The whole state dict of the committed checkpoint at ``url``, nested as it was saved, with
    CPU tensors rebuilt from the metadata: no model is needed to export or compare checkpoints.
    It is all in memory at once. ``progress(done, total)`` counts tensor bytes as they arrive.
    ``trust_pickles`` is `S3Reader`'s: without it a non-tensor value that could run code when
    unpickled raises `UnsafeCheckpoint`."""
    describe(url, config)  # the typed error, which DCP would turn into an AssertionError
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


async def _latest(store: ObjectStore, location: Location) -> CheckpointInfo | None:
    """Reads records from the highest step down, so a long run costs a few GETs, not one each."""
    by_step: dict[int | None, list[Location]] = {}
    for candidate in (await scan.candidates(store, location))[0]:
        by_step.setdefault(scan.step_of(candidate), []).append(candidate)
    for step in sorted(by_step, key=lambda s: (s is not None, s or 0), reverse=True):
        found = await scan.run_all(lambda c: scan.readable(store, c), by_step[step], store)
        committed = [f.info for f in found if f is not None]
        if committed:
            return max(committed, key=scan.newness)
    return None


async def _describe(store: ObjectStore, location: Location) -> tuple[CheckpointInfo, Checkpoint]:
    at = await read_prefix(store, location)
    checkpoint = at.require()
    return scan.found(at).info, checkpoint
