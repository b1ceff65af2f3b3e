"""Incremental checkpoints: what hashing costs, and what a save that references its base saves.

``python -m benchmarks.bench_incremental`` (a local SeaweedFS unless ``--endpoint-url``; about
six minutes on 2 cores; ``--quick``: small sizes, one repetition, under a minute). The client
(this process, one torch thread) is pinned to one core and the local server to the other, as in
`bench_manager`. Three parts, all by default, or those named (``--hashes`` alone takes seconds):

1. ``--hashes``: hash throughput on one core over ``--hash-mib`` of random bytes, in GB/s of CPU
   time (and of wall time), for xxh3-128 (what `s3ckpt.format.digests` uses), xxh3-64, BLAKE3
   (the ``blake3`` package, one thread; skipped if not installed), BLAKE2b and SHA-256, and
   `digests.digest` itself on a ``--tensor-mib`` fp32 tensor. Then the same with two threads at
   once on two cores (before the server starts): a speedup near 2x shows that the hash releases
   the GIL, so an incremental save's hashing threads do not hold up its I/O thread.
2. ``--finetune``: a frozen transformer-shaped base (``--base-gib``, bf16 matrices and fp32
   layernorms) and a LoRA part on its attention projections with AdamW-like ``exp_avg`` and
   ``exp_avg_sq`` and step counters (under 5% of the base); between saves only the LoRA part
   changes. Case ``incremental`` saves ``--saves`` checkpoints ``step-000001`` ... into a fresh
   run prefix per repetition; case ``full`` (``incremental=False``) saves ``--full-saves`` of the
   same steps, spread over them (a full save takes seconds; its size and time do not depend on
   the step). Each case reuses one `S3Writer` across its saves, as `CheckpointManager` does:
   ``dcp.async_save(state, checkpoint_id=..., storage_writer=writer)``, the writer as stager.
   Per save: the stall (until ``async_save`` returns), durable (until its future resolves), the
   bytes it uploaded (its record's ``stored_bytes``), client and server CPU. Then the run's
   storage (every data object under its prefix) and a plain `S3Reader` ``dcp.load`` of the last
   checkpoint of each case, checked equal to the state.
3. ``--pretrain``: a ``--pretrain-mib`` state (fp32 weights and their optimizer state) that
   changes entirely between saves; ``full`` against ``incremental``, ``--pretrain-saves`` each.

Cases alternate save by save (which one goes first flips every step), repetitions in turn;
medians over all repetitions are reported, and saves after the first of a run (the first
incremental save has no base: it is a full save plus hashing). Every run's objects are deleted
after it is measured. The goals (a table at the end, and ``goals`` in the JSON):

- later incremental saves upload at most 1.1x the trained part's bytes;
- a full save's durable time is at least 10x a later incremental save's;
- the incremental run's 10 checkpoints store at most 1.5x one full checkpoint;
- when everything changes, an incremental save is at most 5% slower than a full one.

Results: a table per part and ``benchmarks/results/incremental.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save

from s3ckpt import S3Config, S3Reader, S3Writer
from s3ckpt.engine import bridge
from s3ckpt.engine.contract import ObjectStore
from s3ckpt.engine.store import get_store
from s3ckpt.format import layout
from s3ckpt.format.digests import digest
from s3ckpt.format.tensorbytes import as_flat_bytes
from s3ckpt.tools import catalog

from . import options
from .common import (
    GB,
    Endpoint,
    MiB,
    cpu_since,
    cpu_times,
    format_table,
    machine_info,
    median,
    pin_threads,
    server_cpu_seconds,
    write_json,
)

CASES = ("full", "incremental")
GiB = 1024 * MiB
# Goals of the issue: uploaded / trained bytes, full / incremental durable, run storage / one
# full checkpoint, incremental / full durable when everything changes.
UPLOAD_GOAL, SPEEDUP_GOAL, STORAGE_GOAL, OVERHEAD_GOAL = 1.1, 10.0, 1.5, 1.05
_MIN_HASH_S = 0.3  # each hash timing runs at least this long
State = dict[str, Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = options.Parser(__file__, __doc__)
    count = options.positive_int
    p.add_argument("--hashes", action="store_true", help="run part 1 (default: every part)")
    p.add_argument("--finetune", action="store_true", help="run part 2")
    p.add_argument("--pretrain", action="store_true", help="run part 3")
    p.quick("small sizes, 1 repetition")
    p.scaled("--base-gib", 1.0, 1 / 16, "frozen base", type=options.positive_float)
    p.scaled("--hidden", 2048, 512, "fine-tuned model's width", type=count)
    p.add_argument("--saves", type=int, default=10, help="checkpoints of an incremental run")
    p.scaled("--full-saves", 4, 2, "checkpoints of a full run", type=count)
    p.scaled("--pretrain-mib", 256.0, 32.0, "pretraining state", type=options.positive_float)
    p.scaled("--pretrain-saves", 5, 3, "checkpoints per pretraining run", type=int)
    p.scaled("--hash-mib", 64, 16, "random bytes hashed", type=count)
    p.scaled("--tensor-mib", 256, 32, "fp32 tensor digest() hashes", type=count)
    p.repeat(3, quick=1)
    p.cores()
    p.server(bucket="bench-incremental-")
    p.json("incremental.json")
    args = p.parse(argv)
    if not (args.hashes or args.finetune or args.pretrain):
        args.hashes = args.finetune = args.pretrain = True
    if args.saves < 2 or args.pretrain_saves < 2:
        p.error("--saves and --pretrain-saves need 2 or more")
    return args


# ----------------------------------------------------------------------------- part 1: hashes


def _timed_calls(call: Callable[[], object], count: int) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of ``count`` calls."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(count):
        call()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _calls_for(call: Callable[[], object]) -> int:
    """Calls that take at least `_MIN_HASH_S` (the first one warms caches and pages)."""
    once, _ = _timed_calls(call, 1)
    return max(2, math.ceil(_MIN_HASH_S / max(once, 1e-6)))


def _one_thread(call: Callable[[], object], nbytes: int, count: int) -> dict[str, float]:
    wall, cpu = _timed_calls(call, count)
    return {"gbps_cpu": count * nbytes / cpu / GB, "gbps_wall": count * nbytes / wall / GB}


def _two_threads(
    call: Callable[[], object], nbytes: int, count: int, cores: set[int]
) -> dict[str, float]:
    """Two threads calling at once, on ``cores``: total throughput per wall second, and per
    CPU second (each core's share)."""
    barrier = threading.Barrier(3)
    spent: list[float] = []

    def work() -> None:
        barrier.wait()
        spent.append(_timed_calls(call, count)[1])

    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)  # threads inherit the affinity of the thread creating them
    try:
        threads = [threading.Thread(target=work, name=f"hash-{n}") for n in range(2)]
        for thread in threads:
            thread.start()
        barrier.wait()
        began = time.perf_counter()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
    finally:
        os.sched_setaffinity(0, previous)
    total = 2 * count * nbytes
    return {"gbps_wall": total / wall / GB, "gbps_cpu_per_core": total / sum(spent) / GB}


