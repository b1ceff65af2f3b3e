"""The commit record per chunk: bytes, encode and decode, version 3 (item table) against the
inline JSON of versions 1 and 2.

``python -m benchmarks.bench_record [--chunks 10000 100000 1000000] [--ranks 1000]``. No server:
the record of an FSDP-style save (every tensor ``Shard(0)`` over ``--ranks`` ranks, one chunk
per rank, 4 objects per rank, bfloat16) is built as DCP hands it to the writer, encoded, and
decoded; the old shape is the same record written inline (`tests.recordshapes.inline`), which
is what s3ckpt wrote before version 3. Times are CPU seconds of this process (the machine is
shared), the best of ``--repeat``. "B/extra chunk" is the record's growth per chunk from half
the ranks to all of them (the tensors stay), as docs/scaling.md counts it; "to DCP" is building
DCP's ``Metadata`` from the decoded record (`Checkpoint.metadata`), which a load does next.
Writes ``benchmarks/results/record.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from benchmarks.common import RESULTS, format_table, machine_info
from s3ckpt.format.frames import FrameTable
from s3ckpt.format.record import Locator, decode, encode
from tests.recordshapes import inline

_OBJECTS_PER_RANK = 4
_FRAME = 4 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_record", description=__doc__)
    p.add_argument("--chunks", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--ranks", type=int, default=1000, help="chunks per tensor")
    p.add_argument("--repeat", type=int, default=3, help="timings per step; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=RESULTS / "record.json")
    return p.parse_args(argv)


def fsdp_record(tensors: int, ranks: int, seed: int) -> Callable[[], bytes]:
    """What `S3Writer.finish` encodes for ``tensors`` tensors sharded over ``ranks`` ranks."""
    rng = random.Random(seed)
    state: dict[str, TensorStorageMetadata] = {}
    locators: dict[MetadataIndex, Locator] = {}
    ends = [0] * (ranks * _OBJECTS_PER_RANK)
    names = [f"data-4f1c2a9e/{r:05d}-{o:03d}" for r in range(ranks) for o in range(4)]
    props = TensorProperties(dtype=torch.bfloat16)
    for t in range(tensors):
        rows, cols = rng.choice((1, 2, 4, 8, 16)), rng.choice((1024, 4096, 8192))
        fqn = f"model.layers.{t // 10}.block.{t % 10}.weight"
        chunks = []
        for rank in range(ranks):
            chunks.append(
                ChunkStorageMetadata(torch.Size([rank * rows, 0]), torch.Size([rows, cols]))
            )
            obj = rank * _OBJECTS_PER_RANK + t * _OBJECTS_PER_RANK // tensors
            length = rows * cols * 2
            locators[MetadataIndex(fqn, [rank * rows, 0])] = Locator(names[obj], ends[obj], length)
            ends[obj] += length
        state[fqn] = TensorStorageMetadata(props, torch.Size([ranks * rows, cols]), chunks)
    metadata = Metadata(state_dict_metadata=state, planner_data={})
    objects = {name: end for name, end in zip(names, ends, strict=True) if end}
    frames = {name: _frames(size) for name, size in objects.items()}

    def encoded() -> bytes:
        return encode(
            metadata, locators, save_id="s", created=1.7e9, objects=objects, frames=frames
        )

    return encoded


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


def point(chunks: int, ranks: int, repeat: int, seed: int) -> dict[str, Any]:
    tensors = max(1, chunks // ranks)
    chunks = tensors * ranks
    encoder = fsdp_record(tensors, ranks, seed)
    encode_s, new = cpu(encoder, repeat)
    half = fsdp_record(tensors, ranks // 2, seed)()
    old, old_half = inline(new), inline(half)
    out: dict[str, Any] = {"chunks": chunks, "tensors": tensors, "ranks": ranks}
    extra = chunks - tensors * (ranks // 2)
    for name, data, smaller in (("v3", new, half), ("inline", old, old_half)):
        decode_s, checkpoint = cpu(lambda d=data: decode(d, url="s3://b/p/.metadata"), repeat)
        dcp_s, _ = cpu(lambda c=checkpoint: _to_dcp(c), repeat)
        out[name] = {
            "bytes": len(data),
            "bytes_per_chunk": len(data) / chunks,
            "bytes_per_extra_chunk": (len(data) - len(smaller)) / extra,
            "decode_us_per_chunk": decode_s / chunks * 1e6,
            "to_dcp_us_per_chunk": dcp_s / chunks * 1e6,
        }
    out["v3"]["encode_us_per_chunk"] = encode_s / chunks * 1e6
    return out


def _to_dcp(checkpoint: Any) -> Any:
    from s3ckpt.format.record.torchmeta import to_dcp

    return to_dcp(checkpoint)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = [point(n, args.ranks, args.repeat, args.seed) for n in args.chunks]
    headers = [
        "chunks",
        "shape",
        "B",
        "B/chunk",
        "B/extra chunk",
        "encode us",
        "decode us",
        "to DCP us",
    ]
    rows = []
    for r in results:
        for name in ("inline", "v3"):
            m = r[name]
            rows.append(
                [
                    r["chunks"],
                    name,
                    m["bytes"],
                    m["bytes_per_chunk"],
                    m["bytes_per_extra_chunk"],
                    m.get("encode_us_per_chunk"),
                    m["decode_us_per_chunk"],
                    m["to_dcp_us_per_chunk"],
                ]
            )
    print(format_table(headers, rows))
    print("us: CPU microseconds per chunk; inline: versions 1-2 (no encoder of it remains)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"machine": machine_info(), "args": sys.argv[1:], "results": results}, indent=2)
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
