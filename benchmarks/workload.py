"""The state dict the benchmarks checkpoint, and the s3ckpt cases run on it in a child process.

The state looks like a transformer's training state: per layer four bf16 weight matrices (several
MiB each) with fp32 Adam moments, small fp32 norm vectors, an embedding that absorbs the
remainder so the total matches the requested size, and a 0-d step counter: ~150 tensors at any
size (the hidden width grows with the size). Data is seeded random: this measures transfer, not
compression, and a load can be checked bit for bit by regenerating one tensor at a time.

Each case runs in a fresh process (see `bench_core`) so its peak RSS is its own.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Reader, S3Writer
from s3ckpt.config import MiB, S3Config
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store

from .common import RssSampler, cpu_since, cpu_times

__all__ = ["S3CKPT_CASES", "TensorSpec", "run_case", "state_bytes", "state_specs"]

S3CKPT_CASES = ("save", "async_save", "load")
_LAYERS = 8
_GiB = 1024 * MiB
_HEADROOM = 256 * MiB  # allowance for the interpreter, allocator slack and DCP's planning
_LOAD_FACTOR = 1.25


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _with_adam(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[TensorSpec]:
    return [
        TensorSpec(f"model.{name}", shape, dtype),
        TensorSpec(f"optim.{name}.exp_avg", shape, torch.float32),
        TensorSpec(f"optim.{name}.exp_avg_sq", shape, torch.float32),
    ]


def state_specs(total_bytes: int) -> list[TensorSpec]:
    """Shapes and dtypes of a transformer-like training state of about ``total_bytes``."""
    hidden = max(256, round(1024 * math.sqrt(total_bytes / _GiB) / 256) * 256)
    matrices = {"attn.qkv": (3 * hidden, hidden), "attn.proj": (hidden, hidden)}
    matrices |= {"mlp.fc1": (4 * hidden, hidden), "mlp.fc2": (hidden, 4 * hidden)}
    layer: list[TensorSpec] = []
    for name, shape in matrices.items():
        layer += _with_adam(f"{{}}.{name}.weight", shape, torch.bfloat16)
    for name in ("ln1", "ln2"):
        layer += _with_adam(f"{{}}.{name}.weight", (hidden,), torch.float32)
    per_layer = sum(s.nbytes for s in layer)
    layers = max(1, min(_LAYERS, total_bytes // per_layer))
    specs = [TensorSpec("optim.step", (), torch.float32)]
    for i in range(layers):
        specs += [TensorSpec(s.name.format(f"layers.{i}"), s.shape, s.dtype) for s in layer]
    rows = (total_bytes - layers * per_layer) // (hidden * (2 + 4 + 4))
    if rows > 0:
        specs += _with_adam("embed.weight", (rows, hidden), torch.bfloat16)
    return specs


def state_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def tensor_of(spec: TensorSpec, index: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(spec.shape, dtype=spec.dtype, generator=generator)


def build_state(specs: list[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    return {s.name: tensor_of(s, i, seed) for i, s in enumerate(specs)}


def empty_state(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Destination tensors with every page touched, so the load's RSS is the load's own."""
    return {s.name: torch.empty(s.shape, dtype=s.dtype).fill_(-7) for s in specs}


def verify_state(state: dict[str, torch.Tensor], specs: list[TensorSpec], seed: int) -> int:
    """Compare bit patterns (NaN- and -0.0-safe) one tensor at a time; returns mismatches."""
    bad = 0
    for i, spec in enumerate(specs):
        got = state[spec.name].reshape(-1).view(torch.uint8)
        want = tensor_of(spec, i, seed).reshape(-1).view(torch.uint8)
        bad += not torch.equal(got, want)
    return bad


def run_case(
    case: str,
    config: S3Config,
    bucket: str,
    prefix: str,
    size_bytes: int,
    seed: int,
    verify: bool,
    timeout_s: float,
) -> dict[str, Any]:
    """One measured s3ckpt operation in this (fresh) process; returns its numbers."""
    store = get_store(config)
    # A training job checkpoints repeatedly: start the I/O loop and client before measuring.
    bridge.run(store.check_bucket(bucket))
    specs = state_specs(size_bytes)
    gc.collect()
    rss_empty = RssSampler().baseline
    state = empty_state(specs) if case == "load" else build_state(specs, seed)
    writer = _writer(config, bucket, prefix)
    first_stall = None
    if case == "async_save":
        # A training job saves again and again with one writer: the first save allocates the
        # staging buffers, the ones after reuse them. Measure one after.
        started = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer, no_dist=True)
        first_stall = time.perf_counter() - started
        future.result(timeout=timeout_s)  # type: ignore[union-attr]
    gc.collect()
    requests_before, cpu_before = store.stats.requests, cpu_times()
    stall = None
    with RssSampler() as rss:
        started = time.perf_counter()
        if case == "save":
            dcp.save(state, storage_writer=writer, no_dist=True)
        elif case == "async_save":
            future = dcp.async_save(state, storage_writer=writer, no_dist=True)
            stall = time.perf_counter() - started
            future.result(timeout=timeout_s)  # type: ignore[union-attr]
        elif case == "load":
            dcp.load(state, storage_reader=S3Reader(bucket, prefix, config=config), no_dist=True)
        else:
            raise ValueError(f"unknown case {case!r}")
        seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        "case": case,
        "seconds": seconds,
        "stall_s": stall,
        "bytes": state_bytes(specs),
        "tensors": len(specs),
        **cpu_since(cpu_before),
        "requests": store.stats.requests - requests_before,
        "rss_empty": rss_empty,
        **rss.report(),
    }
    if case == "async_save":
        writer.close()
        result["first_stall_s"] = first_stall
        result["copy_s"] = copy_time(state)
    result.update(memory_bound(case, result["bytes"], config, result))
    if verify and case == "load":
        result["mismatched_tensors"] = verify_state(state, specs, seed)
    return result


def copy_time(state: dict[str, torch.Tensor]) -> float:
    """The stall's yardstick: copying the same bytes into buffers allocated and touched before."""
    targets = {name: tensor.clone() for name, tensor in state.items()}
    started = time.perf_counter()
    for name, tensor in state.items():
        targets[name].copy_(tensor)
    return time.perf_counter() - started


def _writer(config: S3Config, bucket: str, prefix: str) -> S3Writer:
    return S3Writer(bucket, prefix, config=config, overwrite=True)


def memory_bound(
    case: str, state: int, config: S3Config, rss: dict[str, Any]
) -> dict[str, int | bool]:
    """The brief's memory bounds, applied to the quantity each one is about.

    save: peak over the state already in memory <= part_size x concurrency + 256 MiB;
    async_save: the same plus the staged copy of the state; load: peak including the
    destination tensors <= 1.25 x state.
    """
    in_flight = config.part_size * config.max_concurrency
    increase = rss["rss_peak"] - rss["rss_baseline"]
    with_state = rss["rss_peak"] - rss["rss_empty"]
    if case == "load":
        bound, measured = int(_LOAD_FACTOR * state), with_state
    elif case == "async_save":
        bound, measured = state + in_flight + _HEADROOM, increase
    else:
        bound, measured = in_flight + _HEADROOM, increase
    return {
        "rss_increase": increase,
        "rss_with_state": with_state,
        "bound": bound,
        "bounded_quantity": measured,
        "within_bound": measured <= bound,
    }
