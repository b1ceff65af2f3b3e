"""A checkpoint as nested CPU tensors, in memory (`read_state`, which the demo compares) or in a
local ``torch.save`` file (`export`, what ``s3ckpt export`` writes). The one tool that needs torch
(and DCP's planner types): `catalog` imports it when one of them is called.

Both read through `S3Reader` a batch of tensors at a time, at most ``part_size x max_concurrency``
bytes (a larger tensor is read in slabs of that size), and rebuild the nesting from the record
(`format.record.nesting`). `export` holds only one batch: ``torch.save`` writes a whole state
dict from memory, so the file is laid out by ``torch.save`` of the state with fake tensors under
``torch.serialization.skip_data`` (its storages reserved, not written), and each batch is then
written into its storages' places in the zip, their CRC32s patched in after.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..config import S3Config
from ..dcp.reader import S3Reader
from ..format import readplan
from ..format.record import TensorEntry
from ..format.record.nesting import nest
from ..format.tensorbytes import memory_of
from .listing import Progress

__all__ = ["Counter", "Exported", "Piece", "Source", "export", "read_state"]


@dataclass(frozen=True)
class Exported:
    """What `export` wrote: the state's tensors (its entries; not those inside other values)."""

    path: Path
    tensors: int
    tensor_bytes: int


