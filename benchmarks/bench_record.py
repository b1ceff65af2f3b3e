"""The commit record per chunk and per tensor: bytes, encode and decode, version 4 (entry and
item tables) against version 3 (entries as JSON objects, item table) and the inline JSON of
versions 1 and 2.

``python -m benchmarks.bench_record [--chunks 10000 100000 1000000] [--ranks 128]``. No server:
the record of an FSDP-style save (every tensor ``Shard(0)`` over ``--ranks`` ranks, one chunk
per rank, 4 objects per rank, bfloat16) is built as DCP hands it to the writer and encoded by
today's encoder and by the last ones that wrote versions 3 and 1-2 (loaded from git, commits
`ENCODERS`; without git, or in a clone without a commit, that shape is left out), then decoded.
``--layout small`` makes ``--chunks`` unsharded tensors instead (a chunk each, ``--ranks``
ignored), named and with DCP's ``planner_data`` as its default planner saves a model's and an
optimizer's state: what a state of many small tensors costs per tensor. Times are CPU seconds
of this process (the machine may be shared), the best of ``--repeat``. "extra chunk" columns are
the growth from half the ranks to all of them, the tensors staying (as docs/scaling.md counts a
chunk); "to DCP" is building DCP's ``Metadata`` from the decoded record
(`Checkpoint.metadata`), which a load does next. Writes ``benchmarks/results/record.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pickle
import random
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from benchmarks import options
from benchmarks.common import ROOT, format_table, machine_info, write_json
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.record import Locator, decode, encode
from s3ckpt.format.record.torchmeta import to_dcp

# The last commits whose encoders wrote versions 1 and 2 (inline), and version 3, with the
# version each writes: today's model names the newest.
ENCODERS = {"inline": ("2234e1b", None), "v3": ("272bcf5", 3)}
URL = "s3://b/p/.metadata"
_OBJECTS_PER_RANK = 4
_FRAME = 4 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.add_argument("--chunks", type=count, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--ranks", type=count, default=128, help="chunks per tensor")
    p.add_argument(
        "--layout",
        choices=("fsdp", "small"),
        default="fsdp",
        help="tensors sharded over --ranks ranks, or --chunks unsharded ones",
    )
    p.add_argument(
        "--uneven",
        action="store_true",
        help="rows that do not divide by the ranks, shards packed in each rank's own order",
    )
    p.repeat(3, kept="the best")
    p.seed()
    p.json("record.json")
    return p.parse(argv)


Encoder = Callable[..., bytes]


def old_encoder(shape: str) -> Encoder | None:
    """`encode` as of the commit that last wrote ``shape`` (`ENCODERS`); None without git."""
    commit, version = ENCODERS[shape]
    path = "s3ckpt/format/record/encoder.py"
    try:
        shown = subprocess.run(
            ["git", "show", f"{commit}:{path}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType(f"s3ckpt.format.record.encoder_{shape}")
    module.__package__ = "s3ckpt.format.record"
    exec(compile(shown.stdout, f"{commit}:{path}", "exec"), module.__dict__)
    if version is not None:
        module.__dict__["FORMAT_VERSION"] = version  # the version it wrote, not today's
    found: Encoder = module.encode
    return found


@dataclasses.dataclass(frozen=True)
class Saved:
    """What DCP hands `S3Writer.finish`: its ``Metadata`` (which ``dcp.save`` then broadcasts
    to every rank and returns) and the locators, objects and frames of the save."""

    metadata: Metadata
    locators: dict[MetadataIndex, Locator]
    objects: dict[str, int]
    frames: dict[str, FrameTable]

    def encoded(self, encoder: Encoder) -> bytes:
        return encoder(
            self.metadata,
            self.locators,
            save_id="s",
            created=1.7e9,
            objects=self.objects,
            frames=self.frames,
        )


def fsdp_record(tensors: int, ranks: int, seed: int, uneven: bool = False) -> Saved:
    """What `S3Writer.finish` encodes for ``tensors`` tensors sharded over ``ranks`` ranks. With
    ``uneven``, rows do not divide by the ranks (the first ranks hold one more), each rank
    packs its shards in an order of its own, and some are 64-byte aligned (gaps)."""
    rng = random.Random(seed)
    state: dict[str, TensorStorageMetadata] = {}
    shards: list[tuple[int, str, int, list[int], int, int]] = []  # t, fqn, rank, offsets, ...
    names = [f"data-4f1c2a9e/{r:05d}-{o:03d}" for r in range(ranks) for o in range(4)]
    props = TensorProperties(dtype=torch.bfloat16)
    for t in range(tensors):
        rows, cols = rng.choice((1, 2, 4, 8, 16)), rng.choice((1024, 4096, 8192))
        total = rng.randint(ranks, 16 * ranks) if uneven else rows * ranks
        fqn = f"model.layers.{t // 10}.block.{t % 10}.weight"
        chunks, at = [], 0
        for rank in range(ranks):
            held = total // ranks + (rank < total % ranks)
            chunks.append(ChunkStorageMetadata(torch.Size([at, 0]), torch.Size([held, cols])))
            shards.append((t, fqn, rank, [at, 0], held, cols))
            at += held
        state[fqn] = TensorStorageMetadata(props, torch.Size([total, cols]), chunks)
    if uneven:
        rng.shuffle(shards)  # each rank's shards in an order of its own
    locators: dict[MetadataIndex, Locator] = {}
    ends = [0] * (ranks * _OBJECTS_PER_RANK)
    for t, fqn, rank, offsets, rows, cols in shards:
        obj = rank * _OBJECTS_PER_RANK + t * _OBJECTS_PER_RANK // tensors
        if uneven and rng.random() < 0.3:
            ends[obj] += -ends[obj] % 64
        length = rows * cols * 2
        locators[MetadataIndex(fqn, offsets)] = Locator(names[obj], ends[obj], length)
        ends[obj] += length
    metadata = Metadata(state_dict_metadata=dict(state), planner_data={})
    objects = {name: end for name, end in zip(names, ends, strict=True) if end}
    return Saved(
        metadata, locators, objects, {name: _frames(size) for name, size in objects.items()}
    )


def small_record(tensors: int, seed: int) -> Saved:
    """What `S3Writer.finish` encodes for ``tensors`` unsharded tensors of a model and its
    AdamW state (a third each: weights, ``exp_avg``, ``exp_avg_sq``), each one chunk, in one
    object, with the paths DCP's default planner saves in ``planner_data``."""
    rng = random.Random(seed)
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    locators: dict[MetadataIndex, Locator] = {}
    props = TensorProperties(dtype=torch.float32)
    end, name = 0, "data-4f1c2a9e/00000-000"
    for t in range(tensors):
        layer, kind = divmod(t // 3, 4)
        param = f"layers.{layer}.{('q', 'k', 'v', 'o')[kind]}.weight"
        path: tuple[str | int, ...] = (
            ("model", param)
            if t % 3 == 0
            else ("optim", "state", param, ("exp_avg", "exp_avg_sq")[t % 3 - 1])
        )
        fqn = ".".join(map(str, path))
        size = torch.Size([rng.choice((256, 1024, 4096))])
        state[fqn] = TensorStorageMetadata(
            props, size, [ChunkStorageMetadata(torch.Size([0]), size)]
        )
        paths[fqn] = path
        locators[MetadataIndex(fqn, [0])] = Locator(name, end, size[0] * 4)
        end += size[0] * 4
    metadata = Metadata(state_dict_metadata=state, planner_data=paths)
    return Saved(metadata, locators, {name: end}, {name: _frames(end)})


def _frames(size: int) -> FrameTable:
    count = -(-size // _FRAME)
    sizes = [min(_FRAME, size - i * _FRAME) for i in range(count)]
    return FrameTable(_FRAME, sizes, [0] * count, bytes(count), size)


def cpu(step: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        out = None
        started = time.process_time()
        out = step()
        best = min(best, time.process_time() - started)
    return best, out


def point(
    args: argparse.Namespace, chunks: int, encoders: dict[str, Encoder | None]
) -> dict[str, Any]:
    small = args.layout == "small"
    ranks, repeat, seed = (1 if small else args.ranks), args.repeat, args.seed
    tensors = max(1, chunks // ranks)
    out: dict[str, Any] = {"chunks": tensors * ranks, "tensors": tensors, "ranks": ranks}
    extra = tensors * (ranks - ranks // 2)
    sizes = {"all": ranks} if small else {"all": ranks, "half": ranks // 2}
    for shape, encoder in encoders.items():
        if encoder is None:
            continue
        measured: dict[str, dict[str, float | None]] = {}
        for name, world in sizes.items():
            record = (
                small_record(tensors, seed)
                if small
                else fsdp_record(tensors, world, seed, args.uneven)
            )
            encode_s, data = cpu(functools.partial(record.encoded, encoder), repeat)
            decode_s, checkpoint = cpu(functools.partial(decode, data, url=URL), repeat)
            dcp_s, _ = cpu(functools.partial(to_dcp, checkpoint), repeat)
            measured[name] = {"bytes": len(data), "encode": encode_s, "decode": decode_s}
            measured[name]["to_dcp"] = dcp_s
            if shape == "v4" and name == "all":
                out["broadcast"] = broadcast_cost(record.metadata, repeat)
            del data, checkpoint
        full, half = measured["all"], measured.get("half", {})
        count = tensors * ranks
        out[shape] = {
            "bytes": full["bytes"],
            "bytes_per_chunk": _per(full["bytes"], count),
            "bytes_per_extra_chunk": _per(_less(full["bytes"], half.get("bytes")), extra),
            **{
                f"{step}_us_per_chunk": _per(full[step], count, 1e6)
                for step in ("encode", "decode", "to_dcp")
            },
            **{
                f"{step}_us_per_extra_chunk": _per(_less(full[step], half.get(step)), extra, 1e6)
                for step in ("encode", "decode")
            },
        }
    return out


def broadcast_cost(metadata: Metadata, repeat: int) -> dict[str, float]:
    """DCP's end of a save, whatever the storage layer: the coordinator pickles the save's
    ``Metadata`` and broadcasts it, and every rank unpickles it (``_DistWrapper.all_reduce``)."""
    count = sum(
        len(item.chunks)
        for item in metadata.state_dict_metadata.values()
        if isinstance(item, TensorStorageMetadata)
    )
    dumps_s, data = cpu(functools.partial(pickle.dumps, metadata), repeat)
    loads_s, _ = cpu(functools.partial(pickle.loads, data), repeat)
    return {
        "bytes_per_chunk": len(data) / count,
        "dumps_us_per_chunk": dumps_s / count * 1e6,
        "loads_us_per_chunk": loads_s / count * 1e6,
    }


def _less(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _per(value: float | None, count: int, scale: float = 1.0) -> float | None:
    return None if value is None else value / count * scale


_COLUMNS = {
    "B": "bytes",
    "B/chunk": "bytes_per_chunk",
    "B/extra chunk": "bytes_per_extra_chunk",
    "encode us": "encode_us_per_chunk",
    "encode us/extra": "encode_us_per_extra_chunk",
    "decode us": "decode_us_per_chunk",
    "decode us/extra": "decode_us_per_extra_chunk",
    "to DCP us": "to_dcp_us_per_chunk",
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    encoders = {shape: old_encoder(shape) for shape in ENCODERS}
    encoders["v4"] = encode
    results = [point(args, n, encoders) for n in args.chunks]
    rows = [
        [r["chunks"], shape, *(r[shape][key] for key in _COLUMNS.values())]
        for r in results
        for shape in encoders
        if shape in r
    ]
    print(format_table(["chunks", "record", *_COLUMNS], rows))
    shown = {
        shape: f"encoder of commit {ENCODERS[shape][0]}"
        if encoders[shape]
        else f"left out: no git, or no {ENCODERS[shape][0]}"
        for shape in ENCODERS
    }
    print(
        f"inline: versions 1-2 ({shown['inline']}); v3: entries as JSON, the item table "
        f"({shown['v3']}); v4: the entry and item tables. us: CPU microseconds per chunk "
        "(with --layout small, a chunk is a tensor); /extra: per chunk added from half the "
        "ranks to all"
    )
    write_json(args.json, {"machine": machine_info(), "args": sys.argv[1:], "results": results})
    for r in results:
        b = r["broadcast"]
        print(
            f"DCP's end-of-save broadcast of its Metadata, {r['chunks']} chunks: "
            f"{b['bytes_per_chunk']:.0f} B, pickled in {b['dumps_us_per_chunk']:.2f} us on the "
            f"coordinator and unpickled in {b['loads_us_per_chunk']:.2f} us on every rank, "
            "per chunk"
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
