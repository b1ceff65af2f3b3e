"""Loading a run's newest good checkpoint: the fallback past damaged ones, and the read lease
that keeps retention (in this process or another) from deleting a checkpoint while it loads.

Each attempt runs on every rank in step: the coordinator picks the step, every rank reads its
record, the coordinator takes the read lease (and verifies, if asked), the ranks agree that all
is well (`Agreement`), then ``dcp.load`` runs on all of them, on the record each already read.
A load fails on all ranks together (DCP gathers the failures), so every rank makes the same
choice: damage (checksum, missing or short object, unreadable record, replaced or deleted while
loading) moves on to the next older step; anything else (an unreachable store, refused
credentials, a state dict that does not match) is raised at once, so that a passing outage never
silently resumes from an old checkpoint.

The read lease is as good as the store allows: S3 has no read locks. A retention pass that
started before the lease was written may still delete the checkpoint; the load then fails with a
typed error (`CheckpointReplaced`, `ObjectNotFound`) and falls back, and nothing else is touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.stateful import Stateful

from ..config import S3Config
from ..dcp.fit import check_fit
from ..dcp.group import Ranks, read_once
from ..dcp.incremental import Pins
from ..dcp.prefix import read_prefix
from ..dcp.reader import S3Reader
from ..engine import bridge
from ..errors import (
    CheckpointError,
    CheckpointNotFound,
    CheckpointReplaced,
    ChecksumMismatch,
    IncompleteCheckpoint,
    MetadataError,
    ObjectNotFound,
    S3CkptError,
    StorageError,
)
from ..format.layout import Location
from ..format.record import Checkpoint
from ..tools.verify import verify as verify_checkpoint
from .steps import Run, children, committed

__all__ = ["Request", "Restored", "damage", "nothing", "restore", "s3ckpt_error"]

log = logging.getLogger(__name__)

_DAMAGE = (
    ChecksumMismatch,
    ObjectNotFound,
    MetadataError,
    CheckpointReplaced,
    CheckpointNotFound,
    IncompleteCheckpoint,
)
_OK, _DAMAGED, _FATAL = 0, 1, 2  # an attempt's outcome on one rank; the ranks take the worst


def _failures(error: BaseException) -> list[BaseException]:
    """The errors behind ``error``: each failed rank's for DCP's CheckpointException."""
    if isinstance(error, CheckpointException):
        return [failure[0] for _, failure in sorted(error.failures.items())]
    return [error]


def damage(error: BaseException) -> S3CkptError | None:
    """The damage to the checkpoint that ``error`` reports (the first rank's), or None when
    something else failed."""
    failures = _failures(error)
    damaged = [
        f
        for f in failures
        if isinstance(f, _DAMAGE) or (isinstance(f, StorageError) and f.code == "SizeMismatch")
    ]
    if not failures or len(damaged) != len(failures):
        return None
    first = damaged[0]
    assert isinstance(first, S3CkptError)
    return first


def s3ckpt_error(error: BaseException) -> S3CkptError | None:
    """The first s3ckpt error behind ``error`` (DCP's CheckpointException unwrapped)."""
    return next((f for f in _failures(error) if isinstance(f, S3CkptError)), None)


@contextlib.contextmanager
def held(pins: Pins) -> Iterator[bool]:
    """Hold ``pins`` (refreshed on the bridge loop) around synchronous code; yields whether
    they could be written: a reader without write access loads unprotected, with a warning."""
    ready: concurrent.futures.Future[None] = concurrent.futures.Future()
    stop: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def hold() -> None:
        try:
            await pins.hold()
            ready.set_result(None)
            await asyncio.wrap_future(stop)
        finally:
            await pins.release()

    running = bridge.submit(hold())
    concurrent.futures.wait([ready, running], return_when=concurrent.futures.FIRST_COMPLETED)
    if not ready.done():
        error = running.exception()
        log.warning(
            "s3://%s/%s: no read lease (%s): a removal elsewhere may delete the checkpoint "
            "while it loads (the load then fails with a typed error)",
            pins.leases[0].bucket,
            pins.leases[0].key,
            error,
        )
    try:
        yield ready.done()
    finally:
        stop.set_result(None)
        with contextlib.suppress(Exception):
            running.result()


class _Pinned(S3Reader):
    """Loads the record this rank already read (and, on the coordinator, leased), not whatever
    is at the prefix by the time DCP asks: a record deleted meanwhile fails as a typed error on
    the first missing object, not as DCP's untyped metadata failure."""

    def __init__(self, location: Location, config: S3Config, checkpoint: Checkpoint) -> None:
        super().__init__(location.bucket, location.prefix, config=config)
        self._pinned = checkpoint

    def read_metadata(self) -> Metadata:
        self._ranks = self._sharing()
        self.checkpoint = self._pinned
        return self._pinned.metadata


@dataclass
class Restored:
    """What `restore` loaded (``step`` None: the run holds no checkpoint) and the steps it
    skipped as damaged, newest first, with why."""

    step: int | None
    skipped: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """What a restore loads into, and how: ``verify`` every byte first; ``partial``: keys the
    checkpoint lacks keep their values; ``planner`` replaces DCP's default one (and the check
    that the state fits, which assumes the default's keys)."""

    state_dict: dict[str, Any]
    verify: bool = False
    partial: bool = False
    planner: LoadPlanner | None = None


def restore(run: Run, request: Request, step: int | None) -> Restored:
    """Load ``step`` (None: the newest committed step that loads) into the request's state."""
    agreement, restored = run.agreement, Restored(None)
    names = bridge.run(children(run.store, run.location))
    while True:
        picked = _pick(run, step, restored.skipped) if agreement.coordinator else -1
        (candidate,) = agreement.maximum(picked)
        if candidate < 0:
            break
        location = names.get(candidate, run.at(candidate))
        reason = _attempt(run, location, request)
        if reason is None:
            restored.step = candidate
            skipped = list(restored.skipped)
            after = f", past damaged step(s) {skipped}" if skipped else ""
            log.info("restored step %d from %s%s", candidate, location.url, after)
            return restored
        restored.skipped[candidate] = _why(reason)
        if step is not None:
            if isinstance(reason, S3CkptError):
                raise reason
            raise CheckpointError(f"{location.url} does not load: {reason}", url=location.url)
        log.warning("%s does not load, trying an older step: %s", location.url, _why(reason))
    if restored.skipped:
        why = "; ".join(f"step {s}: {reason}" for s, reason in restored.skipped.items())
        raise CheckpointError(
            f"no checkpoint of {run.location.url} loads ({why})", url=run.location.url
        )
    return restored


def _why(reason: S3CkptError | str) -> str:
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, S3CkptError) else reason


def _pick(run: Run, step: int | None, skipped: dict[int, str]) -> int:
    """The coordinator's next candidate (-1: none left): the given step once, else the newest
    committed step not tried yet (listed again each time: a newer one may have committed)."""
    if step is not None:
        return -1 if step in skipped else step
    found = bridge.run(committed(run.store, run.location))
    left = [s for s in found if s not in skipped]
    return max(left, default=-1)


def _read(run: Run, location: Location) -> Checkpoint:
    """The record at ``location``: read by the coordinator and broadcast when there are several
    ranks (the store serves it once), else read here."""
    agreement = run.agreement
    if agreement.group is None:
        return bridge.run(read_prefix(run.store, location, below=False)).require()
    members = tuple(dist.get_process_group_ranks(agreement.group))
    ranks = Ranks(agreement.group, agreement.rank, 0, members)
    return read_once(run.store, location, ranks, below=False)


def _attempt(run: Run, location: Location, request: Request) -> S3CkptError | str | None:
    """Load the checkpoint at ``location`` on every rank: None if it loaded, else why not.
    Raises what is not damage."""
    agreement, store = run.agreement, run.store
    error: S3CkptError | None = None
    checkpoint: Checkpoint | None = None
    try:
        checkpoint = _read(run, location)
        _ = checkpoint.metadata  # building DCP's types is where a hostile record fails
    except S3CkptError as e:
        error = e
    # Every save directory the record uses: an incremental checkpoint's bytes are in several.
    pins = Pins(store, location, checkpoint) if checkpoint else None
    with held(pins) if pins and agreement.coordinator else contextlib.nullcontext(False):
        if error is None and request.verify and agreement.coordinator:
            try:
                verify_checkpoint(location.url, run.config)
            except S3CkptError as e:
                error = e
        outcome = _OK if error is None else _DAMAGED if damage(error) else _FATAL
        (worst,) = agreement.maximum(outcome)
        if worst == _FATAL:
            raise error or CheckpointError(
                f"{location.url}: another rank failed to read the checkpoint", url=location.url
            )
        if worst == _DAMAGED:
            return (
                error or f"another rank could not read or verify it (rank {agreement.rank} could)"
            )
        assert checkpoint is not None
        # DCP's own handling of Stateful values, done here so that the state they give is
        # checked against the checkpoint before DCP plans (and is asked for once).
        state = {
            key: value.state_dict() if isinstance(value, Stateful) else value
            for key, value in request.state_dict.items()
        }
        planner = request.planner
        if planner is None:
            check_fit(state, checkpoint.metadata, location.url, request.partial)
            planner = DefaultLoadPlanner(allow_partial_load=request.partial)
        try:
            load(
                state,
                storage_reader=_Pinned(location, run.config, checkpoint),
                planner=planner,
                process_group=run.group,
            )
        except (Exception, CheckpointException) as e:
            found = damage(e)
            if found is None:
                typed = s3ckpt_error(e)
                if typed is not None:
                    raise typed from e
                raise
            return found
    for key, value in request.state_dict.items():
        if isinstance(value, Stateful):
            value.load_state_dict(state[key])
        else:
            request.state_dict[key] = state[key]
    return None


_SIBLINGS_SHOWN = 10


def nothing(run: Run, required: bool) -> None:
    """Say that the run holds no checkpoint: a WARNING on the coordinator naming its URL and the
    other runs beside it (a typo in the run's name is the usual cause), or, ``required``,
    `CheckpointNotFound` on every rank."""
    url = run.location.url
    beside = _siblings(run) if required or run.agreement.coordinator else []
    shown = ", ".join(beside[:_SIBLINGS_SHOWN])
    more = f" and {len(beside) - _SIBLINGS_SHOWN} more" if len(beside) > _SIBLINGS_SHOWN else ""
    also = f" (other runs beside it: {shown}{more})" if beside else ""
    if required:
        raise CheckpointNotFound(f"{url} holds no checkpoint to restore{also}", url=url)
    log.warning("%s holds no checkpoint: starting from scratch%s", url, also)


def _siblings(run: Run) -> list[str]:
    """The names of the other prefixes in the run's parent."""
    if not run.location.prefix:
        return []
    parent = run.location.parent
    listing = bridge.run(
        run.store.list_objects(parent.bucket, parent.listing_prefix, delimiter=True, limit=1000)
    )
    start = len(parent.listing_prefix)
    names = (prefix[start:].rstrip("/") for prefix in sorted(listing.prefixes))
    return [name for name in names if name and name != run.location.name]
