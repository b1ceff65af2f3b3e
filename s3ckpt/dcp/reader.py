"""`S3Reader`: DCP's StorageReader for checkpoints written by `S3Writer`.

DCP calls, on every rank: ``read_metadata`` (one GET of ``.metadata``, decoded from JSON),
``set_up_storage_reader``, ``prepare_local_plan``; then ``prepare_global_plan`` on the coordinator;
then ``read_data`` on every rank. ``read_data`` maps each read item to the byte range that covers
it in its object (a resharded sub-rectangle becomes the covering rows, split to bound memory),
merges nearby ranges and fetches them with concurrent ranged GETs. Bytes land straight in the
destination tensor when it is a contiguous CPU tensor of the stored dtype and the range is exact;
otherwise they pass through a bounded buffer and a copy (which also moves them to an accelerator).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..config import MiB, S3Config
from ..engine import bridge
from ..engine.bridge import gather_or_cancel
from ..engine.contract import ObjectStore
from ..errors import (
    CheckpointError,
    CheckpointReplaced,
    MetadataError,
    ObjectNotFound,
    S3CkptError,
    UnsafeCheckpoint,
)
from ..format import readplan, sharing
from ..format.frames import FrameTable
from ..format.readplan import Fetch, Target, plan_fetches
from ..format.record import Checkpoint, Locator, Locators
from ..format.record.model import pause_collector
from ..format.sharing import Span
from . import group
from .adapter import AtLocation, to_torch_future
from .exchange import Pieces
from .fetching import run_all
from .fit import check_fit
from .group import gloo
from .prefix import read_prefix
from .targets import StoredChunk, collect, tensor_targets

__all__ = ["S3Reader"]


class S3Reader(AtLocation, StorageReader):
    """Load a DCP checkpoint from ``s3://bucket/prefix``.

    Args:
        bucket: bucket name, or a whole ``s3://bucket/prefix`` URL.
        prefix: key prefix of the checkpoint; ``checkpoint_id`` overrides it.
        config: connection settings; default `S3Config()` reads the standard AWS sources.
        max_gap: ranges in one object closer than this are fetched with one GET.
        trust_pickles: unpickle non-tensor values without checking them first. DCP stores them
            as pickles and its planners unpickle with ``weights_only=False``, so a value saved
            by someone else can run any code on load. By default each is first unpickled with
            torch's ``weights_only`` unpickler (plain containers, numbers, strings, tensors and
            types registered with ``torch.serialization.add_safe_globals`` pass) and anything it
            refuses raises `UnsafeCheckpoint`. Set it only for checkpoints whose writers you trust.
        share_reads: in a ``dcp.load`` over several ranks, read the record on the coordinator
            only and fetch every byte range that several ranks need (data-parallel replicas,
            overlapping resharded reads) on one of them, which passes it on over a gloo group
            (`s3ckpt.dcp.exchange`): the store serves each byte once. ``False`` (or
            ``S3CKPT_SHARE_READS=0``) makes every rank read all it needs itself.
        store: the `ObjectStore` to use instead of the one ``config`` resolves to (a wrapper,
            or a `MemoryStore`); it works only in the process that made it.

    To handle a missing or broken checkpoint, call `check` first: it raises s3ckpt's typed
    error before DCP is involved::

        reader = S3Reader("my-bucket", "run7/step-1000")
        try:
            reader.check()
        except (CheckpointNotFound, IncompleteCheckpoint):
            ...  # start from scratch, or try an older step
        dcp.load(state_dict, storage_reader=reader)

    Without it, ``dcp.load`` raises DCP's ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` does not catch, after logging "Global metadata is not found". Its
    ``failures`` maps each failed rank to ``(error, traceback)``: s3ckpt's typed error for a
    failed data read, but an ``AssertionError`` carrying only s3ckpt's message for a failed
    metadata read (torch 2.13).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        config: S3Config | None = None,
        max_gap: int = 1 * MiB,
        trust_pickles: bool = False,
        share_reads: bool = True,
        store: ObjectStore | None = None,
    ) -> None:
        StorageReader.__init__(self)
        AtLocation.__init__(self, bucket, prefix, config, store)
        self.max_gap = max_gap
        self.trust_pickles = trust_pickles
        self.share_reads = share_reads
        self._ranks: group.Ranks | None = None
        self.checkpoint: Checkpoint | None = None
        self._locators = Locators({})
        self._dtypes: dict[str, torch.dtype] = {}
        self._frames: dict[str, FrameTable] = {}
        self._keys: dict[str, str] = {}  # each object's key in the bucket, by its key in the record

    def reset(self, checkpoint_id: str | Any = None) -> None:
        self._move(checkpoint_id)
        self.checkpoint = None

    def check(self, state_dict: dict[str, Any] | None = None, *, partial: bool = False) -> None:
        """Raise the typed error (`CheckpointNotFound`, `IncompleteCheckpoint`, `MetadataError`,
        `BucketNotFound`, `AccessDenied`, ...) unless a committed, readable checkpoint is at
        `checkpoint_id`: ``dcp.load`` would turn it into an ``AssertionError`` inside a
        ``CheckpointException``. It reads ``.metadata`` and builds DCP's metadata from it (what
        this torch cannot represent fails here too); with no record, a listing of the prefix
        and, for a run prefix, up to 128 HEADs below it. ``dcp.load`` reads the record again: a
        checkpoint replaced in between is loaded as it is then.

        Given the ``state_dict`` that ``dcp.load`` will fill (plain tensors and dicts, as DCP's
        default planner flattens them), it also raises `StateDictMismatch` naming each key the
        checkpoint lacks (unless ``partial``: then load with
        ``DefaultLoadPlanner(allow_partial_load=True)``) or holds with another shape (both
        shapes), where DCP's planner would raise a bare ``ValueError`` or ``RuntimeError``.
        """
        checkpoint = bridge.run(self._read_checkpoint())
        metadata = checkpoint.metadata  # building it is part of the check
        if state_dict is not None:
            check_fit(state_dict, metadata, self.checkpoint_id, partial)

    def read_metadata(self) -> Metadata:
        # No **kwargs: DCP would then call this a second time for "rank-local" metadata, which
        # s3ckpt does not have. (torch 2.13's load re-raises a failure here as AssertionError.)
        self._ranks = self._sharing()
        if self._ranks is None:
            self.checkpoint = bridge.run(self._read_checkpoint())
        else:
            self.checkpoint = group.read_once(self._store, self.location, self._ranks)
        return self.checkpoint.metadata

    def _sharing(self) -> group.Ranks | None:
        """The ranks of the running ``dcp.load``, if it shares reads (call from DCP's calls)."""
        return group.current() if self.share_reads and group.sharing_enabled() else None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, **kwargs: Any
    ) -> None:
        locators = metadata.storage_data
        if not isinstance(locators, Locators):
            raise MetadataError(
                f"{self.checkpoint_id}: metadata was not written by s3ckpt (no object locations)",
                url=self.location.metadata_url,
            )
        if self.checkpoint is None:
            raise MetadataError(
                f"{self.checkpoint_id}: read_metadata() must run before set_up_storage_reader()",
                url=self.location.metadata_url,
            )
        self._frames = self.checkpoint.frames
        self._keys = {key: self.location.key(key) for key in self._frames}
        self._locators = locators
        self._dtypes = {
            fqn: entry.properties.dtype
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    def _chunk(self, index: MetadataIndex) -> tuple[Locator, tuple[int, ...], torch.dtype]:
        """A read item's stored chunk: where it is, its shape and dtype (looked up per item
        read: the record holds every rank's chunks, this rank reads a few)."""
        chunk = self._locators.chunk(index)
        return chunk.locator, chunk.sizes, self._dtypes[index.fqn]

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._ranks is None:
            return plan
        return dataclasses.replace(plan, storage_data=_Member(group.host()))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator of a load that runs on several ranks: which rank fetches each byte
        range that several need, and who receives it from that rank (`format.sharing`)."""
        ranks = self._ranks
        hosts = [p.storage_data.host for p in plans if isinstance(p.storage_data, _Member)]
        if ranks is None or len(hosts) != len(plans) or len(plans) != ranks.size:
            return [dataclasses.replace(p, storage_data=None) for p in plans]
        wanted = [[span for item in p.items for span in self._spans(item)] for p in plans]
        frames = {self._keys[key]: t.frame_size for key, t in self._frames.items()}
        shares = sharing.assign(wanted, hosts, frames)
        if shares is None:
            return [dataclasses.replace(p, storage_data=None) for p in plans]
        return [
            dataclasses.replace(p, storage_data=share)
            for p, share in zip(plans, shares, strict=True)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # The cyclic collector waits until the reads are in (DCP waits for them): planning makes
        # a target, a piece and a part per read item, none in a cycle, and its full passes over
        # the state dict and the plan took a tenth of a load of 20k small tensors, once on the
        # event loop while responses waited.
        resume = pause_collector()
        try:
            share = plan.storage_data if isinstance(plan.storage_data, sharing.Share) else None
            if share is None:
                targets, done = self._plan(plan, planner)
                pieces = Pieces(targets, done)
            elif self._ranks is None:  # the other ranks would wait for this one's transfers
                raise CheckpointError(
                    f"{self.checkpoint_id}: the coordinator shares this load's reads, this rank "
                    "does not: give every rank the same share_reads and S3CKPT_SHARE_READS",
                    url=self.checkpoint_id,
                )
            else:
                pieces = self._shared_pieces(plan, planner, share, self._ranks)
            frames = {self._keys[key]: t.frame_size for key, t in self._frames.items()}
            fetches = plan_fetches(
                pieces.fetch_targets,
                max_gap=self.max_gap,
                max_size=self.config.part_size,
                align=frames,
            )
            reads = bridge.submit(self._read_all(fetches, pieces, share is not None))
        except BaseException:
            resume()
            raise
        reads.add_done_callback(resume)
        return to_torch_future(reads)

    def _plan(
        self, plan: LoadPlan, planner: LoadPlanner
    ) -> tuple[list[Target], Callable[[int], None]]:
        """Every read item's targets, and what to call as each target completes."""
        names = self.checkpoint_id, self.location.metadata_url
        return collect(
            plan.items, lambda number, item: self._targets(number, item, planner, *names)
        )

    def _shared_pieces(
        self, plan: LoadPlan, planner: LoadPlanner, share: sharing.Share, ranks: group.Ranks
    ) -> Pieces:
        """`_plan`, then agree that every rank could plan (one that fails here, a shape that
        does not match, must not leave the others waiting for its transfers)."""
        transport = gloo(ranks)
        try:
            targets, done = self._plan(plan, planner)
        except Exception as e:
            group.any_failed(transport, True)
            raise e
        if group.any_failed(transport, False):
            raise CheckpointError(
                f"{self.checkpoint_id}: another rank could not plan its reads (its own error "
                "says why)",
                url=self.checkpoint_id,
            )
        return Pieces(targets, done, share, transport, ranks.members)

    async def _read_all(self, fetches: list[Fetch], pieces: Pieces, shared: bool) -> None:
        """The fetches and, in a shared load, the transfers; a failure on any rank fails every
        rank's load, once all have sent and received what they promised."""
        loop = asyncio.get_running_loop()
        pieces.planned(fetches)
        receiving = None
        if shared:

            def complete(call: Callable[[], None]) -> None:
                loop.call_soon_threadsafe(call)

            receiving = loop.run_in_executor(None, pieces.receive_all, complete)
        failure: BaseException | None = None
        tables = {self._keys[k]: t for k, t in self._frames.items()}
        try:
            await self._check_sizes(fetches)
            await run_all(self._store, self.location.bucket, fetches, tables, pieces.fetched)
        except ObjectNotFound as e:
            failure = await self._replaced(e)
            failure.__cause__ = None if failure is e else e
        except BaseException as e:
            failure = e
        if receiving is not None:
            if failure is not None:
                pieces.send_the_rest()
            try:
                await receiving
                await pieces.placed()
            except BaseException as e:
                failure = failure or e
            if await loop.run_in_executor(None, pieces.finish, failure is not None):
                failure = failure or CheckpointError(
                    f"{self.checkpoint_id}: another rank's share of the load failed "
                    "(its own error says why)",
                    url=self.checkpoint_id,
                )
        else:
            await pieces.placed()
        if failure is not None:
            raise failure

    async def _check_sizes(self, fetches: list[Fetch]) -> None:
        """HEAD the objects of fetches that buffer more than ``part_size``, to see that they are
        as large as the record says.

        A fetch's buffers are allocated before its GET, which is what shows an object shorter
        than the record claims; only a non-tensor value can need more than ``part_size`` (tensor
        reads are split to fit), so that is the rare fetch a tiny hostile record could otherwise
        turn into an allocation of whatever it claims.
        """
        sizes = {self._keys[key]: table.size for key, table in self._frames.items()}
        large = {
            fetch.key
            for fetch in fetches
            if sum(t.end - t.start for t in fetch.targets if t.sink is None) > self.config.part_size
        }
        store, bucket = self._store, self.location.bucket
        await gather_or_cancel(store.check_size(bucket, key, sizes[key]) for key in sorted(large))

    async def _read_checkpoint(self) -> Checkpoint:
        return (await read_prefix(self._store, self.location)).require()

    def _spans(self, item: ReadItem) -> list[Span]:
        """The byte ranges of one read item, as fine as any rank's targets cut them (pieces of
        at most ``part_size``): what the coordinator of a shared load plans with."""
        if item.type == LoadItemType.BYTE_IO:
            locator = self._locators[item.storage_index]
            key = self._keys[locator.key]
            return [Span(key, locator.offset, locator.offset + locator.length)]
        locator, shape, dtype = self._chunk(item.storage_index)
        key, base = self._keys[locator.key], locator.offset
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        spans = []
        for rect in readplan.split_rect(
            shape, offsets, lengths, dtype.itemsize, self.config.part_size
        ):
            start, end = readplan.covering_range(shape, *rect, dtype.itemsize)
            spans.append(Span(key, base + start, base + end))
        return spans

    def _targets(
        self, number: int, item: ReadItem, planner: LoadPlanner, checkpoint_id: str, url: str
    ) -> tuple[list[Target], Callable[[], None]]:
        """The byte ranges one read item needs, and what to call once they have all arrived
        (``checkpoint_id`` and ``url``, the record's, name it in errors)."""
        if item.type == LoadItemType.BYTE_IO:
            locator = self._locators[item.storage_index]
            key = self._keys[locator.key]

            def load(data: memoryview) -> None:
                raw = bytes(data)
                if not self.trust_pickles:
                    self._check_pickle(item.storage_index.fqn, key, raw)
                planner.load_bytes(item, io.BytesIO(raw))

            if locator.length == 0:
                return [], lambda: load(memoryview(b""))
            end = locator.offset + locator.length
            return [Target(number, key, locator.offset, end, place=load)], lambda: None

        locator, shape, dtype = self._chunk(item.storage_index)
        chunk = StoredChunk(self._keys[locator.key], locator.offset, shape, dtype)
        return tensor_targets(
            number, item, planner, chunk, self.config.part_size, checkpoint_id, url
        )

    def _check_pickle(self, fqn: str, key: str, raw: bytes) -> None:
        """Raise `UnsafeCheckpoint` unless torch's ``weights_only`` unpickler accepts ``raw``.

        That unpickler resolves only allowlisted globals and calls nothing else, so the check runs
        no code the checkpoint chose. The planner then unpickles the same bytes again, fully: DCP
        hands it bytes, not objects, so the checked value cannot be passed on. That second pass
        meets only the globals the check allowed, and costs little: tensors are stored raw, only
        non-tensor values (small) come here.
        """
        try:
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError, or whatever else the stream makes it raise
            bucket, cause = self.location.bucket, _refusal(e)
            raise UnsafeCheckpoint(
                f"{self.checkpoint_id}: refused to unpickle {fqn} (in s3://{bucket}/{key}): "
                f"{cause}. Unpickling it could run code chosen by whoever wrote the checkpoint. "
                "If you trust them, load with S3Reader(..., trust_pickles=True) (s3ckpt export "
                "--trust-pickles); if it is a type of yours, allowlist it with "
                "torch.serialization.add_safe_globals instead",
                url=self.checkpoint_id,
                fqn=fqn,
                bucket=bucket,
                key=key,
                cause=cause,
            ) from None

    async def _replaced(self, missing: ObjectNotFound) -> S3CkptError:
        """`CheckpointReplaced` if the record changed since the load began, else ``missing``."""
        began = None if self.checkpoint is None else self.checkpoint.save_id
        location = self.location
        try:
            now: str | None = (await read_prefix(self._store, location)).require().save_id
        except CheckpointError:  # none there now, or one that cannot be read
            now = None
        except S3CkptError:
            return missing
        if now == began:
            return missing
        return CheckpointReplaced(
            f"{location.url} was replaced while it loaded: the load began on save {began}, the "
            f"prefix now holds {'save ' + now if now else 'no checkpoint'} "
            f"(s3://{location.bucket}/{missing.key} is gone); load again",
            url=location.url,
            save_id=began,
            new_save_id=now,
        )


def _refusal(error: Exception) -> str:
    """What the ``weights_only`` check refused, without torch's advice about ``torch.load``
    (which does not apply to a DCP load); its whole first line if the text is not torch's."""
    text = str(error)
    _, marker, detail = text.partition("WeightsUnpickler error:")
    paragraphs = [p.strip() for p in detail.split("\n\n") if p.strip()] if marker else []
    reason = paragraphs[0].split(". ", 1)[0] if paragraphs else text.strip().split("\n", 1)[0]
    return f"{type(error).__name__}: {reason}"


@dataclasses.dataclass(frozen=True)
class _Member:
    """What a rank tells the coordinator in its local plan: its host."""

    host: str