def read_state(
    url: str,
    config: S3Config | None = None,
    *,
    progress: Progress | None = None,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """See `catalog.read_state`; the checkpoint is known to be committed and readable."""
    source = Source(url, config, trust_pickles)
    values = source.values()
    tensors: dict[str, torch.Tensor] = {}

    def leaf(fqn: str) -> Any:
        if fqn not in source.tensors:
            return values[fqn]
        entry = source.tensors[fqn]
        tensors[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        return tensors[fqn]

    state = nest(source.checkpoint, leaf)
    done = Counter(progress, source.tensor_bytes)
    for batch in source.batches():
        pieces = [(p, _narrow(tensors[p.fqn], p.offsets, p.lengths)) for p in batch]
        source.read(pieces)
        done.add(batch)
    return state


def export(
    url: str,
    path: Path,
    config: S3Config | None = None,
    *,
    progress: Progress | None = None,
    trust_pickles: bool = False,
) -> Exported:
    """Write the committed checkpoint at ``url`` to ``path`` as one ``torch.save`` file of its
    state, nested as it was saved; ``torch.load`` reads it back. ``path`` is replaced only once
    the file is complete. Memory: one batch of tensors (``part_size x max_concurrency`` bytes,
    256 MiB by default), the load's own working set (as much again at most), and the non-tensor
    values (which ``torch.save`` pickles whole)."""
    source = Source(url, config, trust_pickles)
    values = source.values()
    mode = FakeTensorMode()
    fakes: dict[str, torch.Tensor] = {}

    def leaf(fqn: str) -> Any:
        if fqn not in source.tensors:
            return values[fqn]
        entry = source.tensors[fqn]
        with mode:
            fakes[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        return fakes[fqn]

    state = nest(source.checkpoint, leaf)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(state, partial)
            storages = _storages(state)
        with _Zip(partial, [storage.nbytes() for storage in storages]) as out:
            _fill(out, source, storages, fakes, Counter(progress, source.tensor_bytes))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return Exported(path, len(source.tensors), source.tensor_bytes)


def _fill(
    out: _Zip,
    source: Source,
    storages: list[torch.UntypedStorage],
    fakes: dict[str, torch.Tensor],
    done: Counter,
) -> None:
    """Every storage's bytes into its record: those of tensors inside non-tensor values from
    memory, the state's tensors from the checkpoint a batch at a time."""
    names = {fake.untyped_storage()._cdata: fqn for fqn, fake in fakes.items()}
    keys: dict[str, int] = {}
    for key, storage in enumerate(storages):
        if storage._cdata in names:
            keys[names[storage._cdata]] = key
        else:
            held = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu()
            out.write(key, 0, memory_of(held))
    for batch in source.batches():
        pieces = [(piece, torch.empty(piece.lengths, dtype=piece.dtype)) for piece in batch]
        source.read(pieces)
        for piece, tensor in pieces:
            out.write(keys[piece.fqn], piece.start, memory_of(tensor))
        del pieces  # before the next batch is allocated
        done.add(batch)


@dataclass(frozen=True)
class Piece:
    """A row-major run of one tensor's elements, read and written as one."""

    fqn: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: torch.dtype
    start: int  # its first byte in the tensor's bytes
    nbytes: int

    @property
    def index(self) -> MetadataIndex:
        return MetadataIndex(self.fqn, self.offsets)


class Source:
    """A committed checkpoint read through `S3Reader` piece by piece: DCP's read items for each
    piece, as its planner would make them, and no whole state dict in memory."""

    def __init__(self, url: str, config: S3Config | None, trust_pickles: bool) -> None:
        self.reader = S3Reader(url, config=config, trust_pickles=trust_pickles)
        metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(metadata, is_coordinator=True)
        assert self.reader.checkpoint is not None
        self.checkpoint = self.reader.checkpoint
        self.metadata = metadata
        self.tensors = {
            fqn: entry
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }
        self.tensor_bytes = sum(
            entry.nbytes
            for entry in self.checkpoint.entries.values()
            if isinstance(entry, TensorEntry)
        )
        config = self.reader.config
        self.budget = config.part_size * config.max_concurrency

    def values(self) -> dict[str, Any]:
        """Every non-tensor value, unpickled (after `S3Reader`'s check, unless trusted)."""
        items = [
            ReadItem(
                type=LoadItemType.BYTE_IO,
                dest_index=MetadataIndex(fqn),
                dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(fqn),
                storage_offsets=torch.Size((0,)),
                lengths=torch.Size((0,)),
            )
            for fqn in self.metadata.state_dict_metadata
            if fqn not in self.tensors
        ]
        planner = _Planner({})
        self._run(items, planner)
        return planner.values

    def batches(self, fqns: Sequence[str] | None = None) -> Iterator[list[Piece]]:
        """The pieces of every tensor (or of ``fqns``, in that order), in batches of at most
        `budget` bytes."""
        batch: list[Piece] = []
        size = 0
        for fqn in self.tensors if fqns is None else fqns:
            entry = self.tensors[fqn]
            shape, dtype = tuple(entry.size), entry.properties.dtype
            origin = (0,) * len(shape)
            for offsets, lengths in readplan.split_rect(
                shape, origin, shape, dtype.itemsize, self.budget
            ):
                start, end = readplan.covering_range(shape, offsets, lengths, dtype.itemsize)
                if batch and size + end - start > self.budget:
                    yield batch
                    batch, size = [], 0
                batch.append(Piece(fqn, offsets, lengths, dtype, start, end - start))
                size += end - start
        if batch:
            yield batch

    def read(self, pieces: list[tuple[Piece, torch.Tensor]]) -> None:
        """Read each piece into its tensor (of the piece's shape)."""
        items = [
            item
            for piece, _ in pieces
            for item in create_read_items_for_chunk_list(
                piece.fqn,
                self.tensors[piece.fqn],
                [ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.lengths))],
            )
        ]
        self._run(items, _Planner({piece.index: tensor for piece, tensor in pieces}))

    def _run(self, items: list[ReadItem], planner: _Planner) -> None:
        self.reader.read_data(LoadPlan(items), planner).wait()


class _Planner(DefaultLoadPlanner):
    """Where `S3Reader` puts what it reads: the pieces' tensors, and non-tensor values."""

    def __init__(self, pieces: dict[MetadataIndex, torch.Tensor]) -> None:
        super().__init__()
        self.pieces = pieces
        self.values: dict[str, Any] = {}

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.pieces[read_item.dest_index]
        return _narrow(piece, read_item.dest_offsets, read_item.lengths)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # What DCP's own planner does; the reader has checked the pickle unless told to trust it.
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The region of ``tensor`` at ``offsets`` of ``lengths`` (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class Counter:
    """Reports tensor bytes as batches complete."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        self.add([])

    def add(self, batch: list[Piece]) -> None:
        self.done += sum(piece.nbytes for piece in batch)
        if self.progress is not None:
            self.progress(self.done, self.total)


def _storages(state: dict[str, Any]) -> list[torch.UntypedStorage]:
    """The storages ``torch.save`` writes for ``state``, in the order of its record names
    (``data/0``, ``data/1``, ...): it numbers them as its pickler first meets them, which a
    pickler of the same protocol meets in the same order (under the same ``skip_data``)."""
    found: list[torch.UntypedStorage] = []
    seen: dict[int, int] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.storage.TypedStorage):
                storage = obj._untyped_storage
            elif isinstance(obj, torch.UntypedStorage):
                storage = obj
            else:
                return None
            if storage._cdata not in seen:
                seen[storage._cdata] = len(found)
                found.append(storage)
            return seen[storage._cdata]

    Pickler(_Discard(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(state)
    return found


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


class _Zip:
    """The storages' records of a zip that ``torch.save`` laid out with ``skip_data``: where each
    one's bytes go, and its CRC32 (computed as they are written) patched into its data descriptor
    and the central directory when it closes, so that the file is a sound zip."""

    _LOCAL = 30  # a local file header's size; its name and extra field lengths are at 26
    _CENTRAL = 46  # a central directory entry's; its CRC is at 16, its three lengths at 28

    def __init__(self, path: Path, sizes: list[int]) -> None:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as file:
            infos = archive.infolist()
            archive_name = infos[0].filename.partition("/")[0]
            self.records: dict[int, tuple[int, int, zipfile.ZipInfo]] = {}
            for info in infos:
                folder, _, key = info.filename.removeprefix(f"{archive_name}/").partition("/")
                if folder == "data" and key.isdigit():
                    file.seek(info.header_offset)
                    name, extra = struct.unpack_from("<HH", file.read(self._LOCAL), 26)
                    start = info.header_offset + self._LOCAL + name + extra
                    self.records[int(key)] = (start, info.file_size, info)
            self._central = _central_entries(file, archive.start_dir, len(infos))
        laid_out = [
            self.records[key][1] if key in self.records else None for key in range(len(sizes))
        ]
        if len(self.records) != len(sizes) or laid_out != sizes:
            raise RuntimeError(
                "torch.save laid the export's storages out differently than expected "
                f"({laid_out} bytes, expected {sizes})"
            )
        self.crcs = {key: 0 for key in self.records}
        self.written = {key: 0 for key in self.records}
        self.file = open(path, "r+b")  # noqa: SIM115  # closed by __exit__

    def write(self, key: int, offset: int, data: memoryview) -> None:
        """Bytes of record ``key`` from ``offset`` on; a record's bytes come in order."""
        start, size, _ = self.records[key]
        assert offset == self.written[key] and offset + len(data) <= size
        done = 0
        while done < len(data):
            done += os.pwrite(self.file.fileno(), data[done:], start + offset + done)
        self.crcs[key] = zlib.crc32(data, self.crcs[key])
        self.written[key] += len(data)

    def __enter__(self) -> _Zip:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self._patch()
        finally:
            self.file.close()

    def _patch(self) -> None:
        fd = self.file.fileno()
        for key, (start, size, info) in self.records.items():
            crc = struct.pack("<I", self.crcs[key])
            os.pwrite(fd, crc, self._central[info.filename] + 16)
            if info.flag_bits & 0x08:  # a data descriptor after the bytes holds the CRC
                signature = os.pread(fd, 4, start + size)
                os.pwrite(fd, crc, start + size + (4 if signature == b"PK\x07\x08" else 0))
            else:
                os.pwrite(fd, crc, info.header_offset + 14)


def _central_entries(file: BinaryIO, start: int, count: int) -> dict[str, int]:
    """Where each file's entry in a zip's central directory (at ``start``) is."""
    entries: dict[str, int] = {}
    file.seek(start)
    for _ in range(count):
        at = file.tell()
        name, extra, comment = struct.unpack_from("<HHH", file.read(_Zip._CENTRAL), 28)
        entries[file.read(name).decode()] = at
        file.seek(extra + comment, os.SEEK_CUR)
    return entries