def _hashers(buffer: bytes, tensor: torch.Tensor) -> tuple[list[Any], list[str]]:
    """(name, input, call, bytes) of each hash; notes on those left out."""
    size, notes = len(buffer), []
    random = f"{size // MiB} MiB random bytes"
    hashers: list[tuple[str, str, Callable[[], object], int]] = [
        ("xxh3_128", random, lambda: xxhash.xxh3_128_digest(buffer), size),
        ("xxh3_64", random, lambda: xxhash.xxh3_64_digest(buffer), size),
    ]
    try:
        blake3: Any = importlib.import_module("blake3")
        hashers.append(("blake3", random, lambda: blake3.blake3(buffer).digest(), size))
    except ImportError:
        notes.append("blake3: not installed (pip install blake3), skipped")
    hashers += [
        ("blake2b", random, lambda: hashlib.blake2b(buffer).digest(), size),
        ("sha256", random, lambda: hashlib.sha256(buffer).digest(), size),
    ]
    nbytes = tensor.numel() * tensor.element_size()
    fp32 = f"{nbytes // MiB} MiB fp32 tensor"
    hashers.append(("digests.digest", fp32, lambda: digest(tensor), nbytes))
    return hashers, notes


def hash_part(args: argparse.Namespace) -> dict[str, Any]:
    """Every hash on this thread's core, then two threads on two cores; interleaved, medians."""
    buffer = os.urandom(args.hash_mib * MiB)
    generator = torch.Generator().manual_seed(1)
    tensor = torch.rand(args.tensor_mib * MiB // 4, generator=generator)
    hashers, notes = _hashers(buffer, tensor)
    cores = {args.trainer_core, args.server_core}
    if len(cores) < 2:
        notes.append("one core only: no two-thread timings")
    print(f"part 1: hashes on core {args.trainer_core}; two threads on cores {sorted(cores)}")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in hashers}
    for rep in range(args.repeat):
        for name, _, call, nbytes in hashers:
            count = _calls_for(call)
            one = _one_thread(call, nbytes, count)
            two = _two_threads(call, nbytes, count, cores) if len(cores) > 1 else {}
            runs[name].append(one | {f"two_{k}": v for k, v in two.items()} | {"calls": count})
            print(
                f"  [{rep + 1}/{args.repeat}] {name:>15}: {one['gbps_cpu']:.2f} GB/s CPU, "
                f"two threads {two.get('gbps_wall', 0.0):.2f} GB/s",
                flush=True,
            )
    summary: dict[str, Any] = {}
    for name, source, _, nbytes in hashers:
        results = runs[name]
        one_wall = median([r["gbps_wall"] for r in results])
        two_wall = median([r.get("two_gbps_wall") for r in results])
        summary[name] = {
            "input": source,
            "bytes": nbytes,
            "gbps_cpu": median([r["gbps_cpu"] for r in results]),
            "gbps_wall": one_wall,
            "two_threads_gbps_wall": two_wall,
            "two_threads_gbps_cpu_per_core": median(
                [r.get("two_gbps_cpu_per_core") for r in results]
            ),
            "two_threads_speedup": None
            if not one_wall or two_wall is None
            else two_wall / one_wall,
        }
    return {"summary": summary, "runs": runs, "notes": notes}


