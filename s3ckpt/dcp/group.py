"""The ranks a running ``dcp.load`` spans, and a gloo group over them for s3ckpt's own transfers.

Sharing a load's reads (the record once, replicated bytes once) needs collectives over exactly
the ranks of the DCP call: the default group would hang when ``dcp.load`` was given a subgroup, and
any group would when it runs with ``no_dist=True``. torch's StorageReader API passes no group
(2.13), so `current` looks for the ``_DistWrapper`` of the running DCP call on the call stack
(DCP's own record of its group and whether it uses collectives). Where none is found, as in any
call from outside DCP or a torch that changed its internals, nothing is shared and each rank reads
for itself, as without torch.distributed.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.utils import _DistWrapper

from ..engine import bridge
from ..engine.contract import ObjectStore
from ..errors import S3CkptError
from ..format.layout import Location
from ..format.record import Checkpoint, decode
from .prefix import read_prefix, read_record

__all__ = [
    "Ranks",
    "any_failed",
    "broadcast",
    "current",
    "gloo",
    "host",
    "picklable",
    "read_once",
    "sharing_enabled",
]

# How far up the stack the DCP call may be: StorageReader methods run two or three frames below.
_DEPTH = 8
# A transfer that makes no progress for this long fails the load (gloo's own default is 30 min).
_TIMEOUT = timedelta(minutes=10)
_GLOO: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class Ranks:
    """The group of a running DCP call: its process group (None: the default one), this rank's
    place in it, its coordinator's, and the global rank of each member in group order."""

    group: dist.ProcessGroup | None
    rank: int
    coordinator: int
    members: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.members)


def sharing_enabled() -> bool:
    """``S3CKPT_SHARE_READS=0`` turns sharing off for every reader of the process."""
    return os.environ.get("S3CKPT_SHARE_READS", "1").strip() not in ("0", "false", "no", "off")


def current() -> Ranks | None:
    """The group of the DCP call this runs inside, if it uses collectives over several ranks."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        wrapper = next((v for v in frame.f_locals.values() if isinstance(v, _DistWrapper)), None)
        if wrapper is not None:
            return _ranks(wrapper)
        frame = frame.f_back
    return None


def _ranks(wrapper: _DistWrapper) -> Ranks | None:
    if not (wrapper.use_dist and dist.is_available() and dist.is_initialized()):
        return None
    members = tuple(dist.get_process_group_ranks(wrapper.group or dist.group.WORLD))
    if len(members) < 2:
        return None
    return Ranks(wrapper.group, wrapper.rank, wrapper.coordinator_rank, members)


def gloo(ranks: Ranks) -> dist.ProcessGroup:
    """A group over ``ranks`` that moves CPU tensors: DCP's own if its backend has gloo, else
    one made once per set of members (every member must call this at the same point)."""
    group = ranks.group or dist.group.WORLD
    if group is not None and "gloo" in str(dist.get_backend(group)):
        return group
    made = _GLOO.get(ranks.members)
    if made is None:
        made = dist.new_group(
            list(ranks.members), timeout=_TIMEOUT, backend="gloo", use_local_synchronization=True
        )
        _GLOO[ranks.members] = made
    return made


def any_failed(group: dist.ProcessGroup, failed: bool) -> bool:
    """Whether any rank of ``group`` says it failed (a collective: every rank calls it)."""
    flag = torch.tensor([int(failed)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def host() -> str:
    """This rank's host, so that shared fetches spread over hosts."""
    return socket.gethostname()


def broadcast(ranks: Ranks, value: Any) -> Any:
    """The coordinator's ``value`` on every rank (others pass None). An exception the
    coordinator passes is raised on every rank, so all fail alike."""
    group, source = gloo(ranks), ranks.members[ranks.coordinator]
    sending = ranks.rank == ranks.coordinator
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if sending else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=source, group=group)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if sending else None
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=source, group=group)
    # From this job's own coordinator over its process group, not from the bucket.
    received = value if sending else pickle.loads(data.numpy().tobytes())
    if isinstance(received, BaseException):
        raise received
    return received


def read_once(
    store: ObjectStore, location: Location, ranks: Ranks, *, below: bool = True
) -> Checkpoint:
    """The committed checkpoint at ``location``, its record read by the coordinator alone and
    broadcast (one GET per load, not per rank); every rank decodes it, or raises the error the
    coordinator met (`prefix.read_prefix`: none there, incomplete, unreadable)."""
    found: bytes | Checkpoint | BaseException | None = None
    if ranks.rank == ranks.coordinator:
        try:
            record = bridge.run(read_record(store, location))
            if record is None:  # then what the prefix holds says why: it raises
                found = bridge.run(read_prefix(store, location, below=below)).require()
            else:
                found = record[0]
        except BaseException as e:
            found = picklable(e)
    shared = broadcast(ranks, found)
    if isinstance(shared, Checkpoint):  # a record that landed just after the first GET
        return shared
    return decode(shared, url=location.metadata_url, max_size=store.config.max_record_size)


def picklable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (s3ckpt's errors do), else an S3CkptError saying it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return S3CkptError(f"{type(error).__name__}: {error}")
    return error
