"""A committed checkpoint's tensors as Hugging Face safetensors files (``s3ckpt export --format
safetensors``), in a local directory or under an ``s3://`` prefix.

The tensors are read through `S3Reader` (every frame's CRC checked) a batch at a time, whole
tensors rebuilt from however the checkpoint sharded them, and streamed into each file in the
order of its header (`format.safetensors.layout`). Memory: one batch of at most ``part_size x
max_concurrency`` bytes (256 MiB by default; a larger tensor goes in slabs) and its dtype
conversion, plus, to S3, the parts of the multipart upload in flight (at most
``max_concurrency``, each under ``2 x part_size``): bounded by those settings, whatever the
size of the tensors or of the model.

Atomic: a local file is written under a temporary name and renamed once complete; on S3 a file
appears only when its multipart upload completes. Files appear one after the other, the index
(``model.safetensors.index.json``) last; a failed export removes the files it had completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import S3Config
from ..engine import bridge
from ..engine.contract import ObjectStore
from ..engine.store import get_store
from ..errors import ConfigError, S3CkptError
from ..format import safetensors as st
from ..format.layout import Location
from ..format.record import TensorEntry
from ..format.tensorbytes import memory_of
from .export import Counter, Source
from .listing import Progress

__all__ = ["DEFAULT_SHARD_SIZE", "SafetensorsExport", "export_safetensors", "parse_size"]

DEFAULT_SHARD_SIZE = 5 * 10**9  # save_pretrained's default, "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_NAMES = {name: dtype for dtype, (name, _) in st.DTYPES.items()}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
_ALIASES |= {"float": "float32", "fp64": "float64", "double": "float64"}
Contents = Callable[[], Iterator[memoryview]]  # a file's bytes, produced as they are written


@dataclass(frozen=True)
class SafetensorsExport:
    """What `export_safetensors` wrote: its files (the index last), their tensors and data bytes,
    and the entries it left out (non-tensor values, which safetensors cannot hold)."""

    destination: str
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    skipped: tuple[str, ...]


def parse_size(text: str) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"1000000"``: a size in bytes, as HF writes it."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).upper() if found else ""
    if found is None or unit not in _UNITS or float(found.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(f"expected a size such as 5GB, 500MiB or 1000000 bytes, got {text!r}")
    return int(float(found.group(1)) * _UNITS[unit])


def export_safetensors(
    url: str,
    dest: str | Path,
    config: S3Config | None = None,
    *,
    select: str | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    progress: Progress | None = None,
) -> SafetensorsExport:
    """Write the tensors of the committed checkpoint at ``url`` to ``dest`` (a local directory
    or an ``s3://`` prefix) in the Hugging Face layout: ``model.safetensors``, or files of at
    most ``max_shard_size`` bytes and ``model.safetensors.index.json``. ``select="model"`` keeps
    the entries under ``model`` and drops that prefix from their names; ``dtype`` (a
    floating-point one: another is a ConfigError, raised before anything is read, as is a size
    that is not one) converts the floating-point tensors. ``dest`` must not hold safetensors
    files already. ``progress(done, total)`` counts the bytes read."""
    select = select.strip(".") if select else None
    wanted = None if dtype is None else _torch_dtype(dtype)  # refused before anything is read
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    if limit < 1:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, got {limit}")
    source = Source(url, config, trust_pickles=False)
    names = _selected(source, select)
    if not names:
        raise ConfigError(f"{url}: no tensors under {select!r} to export")
    out = {fqn: _output_dtype(fqn, source.tensors[fqn].properties.dtype, wanted) for fqn in names}
    sizes = [(name, _nbytes(source, fqn, out[fqn])) for fqn, name in names.items()]
    shards = st.plan_shards(sizes, limit)
    fqn_of = {name: fqn for fqn, name in names.items()}
    headers = {
        st.shard_name(number, len(shards)): st.layout(
            [
                (name, _st_dtype(out[fqn_of[name]]), tuple(source.tensors[fqn_of[name]].size))
                for name in shard
            ],
            {"format": "pt"},
        )
        for number, shard in enumerate(shards, 1)
    }
    total = sum(size for _, size in sizes)
    done = Counter(progress, sum(_nbytes(source, fqn, None) for fqn in names))

    step = source.reader.config.part_size

    def contents(header: st.Header) -> Iterator[memoryview]:
        """The file's bytes in views of at most ``part_size``: an upload cuts a part once it
        holds ``part_size``, so its parts stay under twice that, whatever the tensors' sizes."""
        yield memoryview(header.encode())
        fqns = [fqn_of[info.name] for info in header.tensors]
        for batch in source.batches(fqns):
            pieces = [(piece, torch.empty(piece.lengths, dtype=piece.dtype)) for piece in batch]
            source.read(pieces)
            for piece, tensor in pieces:
                converted = tensor.to(out[piece.fqn])  # held while its views are used
                view = memory_of(converted)
                for at in range(0, len(view), step):
                    yield view[at : at + step]
            del pieces, converted, view  # before the next batch is allocated
            done.add(batch)

    files: dict[str, Contents] = {
        name: functools.partial(contents, header) for name, header in headers.items()
    }
    index = None
    if len(shards) > 1:
        weight_map = {info.name: f for f, h in headers.items() for info in h.tensors}
        index = st.encode_index(weight_map, total)
    written = _write(str(dest), files, index, source.reader.config)
    skipped = tuple(
        fqn
        for fqn, entry in source.checkpoint.entries.items()
        if not isinstance(entry, TensorEntry) and _name(fqn, select) is not None
    )
    return SafetensorsExport(str(dest), written, len(names), total, skipped)


def _name(fqn: str, select: str | None) -> str | None:
    if not select:
        return fqn
    return fqn[len(select) + 1 :] if fqn.startswith(f"{select}.") else None


def _selected(source: Source, select: str | None) -> dict[str, str]:
    """Each exported tensor's fqn and its name in the files, in the checkpoint's order."""
    names = {fqn: _name(fqn, select) for fqn in source.tensors}
    return {fqn: name for fqn, name in names.items() if name is not None}


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        found: object = dtype
    else:
        found = getattr(torch, _ALIASES.get(dtype.lower(), dtype.lower()), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ConfigError(f"expected a floating-point dtype such as bfloat16 or float32: {dtype!r}")
    return found


def _output_dtype(fqn: str, stored: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    out = wanted if wanted is not None and stored.is_floating_point else stored
    if _st_dtype(out) not in st.DTYPES:
        raise ConfigError(f"{fqn}: safetensors has no dtype for {out}")
    return out


def _st_dtype(dtype: torch.dtype) -> str:
    """safetensors' name for ``dtype`` (empty if it has none)."""
    return _NAMES.get(str(dtype).removeprefix("torch."), "")


def _nbytes(source: Source, fqn: str, dtype: torch.dtype | None) -> int:
    entry = source.tensors[fqn]
    return entry.size.numel() * (dtype or entry.properties.dtype).itemsize


def _write(
    dest: str, files: dict[str, Contents], index: bytes | None, config: S3Config
) -> tuple[str, ...]:
    if dest.startswith("s3://"):
        location = Location.of(dest)
        return bridge.run(_to_s3(get_store(config), location, files, index))
    return _to_directory(Path(dest), files, index)


def _to_directory(dest: Path, files: dict[str, Contents], index: bytes | None) -> tuple[str, ...]:
    """Every file under a temporary name first, then renamed into place, the index last."""
    dest.mkdir(parents=True, exist_ok=True)
    _refuse_existing([path.name for path in dest.iterdir()], str(dest))
    names = [*files, *([st.INDEX] if index is not None else [])]
    token = secrets.token_hex(4)
    partial = {name: dest / f".{name}.{token}.partial" for name in names}
    try:
        for name, contents in files.items():
            with open(partial[name], "wb") as out:
                for chunk in contents():
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        if index is not None:
            partial[st.INDEX].write_bytes(index)
        for name in names:
            os.replace(partial[name], dest / name)
    finally:
        for path in partial.values():
            path.unlink(missing_ok=True)
    return tuple(str(dest / name) for name in names)


async def _to_s3(
    store: ObjectStore, location: Location, files: dict[str, Contents], index: bytes | None
) -> tuple[str, ...]:
    """Each file as one streamed upload (visible only once complete), then the index; a failure
    deletes the files already completed."""
    bucket = location.bucket
    listing = await store.list_objects(bucket, location.listing_prefix, delimiter=True)
    start = len(location.listing_prefix)
    _refuse_existing([obj.key[start:] for obj in listing.objects], location.url)
    written: list[str] = []
    try:
        for name, contents in files.items():
            key = location.key(name)
            await store.upload_stream(bucket, key, _pulled(contents()))
            written.append(key)
        if index is not None:
            await store.put(bucket, location.key(st.INDEX), index)
            written.append(location.key(st.INDEX))
    except BaseException:
        await asyncio.shield(_delete_quietly(store, bucket, written))
        raise
    return tuple(f"s3://{bucket}/{key}" for key in written)


async def _delete_quietly(store: ObjectStore, bucket: str, keys: Sequence[str]) -> None:
    with contextlib.suppress(S3CkptError):  # the export's own error is the one to report
        await store.delete(bucket, keys)


async def _pulled(contents: Iterator[memoryview]) -> AsyncIterator[memoryview]:
    """``contents`` produced in a worker thread (it reads through `S3Reader`, on this loop). A
    view stays valid until the next one is asked for: the upload copies it before that."""
    loop = asyncio.get_running_loop()
    while (chunk := await loop.run_in_executor(None, next, contents, None)) is not None:
        yield chunk


_EXPORTED = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _refuse_existing(names: Sequence[str], dest: str) -> None:
    found = sorted(name for name in names if _EXPORTED.fullmatch(name))
    if found:
        raise ConfigError(
            f"{dest} already holds safetensors files ({', '.join(found[:3])}): an export there "
            "would mix with them; remove them or choose another destination"
        )