def hash_table(part: dict[str, Any]) -> str:
    headers = ["hash", "input", "GB/s CPU", "GB/s wall", "2 thr GB/s", "2 thr GB/s/core"]
    headers.append("2 thr speedup")
    keys = ["gbps_cpu", "gbps_wall", "two_threads_gbps_wall", "two_threads_gbps_cpu_per_core"]
    rows = [
        [name, n["input"], *(n[k] for k in keys), _times(n["two_threads_speedup"])]
        for name, n in part["summary"].items()
    ]
    lines = [format_table(headers, rows)]
    lines.append(
        "GB/s CPU: bytes per CPU second of the hashing thread (one core); 2 thr: two threads "
        "hashing at once on two cores, total per wall second, and per CPU second (each core); "
        "speedup near 2x: the GIL is released"
    )
    summary = part["summary"]
    if "blake3" in summary:
        ratio = summary["xxh3_128"]["gbps_cpu"] / summary["blake3"]["gbps_cpu"]
        lines.append(f"xxh3_128 hashes {ratio:.1f}x as fast as blake3 per core")
    return "\n".join(lines + part["notes"])


# ----------------------------------------------------------------------------- states


def _random(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype).normal_(0.0, 0.02, generator=generator)


def _transformer(
    hidden: int, layers: int, vocab: int, dtype: torch.dtype, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Weights of a transformer's shapes: embedding, per layer the attention projections, an
    MLP of 4x the width and two layernorms (fp32), and a final layernorm."""
    d = hidden
    out: dict[str, torch.Tensor] = {}
    if vocab:
        out["embed.weight"] = _random((vocab, d), dtype, generator)
    for n in range(layers):
        at = f"layers.{n}"
        for proj in ("q", "k", "v", "o"):
            out[f"{at}.attn.{proj}.weight"] = _random((d, d), dtype, generator)
        out[f"{at}.mlp.up.weight"] = _random((4 * d, d), dtype, generator)
        out[f"{at}.mlp.down.weight"] = _random((d, 4 * d), dtype, generator)
        out[f"{at}.norm1.weight"] = torch.ones(d)
        out[f"{at}.norm2.weight"] = torch.ones(d)
    out["norm.weight"] = torch.ones(d)
    return out


def _layer_bytes(hidden: int, dtype: torch.dtype) -> int:
    return 12 * hidden * hidden * dtype.itemsize + 2 * hidden * 4


def _adam_state(params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
            "step": torch.tensor(0.0),
        }
        for name, p in params.items()
    }


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class FineTune:
    """A frozen bf16 base and LoRA matrices (rank ``hidden // 128``) on the four attention
    projections of every layer, with AdamW's per-parameter state; `step` changes the LoRA part
    only, as a fine-tuning step does."""

    def __init__(self, base_bytes: int, hidden: int) -> None:
        self.generator = torch.Generator().manual_seed(0)
        vocab = 16 * hidden
        embed = vocab * hidden * torch.bfloat16.itemsize
        if embed > base_bytes / 2:
            vocab, embed = 0, 0
        layers = max(1, math.ceil((base_bytes - embed) / _layer_bytes(hidden, torch.bfloat16)))
        self.layers, self.hidden, self.rank = layers, hidden, max(4, hidden // 128)
        base = _transformer(hidden, layers, vocab, torch.bfloat16, self.generator)
        self.lora: dict[str, torch.Tensor] = {}
        for n in range(layers):
            for proj in ("q", "k", "v", "o"):
                at = f"layers.{n}.attn.{proj}"
                self.lora[f"{at}.lora_A"] = _random(
                    (self.rank, hidden), torch.float32, self.generator
                )
                self.lora[f"{at}.lora_B"] = _random(
                    (hidden, self.rank), torch.float32, self.generator
                )
        self.optim = _adam_state(self.lora)
        self.state: State = {
            "model": base | self.lora,
            "optim": {"state": self.optim},
            "step": 0,
        }
        self.base_bytes = nbytes(base)
        self.trained_bytes = nbytes(self.lora) + nbytes(self.optim)

    def step(self) -> None:
        for name, param in self.lora.items():
            grad = torch.randn(param.shape, generator=self.generator)
            slot = self.optim[name]
            slot["exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
            slot["exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
            slot["step"].add_(1)
            param.add_(grad, alpha=-1e-4)
        self.state["step"] += 1

    def describe(self) -> str:
        return (
            f"{self.layers} layers of width {self.hidden}: frozen base {self.base_bytes / GiB:.2f} "
            f"GiB (bf16, fp32 layernorms), LoRA rank {self.rank} on q/k/v/o with AdamW state "
            f"{self.trained_bytes / MiB:.1f} MiB ({100 * self.trained_bytes / self.base_bytes:.1f}"
            "% of the base)"
        )


class Pretrain:
    """fp32 weights of transformer shapes (width 512) and AdamW's state for each: `step`
    changes every tensor, as a pretraining step does."""

    hidden = 512

    def __init__(self, target_bytes: int) -> None:
        generator = torch.Generator().manual_seed(2)
        layer = 3 * _layer_bytes(self.hidden, torch.float32)
        self.layers = max(1, round(target_bytes / layer))
        params = _transformer(self.hidden, self.layers, 0, torch.float32, generator)
        self.state: State = {"model": params, "optim": {"state": _adam_state(params)}, "step": 0}
        self.bytes = nbytes(self.state)

    def step(self) -> None:
        for tensor in _tensors(self.state):
            tensor.add_(1e-3)
        self.state["step"] += 1


def blank(value: Any) -> Any:
    """A structure like ``value`` with fresh tensors of the same shapes (pages touched), for
    ``dcp.load`` to fill."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value).zero_()
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    return -1


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return bool(a == b)


def hash_seconds(state: State) -> float:
    """Wall time to digest every tensor of ``state`` on this thread, as an incremental save does
    (in worker threads, here on one core)."""
    began = time.perf_counter()
    for tensor in _tensors(state):
        digest(as_flat_bytes(tensor))
    return time.perf_counter() - began


# ----------------------------------------------------------------------------- saving


def timed_save(
    writer: S3Writer, url: str, state: State, config: S3Config, server_pid: int | None
) -> dict[str, Any]:
    """One ``async_save`` through the case's writer, waited for; what its record says."""
    before, server = cpu_times(), server_cpu_seconds(server_pid)
    began = time.perf_counter()
    future = async_save(state, checkpoint_id=url, storage_writer=writer)
    stall = time.perf_counter() - began
    assert isinstance(future, Future)  # S3Writer stages at once: no AsyncSaveResponse
    future.result()
    durable = time.perf_counter() - began
    cpu = cpu_since(before)
    after = server_cpu_seconds(server_pid)
    info, _ = catalog.describe(url, config)
    return {
        "url": url,
        "step": info.step,
        "stall_s": stall,
        "durable_s": durable,
        **cpu,
        "server_cpu_s": None if server is None or after is None else after - server,
        "stored_bytes": info.stored_bytes,
        "referenced_bytes": info.referenced_bytes,
        "logical_bytes": info.logical_bytes,
        "references": list(info.references),
    }


def timed_load(url: str, dest: State, config: S3Config) -> float:
    began = time.perf_counter()
    dcp_load(dest, storage_reader=S3Reader(url, config=config))
    return time.perf_counter() - began


def run_storage(store: ObjectStore, bucket: str, run: str) -> dict[str, int]:
    """What the server holds under a run: its data objects (leases aside) and everything."""
    listing = bridge.run(store.list_objects(bucket, f"{run}/"))
    data = [o for o in listing.objects if "/data-" in o.key and not layout.is_lease(o.key)]
    return {
        "data_bytes": sum(o.size for o in data),
        "data_objects": len(data),
        "all_bytes": sum(o.size for o in listing.objects),
        "all_objects": len(listing.objects),
    }


def remove_run(store: ObjectStore, bucket: str, run: str) -> None:
    """Every object (and multipart upload) under a run: a measured case leaves nothing."""

    async def remove() -> None:
        listing = await store.list_objects(bucket, f"{run}/")
        if listing.objects:
            await store.delete(bucket, [o.key for o in listing.objects])
        for upload in await store.list_uploads(bucket, f"{run}/"):
            await store.abort(bucket, upload)

    bridge.run(remove())


def _order(step: int, rep: int) -> tuple[str, ...]:
    """The cases in turn, which one goes first flipping every step."""
    return CASES if (step + rep) % 2 == 0 else CASES[::-1]


def spread(count: int, saves: int) -> list[int]:
    """``count`` steps of ``1..saves`` spread evenly, the first and last included."""
    if count >= saves:
        return list(range(1, saves + 1))
    if count == 1:
        return [saves]
    return sorted({round(1 + i * (saves - 1) / (count - 1)) for i in range(count)})


def _progress(tag: str, result: dict[str, Any]) -> None:
    print(
        f"  {tag}: durable {result['durable_s']:.2f} s, stall {result['stall_s'] * 1e3:.0f} ms, "
        f"{result['stored_bytes'] / 1e6:.1f} MB up, CPU {result['cpu_s']:.2f} s",
        flush=True,
    )


def _medians(saves: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "saves": len(saves),
        "durable_s": median([s["durable_s"] for s in saves]),
        "stall_ms": median([s["stall_s"] * 1e3 for s in saves]),
        "stored_bytes": median([s["stored_bytes"] for s in saves]),
        "cpu_s": median([s["cpu_s"] for s in saves]),
        "server_cpu_s": median([s["server_cpu_s"] for s in saves]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _times(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _goal(goal: str, measured: float | None, target: float, at_most: bool) -> dict[str, Any]:
    met = None if measured is None else measured <= target if at_most else measured >= target
    return {
        "goal": goal,
        "measured": measured,
        "target": f"{'<=' if at_most else '>='} {target:g}x",
        "met": met,
    }


# ----------------------------------------------------------------------------- part 2: fine-tuning


def finetune_part(
    args: argparse.Namespace, ep: Endpoint, config: S3Config, store: ObjectStore
) -> dict[str, Any]:
    model = FineTune(int(args.base_gib * GiB), args.hidden)
    hashing = hash_seconds(model.state)
    full_steps = spread(args.full_saves, args.saves)
    print(
        f"part 2: fine-tuning, {model.describe()}; incremental saves steps 1-{args.saves}, full "
        f"saves steps {full_steps}; hashing the whole state on one core takes {hashing:.2f} s",
        flush=True,
    )
    writers = {
        case: S3Writer(
            f"s3://{args.bucket}/ft-{case}", config=config, incremental=case == "incremental"
        )
        for case in CASES
    }
    dest = blank(model.state)
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeat):
            prefixes = {case: f"ft-{case}-{rep}" for case in CASES}
            saves: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
            for step in range(1, args.saves + 1):
                if step > 1:
                    model.step()
                for case in _order(step, rep):
                    if case == "full" and step not in full_steps:
                        continue
                    url = f"s3://{args.bucket}/{prefixes[case]}/step-{step:06d}"
                    result = timed_save(writers[case], url, model.state, config, ep.server_pid)
                    saves[case].append(result)
                    _progress(f"[{rep + 1}/{args.repeat}] {case:>11} step {step:>2}", result)
            storage = {case: run_storage(store, args.bucket, prefixes[case]) for case in CASES}
            loads: dict[str, float] = {}
            for case in _order(rep, 0):
                loads[case] = timed_load(saves[case][-1]["url"], dest, config)
                if not equal(dest, model.state):
                    raise SystemExit(f"{saves[case][-1]['url']} did not load as it was saved")
                print(f"  [{rep + 1}/{args.repeat}] {case:>11} load: {loads[case]:.2f} s")
            for case in CASES:
                remove_run(store, args.bucket, prefixes[case])
            runs.append({"saves": saves, "storage": storage, "load_s": loads})
    finally:
        for writer in writers.values():
            writer.close()
    return summarize_finetune(model, hashing, full_steps, runs)


def summarize_finetune(
    model: FineTune, hashing: float, full_steps: list[int], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    full = [s for r in runs for s in r["saves"]["full"]]
    first = [s for r in runs for s in r["saves"]["incremental"] if s["step"] == 1]
    later = [s for r in runs for s in r["saves"]["incremental"] if s["step"] > 1]
    cases = {"full": _medians(full), "incremental first": _medians(first)}
    cases["incremental later"] = _medians(later)
    cases["full"]["load_s"] = median([r["load_s"]["full"] for r in runs])
    cases["incremental later"]["load_s"] = median([r["load_s"]["incremental"] for r in runs])
    full_bytes = cases["full"]["stored_bytes"]
    stored = [r["storage"]["incremental"]["data_bytes"] for r in runs]
    upload = _ratio(cases["incremental later"]["stored_bytes"], model.trained_bytes)
    speedup = _ratio(cases["full"]["durable_s"], cases["incremental later"]["durable_s"])
    storage = median([_ratio(s, full_bytes) for s in stored])
    load = _ratio(cases["incremental later"]["load_s"], cases["full"]["load_s"])
    later_referenced = median([s["referenced_bytes"] for s in later])
    goals = [
        _goal("fine-tuning: later save uploads / trained bytes", upload, UPLOAD_GOAL, True),
        _goal("fine-tuning: full / incremental durable", speedup, SPEEDUP_GOAL, False),
        _goal("fine-tuning: run storage / one full checkpoint", storage, STORAGE_GOAL, True),
    ]
    return {
        "model": {
            "layers": model.layers,
            "hidden": model.hidden,
            "lora_rank": model.rank,
            "base_bytes": model.base_bytes,
            "trained_bytes": model.trained_bytes,
            "state_bytes": nbytes(model.state),
        },
        "hash_state_s": hashing,
        "full_steps": full_steps,
        "cases": cases,
        "upload_ratio": upload,
        "speedup": speedup,
        "storage_ratio": storage,
        "load_ratio": load,
        "later_referenced_bytes": later_referenced,
        "incremental_run_data_bytes": stored,
        "goals": goals,
        "runs": runs,
    }


def finetune_table(part: dict[str, Any], repeat: int) -> str:
    headers = ["case", "saves", "durable s", "stall ms", "MB up", "CPU s", "server CPU s"]
    headers.append("load s")
    keys = ["saves", "durable_s", "stall_ms", "stored_bytes", "cpu_s", "server_cpu_s", "load_s"]
    rows = []
    for case, n in part["cases"].items():
        values = [n.get(k) for k in keys]
        values[3] = None if values[3] is None else values[3] / 1e6
        rows.append([case, *values])
    model = part["model"]
    lines = [format_table(headers, rows)]
    lines.append(
        f"medians of {repeat} repetitions; saves: in all of them; MB up: the record's "
        "stored_bytes; load s: the run's last checkpoint, a plain S3Reader"
    )
    lines.append(
        f"trained part {model['trained_bytes'] / 1e6:.1f} MB; later incremental saves upload "
        f"{_times(part['upload_ratio'])} of it and reference "
        f"{(part['later_referenced_bytes'] or 0) / 1e6:.0f} MB; full durable / incremental "
        f"later durable {_times(part['speedup'])}; the incremental run stores "
        f"{_times(part['storage_ratio'])} one full checkpoint; its last checkpoint loads in "
        f"{_times(part['load_ratio'])} the full one's time"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- part 3: pretraining


def pretrain_part(
    args: argparse.Namespace, ep: Endpoint, config: S3Config, store: ObjectStore
) -> dict[str, Any]:
    model = Pretrain(int(args.pretrain_mib * MiB))
    print(
        f"part 3: pretraining, {model.layers} fp32 layers of width {model.hidden} with AdamW "
        f"state, {model.bytes / MiB:.0f} MiB, every tensor changing; {args.pretrain_saves} saves "
        "per case",
        flush=True,
    )
    writers = {
        case: S3Writer(
            f"s3://{args.bucket}/pt-{case}", config=config, incremental=case == "incremental"
        )
        for case in CASES
    }
    runs: list[dict[str, list[dict[str, Any]]]] = []
    try:
        for rep in range(args.repeat):
            prefixes = {case: f"pt-{case}-{rep}" for case in CASES}
            saves: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
            for step in range(1, args.pretrain_saves + 1):
                if step > 1:
                    model.step()
                for case in _order(step, rep):
                    url = f"s3://{args.bucket}/{prefixes[case]}/step-{step:06d}"
                    result = timed_save(writers[case], url, model.state, config, ep.server_pid)
                    saves[case].append(result)
                    _progress(f"[{rep + 1}/{args.repeat}] {case:>11} step {step:>2}", result)
            for case in CASES:
                remove_run(store, args.bucket, prefixes[case])
            runs.append(saves)
    finally:
        for writer in writers.values():
            writer.close()
    cases = {
        case: _medians([s for saves in runs for s in saves[case] if s["step"] > 1])
        for case in CASES
    }
    referenced = [s["referenced_bytes"] for saves in runs for s in saves["incremental"]]
    overhead = _ratio(cases["incremental"]["durable_s"], cases["full"]["durable_s"])
    goal = _goal("pretraining: incremental / full durable", overhead, OVERHEAD_GOAL, True)
    return {
        "state_bytes": model.bytes,
        "layers": model.layers,
        "cases": cases,
        "overhead": overhead,
        "stall_ratio": _ratio(cases["incremental"]["stall_ms"], cases["full"]["stall_ms"]),
        "incremental_referenced_bytes": max(referenced, default=0),
        "goals": [goal],
        "runs": runs,
    }


def pretrain_table(part: dict[str, Any], repeat: int) -> str:
    headers = ["case", "saves", "durable s", "stall ms", "MB up", "CPU s", "server CPU s"]
    keys = ["saves", "durable_s", "stall_ms", "stored_bytes", "cpu_s", "server_cpu_s"]
    rows = []
    for case, n in part["cases"].items():
        values = [n.get(k) for k in keys]
        values[3] = None if values[3] is None else values[3] / 1e6
        rows.append([case, *values])
    lines = [format_table(headers, rows)]
    lines.append(
        f"medians of the saves after each run's first, {repeat} repetitions; incremental / full: "
        f"durable {_times(part['overhead'])}, stall {_times(part['stall_ratio'])}; bytes "
        f"referenced by incremental saves: {part['incremental_referenced_bytes']} (none expected)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def goals_table(goals: list[dict[str, Any]]) -> str:
    rows = [
        [
            g["goal"],
            None if g["measured"] is None else f"{g['measured']:.3f}x",
            g["target"],
            {True: "yes", False: "NO", None: "-"}[g["met"]],
        ]
        for g in goals
    ]
    return format_table(["goal", "measured", "target", "met"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    machine = machine_info()
    began = time.perf_counter()
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    report["machine"] = machine
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.trainer_core})
    tables: list[str] = []  # printed together at the end, after the progress lines
    if args.hashes:  # before the server starts: the two-thread timings use its core
        report["hashes"] = hash_part(args)
        tables.append("part 1: hashes\n" + hash_table(report["hashes"]))
    goals: list[dict[str, Any]] = []
    if args.finetune or args.pretrain:
        with options.endpoint(args) as ep:
            pinned = pin_threads(ep.server_pid, args.server_core)
            pinned = pin_threads(0, args.trainer_core) and pinned
            config = ep.config(part_size=16 * MiB, max_concurrency=8)
            store = get_store(config)
            bridge.run(store.create_bucket(args.bucket))
            report |= {"server": ep.server, "server_pinned": pinned}
            print(
                f"client on core {args.trainer_core}, server "
                f"{f'on core {args.server_core}' if pinned else 'unpinned'}; {ep.server}",
                flush=True,
            )
            if args.finetune:
                report["finetune"] = finetune_part(args, ep, config, store)
                table = finetune_table(report["finetune"], args.repeat)
                tables.append("part 2: fine-tuning\n" + table)
                goals += report["finetune"]["goals"]
            if args.pretrain:
                report["pretrain"] = pretrain_part(args, ep, config, store)
                table = pretrain_table(report["pretrain"], args.repeat)
                tables.append("part 3: pretraining\n" + table)
                goals += report["pretrain"]["goals"]
    if goals:
        tables.append("goals\n" + goals_table(goals))
    print("\n\n".join(tables))
    report |= {"goals": goals, "wall_s": time.perf_counter() - began}
    write_json(args.json, report)
    print(f"{time.perf_counter() - began:.0f} s; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
